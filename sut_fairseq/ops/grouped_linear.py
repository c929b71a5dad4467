"""The routed linear map on PyTorch's grouped GEMM (``torch.nn.functional.grouped_mm``), the
expert products of a CUDA step under ``SUT_EXPERT_GEMM=grouped_mm`` (the default there is the
plugin's Triton kernels), in the row layouts of ``routed_linear.py``. With A = the active
sorted rows (``expert_offsets[-1]``; the rows after them are no-op slots) and o_e the end
offset of expert e's rows:

    xs   = x[src_r]  for r < A, 0 for r >= A        (M, in)   the rows in expert order
    ys   = grouped_mm(xs, W, offs=o)                (M, out)  rows o_{e-1}..o_e times W[e]
    ys   = ys + b[e_r]  for r < A, 0 for r >= A
    out  = ys in slot order                         (M, out)  (``grouped_out``: ys itself)
    out  = Σ_j g_nj out_{n,j}                       (N, out)  with gates (N, k)

Plain, differentiable PyTorch operations: autograd's own formula of ``grouped_mm`` gives the
input gradient (one grouped product of dY with the Wᵀ) and the weight gradient (one product
grouped over the rows, xsᵀ dY per expert, over every row of the call), and ``torch.compile``
traces the whole map, fusing the gathers, the bias, the gates and the scatter with their
neighbours. The product leaves the rows past A undefined, so both the forward's output and
the input gradient are masked there (the masks' ``where`` and its backward). The operands
must be bfloat16 on CUDA and in a compiled step (float32 and float16 too eagerly on a CPU),
with 16-byte aligned rows (``in`` and ``out`` a multiple of 8 in bf16); on CUDA, PyTorch
runs it on sm_90 and newer.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compiler import tracing
from .routing import Routing, slot_order

#: what ``grouped_mm`` multiplies: on CUDA and in a traced graph bfloat16 only; eagerly on a
#: CPU also float32 and float16 (the tests' exact comparisons)
CUDA_DTYPES = (torch.bfloat16,)
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def misaligned_width(weight: Tensor, dtype: torch.dtype) -> Optional[Tuple[str, int]]:
    """The first expert width, ("in" or "out", its size), of weight (E, in, out) whose rows
    in ``dtype`` are not 16-byte aligned, as ``grouped_mm`` needs them; None if both are."""
    widths = (("in", weight.size(1)), ("out", weight.size(2)))
    return next(((name, w) for name, w in widths if w * dtype.itemsize % 16), None)


def check_grouped_operands(x: Tensor, weight: Tensor) -> None:
    """Refuse, by name, operands ``grouped_mm`` does not take (dtype, row alignment)."""
    dtypes = CUDA_DTYPES if x.is_cuda or tracing() else CPU_DTYPES
    if x.dtype not in dtypes:
        where = "on CUDA and in a compiled step" if dtypes is CUDA_DTYPES else "on a CPU"
        raise ValueError(f"SUT_EXPERT_GEMM=grouped_mm multiplies {dtypes} operands {where}, "
                         f"not {x.dtype} (train with --bf16 there); or use the Triton kernels "
                         f"(SUT_EXPERT_GEMM=kernels)")
    bad = misaligned_width(weight, x.dtype)
    if bad is not None:
        name, width = bad
        size = x.element_size()
        raise ValueError(f"SUT_EXPERT_GEMM=grouped_mm needs 16-byte rows: expert width "
                         f"{name}={width} in {x.dtype} is {width * size} bytes; use a "
                         f"multiple of {16 // size} or SUT_EXPERT_GEMM=kernels")


def grouped_routed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], routing: Routing,
                          fan_out: int, grouped_in: bool, grouped_out: bool,
                          gates: Optional[Tensor]) -> Tensor:
    """The module docstring's map. x (N, in) token rows read by ``fan_out`` slots each,
    (M, in) slot rows (``fan_out`` 1) or (A..M, in) sorted rows (``grouped_in``); weight
    (E, in, out) and bias (E, out) or None in x's dtype; gates (N, k) or None. Returns
    (M, out) in slot or sorted order, or (N, out) with gates."""
    check_grouped_operands(x, weight)
    order = routing.sorted_scattered_idxs                          # (M,) slot of sorted row r
    M = order.numel()
    active = (torch.arange(M, device=x.device) < routing.expert_offsets[-1]).unsqueeze(1)
    if grouped_in:  # sorted rows; the no-op rows after the A active ones may be left off
        xs = x if x.size(0) == M else F.pad(x, (0, 0, 0, M - x.size(0)))
    else:
        xs = x.index_select(0, order // fan_out)
    xs = torch.where(active, xs, 0)                                # (M, in); the backward masks dxs
    ys = F.grouped_mm(xs, weight, offs=routing.expert_offsets.to(torch.int32))
    if bias is not None:  # the sentinel expert E of the no-op rows reads b[E - 1], masked below
        ys = ys + bias.index_select(0, routing.sorted_expert_idxs.clamp(max=weight.size(0) - 1))
    ys = torch.where(active, ys, 0)                                # (M, out)
    if grouped_out:
        return ys
    slots = slot_order(ys, order)                                  # (M, out) in slot order
    if gates is None:
        return slots
    k = routing.k
    return (slots.view(-1, k, slots.size(1)) * gates.to(slots.dtype).unsqueeze(2)).sum(1)
