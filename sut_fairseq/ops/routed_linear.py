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

    Differentiable by autograd. Reads the expert counts on the host (one sync), which is
    free on CPU; this is the oracle the Triton path is tested against.
    """
    num_slots = routing.num_slots
    ends = routing.expert_offsets.tolist()
    num_active = ends[-1] if ends else 0
    out_dim = weight.size(2)
    active_slots = routing.sorted_scattered_idxs[:num_active]
    xs = x[:num_active] if grouped_in else x.index_select(0, active_slots // fan_out)

    pieces, start = [], 0
    for e, end in enumerate(ends):
        if end > start:
            y_e = xs[start:end] @ weight[e]
            pieces.append(y_e + bias[e] if bias is not None else y_e)
        start = end
    y = torch.cat(pieces, 0) if pieces else xs.new_zeros((0, out_dim))

    if grouped_out:
        return torch.cat([y, y.new_zeros(num_slots - num_active, out_dim)], 0)
    if gates is None:
        return y.new_zeros(num_slots, out_dim).index_copy(0, active_slots, y)
    k = routing.k
    y = y * gates.reshape(-1).index_select(0, active_slots).unsqueeze(1).to(y.dtype)
    return y.new_zeros(routing.num_tokens, out_dim).index_add(0, active_slots // k, y)
