"""The routed linear map as a ``torch.library`` custom op: ``sut::routed_linear``.

Everything data-dependent about routing (how many rows each expert got, skipping the
no-op rows of halted and padding positions) happens inside this op, so a caller's graph
around it has static shapes and ``torch.compile(fullgraph=True)`` traces it whole, as the
expert matmuls of ScatterMoE and MoEUT are registered:

    sut::routed_linear(x, W, b, gates, expert_idxs, sorted_expert_idxs,
                       sorted_scattered_idxs, expert_offsets, fan_out, grouped_in,
                       grouped_out) -> y          (M, out), or (N, out) with gates
    sut::routed_linear_backward(dy, <the same inputs>, need_x, need_w, need_b, need_g)
                       -> (dx, dW, db, dg)         (an empty tensor for each one not needed)

The routing is passed as its four tensors (``ops.routing.Routing``; E = W.size(0)), the
output's shape follows from the input shapes alone (the "fake" implementations below),
and the autograd formula calls the backward op. Inside, CPU tensors run the per-expert
reference (``ExpertBlockLinear``: it reads the expert counts on the host, free on a CPU)
and CUDA tensors the Triton kernels (``RoutedLinearFunction``: no host synchronisation);
``SUT_KERNELS`` chooses as for ``routed_linear``. Both backends are called through their
autograd Functions' own ``forward`` / ``backward`` with a plain context object, so the
arithmetic is exactly theirs.

The op takes its operands already in the compute dtype (``routed_linear`` casts them, as
``nn.Linear`` does under autocast); the gates keep their own dtype.
"""
from types import SimpleNamespace
from typing import Optional, Tuple

import torch
from torch import Tensor

from .reference_linear import ExpertBlockLinear, kernel_backend
from .routing import Routing


def _routing(gates_or_idx: Tensor, expert_idxs: Tensor, sorted_expert_idxs: Tensor,
             sorted_scattered_idxs: Tensor, expert_offsets: Tensor, num_experts: int) -> Routing:
    return Routing(expert_idxs=expert_idxs, gates=gates_or_idx, sorted_expert_idxs=sorted_expert_idxs,
                   sorted_scattered_idxs=sorted_scattered_idxs, expert_offsets=expert_offsets,
                   num_experts=num_experts)


def _use_triton(x: Tensor) -> bool:
    return kernel_backend(x) == "triton"


class _Ctx(SimpleNamespace):
    """What an autograd Function's static forward/backward read from ``ctx``."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _reference_ctx(x, weight, bias, gates, routing: Routing, fan_out, grouped_in, grouped_out):
    """The arguments of ``ExpertBlockLinear.forward`` (see ``reference_routed_linear``)."""
    ends = tuple(routing.expert_offsets.tolist())
    active_slots = routing.sorted_scattered_idxs[: ends[-1]]
    src = None if grouped_in else active_slots // fan_out
    row_gates = None
    if grouped_out:
        dst, out_rows = None, routing.num_slots
    elif gates is None:
        dst, out_rows = active_slots, routing.num_slots
    else:
        dst, out_rows = active_slots // routing.k, routing.num_tokens
        row_gates = gates.reshape(-1).index_select(0, active_slots)
    return (x, weight, bias, row_gates, src, dst, ends, out_rows)


@torch.library.custom_op("sut::routed_linear", mutates_args=())
def routed_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], gates: Optional[Tensor],
                     expert_idxs: Tensor, sorted_expert_idxs: Tensor, sorted_scattered_idxs: Tensor,
                     expert_offsets: Tensor, fan_out: int, grouped_in: bool,
                     grouped_out: bool) -> Tensor:
    routing = _routing(gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
                       expert_offsets, weight.size(0))
    ctx = _Ctx()
    if _use_triton(x):
        from ..kernels.routed_linear_function import RoutedLinearFunction, _no_autocast

        if routing.num_slots == 0:
            return x.new_zeros(routing.num_tokens if gates is not None else 0, weight.size(2))
        with _no_autocast(x.device.type):
            return RoutedLinearFunction.forward(ctx, x, weight, bias, gates, routing, fan_out,
                                                grouped_in, grouped_out)
    args = _reference_ctx(x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out)
    return ExpertBlockLinear.forward(ctx, *args)


@routed_linear_op.register_fake
def _(x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
      expert_offsets, fan_out, grouped_in, grouped_out):
    rows = gates.size(0) if gates is not None else sorted_scattered_idxs.size(0)
    return x.new_empty(rows, weight.size(2))


_EMPTY = 0  # marker size of a gradient that was not asked for


@torch.library.custom_op("sut::routed_linear_backward", mutates_args=())
def routed_linear_backward_op(
        grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], gates: Optional[Tensor],
        expert_idxs: Tensor, sorted_expert_idxs: Tensor, sorted_scattered_idxs: Tensor,
        expert_offsets: Tensor, fan_out: int, grouped_in: bool, grouped_out: bool,
        need_x: bool, need_w: bool, need_b: bool, need_g: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    routing = _routing(gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
                       expert_offsets, weight.size(0))
    needs = (need_x, need_w, need_b and bias is not None, need_g and gates is not None)
    if _use_triton(x):
        from ..kernels.routed_linear_function import RoutedLinearFunction, _no_autocast

        if routing.num_slots == 0:
            grads = (torch.zeros_like(x), torch.zeros_like(weight),
                     None if bias is None else torch.zeros_like(bias),
                     None if gates is None else torch.zeros_like(gates))
        else:
            gates_flat = gates.reshape(-1).contiguous() if gates is not None else None
            ctx = _Ctx(saved_tensors=(x.contiguous(), weight, bias, gates_flat), routing=routing,
                       fan_out=fan_out, grouped_in=grouped_in, grouped_out=grouped_out,
                       gates_dtype=None if gates is None else gates.dtype,
                       needs_input_grad=needs + (False,) * 4)
            with _no_autocast(x.device.type):
                grads = RoutedLinearFunction.backward(ctx, grad)[:4]
    else:
        x_, weight_, bias_, row_gates, src, dst, ends, _ = _reference_ctx(
            x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out)
        dtype = weight.dtype
        g = None if row_gates is None else row_gates.to(dtype).unsqueeze(1)
        ctx = _Ctx(saved_tensors=(x, weight, bias, g, src, dst), ends=ends,
                   dtypes=(x.dtype, weight.dtype, None if bias is None else bias.dtype,
                           None if gates is None else gates.dtype),
                   needs_input_grad=needs + (False,) * 4)
        grad_x, grad_w, grad_b, grad_rows = ExpertBlockLinear.backward(ctx, grad)[:4]
        grad_g = None
        if grad_rows is not None:  # per active sorted row -> per slot (N, k)
            active = routing.sorted_scattered_idxs[: ends[-1]]
            grad_g = torch.zeros(gates.numel(), dtype=gates.dtype, device=gates.device)
            grad_g = grad_g.index_copy(0, active, grad_rows.to(gates.dtype)).view_as(gates)
        grads = (grad_x, grad_w, grad_b, grad_g)
    return tuple(grad if grad is not None else x.new_empty(_EMPTY) for grad in grads)


@routed_linear_backward_op.register_fake
def _(grad, x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
      expert_offsets, fan_out, grouped_in, grouped_out, need_x, need_w, need_b, need_g):
    def like(t, needed):
        return torch.empty_like(t) if (needed and t is not None) else x.new_empty(_EMPTY)
    return like(x, need_x), like(weight, need_w), like(bias, need_b), like(gates, need_g)


def _setup_context(ctx, inputs, output):
    (x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
     expert_offsets, fan_out, grouped_in, grouped_out) = inputs
    ctx.save_for_backward(x, weight, bias, gates, expert_idxs, sorted_expert_idxs,
                          sorted_scattered_idxs, expert_offsets)
    ctx.layout = (fan_out, grouped_in, grouped_out)


def _backward(ctx, grad):
    (x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
     expert_offsets) = ctx.saved_tensors
    need_x, need_w, need_b, need_g = ctx.needs_input_grad[:4]
    grads = torch.ops.sut.routed_linear_backward(
        grad, x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
        expert_offsets, *ctx.layout, need_x, need_w, need_b, need_g)
    wanted = (need_x, need_w, need_b and bias is not None, need_g and gates is not None)
    return tuple(g if want else None for g, want in zip(grads, wanted)) + (None,) * 7


routed_linear_op.register_autograd(_backward, setup_context=_setup_context)


def call_routed_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], routing: Routing,
                          fan_out: int, grouped_in: bool, grouped_out: bool,
                          gates: Optional[Tensor]) -> Tensor:
    """``sut::routed_linear`` with the routing's tensors (operands in the compute dtype)."""
    return torch.ops.sut.routed_linear(
        x, weight, bias, gates, routing.expert_idxs, routing.sorted_expert_idxs,
        routing.sorted_scattered_idxs, routing.expert_offsets, fan_out, grouped_in, grouped_out)
