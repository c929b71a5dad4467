"""Triton kernels of the label-smoothed cross entropy (``sut_fairseq/ops/label_smoothed_ce.py``,
where the formulas are derived): one pass over the logits forward, one backward.

For logits z (N, V), one program per row, looping over the row in ``BLOCK_V`` columns:

* ``ce_forward_kernel``: ``lse_n = log Σ_j exp z_nj`` (an online logsumexp: a running
  maximum m and sum s rescaled by exp(m_old - m_new) when m grows), ``Σ_j z_nj`` and the
  target's logit ``z_{n, target_n}``, accumulated in fp32 and written as three (N,) fp32
  vectors;
* ``ce_backward_kernel``: ``dz_nj = exp(z_nj - lse_n) · scale_n - shift_n`` plus
  ``target_term_n`` at ``j = target_n``, computed in fp32 and stored in the logits' dtype.

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


def _ce_forward(Z, TARGET, LSE, ROW_SUM, Z_TARGET, V, stride_zn, BLOCK_V: tl.constexpr):
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
    tl.store(LSE + row, m + tl.log(s))
    tl.store(ROW_SUM + row, tl.sum(total, 0))
    tl.store(Z_TARGET + row, tl.load(z_row + tl.load(TARGET + row)).to(tl.float32))


def _ce_backward(Z, DZ, LSE, SCALE, SHIFT, TARGET, TARGET_TERM, V, stride_zn, stride_dn,
                 BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_zn
    dz_row = DZ + row * stride_dn
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)
    shift = tl.load(SHIFT + row)
    target = tl.load(TARGET + row)
    target_term = tl.load(TARGET_TERM + row)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        inside = start + cols < V
        z = tl.load(z_row + start + cols, mask=inside, other=0.0).to(tl.float32)
        dz = tl.exp(z - lse) * scale - shift
        dz = tl.where(start + cols == target, dz + target_term, dz)
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


def ce_forward(logits: torch.Tensor, target: torch.Tensor):
    """logits (N, V), target (N,) in [0, V) -> (lse, row_sum, z_target), each (N,) fp32."""
    _check_logits(logits)
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    row_sum, z_target = torch.empty_like(lse), torch.empty_like(lse)
    _launch(ce_forward_kernel, N, dict(Z=logits, TARGET=target, LSE=lse, ROW_SUM=row_sum,
                                       Z_TARGET=z_target, V=V, stride_zn=logits.stride(0)),
            logits.device)
    return lse, row_sum, z_target


def ce_backward(logits: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                shift: torch.Tensor, target: torch.Tensor, target_term: torch.Tensor) -> torch.Tensor:
    """dz (N, V) in the logits' dtype: ``exp(z - lse) · scale - shift``, plus ``target_term``
    at each row's target column; lse, scale, shift, target_term (N,) fp32, target (N,) long."""
    _check_logits(logits)
    N, V = logits.shape
    dz = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _launch(ce_backward_kernel, N, dict(Z=logits, DZ=dz, LSE=lse, SCALE=scale, SHIFT=shift,
                                        TARGET=target, TARGET_TERM=target_term, V=V,
                                        stride_zn=logits.stride(0), stride_dn=dz.stride(0)),
            logits.device)
    return dz
