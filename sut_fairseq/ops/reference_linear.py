"""The PyTorch backend of ``sut::routed_linear`` (CPU tensors, and the oracle the Triton
kernels are tested against): ``reference_forward`` / ``reference_backward``, which the
op in ``routed_linear.py`` (where the row layouts are documented) calls; and
``kernel_backend``, which backend a tensor's device takes (and ``expert_gemm``, whether its
routed products are the Triton kernels or PyTorch's grouped GEMM)."""
import os
from typing import Optional

import torch
import torch.nn.functional as F

from ..compiler import tracing
from .grouped_linear import CPU_DTYPES, misaligned_width


_BACKENDS = ("auto", "reference", "triton")


def kernel_backend(x: torch.Tensor) -> str:
    """The backend ``routed_linear`` uses for a tensor on ``x``'s device."""
    choice = os.environ.get("SUT_KERNELS", "auto")
    if choice not in _BACKENDS:
        raise ValueError(f"SUT_KERNELS={choice!r} is not one of {_BACKENDS}")
    return ("triton" if x.is_cuda else "reference") if choice == "auto" else choice


_EXPERT_GEMMS = ("kernels", "grouped_mm")


def expert_gemm() -> str:
    """``SUT_EXPERT_GEMM``: what multiplies the routed rows where the Triton backend runs:
    the plugin's Triton kernels (``kernels``, the default) or PyTorch's grouped GEMM
    (``grouped_mm``, ``grouped_linear.py``); the routers and the loss keep their kernels."""
    choice = os.environ.get("SUT_EXPERT_GEMM", "kernels")
    if choice not in _EXPERT_GEMMS:
        raise ValueError(f"SUT_EXPERT_GEMM={choice!r} is not one of {_EXPERT_GEMMS}")
    return choice


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for ``device_type``, or None (also for a device type that
    autocast does not know, such as ``meta``)."""
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def as_custom_op(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a plugin op on ``tensors`` (None entries skipped) is called as its custom op:
    in a traced graph, or where autograd records it. Eagerly without a gradient (decoding)
    its body is called directly, which skips the custom op's dispatch (about 30 us a call on
    a CPU)."""
    return tracing() or (torch.is_grad_enabled()
                         and any(t is not None and t.requires_grad for t in tensors))


def _rows(t: torch.Tensor, idx: Optional[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Rows start..end of the sorted order: ``t[start:end]`` or ``t[idx[start:end]]``."""
    return t[start:end] if idx is None else t.index_select(0, idx[start:end])


def _experts(ends):
    """(e, start, end) per expert e: its rows start..end of the sorted order."""
    return [(e, start, end) for e, (start, end) in enumerate(zip((0,) + tuple(ends[:-1]), ends))]


#: the forward groups the experts' GEMMs up to this many active rows per expert on average
#: (decoding); above it the loop is faster (``benchmarks/grouped_gemm_cpu.py``)
GROUPED_MAX_ROWS_PER_EXPERT = 64


def _grouped_gemm_takes(x: torch.Tensor, weight: torch.Tensor, active_rows: int) -> bool:
    """Whether the forward groups the experts' GEMMs: at most GROUPED_MAX_ROWS_PER_EXPERT
    ``active_rows`` per expert, and operands ``torch.nn.functional.grouped_mm`` takes (a
    float32 / bf16 / fp16 dtype, rows of ``x`` and of every expert's weight 16-byte aligned)."""
    return (active_rows <= GROUPED_MAX_ROWS_PER_EXPERT * weight.size(0)
            and x.dtype in CPU_DTYPES and weight.is_contiguous()
            and misaligned_width(weight, x.dtype) is None)


def _grouped_forward(x, weight, bias, g, src, dst, ends, out_rows):
    """All experts in one ``grouped_mm``, then the bias, the gate and the scatter once each:
    ``y = grouped_mm(x[src], W, offs=ends)`` (rows ends[e-1]..ends[e] times W[e]);
    ``y += b[e_r]``; ``y *= g``; ``out[dst] (+)= y``."""
    num_active = ends[-1]
    if num_active == 0:
        return x.new_zeros(out_rows, weight.size(2))
    xs = x[:num_active] if src is None else x.index_select(0, src)
    y = F.grouped_mm(xs.contiguous(), weight, offs=torch.tensor(ends, dtype=torch.int32, device=x.device))
    if bias is not None:  # the bias of each row's expert
        counts = torch.tensor([end - start for _, start, end in _experts(ends)], device=x.device)
        y.add_(bias.repeat_interleave(counts, dim=0, output_size=num_active))
    if g is not None:
        y.mul_(g)
    if dst is not None:
        out = x.new_zeros(out_rows, weight.size(2))
        return out.index_copy_(0, dst, y) if g is None else out.index_add_(0, dst, y)
    if num_active < out_rows:  # the no-op rows
        y = torch.cat([y, y.new_zeros(out_rows - num_active, y.size(1))])
    return y


def _looped_forward(x, weight, bias, g, src, dst, ends, out_rows):
    """Expert by expert (any dtype and shape; float64 for gradient checks)."""
    if dst is None:  # every row below ends[-1] is written: zero only the rest
        out = x.new_empty(out_rows, weight.size(2))
        out[ends[-1]:].zero_()
    else:
        out = x.new_zeros(out_rows, weight.size(2))
    for e, start, end in _experts(ends):
        if end == start:
            continue
        xe = _rows(x, src, start, end)
        ye = out[start:end] if dst is None else None  # dst None: straight into the output rows
        ye = (torch.mm(xe, weight[e], out=ye) if bias is None
              else torch.addmm(bias[e], xe, weight[e], out=ye))
        if g is not None:
            ye.mul_(g[start:end])
        if dst is not None:
            if g is None:  # one slot per output row
                out.index_copy_(0, dst[start:end], ye)
            else:
                out.index_add_(0, dst[start:end], ye)
    return out


def reference_forward(x, weight, bias, row_gates, src, dst, ends, out_rows):
    """``out[dst_r] (+)= g_r · (x[src_r] @ W[e] + b[e])`` for the sorted rows r of expert e.

    x (R_in, in), weight (E, in, out), bias (E, out) or None, all in one dtype; row_gates
    (A,) in any float dtype, or None (no gate, no sum); src / dst (A,) long: the row of x
    each active sorted row reads and the output row it writes (None: row r itself; with
    gates the rows landing on one output row are summed); ends: each expert's end offset in
    the sorted order (A = ends[-1]). Returns (out_rows, out), zero where no row writes."""
    g = None if row_gates is None else row_gates.to(x.dtype).unsqueeze(1)
    with torch.autocast(x.device.type, enabled=False):
        if _grouped_gemm_takes(x, weight, ends[-1]):
            return _grouped_forward(x, weight, bias, g, src, dst, ends, out_rows)
        return _looped_forward(x, weight, bias, g, src, dst, ends, out_rows)


def reference_backward(grad_out, x, weight, bias, row_gates, src, dst, ends, needs):
    """The gradients of ``reference_forward`` asked for by ``needs`` = (x, weight, bias,
    row gates), None for the others, each in its operand's dtype. Expert by expert, the
    gathered input recomputed rather than kept. Per expert, with P = G Wᵀ and G the gathered
    output gradient: dx = g ⊙ P, dW = xᵀ (g ⊙ G), db = Σ_rows g ⊙ G, dg = rowsum(P ⊙ x) + G b."""
    g = None if row_gates is None else row_gates.to(x.dtype).unsqueeze(1)
    grad_out = grad_out.to(x.dtype)
    need_x, need_w, need_b, need_g = needs
    need_b = need_b and bias is not None
    # buffers the blocks write are left uninitialised; what no block writes is zeroed
    if not need_x:
        grad_x = None
    elif src is None:
        grad_x = torch.empty_like(x)
        grad_x[ends[-1]:].zero_()
    else:  # accumulated with index_add_
        grad_x = torch.zeros_like(x)
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = weight.new_empty(weight.size(0), weight.size(2)) if need_b else None
    grad_g = g.new_empty(g.size(0)) if (need_g and g is not None) else None
    ones = x.new_ones(max(ends[-1], 1)) if need_b else None
    with torch.autocast(x.device.type, enabled=False):
        for e, start, end in _experts(ends):
            if end == start:  # an expert no row chose
                for grad in (grad_w, grad_b):
                    if grad is not None:
                        grad[e].zero_()
                continue
            ge = _rows(grad_out, dst, start, end)  # (n, out) G
            xe = _rows(x, src, start, end) if (need_w or grad_g is not None) else None
            if g is not None:
                gate = g[start:end]
                if need_x or grad_g is not None:
                    p = ge @ weight[e].t()  # (n, in) P = G Wᵀ
                    if grad_g is not None:  # dg = rowsum(P ⊙ x) + G b
                        grad_g[start:end] = (p * xe).sum(1)
                        if bias is not None:
                            grad_g[start:end] += ge @ bias[e]
                    gxe = p.mul_(gate) if need_x else None
                ge = ge * gate  # g ⊙ G
            elif need_x:
                gxe = ge @ weight[e].t()
            if need_x:
                if src is None:
                    grad_x[start:end] = gxe
                else:
                    grad_x.index_add_(0, src[start:end], gxe)
            if need_w:
                torch.mm(xe.t(), ge, out=grad_w[e])
            if need_b:  # Σ_rows as a matrix-vector product (BLAS)
                torch.mv(ge.t(), ones[: end - start], out=grad_b[e])
    return grad_x, grad_w, grad_b, None if grad_g is None else grad_g.to(row_gates.dtype)
