"""Label-smoothed cross entropy straight from the logits, with a hand-written backward.

fairseq's ``label_smoothed_nll_loss`` works on log-probabilities, which costs autograd four
(N, V) buffers per step; this op computes the same two sums from the logits and one
logsumexp per row and, in backward, writes the logit gradient into a single (N, V) buffer.

For a row with logits z (V,), target t and ε_i = ε / (V - 1) (fairseq's convention):

    lse      = log Σ_j exp z_j
    nll      = lse - z_t                       (= -log p_t)
    smooth   = V · lse - Σ_j z_j               (= -Σ_j log p_j)
    loss     = (1 - ε - ε_i) · nll + ε_i · smooth
    ∂loss/∂z_j = (1 - ε - ε_i + V ε_i) · p_j - (1 - ε - ε_i) · [j = t] - ε_i

Rows whose target is ``ignore_index`` contribute 0 and get a zero gradient. The sums
are accumulated in fp32 (fp64 for fp64 logits) whatever the logits' dtype, as fairseq's
``log_softmax`` does. Both passes go over blocks of rows, converting one block at a time
(fp16/bf16 logits are never copied whole to fp32): small enough to stay in cache on a CPU,
large on a GPU, where each operation on a block is a kernel launch (docs/install.md).
"""
from typing import Tuple

import torch

_BLOCK_ELEMENTS = 1 << 18  # logits per block of rows on a CPU: about 1 MB in fp32
_BLOCK_ELEMENTS_GPU = 1 << 24  # on a GPU: about 64 MB in fp32


def _row_blocks(n_rows: int, n_cols: int, device: torch.device):
    """Slices of rows, each holding at most the device's block of logits (one row at least)."""
    elements = _BLOCK_ELEMENTS if device.type == "cpu" else _BLOCK_ELEMENTS_GPU
    step = max(1, elements // n_cols)
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


class _LabelSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index):
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp64 stays (gradcheck)
        N, V = logits.shape
        eps_i = epsilon / (V - 1)
        keep = target.ne(ignore_index)
        safe_target = target.masked_fill(~keep, 0)
        lse = logits.new_empty(N, dtype=acc)  # log Σ_j exp z_j per row
        row_sum = logits.new_empty(N, dtype=acc)  # Σ_j z_j per row
        for rows in _row_blocks(N, V, logits.device):
            z = logits[rows].to(acc)
            torch.logsumexp(z, dim=1, out=lse[rows])
            torch.sum(z, dim=1, out=row_sum[rows])
        z_target = logits.gather(1, safe_target.unsqueeze(1)).squeeze(1).to(acc)
        nll_sum = ((lse - z_target) * keep).sum()
        smooth_sum = ((V * lse - row_sum) * keep).sum()
        loss = (1.0 - epsilon - eps_i) * nll_sum + eps_i * smooth_sum
        ctx.save_for_backward(logits, lse, safe_target, keep)
        ctx.coefficients = (1.0 - epsilon - eps_i, eps_i)
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        logits, lse, target, keep = ctx.saved_tensors
        on_target, eps_i = ctx.coefficients
        V, acc = logits.size(1), lse.dtype
        w = keep.to(acc) * grad_loss.to(acc)  # (N,) upstream weight of each row
        scale = (w * (on_target + V * eps_i)).unsqueeze(1)
        shift = (w * eps_i).unsqueeze(1)
        grad = torch.empty_like(logits, dtype=acc)  # the only (N, V) buffer
        for rows in _row_blocks(*logits.shape, logits.device):
            block = torch.sub(logits[rows].to(acc), lse[rows].unsqueeze(1), out=grad[rows])
            block.exp_().mul_(scale[rows]).sub_(shift[rows])
        grad.scatter_add_(1, target.unsqueeze(1), (-on_target * w).unsqueeze(1))
        return grad.to(logits.dtype), None, None, None


def label_smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                                 ignore_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed loss and summed nll (no gradient) of logits (N, V), target (N,):
    ``fairseq.criterions.label_smoothed_cross_entropy.label_smoothed_nll_loss(
    log_softmax(logits), target, epsilon, ignore_index, reduce=True)``."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (N, V) and target (N,); got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    if logits.size(1) < 2:
        raise ValueError(f"label smoothing needs a vocabulary of at least 2; got {logits.size(1)}")
    return _LabelSmoothedCrossEntropy.apply(logits, target, float(epsilon), int(ignore_index))
