"""The routed linear map: ``y_s = x_s @ W[e_s] + b[e_s]`` for every routed slot s.

One operation serves MoE-FFD (up and down projections) and MoMHA (per-expert query and
output projections). Layouts (N tokens, k slots each, M = N * k, see ``routing.py``):

* input ``x``: token-ordered (N, in) with ``fan_out = k`` (slot s reads row s // k),
  slot-ordered (M, in) with ``fan_out = 1`` (slot s reads row s), or, with
  ``grouped_in=True``, (M, in) rows already in sorted (expert-grouped) order;
* output: ``grouped_out=True`` gives (M, out) in sorted order; otherwise (M, out) in slot
  order, or, when ``gates`` (N, k) is given, the gate-weighted sum over each token's k
  slots, (N, out).  No-op slots produce zero rows and cost nothing.

Backends: CUDA tensors take the Triton kernels (``sut_fairseq.kernels``), CPU tensors the
plain PyTorch reference below. ``SUT_KERNELS=reference|triton|auto`` (default ``auto``)
forces one; ``triton`` on CPU tensors requires ``TRITON_INTERPRET=1`` (tests). Both run
inside the custom op ``sut::routed_linear`` (``routed_linear_op.py``), so the graph around
an expert layer has static shapes and compiles whole.
"""
import os
from typing import Optional

import torch

from .routed_linear_op import call_routed_linear_op
from .routing import Routing

_BACKENDS = ("auto", "reference", "triton")


def kernel_backend(x: torch.Tensor) -> str:
    """The backend ``routed_linear`` uses for a tensor on ``x``'s device."""
    choice = os.environ.get("SUT_KERNELS", "auto")
    if choice not in _BACKENDS:
        raise ValueError(f"SUT_KERNELS={choice!r} is not one of {_BACKENDS}")
    if choice == "auto":
        return "triton" if x.is_cuda else "reference"
    return choice


def routed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    routing: Routing,
    fan_out: int,
    grouped_in: bool = False,
    grouped_out: bool = False,
    gates: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Apply expert ``e``'s linear map to every slot routed to ``e``.

    Args:
        x: (N, in), (M, in) or sorted (M, in), see the module docstring.
        weight: (E, in, out) expert weights.
        bias: (E, out) expert biases or None.
        routing: the sorted routing of the N tokens.
        fan_out: how many consecutive slots read one row of an un-grouped ``x``
            (``routing.k`` for token rows, 1 for slot rows); ignored when ``grouped_in``.
        grouped_in / grouped_out: whether input / output rows are in sorted order.
        gates: (N, k) gate weights: multiply each slot's output and sum the k slots of a
            token (only with ``grouped_out=False``).
    Returns:
        (M, out) or, with ``gates``, (N, out).
    """
    if gates is not None and grouped_out:
        raise ValueError("gates combine a token's slots and need grouped_out=False")
    if weight.dim() != 3 or weight.size(0) != routing.num_experts:
        raise ValueError(
            f"weight must be (E={routing.num_experts}, in, out); got {tuple(weight.shape)}"
        )
    if kernel_backend(x) == "triton":
        _check_triton_operands(x, weight, bias, routing, fan_out, grouped_in, gates)
    # the compute dtype, as nn.Linear under autocast; the op runs with its operands in it
    dtype = _autocast_dtype(x.device.type) or torch.promote_types(x.dtype, weight.dtype)
    x, weight = x.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    return call_routed_linear_op(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates)


def _check_triton_operands(x, weight, bias, routing: Routing, fan_out: int, grouped_in: bool,
                           gates: Optional[torch.Tensor]) -> None:
    """The shape checks of ``triton_routed_linear`` (the kernels index without bounds checks)."""
    M, E = routing.num_slots, routing.num_experts
    if x.dim() != 2 or x.size(1) != weight.size(1):
        raise ValueError(f"x (rows, in) and weight (E={E}, in, out) do not match: "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (E, weight.size(2)):
        raise ValueError(f"bias must be (E, out); got {tuple(bias.shape)}")
    if gates is not None and tuple(gates.shape) != tuple(routing.expert_idxs.shape):
        raise ValueError(f"gates must be (N, k) = {tuple(routing.expert_idxs.shape)}; "
                         f"got {tuple(gates.shape)}")
    if grouped_in:
        if x.size(0) < M:
            raise ValueError(f"grouped x needs >= M = {M} rows; got {x.size(0)}")
    elif fan_out < 1 or M % fan_out or x.size(0) < M // fan_out:
        raise ValueError(f"x with fan_out={fan_out} needs M / fan_out = {M}/{fan_out} rows; "
                         f"got {x.size(0)}")


def reference_routed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    routing: Routing,
    fan_out: int,
    grouped_in: bool = False,
    grouped_out: bool = False,
    gates: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plain PyTorch: for each non-empty expert, gather its rows, one matmul, scatter.

    Reads the expert counts on the host (one sync), which is free on CPU; this is the
    oracle the Triton path is tested against.
    """
    ends = routing.expert_offsets.tolist()
    num_active = ends[-1]
    active_slots = routing.sorted_scattered_idxs[:num_active]
    src = None if grouped_in else active_slots // fan_out  # row of x read by each sorted row
    row_gates = None
    if grouped_out:  # sorted rows out, the no-op rows zero
        dst, out_rows = None, routing.num_slots
    elif gates is None:  # slot rows out
        dst, out_rows = active_slots, routing.num_slots
    else:  # Σ_j g_j y_j over each token's k slots
        dst, out_rows = active_slots // routing.k, routing.num_tokens
        row_gates = gates.reshape(-1).index_select(0, active_slots)
    return ExpertBlockLinear.apply(x, weight, bias, row_gates, src, dst, tuple(ends), out_rows)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for ``device_type``, or None (torch >= 2.1 compatible)."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    except TypeError:  # torch < 2.4: per-device functions
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _rows(t: torch.Tensor, idx: Optional[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Rows start..end of the sorted order: ``t[start:end]`` or ``t[idx[start:end]]``."""
    return t[start:end] if idx is None else t.index_select(0, idx[start:end])


class ExpertBlockLinear(torch.autograd.Function):
    """``out[dst_r] (+)= g_r · (x[src_r] @ W[e] + b[e])`` for the sorted rows r of expert e.

    Args (forward):
        x: (R_in, in); weight: (E, in, out); bias: (E, out) or None.
        row_gates: (A,) gate of each active sorted row, or None (no gate, no sum).
        src: (A,) long, the row of ``x`` each active sorted row reads; None: row r itself.
        dst: (A,) long, the output row of each active sorted row; None: row r itself.
            With ``row_gates`` the rows landing on one output row are summed.
        ends: end offset of each expert's rows in the sorted order (A = ends[-1]).
        out_rows: rows of the output; rows no sorted row writes are zero.

    Works expert block by expert block: the gather, the GEMM, the gate and the scatter of
    one expert's rows run back to back on data that is still in cache, and backward
    recomputes the gathered input instead of keeping an (A, in) copy. Under autocast the
    inputs are cast to the autocast dtype once; gradients come back in the inputs' own
    dtypes. Backward (per expert, P = G Wᵀ with G the gathered output gradient):
    dx = g ⊙ P, dW = xᵀ (g ⊙ G), db = Σ_rows g ⊙ G, dg = rowsum(P ⊙ x) + G b.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, row_gates, src, dst, ends, out_rows):
        dtype = _autocast_dtype(x.device.type) or torch.result_type(x, weight)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype,
                      None if row_gates is None else row_gates.dtype)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        g = None if row_gates is None else row_gates.to(dtype).unsqueeze(1)
        if dst is None:  # every row below ends[-1] is written: zero only the rest
            out = x.new_empty(out_rows, weight.size(2))
            out[ends[-1]:].zero_()
        else:
            out = x.new_zeros(out_rows, weight.size(2))
        with torch.autocast(x.device.type, enabled=False):
            start = 0
            for e, end in enumerate(ends):
                if end > start:
                    xe = _rows(x, src, start, end)
                    # dst None: straight into the output rows
                    ye = out[start:end] if dst is None else None
                    if bias is None:
                        ye = torch.mm(xe, weight[e], out=ye)
                    else:
                        ye = torch.addmm(bias[e], xe, weight[e], out=ye)
                    if g is not None:
                        ye.mul_(g[start:end])
                    if dst is not None:
                        if g is None:  # one slot per output row
                            out.index_copy_(0, dst[start:end], ye)
                        else:
                            out.index_add_(0, dst[start:end], ye)
                start = end
        ctx.ends = ends
        ctx.save_for_backward(x, weight, bias, g, src, dst)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, g, src, dst = ctx.saved_tensors
        grad_out = grad_out.to(x.dtype)
        need_x, need_w, need_b, need_g = ctx.needs_input_grad[:4]
        need_b = need_b and bias is not None
        # buffers written block by block are left uninitialised; what no block writes
        # (empty experts, rows past ends[-1]) is zeroed below
        if not need_x:
            grad_x = None
        elif src is None:
            grad_x = torch.empty_like(x)
            grad_x[ctx.ends[-1]:].zero_()
        else:  # accumulated with index_add_
            grad_x = torch.zeros_like(x)
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = weight.new_empty(weight.size(0), weight.size(2)) if need_b else None
        grad_g = g.new_empty(g.size(0)) if (need_g and g is not None) else None
        ones = x.new_ones(max(ctx.ends[-1], 1)) if need_b else None
        with torch.autocast(x.device.type, enabled=False):
            start = 0
            for e, end in enumerate(ctx.ends):
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
                start = end
        x_dtype, w_dtype, b_dtype, g_dtype = ctx.dtypes
        return (
            None if grad_x is None else grad_x.to(x_dtype),
            None if grad_w is None else grad_w.to(w_dtype),
            None if grad_b is None else grad_b.to(b_dtype),
            None if grad_g is None else grad_g.to(g_dtype),
            None, None, None, None,
        )
