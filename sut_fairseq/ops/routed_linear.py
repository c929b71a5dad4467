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
from typing import Optional

import torch

from .reference_linear import ExpertBlockLinear, _autocast_dtype, kernel_backend  # noqa: F401 (re-exported)
from .routed_linear_op import call_routed_linear_op
from .routing import Routing

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
    if kernel_backend(x) == "triton":  # the kernels index without bounds checks
        from ..kernels.routed_linear_function import check_operands

        check_operands(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates)
    # the compute dtype, as nn.Linear under autocast; the op runs with its operands in it
    dtype = _autocast_dtype(x.device.type) or torch.promote_types(x.dtype, weight.dtype)
    x, weight = x.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    return call_routed_linear_op(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates)


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
