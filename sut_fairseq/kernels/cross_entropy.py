"""Triton kernels of the label-smoothed cross entropy (``sut_fairseq/ops/label_smoothed_ce.py``,
where the formulas are derived): one pass over the logits forward, one backward.

For logits z (N, V), one program per row, looping over the row in ``BLOCK_V`` columns:

* ``ce_forward_kernel``: ``lse_n = log Σ_j exp z_nj`` (an online logsumexp: a running
  maximum m and sum s rescaled by exp(m_old - m_new) when m grows), ``Σ_j z_nj`` and the
  target's logit ``z_{n, target_n}``, accumulated in fp32; it writes lse_n and the row's
  loss and nll (their weights and the ignored rows' zeros applied), so that one sum over
  the rows gives both totals;
* ``ce_backward_kernel``: ``dz_nj = exp(z_nj - lse_n) · scale_n - shift_n`` plus
  ``target_term_n`` at ``j = target_n``, the row's terms formed from the upstream
  gradient of the loss (read on the device) and the weights, computed in fp32 and stored
  in the logits' dtype.

Everything per row happens in the kernels: the op's launches are these two and one sum.

The PyTorch path of the op (CPU) converts and walks the logits in blocks of rows with one
operation each; on a GPU each operation is a launch and a pass over the (N, V) logits
(a 4,096 x 32,768 bf16 batch is 268 MB): the forward read them 3 times and the backward
6 times, with an fp32 (N, V) gradient buffer. Here each kernel reads them once and the
backward writes its gradient once, in the logits' dtype.

CUDA tensors launch the compiled kernels; CPU tensors run them in Triton's interpreter
(tests; needs ``TRITON_INTERPRET=1`` before ``triton`` is imported), as the routed kernels.
"""
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from . import launch

#: columns per iteration on a GPU (fp32 registers: BLOCK_V / (32 * NUM_WARPS) per thread)
BLOCK_V = 4096
NUM_WARPS = 8
#: columns per iteration in the interpreter (small, so rows span several iterations)
INTERPRET_BLOCK_V = 16


def _ce_forward(Z, TARGET, LSE, ROWS, V, N, stride_zn, ignore_index, on_target, eps_i,
                BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_zn
    cols = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)  # running max
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)                 # running Σ exp(z - m)
    total = tl.zeros([BLOCK_V], tl.float32)                        # Σ z, per lane
    for start in range(0, V, BLOCK_V):
        inside = start + cols < V
        z = tl.load(z_row + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        total += tl.where(inside, z, 0.0)
    lse = m + tl.log(s)
    target = tl.load(TARGET + row)
    keep = target != ignore_index
    z_target = tl.load(z_row + tl.where(keep, target, 0)).to(tl.float32)
    nll = tl.where(keep, lse - z_target, 0.0)
    smooth = tl.where(keep, V * lse - tl.sum(total, 0), 0.0)
    tl.store(LSE + row, lse)
    tl.store(ROWS + row, on_target * nll + eps_i * smooth)
    tl.store(ROWS + N + row, nll)


def _ce_backward(Z, DZ, LSE, TARGET, GRAD_LOSS, V, stride_zn, stride_dn, ignore_index,
                 on_target, eps_i, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_zn
    dz_row = DZ + row * stride_dn
    lse = tl.load(LSE + row)
    target = tl.load(TARGET + row)
    w = tl.where(target != ignore_index, tl.load(GRAD_LOSS).to(tl.float32), 0.0)
    scale = w * (on_target + V * eps_i)
    shift = w * eps_i
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        inside = start + cols < V
        z = tl.load(z_row + start + cols, mask=inside, other=0.0).to(tl.float32)
        dz = tl.exp(z - lse) * scale - shift
        dz = tl.where(start + cols == target, dz - on_target * w, dz)
        tl.store(dz_row + start + cols, dz.to(DZ.dtype.element_ty), mask=inside)


# Plain JITFunctions whatever TRITON_INTERPRET says (ahead-of-time builds need them);
# ``interpreted`` gives the interpreter's version, as in ``grouped_gemm``.
ce_forward_kernel = JITFunction(_ce_forward)
ce_backward_kernel = JITFunction(_ce_backward)
KERNELS = (ce_forward_kernel, ce_backward_kernel)

def _launch(kernel, rows: int, args: dict, device: torch.device) -> None:
    if launch.recorder is not None:
        launch.recorder(kernel, dict(args, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS, rows=rows))
    elif device.type == "cpu":
        launch.interpreted(kernel)[(rows,)](**args, BLOCK_V=INTERPRET_BLOCK_V)
    else:
        kernel[(rows,)](**args, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (N, V) with contiguous rows; got shape "
                         f"{tuple(logits.shape)}, strides {logits.stride()}")


def ce_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, on_target: float,
               eps_i: float):
    """logits (N, V), target (N,) in [0, V) or ``ignore_index`` -> (lse (N,), rows (2, N)),
    fp32: per row ``lse``, the loss ``on_target · nll + eps_i · smooth`` (row 0) and ``nll``
    (row 1), 0 on an ignored row (``ops/label_smoothed_ce.py``)."""
    _check_logits(logits)
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    rows = torch.empty(2, N, dtype=torch.float32, device=logits.device)
    _launch(ce_forward_kernel, N, dict(Z=logits, TARGET=target, LSE=lse, ROWS=rows, V=V, N=N,
                                       stride_zn=logits.stride(0), ignore_index=ignore_index,
                                       on_target=on_target, eps_i=eps_i), logits.device)
    return lse, rows


def ce_backward(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                grad_loss: torch.Tensor, ignore_index: int, on_target: float,
                eps_i: float) -> torch.Tensor:
    """dz (N, V) in the logits' dtype: with w = grad_loss (a one-element tensor) on a row
    whose target is not ``ignore_index`` (else 0), ``exp(z - lse) · w (on_target + V eps_i)
    - w eps_i``, minus ``on_target · w`` at the row's target column; lse (N,) fp32."""
    _check_logits(logits)
    N, V = logits.shape
    dz = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _launch(ce_backward_kernel, N, dict(Z=logits, DZ=dz, LSE=lse, TARGET=target,
                                        GRAD_LOSS=grad_loss, V=V, stride_zn=logits.stride(0),
                                        stride_dn=dz.stride(0), ignore_index=ignore_index,
                                        on_target=on_target, eps_i=eps_i), logits.device)
    return dz
