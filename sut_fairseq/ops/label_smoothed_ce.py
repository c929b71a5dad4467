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
``log_softmax`` does.

Two backends, chosen as the routed expert ops' (``SUT_KERNELS``, ``reference_linear.kernel_backend``):
the Triton kernels of ``kernels/cross_entropy.py`` for CUDA tensors (one pass over the
logits forward, one backward writing the gradient in the logits' dtype; fp64 logits take
the PyTorch path), and PyTorch for CPU tensors (or ``SUT_KERNELS=reference``): both passes
over blocks of rows, converting one block at a time (fp16/bf16 logits are never copied
whole to fp32), small enough to stay in cache on a CPU.
"""
from typing import Tuple

import torch

from .reference_linear import kernel_backend

_BLOCK_ELEMENTS = 1 << 18  # logits per block of rows on a CPU: about 1 MB in fp32
_BLOCK_ELEMENTS_GPU = 1 << 24  # on a GPU (``SUT_KERNELS=reference``): about 64 MB in fp32


def _row_blocks(n_rows: int, n_cols: int, device: torch.device):
    """Slices of rows, each holding at most the device's block of logits (one row at least):
    cache-sized on a CPU, large on a GPU, where each operation on a block is a launch."""
    elements = _BLOCK_ELEMENTS if device.type == "cpu" else _BLOCK_ELEMENTS_GPU
    step = max(1, elements // n_cols)
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def _uses_triton(logits: torch.Tensor) -> bool:
    return logits.dtype != torch.float64 and kernel_backend(logits) == "triton"


def _row_terms(logits: torch.Tensor, target: torch.Tensor, acc: torch.dtype):
    """(log Σ_j exp z_j, Σ_j z_j, z_target) per row of logits (N, V), target (N,) in
    [0, V); each (N,) in ``acc``."""
    N = logits.size(0)
    lse, row_sum = logits.new_empty(N, dtype=acc), logits.new_empty(N, dtype=acc)
    for rows in _row_blocks(*logits.shape, logits.device):
        z = logits[rows].to(acc)
        torch.logsumexp(z, dim=1, out=lse[rows])
        torch.sum(z, dim=1, out=row_sum[rows])
    return lse, row_sum, logits.gather(1, target.unsqueeze(1)).squeeze(1).to(acc)


def _logit_gradient(logits, lse, scale, shift, target, target_term):
    """∂loss/∂z (N, V) in the logits' dtype: exp(z - lse)·scale - shift, plus target_term at
    each row's target; lse, scale, shift, target_term (N,), target (N,)."""
    grad = torch.empty_like(logits, dtype=lse.dtype)  # the only (N, V) buffer
    scale, shift = scale.unsqueeze(1), shift.unsqueeze(1)
    for rows in _row_blocks(*logits.shape, logits.device):
        block = torch.sub(logits[rows].to(lse.dtype), lse[rows].unsqueeze(1), out=grad[rows])
        block.exp_().mul_(scale[rows]).sub_(shift[rows])
    grad.scatter_add_(1, target.unsqueeze(1), target_term.unsqueeze(1))
    return grad.to(logits.dtype)


class _LabelSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index):
        V = logits.size(1)
        eps_i = epsilon / (V - 1)
        ctx.coefficients = (1.0 - epsilon - eps_i, eps_i, ignore_index)
        ctx.kernels = _uses_triton(logits)
        if ctx.kernels:  # the rows' terms in the kernel, one sum of both totals
            from ..kernels.cross_entropy import ce_forward

            target = target.contiguous()
            lse, rows = ce_forward(logits.contiguous(), target, ignore_index, 1.0 - epsilon - eps_i,
                                   eps_i)
            loss, nll_sum = rows.sum(1).unbind()
            ctx.save_for_backward(logits, lse, target)
            ctx.mark_non_differentiable(nll_sum)
            return loss, nll_sum
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp64 stays (gradcheck)
        keep = target.ne(ignore_index)
        safe_target = target.masked_fill(~keep, 0)
        lse, row_sum, z_target = _row_terms(logits, safe_target, acc)  # log Σ exp z, Σ z, z_t
        nll_sum = ((lse - z_target) * keep).sum()
        smooth_sum = ((V * lse - row_sum) * keep).sum()
        loss = (1.0 - epsilon - eps_i) * nll_sum + eps_i * smooth_sum
        ctx.save_for_backward(logits, lse, safe_target, keep)
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        on_target, eps_i, ignore_index = ctx.coefficients
        if ctx.kernels:
            from ..kernels.cross_entropy import ce_backward

            logits, lse, target = ctx.saved_tensors
            grad = ce_backward(logits.contiguous(), lse, target, grad_loss.to(lse.dtype),
                               ignore_index, on_target, eps_i)
            return grad, None, None, None
        logits, lse, target, keep = ctx.saved_tensors
        V, acc = logits.size(1), lse.dtype
        w = keep.to(acc) * grad_loss.to(acc)  # (N,) upstream weight of each row
        grad = _logit_gradient(logits, lse, w * (on_target + V * eps_i), w * eps_i, target,
                               -on_target * w)
        return grad, None, None, None


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
