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
``sut::routed_linear_backward``, empty tensors for the gradients not needed.
Backends: ``reference`` (``reference_linear.py``, reads the expert counts on the host) for
CPU tensors, ``triton`` (``kernels/routed_linear_triton.py``, no host synchronisation) for
CUDA tensors; ``SUT_KERNELS=reference|triton|auto`` forces one (``triton`` on CPU tensors
needs ``TRITON_INTERPRET=1``). Under ``SUT_EXPERT_GEMM=grouped_mm`` the ``triton`` backend's
products are PyTorch's grouped GEMM instead (``grouped_linear.py``, the ``grouped`` path: no
custom op, differentiable operations that a compiled step traces and fuses).

Input activation (``activation`` "gelu" or "relu", MoE-FFD's down projection): the caller
hands over the up projection's pre-activations u (``pre``) beside the input it made from
them without a gradient,

    x = act(u) ⊙ keep / (1 - p)             (keep: the activation dropout's mask, or none)

(one pass forward: ``activation_dropout`` in ``modules/dropout.py``), and the op returns
u's gradient itself, du = dx ⊙ act'(u) ⊙ keep / (1 - p), which the kernels apply as they
store dx: the activation's backward was a pass over the (M, D) rows of its own.

Where the sums over a token's slots happen depends on the backend (``sums_outside``):

* ``reference``: inside the ops, as ``index_add_`` into token rows (the cheapest form on a
  CPU): the op returns the gated sum (N, out), its backward dx in x's shape and dg (N, k);
* ``triton``: outside them, in the traced graph, where a compiled step fuses them with
  their neighbours (inductor writes a sum over fewer than 8 slots as pointwise code; in an
  opaque op each sum was a kernel and a pass over (M, width) of its own): the op returns
  gate-weighted slot rows (N, k, out) that ``routed_linear`` sums over k; its backward
  reads that sum's gradient as one row per token (it arrives broadcast over the k slots)
  and returns dx per slot (M, in), which the autograd formula sums over the ``fan_out``
  slots reading one row, and dg as fp32 partial sums over the kernel's column tiles
  (T, M), which the formula adds up and casts; or, given gate rows (R, N, k) (R >= T equal
  rows, fp32: ``Router._gate_rows``), leaves as they are, partial r the gradient of row r:
  right in its sum over the rows, the only way the router's op reads it (its kernel adds
  them up as it loads them: no kernel of their own).
"""
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .grouped_linear import grouped_routed_linear
from .reference_linear import (_autocast_dtype, as_custom_op, expert_gemm, kernel_backend,
                               reference_backward, reference_forward)
from .routing import Routing, plain_gates
from . import weight_grads


def sums_outside(backend: str) -> bool:
    """Whether ``backend`` leaves the sums over a token's slots to the traced graph around
    the ops (module docstring)."""
    return backend == "triton"


def row_layout(routing: Routing, fan_out: int, grouped_in: bool, grouped_out: bool,
               gates: Optional[Tensor], out_fan: int = 1):
    """Where each active sorted row r (A = expert_offsets[-1] of them) reads and writes:
    (src (A,) rows of x, or None for row r itself; dst (A,) rows of the output (forward)
    or of its gradient (backward), ``out_fan`` consecutive slots sharing one (their rows
    summed in the forward), or None for row r itself; row_gates (A,) or None; ends, the
    experts' end offsets as ints (one host read))."""
    ends = tuple(routing.expert_offsets.tolist())
    active_slots = routing.sorted_scattered_idxs[: ends[-1]]
    src = None if grouped_in else active_slots // fan_out
    dst = None if grouped_out else (active_slots if out_fan == 1 else active_slots // out_fan)
    row_gates = None if gates is None else gates.reshape(-1).index_select(0, active_slots)
    return src, dst, row_gates, ends


def activated(u: Tensor, activation: str, keep: Optional[Tensor], keep_scale: float):
    """(act(u) ⊙ keep · keep_scale in u's dtype, act'(u) ⊙ keep · keep_scale in fp32 at
    least) of u (rows, in); act: "gelu" (u Φ(u), erf form: fairseq's ``gelu``) or "relu";
    keep: (rows, in) bool or None."""
    wide = u.to(torch.promote_types(u.dtype, torch.float32))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(wide * 0.5 ** 0.5))
        value, slope = wide * cdf, cdf + wide * torch.exp(-0.5 * wide * wide) * (2 * torch.pi) ** -0.5
    elif activation == "relu":
        value, slope = wide.clamp_min(0), (wide > 0).to(wide.dtype)
    else:
        raise ValueError(f"activation must be 'gelu' or 'relu'; got {activation!r}")
    if keep is not None:
        value, slope = value * keep * keep_scale, slope * keep * keep_scale
    return value.to(u.dtype), slope


def sum_rows(rows: Tensor, fan: int, num_rows: int) -> Tensor:
    """(M, W) slot rows -> (num_rows, W): row r sums slots r*fan .. r*fan+fan-1 (zero rows
    past M // fan)."""
    M, W = rows.shape
    out = rows if fan == 1 else rows.view(M // fan, fan, W).sum(1)
    if out.size(0) < num_rows:
        out = torch.cat([out, out.new_zeros(num_rows - out.size(0), W)], 0)
    return out


@torch.library.custom_op("sut::routed_linear", mutates_args=())
def routed_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], gates: Optional[Tensor],
                     expert_idxs: Tensor, sorted_expert_idxs: Tensor, sorted_scattered_idxs: Tensor,
                     expert_offsets: Tensor, fan_out: int, grouped_in: bool, grouped_out: bool,
                     backend: str, defer: int = -1, pre: Optional[Tensor] = None,
                     activation: str = "", keep: Optional[Tensor] = None,
                     keep_scale: float = 1.0) -> Tensor:
    """``defer``: ``weight_grads.defer_code`` (-1: the weight gradient of this call alone);
    ``pre``, ``activation``, ``keep``, ``keep_scale``: x = act(pre) ⊙ keep · keep_scale,
    the input gradient pre's (module docstring; the forward reads x only)."""
    routing = Routing(expert_idxs, gates, sorted_expert_idxs, sorted_scattered_idxs,
                      expert_offsets, weight.size(0))
    return _forward(x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out, backend)


def _forward(x, weight, bias, gates, routing: Routing, fan_out: int, grouped_in: bool,
             grouped_out: bool, backend: str) -> Tensor:
    """The op's body: the forward on ``backend``: (M, out); with gates (N, out) summed, or
    (N, k, out) gate-weighted slot rows where the sums are outside."""
    if backend == "triton":
        from ..kernels.routed_linear_triton import triton_forward

        y = triton_forward(x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out)
        return y if gates is None else y.view(routing.num_tokens, routing.k, weight.size(2))
    k = 1 if gates is None else routing.k
    src, dst, row_gates, ends = row_layout(routing, fan_out, grouped_in, grouped_out, gates, k)
    return reference_forward(x, weight, bias, row_gates, src, dst, ends, routing.num_slots // k)


@routed_linear_op.register_fake
def _(x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
      expert_offsets, fan_out, grouped_in, grouped_out, backend, defer=-1, pre=None,
      activation="", keep=None, keep_scale=1.0):
    if gates is None:
        return x.new_empty(sorted_scattered_idxs.size(0), weight.size(2))
    slots = gates.shape[-2:] if sums_outside(backend) else gates.shape[-2:-1]
    return x.new_empty(*slots, weight.size(2))


@torch.library.custom_op("sut::routed_linear_backward", mutates_args=())
def routed_linear_backward_op(
        grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], gates: Optional[Tensor],
        expert_idxs: Tensor, sorted_expert_idxs: Tensor, sorted_scattered_idxs: Tensor,
        expert_offsets: Tensor, fan_out: int, grouped_in: bool, grouped_out: bool, backend: str,
        need_x: bool, need_w: bool, need_b: bool, need_g: bool, pre: Optional[Tensor] = None,
        activation: str = "", keep: Optional[Tensor] = None, keep_scale: float = 1.0,
        acc_w: Optional[Tensor] = None, acc_b: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """grad: the output's gradient, (M, out) rows or one row per token (N, out) read by
    its k slots. Returns (dx, dW, db, dg), empty tensors for those not asked
    for; where the sums are outside (module docstring) dx is x's shape with ``grouped_in``,
    else (M, in) slot rows, and dg (T, M) fp32 partial sums (T = ``max_column_tiles``);
    with ``activation`` (x = act(pre) ⊙ keep · keep_scale, grouped) dx is pre's gradient;
    ``acc_w`` / ``acc_b`` (W's / b's shape, with ``need_w`` / ``need_b``): running sums that
    dW / db include, dW = acc_w + this call's term (the weight-gradient kernel adds them as
    it stores its tiles; ``weight_grads``)."""
    if (acc_w is not None and not need_w) or (acc_b is not None and (acc_w is None or not need_b)):
        raise ValueError("acc_w needs need_w, and acc_b needs need_b and acc_w")
    routing = Routing(expert_idxs, gates, sorted_expert_idxs, sorted_scattered_idxs,
                      expert_offsets, weight.size(0))
    needs = (need_x, need_w, need_b and bias is not None, need_g and gates is not None)
    dout_fan = routing.num_slots // grad.size(0) if grad.size(0) else 1  # token rows: k
    if backend == "triton":
        from ..kernels.routed_linear_triton import triton_backward

        grads = triton_backward(grad, x, weight, bias, gates, routing, fan_out, grouped_in,
                                grouped_out, dout_fan, needs, activation, pre, keep, keep_scale,
                                acc_w, acc_b)
    else:
        src, dst, row_gates, ends = row_layout(routing, fan_out, grouped_in, grouped_out, gates,
                                               dout_fan)
        *grads, grad_g = reference_backward(grad, x, weight, bias, row_gates, src, dst, ends, needs)
        if activation and grads[0] is not None:  # du = dx ⊙ act'(u) ⊙ keep · scale
            grads[0] = (grads[0] * activated(pre, activation, keep, keep_scale)[1]).to(x.dtype)
        if acc_w is not None:  # the running sums: dW = acc_w + this call's term
            grads[1] = acc_w + grads[1]
            if acc_b is not None and grads[2] is not None:
                grads[2] = acc_b + grads[2]
        if grad_g is not None:  # per active sorted row -> per slot (N, k)
            grad_g = gates.new_zeros(gates.numel()).index_copy(
                0, sorted_scattered_idxs[: ends[-1]], grad_g).view_as(gates)
        grads = (*grads, grad_g)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)  # empty: not needed


@routed_linear_backward_op.register_fake
def _(grad, x, weight, bias, gates, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs,
      expert_offsets, fan_out, grouped_in, grouped_out, backend, need_x, need_w, need_b, need_g,
      pre=None, activation="", keep=None, keep_scale=1.0, acc_w=None, acc_b=None):
    outside = sums_outside(backend)
    M = sorted_scattered_idxs.size(0)
    dx = dg = x.new_empty(0)
    if need_x:
        dx = x.new_empty(M, x.size(1)) if outside and not grouped_in else torch.empty_like(x)
    if need_g and gates is not None:
        if outside:
            from ..kernels.routed_linear_triton import partial_rows

            dg = x.new_empty(partial_rows(gates, weight.size(1), x.dtype, x.device), M,
                             dtype=torch.float32)
        else:
            dg = torch.empty_like(gates)
    dw = torch.empty_like(weight) if need_w else x.new_empty(0)
    db = torch.empty_like(bias) if (need_b and bias is not None) else x.new_empty(0)
    return dx, dw, db, dg


#: the op's trailing arguments' defaults: defer, pre, activation, keep, keep_scale
_DEFAULTS = (-1, None, "", None, 1.0)


def _setup_context(ctx, inputs, output):
    inputs = tuple(inputs) + _DEFAULTS[len(inputs) - 12:]
    # x, W, b, gates, the routing's four tensors; u and the mask of an input activation
    ctx.save_for_backward(*inputs[:8], inputs[13], inputs[15])
    ctx.layout = inputs[8:12]  # fan_out, grouped_in, grouped_out, backend
    ctx.activation = (inputs[14], inputs[16])  # activation, keep_scale
    ctx.bucket, ctx.flushes = weight_grads.attach(inputs[12])


def _backward(ctx, grad):
    """The op's gradient: ``sut::routed_linear_backward``, then the sums it leaves outside
    (module docstring) in the traced graph; with a bucket (``weight_grads``) the weight and
    bias gradients of every step at step 1's (per step: each step's launch adds the running
    sum of the later steps; deferred: one launch over every step's rows)."""
    activation = ctx.activation[0]
    needs = ctx.needs_input_grad[:4]  # x, W, b, gates (False for a None bias or gates)
    if activation:  # the input gradient is pre's (x is a detached act(pre))
        needs = (ctx.needs_input_grad[13],) + needs[1:]
    grads = _gradients(ctx, grad, needs)
    if activation:  # dx is pre's
        return (None,) + grads[1:] + (None,) * 9 + (grads[0], None, None, None)
    return grads + (None,) * 13


def _gradients(ctx, grad, needs):
    """(dx, dW, db, dgates), None where ``needs`` (x, W, b, gates) asks for none."""
    *saved, pre, keep = ctx.saved_tensors
    x, weight, bias, gates, expert_idxs, _, sorted_scattered_idxs, _ = saved
    fan_out, grouped_in, grouped_out, backend = ctx.layout
    activation, keep_scale = ctx.activation
    # rows of the output's gradient: slot rows (M, out), or one row per token (N, out) that
    # its k slots read: the summed output's, or with the sum outside the gradient of that
    # sum, which arrives broadcast over the slots (stride 0)
    if gates is not None and grad.dim() == 3:
        token_rows = grad.stride(1) == 0 or expert_idxs.size(1) == 1
        grad = grad.select(1, 0) if token_rows else grad.reshape(-1, grad.size(-1))
    bucket = ctx.bucket if needs[1] else None
    deferred = bucket is not None and bucket.deferred
    per_step = bucket is not None and not deferred
    step_needs = (needs[0], False, False, needs[3]) if deferred else needs
    # per step in a recurrence: dW and db include the running sum of the steps after this
    # one (its db is None where no bias gradient is asked for: the needs are every step's)
    acc_w, acc_b = bucket.running if per_step and bucket.running is not None else (None, None)
    dx = dw = db = dg = None
    if any(step_needs):
        dx, dw, db, dg = torch.ops.sut.routed_linear_backward(
            grad, *saved, *ctx.layout, *step_needs, pre, activation, keep, keep_scale, acc_w, acc_b)
    if per_step:
        dw, db = weight_grads.running_sum(bucket, dw, db if needs[2] else None, ctx.flushes)
    if deferred:
        weight_grads.add(bucket, weight_grads.Entry(
            grad, x, None if gates is None else plain_gates(gates), expert_idxs,
            sorted_scattered_idxs, fan_out, grouped_in, grouped_out))
        dw, db = (weight_grads.flush(bucket, weight, bias, backend, needs[2]) if ctx.flushes
                  else (None, None))  # step 1: every step's rows in one product
    if sums_outside(backend):
        if needs[0] and not grouped_in:
            dx = sum_rows(dx, fan_out, x.size(0))
        if needs[3]:  # gate rows (R, N, k) take the R partials as they are (Router._gate_rows)
            dg = dg.view_as(gates) if gates.dim() == 3 else dg.sum(0).view_as(gates).to(gates.dtype)
    return tuple(g if need and g is not None else None for g, need in zip((dx, dw, db, dg), needs))


routed_linear_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("sut::routed_linear_activated", mutates_args=())
def routed_linear_activated_op(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                               expert_idxs: Tensor, sorted_expert_idxs: Tensor,
                               sorted_scattered_idxs: Tensor, expert_offsets: Tensor,
                               fan_out: int, grouped_in: bool, grouped_out: bool, backend: str,
                               defer: int, activation: str, keep: Optional[Tensor],
                               keep_scale: float) -> Tuple[Tensor, Tensor]:
    """``sut::routed_linear`` without gates that also returns the next map's input: (u,
    act(u) ⊙ keep · keep_scale) of the (M, out) rows u (``routed_linear_activated``); the
    second output has no gradient."""
    routing = Routing(expert_idxs, None, sorted_expert_idxs, sorted_scattered_idxs,
                      expert_offsets, weight.size(0))
    return _forward_activated(x, weight, bias, routing, fan_out, grouped_in, backend, activation,
                              keep, keep_scale)


def _forward_activated(x, weight, bias, routing: Routing, fan_out: int, grouped_in: bool,
                       backend: str, activation: str, keep, keep_scale: float):
    """The body of ``sut::routed_linear_activated`` (sorted output): (u, act(u) ⊙ keep ·
    keep_scale)."""
    if backend == "triton":
        from ..kernels.routed_linear_triton import triton_forward

        return triton_forward(x, weight, bias, None, routing, fan_out, grouped_in, True,
                              activation, keep, keep_scale)
    u = _forward(x, weight, bias, None, routing, fan_out, grouped_in, True, backend)
    return u, activated(u, activation, keep, keep_scale)[0]


@routed_linear_activated_op.register_fake
def _(x, weight, bias, expert_idxs, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
      fan_out, grouped_in, grouped_out, backend, defer, activation, keep, keep_scale):
    M = sorted_scattered_idxs.size(0)
    return x.new_empty(M, weight.size(2)), x.new_empty(M, weight.size(2))


def _setup_context_activated(ctx, inputs, output):
    """``_setup_context`` of the plain op's first 13 arguments (no gates) and u."""
    _setup_context(ctx, tuple(inputs[:3]) + (None,) + tuple(inputs[3:12]), output[0])
    ctx.mark_non_differentiable(output[1])


def _backward_activated(ctx, grad_u, grad_x):
    """u's gradient as the plain op's (``grad_x``: none, the second output has none)."""
    needs = tuple(ctx.needs_input_grad[:3]) + (False,)
    dx, dw, db, _ = _gradients(ctx, grad_u, needs)
    return (dx, dw, db) + (None,) * 12


routed_linear_activated_op.register_autograd(_backward_activated,
                                             setup_context=_setup_context_activated)


def _operands(x, weight, bias, routing: Routing, fan_out: int, grouped_in: bool,
              grouped_out: bool, gates, backend: Optional[str]):
    """The map's operands checked and in the compute dtype (autocast's, else the promoted
    dtype of x and weight), and the backend: (x, weight, bias, backend)."""
    if weight.dim() != 3 or weight.size(0) != routing.num_experts:
        raise ValueError(f"weight must be (E={routing.num_experts}, in, out); "
                         f"got {tuple(weight.shape)}")
    if backend is None:
        backend = kernel_backend(x)
        backend = "grouped" if backend == "triton" and expert_gemm() == "grouped_mm" else backend
    if gates is not None and gates.dim() == 3 and backend != "triton":
        raise ValueError(f"gate rows (R, N, k) = {tuple(gates.shape)} are for the Triton "
                         "kernels; other backends take gates (N, k)")
    if backend == "triton":  # the kernels index without bounds checks
        from ..kernels.routed_linear_triton import check_operands

        check_operands(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates)
    dtype = _autocast_dtype(x.device.type) or torch.promote_types(x.dtype, weight.dtype)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), backend


def routed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], routing: Routing,
                  fan_out: int, grouped_in: bool = False, grouped_out: bool = False,
                  gates: Optional[Tensor] = None, backend: Optional[str] = None,
                  tag: int = -1, activation: str = "", pre: Optional[Tensor] = None,
                  keep: Optional[Tensor] = None, keep_scale: float = 1.0) -> Tensor:
    """Apply expert ``e``'s linear map to every slot routed to ``e`` (``sut::routed_linear``).

    x (N, in), (M, in) or sorted (M, in); weight (E, in, out); bias (E, out) or None;
    ``fan_out``: how many consecutive slots read one row of an un-grouped x (``routing.k``
    for token rows, 1 for slot rows); ``gates`` (N, k): weight each slot's output and sum a
    token's k slots (only with ``grouped_out=False``); ``backend``: ``reference`` or
    ``triton`` (the op), or ``grouped`` (``grouped_linear.py``: PyTorch's grouped GEMM,
    differentiable operations, no custom op); None for ``kernel_backend(x)``, whose
    ``triton`` is ``grouped`` under ``SUT_EXPERT_GEMM=grouped_mm``; ``tag``: the
    parameter's ``weight_grads`` tag (-1: none; under ``SUT_WEIGHT_GRADS=deferred`` the
    op's weight gradient is made at the recurrence's step 1); ``activation`` ("gelu",
    "relu"; "" none), grouped x only: x = act(pre) ⊙ keep · keep_scale made by the caller
    without a gradient, ``pre`` (x's shape) the pre-activations that get the input's
    gradient, ``keep`` (x's shape, bool) or None (module docstring). Returns (M, out), or (N, out)
    with gates, in the compute dtype: autocast's, else the promoted dtype of x and weight
    (as ``nn.Linear``; the gates keep theirs).
    """
    if gates is not None and grouped_out:
        raise ValueError("gates combine a token's slots and need grouped_out=False")
    if activation:
        if activation not in ("gelu", "relu") or not grouped_in:
            raise ValueError(f"an input activation is 'gelu' or 'relu' on grouped rows "
                             f"(grouped_in=True); got {activation!r}, grouped_in={grouped_in}")
        if pre is None or pre.shape != x.shape:
            raise ValueError(f"an input activation needs its pre-activations (pre) of x's "
                             f"shape {tuple(x.shape)}; got {None if pre is None else tuple(pre.shape)}")
        if keep is not None and (keep.dtype != torch.bool or keep.shape != x.shape):
            raise ValueError(f"keep must be a bool mask of x's shape {tuple(x.shape)}; got "
                             f"{keep.dtype} {tuple(keep.shape)}")
    x, weight, bias, backend = _operands(x, weight, bias, routing, fan_out, grouped_in,
                                         grouped_out, gates, backend)
    if activation:
        pre = pre.to(x.dtype)
        x = x.detach()  # its gradient is pre's, by the op (or through the grouped form's x)
    custom = as_custom_op(x, weight, bias, gates, pre)
    if activation and backend == "grouped":  # differentiable operations: x again from pre
        x = activated(pre, activation, keep, keep_scale)[0]
    if backend == "grouped":
        return grouped_routed_linear(x, weight, bias, routing, fan_out, grouped_in, grouped_out,
                                     gates)
    if not custom:  # eager, no gradient (decoding)
        y = _forward(x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out, backend)
    else:
        y = torch.ops.sut.routed_linear(
            x, weight, bias, gates, routing.expert_idxs, routing.sorted_expert_idxs,
            routing.sorted_scattered_idxs, routing.expert_offsets, fan_out, grouped_in,
            grouped_out, backend, weight_grads.defer_code(tag, weight), pre, activation, keep,
            keep_scale)
    if gates is not None and sums_outside(backend):
        y = y.sum(1)  # Σ_j g_j y_j over each token's k slots
    return y


def routed_linear_activated(x: Tensor, weight: Tensor, bias: Optional[Tensor], routing: Routing,
                            fan_out: int, activation: str, keep: Optional[Tensor] = None,
                            keep_scale: float = 1.0, backend: Optional[str] = None,
                            tag: int = -1) -> Tuple[Tensor, Tensor]:
    """MoE-FFD's up projection with the down projection's input formed as it is stored:

        u = x W[e] + b[e]   (M, out) sorted rows,     x' = act(u) ⊙ keep · keep_scale

    returns (u, x'); x' has no gradient (the down projection takes it with ``pre=u``, whose
    gradient it returns, ``routed_linear``'s input activation). On the Triton kernels one
    launch writes both (its epilogue forms x' of u as stored); elsewhere x' is formed after
    u. x, weight, bias, routing, fan_out, backend, tag: as ``routed_linear`` (sorted output,
    no gates); activation "gelu" or "relu"; keep (M, out) bool (the activation dropout's
    mask) or None."""
    if activation not in ("gelu", "relu"):
        raise ValueError(f"an output activation is 'gelu' or 'relu'; got {activation!r}")
    shape = (routing.num_slots, weight.size(-1))
    if keep is not None and (keep.dtype != torch.bool or tuple(keep.shape) != shape):
        raise ValueError(f"keep must be a bool mask of the output's shape {shape}; got "
                         f"{keep.dtype} {tuple(keep.shape)}")
    x, weight, bias, backend = _operands(x, weight, bias, routing, fan_out, False, True, None,
                                         backend)
    if backend == "grouped":  # differentiable operations (the down projection forms x' again)
        u = grouped_routed_linear(x, weight, bias, routing, fan_out, False, True, None)
        return u, activated(u.detach(), activation, keep, keep_scale)[0]
    if not as_custom_op(x, weight, bias):  # eager, no gradient (decoding)
        return _forward_activated(x, weight, bias, routing, fan_out, False, backend, activation,
                                  keep, keep_scale)
    return torch.ops.sut.routed_linear_activated(
        x, weight, bias, routing.expert_idxs, routing.sorted_expert_idxs,
        routing.sorted_scattered_idxs, routing.expert_offsets, fan_out, False, True, backend,
        weight_grads.defer_code(tag, weight), activation, keep, keep_scale)


#: the op on the PyTorch backend whatever the device (the oracle of the kernels' tests)
reference_routed_linear = functools.partial(routed_linear, backend="reference")
#: the op on the Triton kernels whatever the device (CPU tensors: in Triton's interpreter)
triton_routed_linear = functools.partial(routed_linear, backend="triton")
#: the map on PyTorch's grouped GEMM whatever the device (``grouped_linear.py``)
grouped_mm_routed_linear = functools.partial(routed_linear, backend="grouped")
