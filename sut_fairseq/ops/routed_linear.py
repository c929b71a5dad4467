"""The routed linear map ``y_s = x_s @ W[e_s] + b[e_s]`` for every routed slot s, as one
``torch.library`` custom op, ``sut::routed_linear``, with two backends; MoE-FFD and MoMHA
use it through ``modules/expert_linear.py``'s ``ExpertLinear``. Layouts (N tokens, k slots
each, M = N * k, see ``routing.py``):

* input ``x``: token-ordered (N, in) with ``fan_out = k`` (slot s reads row s // k),
  slot-ordered (M, in) with ``fan_out = 1`` (slot s reads row s), or, with
  ``grouped_in=True``, (M, in) rows already in sorted (expert-grouped) order;
* output: ``grouped_out=True`` gives (M, out) in sorted order; otherwise (M, out) in slot
  order, or, when ``gates`` (N, k) is given, the gate-weighted sum over each token's k
  slots, (N, out).  No-op slots produce zero rows and cost nothing.

Everything data-dependent about routing happens inside the op, so ``torch.compile
(fullgraph=True)`` traces the static-shaped graph around it whole; its gradient is the op
``sut::routed_linear_backward`` -> (dx, dW, db, dg), empty tensors for those not needed.
Backends: ``reference`` (``reference_linear.py``, reads the expert counts on the host) for
CPU tensors, ``triton`` (``kernels/routed_linear_triton.py``, no host synchronisation) for
CUDA tensors; ``SUT_KERNELS=reference|triton|auto`` forces one (``triton`` on CPU tensors
needs ``TRITON_INTERPRET=1``).
"""
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .reference_linear import (_autocast_dtype, as_custom_op, kernel_backend, reference_backward,
                               reference_forward)
from .routing import Routing


def row_layout(routing: Routing, fan_out: int, grouped_in: bool, grouped_out: bool,
               gates: Optional[Tensor]):
    """Where each active sorted row r (A = expert_offsets[-1] of them) reads and writes:
    (src (A,) rows of x, or None for row r itself; dst (A,) output rows, or None for row r
    itself; row_gates (A,) or None; ends, the experts' end offsets as ints (one host read);
    out_rows)."""
    ends = tuple(routing.expert_offsets.tolist())
    active_slots = routing.sorted_scattered_idxs[: ends[-1]]
    src = None if grouped_in else active_slots // fan_out
    row_gates = None
    if grouped_out:  # sorted rows out, the no-op rows zero
        dst, out_rows = None, routing.num_slots
    elif gates is None:  # slot rows out
        dst, out_rows = active_slots, routing.num_slots
    else:  # Σ_j g_j y_j over each token's k slots
        dst, out_rows = active_slots // routing.k, routing.num_tokens
        row_gates = gates.reshape(-1).index_select(0, active_slots)
    return src, dst, row_gates, ends, out_rows


@torch.library.custom_op("sut::routed_linear", mutates_args=())
def routed_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], gates: Optional[Tensor],
                     expert_idxs: Tensor, sorted_expert_idxs: Tensor, sorted_scattered_idxs: Tensor,
                     expert_offsets: Tensor, fan_out: int, grouped_in: bool, grouped_out: bool,
                     backend: str) -> Tensor:
    routing = Routing(expert_idxs, gates, sorted_expert_idxs, sorted_scattered_idxs,
                      expert_offsets, weight.size(0))
    return _forward(x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out, backend)


def _forward(x, weight, bias, gates, routing: Routing, fan_out: int, grouped_in: bool,
             grouped_out: bool, backend: str) -> Tensor:
    """The op's body: the forward on ``backend``."""
    if backend == "triton":
        from ..kernels.routed_linear_triton import triton_forward

        return triton_forward(x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out)
    src, dst, row_gates, ends, out_rows = row_layout(routing, fan_out, grouped_in, grouped_out, gates)
    return reference_forward(x, weight, bias, row_gates, src, dst, ends, out_rows)


@routed_linear_op.register_fake
def _(x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
      expert_offsets, fan_out, grouped_in, grouped_out, backend):
    rows = gates.size(0) if gates is not None else sorted_scattered_idxs.size(0)
    return x.new_empty(rows, weight.size(2))


@torch.library.custom_op("sut::routed_linear_backward", mutates_args=())
def routed_linear_backward_op(
        grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], gates: Optional[Tensor],
        expert_idxs: Tensor, sorted_expert_idxs: Tensor, sorted_scattered_idxs: Tensor,
        expert_offsets: Tensor, fan_out: int, grouped_in: bool, grouped_out: bool, backend: str,
        need_x: bool, need_w: bool, need_b: bool, need_g: bool
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    routing = Routing(expert_idxs, gates, sorted_expert_idxs, sorted_scattered_idxs,
                      expert_offsets, weight.size(0))
    needs = (need_x, need_w, need_b and bias is not None, need_g and gates is not None)
    if backend == "triton":
        from ..kernels.routed_linear_triton import triton_backward

        grads = triton_backward(grad, x, weight, bias, gates, routing, fan_out, grouped_in,
                                grouped_out, needs)
    else:
        src, dst, row_gates, ends, _ = row_layout(routing, fan_out, grouped_in, grouped_out, gates)
        *grads, grad_g = reference_backward(grad, x, weight, bias, row_gates, src, dst, ends, needs)
        if grad_g is not None:  # per active sorted row -> per slot (N, k)
            grad_g = gates.new_zeros(gates.numel()).index_copy(
                0, sorted_scattered_idxs[: ends[-1]], grad_g).view_as(gates)
        grads = (*grads, grad_g)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)  # empty: not needed


@routed_linear_backward_op.register_fake
def _(grad, x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
      expert_offsets, fan_out, grouped_in, grouped_out, backend, need_x, need_w, need_b, need_g):
    def like(t, needed):
        return torch.empty_like(t) if (needed and t is not None) else x.new_empty(0)
    return like(x, need_x), like(weight, need_w), like(bias, need_b), like(gates, need_g)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8])  # x, W, b, gates and the routing's four tensors
    ctx.layout = inputs[8:]  # fan_out, grouped_in, grouped_out, backend


def _backward(ctx, grad):
    needs = ctx.needs_input_grad[:4]  # x, W, b, gates (False for a None bias or gates)
    grads = torch.ops.sut.routed_linear_backward(grad, *ctx.saved_tensors, *ctx.layout, *needs)
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None,) * 8


routed_linear_op.register_autograd(_backward, setup_context=_setup_context)


def routed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], routing: Routing,
                  fan_out: int, grouped_in: bool = False, grouped_out: bool = False,
                  gates: Optional[Tensor] = None, backend: Optional[str] = None) -> Tensor:
    """Apply expert ``e``'s linear map to every slot routed to ``e`` (``sut::routed_linear``).

    x (N, in), (M, in) or sorted (M, in); weight (E, in, out); bias (E, out) or None;
    ``fan_out``: how many consecutive slots read one row of an un-grouped x (``routing.k``
    for token rows, 1 for slot rows); ``gates`` (N, k): weight each slot's output and sum a
    token's k slots (only with ``grouped_out=False``); ``backend``: ``reference`` or
    ``triton``, None for ``kernel_backend(x)``. Returns (M, out), or (N, out) with gates, in
    the compute dtype: autocast's, else the promoted dtype of x and weight (as ``nn.Linear``;
    the gates keep theirs).
    """
    if gates is not None and grouped_out:
        raise ValueError("gates combine a token's slots and need grouped_out=False")
    if weight.dim() != 3 or weight.size(0) != routing.num_experts:
        raise ValueError(f"weight must be (E={routing.num_experts}, in, out); "
                         f"got {tuple(weight.shape)}")
    backend = backend or kernel_backend(x)
    if backend == "triton":  # the kernels index without bounds checks
        from ..kernels.routed_linear_triton import check_operands

        check_operands(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates)
    dtype = _autocast_dtype(x.device.type) or torch.promote_types(x.dtype, weight.dtype)
    x, weight = x.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    if not as_custom_op(x, weight, bias, gates):  # eager, no gradient (decoding)
        return _forward(x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out, backend)
    return torch.ops.sut.routed_linear(
        x, weight, bias, gates, routing.expert_idxs, routing.sorted_expert_idxs,
        routing.sorted_scattered_idxs, routing.expert_offsets, fan_out, grouped_in, grouped_out,
        backend)


#: the op on the PyTorch backend whatever the device (the oracle of the kernels' tests)
reference_routed_linear = functools.partial(routed_linear, backend="reference")
#: the op on the Triton kernels whatever the device (CPU tensors: in Triton's interpreter)
triton_routed_linear = functools.partial(routed_linear, backend="triton")
