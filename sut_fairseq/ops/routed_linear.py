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
forces one; ``triton`` on CPU tensors requires ``TRITON_INTERPRET=1`` (tests).
"""
import os
from typing import Optional

import torch

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
        from ..kernels import triton_routed_linear

        return triton_routed_linear(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates)
    return reference_routed_linear(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates)


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
    """Plain PyTorch: gather the routed rows, one matmul per non-empty expert, scatter.

    Reads the expert counts on the host (one sync), which is free on CPU; this is the
    oracle the Triton path is tested against.
    """
    num_slots = routing.num_slots
    ends = routing.expert_offsets.tolist()
    num_active = ends[-1] if ends else 0
    active_slots = routing.sorted_scattered_idxs[:num_active]
    xs = x if grouped_in else x.index_select(0, active_slots // fan_out)
    y = GroupedMatmul.apply(xs, weight, bias, tuple(ends), num_slots if grouped_out else num_active)
    if grouped_out:
        return y
    out_dim = weight.size(2)
    if gates is None:
        return y.new_zeros(num_slots, out_dim).index_copy(0, active_slots, y)
    y = y * gates.reshape(-1).index_select(0, active_slots).unsqueeze(1).to(y.dtype)
    return y.new_zeros(routing.num_tokens, out_dim).index_add(0, active_slots // routing.k, y)


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


class GroupedMatmul(torch.autograd.Function):
    """``out[r] = xs[r] @ W[e] + b[e]`` for the rows ``r`` of expert ``e`` in sorted order.

    xs: (R, in) rows sorted by expert (rows at ``ends[-1]`` and beyond are ignored);
    ends: end offset per expert; out: (total_rows, out), rows past ``ends[-1]`` zero.
    Written as one Function so that backward fills one input-gradient and one
    weight-gradient buffer expert by expert (autograd through per-expert slices would
    materialise a full-size zero gradient per expert). Under autocast the inputs are cast
    to the autocast dtype once; gradients come back in the parameters' own dtypes.
    """

    @staticmethod
    def forward(ctx, xs, weight, bias, ends, total_rows):
        dtype = _autocast_dtype(xs.device.type)
        ctx.dtypes = (xs.dtype, weight.dtype, None if bias is None else bias.dtype)
        if dtype is not None:
            xs, weight = xs.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        else:
            dtype = torch.result_type(xs, weight)
            xs, weight = xs.to(dtype), weight.to(dtype)
        out = xs.new_empty(total_rows, weight.size(2), dtype=dtype)
        with torch.autocast(xs.device.type, enabled=False):
            start = 0
            for e, end in enumerate(ends):
                if end > start:
                    if bias is None:
                        torch.mm(xs[start:end], weight[e], out=out[start:end])
                    else:  # b + x W in one BLAS call
                        torch.addmm(bias[e].to(dtype), xs[start:end], weight[e], out=out[start:end])
                start = end
        out[start:].zero_()
        ctx.ends, ctx.has_bias, ctx.num_rows = ends, bias is not None, xs.size(0)
        ctx.save_for_backward(xs, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xs, weight = ctx.saved_tensors
        grad_out = grad_out.to(xs.dtype)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # empty buffers: every row / expert below is either written or zeroed once
        grad_x = xs.new_empty(xs.shape) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = weight.new_empty(weight.size(0), weight.size(2)) if (need_b and ctx.has_bias) else None
        ones = grad_out.new_ones(max(ctx.ends[-1], 1)) if grad_b is not None else None
        with torch.autocast(xs.device.type, enabled=False):
            start = 0
            for e, end in enumerate(ctx.ends):
                g = grad_out[start:end]
                if grad_x is not None and end > start:
                    torch.mm(g, weight[e].t(), out=grad_x[start:end])
                if grad_w is not None:
                    if end > start:
                        torch.mm(xs[start:end].t(), g, out=grad_w[e])
                    else:
                        grad_w[e].zero_()
                if grad_b is not None:
                    # Σ_rows g as a matrix-vector product: BLAS, where a column sum
                    # (g.sum(0)) is a parallel reduction that stalls on a busy machine
                    if end > start:
                        torch.mv(g.t(), ones[: end - start], out=grad_b[e])
                    else:
                        grad_b[e].zero_()
                start = end
        if grad_x is not None:
            grad_x[start:].zero_()
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        return (
            None if grad_x is None else grad_x.to(x_dtype),
            None if grad_w is None else grad_w.to(w_dtype),
            None if grad_b is None else grad_b.to(b_dtype),
            None,
            None,
        )
