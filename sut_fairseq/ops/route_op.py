"""A router's choice from its logits as one custom op, ``sut::route_top_k``: the k picks,
their renormalised gates, the sorted layout of ``ops/routing.py`` and the sums of the
routing statistics, in two Triton launches on CUDA (``kernels/routing_triton.py``; its
gradient in one) where the PyTorch ops are about 20 kernels forward; PyTorch elsewhere.
The logits are its input x (N, E), or z = x W^T from the router's hidden layer x (N, D)
and its last layer W (E, D) (no bias), which the kernels multiply themselves: then the
op's gradient launch also gives x's gradient dz W, and W's gradient dz^T x is one product
outside the op (where a compiled loop sums it over steps in its GEMMs). With ``pre_tanh``
x is the hidden layer's pre-activation u = W1 x' + b1 and the op forms the layer itself,

    h = a · tanh(u) ⊙ keep / (1 - p)        (N, D), in u's dtype; keep: the gating dropout's mask

(``router_hidden``; without a mask h = a · tanh(u)), so that no kernel of its own reads
and writes it (the routers' tanh and dropout were two passes over (N, D) per call, forward
and backward); its gradient is then u's, dh ⊙ keep / (1 - p) ⊙ (1 - tanh(u)^2) on active
rows, and W's is dz^T h with h from the gradient's launch.

For logits z (N, E), active rows a (N,) and k picks (the gates returned in ``gate_dtype``,
the compute dtype of the expert layers, the rest in fp32 at least):

    p = softmax(z)                                                   (N, E), fp32
    i_j = argmax_e p^(j), p^(j+1) = p^(j) with its pick masked       (N, k), ties: lowest index
    g_j = a · p_{i_j} / S,  S = max(Σ_j p_{i_j}, 1e-9)               (N, k)
    expert of slot (n, j) = i_j if a_n else E (the no-op expert)
    sums = [Σ_n a p_n (E) | picks per expert over active slots (E) | Σ_n a Σ_e p log(p + 1e-9) | Σ_n a]
           + running  (the sums of the forward's earlier calls, ``RouterStats.sums``; or none)

Gradient: the gates, the first E + 1 sums and ``running`` carry one (running's is the sums'
gradient itself), the rest none. With G the gates' gradient, P the
sums' first E entries' and H the entropy term's,

    ∂/∂p_e = a (P_e + H (log(p_e + 1e-9) + p_e / (p_e + 1e-9)))
             + a [e = i_j] (G_j - Σ_l G_l p_{i_l} / S) / S          (S ≥ max_e p_e ≥ 1/E)
    ∂/∂z   = p ⊙ (∂/∂p - Σ_e p_e ∂/∂p_e)
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference_linear import kernel_backend
from .routing import make_routing

EPS = 1e-9


def top_k_by_argmax(scores: Tensor, k: int) -> Tensor:
    """The indices (n, k) of the k largest of each row of scores (n, E), largest first,
    as k argmax passes, each masking its pick:

        i_j = argmax_e s^(j)_e,   s^(j+1) = s^(j) with s_{i_j} = -inf

    = ``scores.topk(k).indices`` for distinct values (ties: the lowest index first)."""
    picks, s = [], scores
    for _ in range(k):
        i = s.argmax(1, keepdim=True)
        picks.append(i)
        s = s.scatter(1, i, float("-inf"))
    return torch.cat(picks, 1)


def routing_sums(probs: Tensor, top_idx: Tensor, active: Optional[Tensor] = None) -> Tensor:
    """The statistics of one router call (2 E + 2,) (module docstring) from its distribution
    probs (N, E) fp32, its picks top_idx (N, k) and its active rows (N,) bool (None: all)."""
    a = probs.new_ones(probs.size(0)) if active is None else active.to(probs.dtype)
    picks = probs.new_zeros(probs.size(1)).scatter_add_(
        0, top_idx.reshape(-1), a.repeat_interleave(top_idx.size(1)))
    return torch.cat([(probs * a.unsqueeze(1)).sum(0), picks,
                      ((probs * torch.log(probs + EPS)).sum(1) * a).sum().unsqueeze(0),
                      a.sum().unsqueeze(0)])


def router_logits(x: Tensor, weight: Optional[Tensor]) -> Tensor:
    """z = x (N, E) without a weight, else z = x W^T (N, E) from x (N, D) and the router's
    last layer W (E, D), in x's dtype."""
    return x if weight is None else F.linear(x, weight.to(x.dtype))


def router_hidden(u: Tensor, active: Tensor, keep: Optional[Tensor], keep_scale: float) -> Tensor:
    """The routers' hidden layer from its pre-activation u (N, D): h = a · tanh(u) ⊙ keep ·
    keep_scale (N, D) in u's dtype, a the active rows (N,) bool, keep (N, D) bool or None."""
    h = torch.tanh(u)
    if keep is not None:
        h = h * keep * keep_scale
    return torch.where(active.unsqueeze(1), h, 0.0)


def route_top_k_reference(x: Tensor, weight: Optional[Tensor], active: Tensor, k: int,
                          gate_dtype: torch.dtype = torch.float32, running: Optional[Tensor] = None,
                          keep: Optional[Tensor] = None, keep_scale: float = 1.0,
                          pre_tanh: bool = False, gate_rows: int = 0):
    """The op's outputs from PyTorch operations, differentiable by autograd (module
    docstring; z = ``router_logits(x, weight)``, of ``router_hidden(x, ...)`` with
    ``pre_tanh``): gates (N, k) (with ``gate_rows`` R >= 1: (R, N, k), R equal rows),
    expert_idxs (N, k), sorted_expert_idxs (M,), sorted_scattered_idxs (M,), expert_offsets
    (E,), sums (2 E + 2,)."""
    if pre_tanh:
        x = router_hidden(x, active, keep, keep_scale)
    logits = router_logits(x, weight)
    E = logits.size(1)
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(1)
    top_idx = top_k_by_argmax(probs, k)
    top = probs.gather(1, top_idx)
    keep = active.unsqueeze(1)
    gates = top / top.sum(1, keepdim=True).clamp_min(EPS) * keep
    routing = make_routing(top_idx.masked_fill(~keep, E), gates, E)
    sums = routing_sums(probs, top_idx, active)
    if running is not None:
        sums = running + sums
    gates = gates.to(gate_dtype)
    if gate_rows:
        gates = gates.expand(gate_rows, -1, -1).clone()
    return (gates, routing.expert_idxs, routing.sorted_expert_idxs,
            routing.sorted_scattered_idxs, routing.expert_offsets.clone(), sums)


def route_top_k_backward_reference(x: Tensor, weight: Optional[Tensor], active: Tensor,
                                   expert_idxs: Tensor, grad_gates: Tensor, grad_sums: Tensor,
                                   keep: Optional[Tensor] = None, keep_scale: float = 1.0,
                                   pre_tanh: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """(∂/∂z (N, E) in x's dtype by the formula of the module docstring, ∂/∂x = ∂/∂z W
    (N, D), or an empty tensor without a weight, and the hidden layer h (N, D) with
    ``pre_tanh`` (∂/∂x then through it), else an empty tensor)."""
    if pre_tanh:
        u, x = x, router_hidden(x, active, keep, keep_scale)
    logits = router_logits(x, weight)
    E = logits.size(1)
    probs = logits.to(grad_sums.dtype).softmax(1)
    a = active.to(probs.dtype).unsqueeze(1)
    picks = expert_idxs.clamp_max(E - 1)  # an inactive row's slots (E) have zero G and a
    top = probs.gather(1, picks)
    total = top.sum(1, keepdim=True).clamp_min(EPS)
    if grad_gates.dim() == 3:  # gate rows: their sum
        grad_gates = grad_gates.sum(0)
    g = grad_gates.to(probs.dtype) * a
    grad = a * (grad_sums[:E] + grad_sums[2 * E] * (torch.log(probs + EPS) + probs / (probs + EPS)))
    grad = grad.scatter_add(1, picks, (g - (g * top).sum(1, keepdim=True) / total) / total)
    dz = (probs * (grad - (grad * probs).sum(1, keepdim=True))).to(x.dtype)
    if weight is None:
        return dz, x.new_empty(0), x.new_empty(0)
    dx = dz @ weight.to(x.dtype)
    if not pre_tanh:
        return dz, dx, x.new_empty(0)
    wide = torch.promote_types(u.dtype, torch.float32)  # as the kernel: fp32 at least
    slope = 1 - torch.tanh(u.to(wide)) ** 2  # dh ⊙ keep · scale ⊙ (1 - tanh(u)^2), active rows
    if keep is not None:
        slope = slope * keep * keep_scale
    du = torch.where(active.unsqueeze(1), dx.to(wide) * slope, 0.0).to(u.dtype)
    return dz, du, x


@torch.library.custom_op("sut::route_top_k", mutates_args=())
def route_top_k_op(x: Tensor, weight: Optional[Tensor], active: Tensor, k: int,
                   gate_dtype: torch.dtype, running: Optional[Tensor],
                   keep: Optional[Tensor] = None, keep_scale: float = 1.0, pre_tanh: bool = False,
                   gate_rows: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``gate_rows`` R >= 1: the gates as (R, N, k), R equal rows, whose gradient arrives
    as R rows that the backward sums (a gated map's per-column-tile partial sums,
    ``Router``); 0: (N, k)."""
    if gate_rows < 0:
        raise ValueError(f"gate_rows must be >= 0; got {gate_rows}")
    if kernel_backend(x) == "triton":
        from ..kernels.routing_triton import route_top_k

        return route_top_k(x.contiguous(), None if weight is None else weight.contiguous(),
                           active.contiguous(), k, gate_dtype, running,
                           None if keep is None else keep.contiguous(), keep_scale, pre_tanh,
                           gate_rows)
    return route_top_k_reference(x, weight, active, k, gate_dtype, running, keep, keep_scale,
                                 pre_tanh, gate_rows)


@route_top_k_op.register_fake
def _(x, weight, active, k, gate_dtype, running, keep=None, keep_scale=1.0, pre_tanh=False,
      gate_rows=0):
    N = x.size(0)
    E = x.size(1) if weight is None else weight.size(0)
    index = dict(dtype=torch.long)
    values = dict(dtype=torch.promote_types(x.dtype, torch.float32))
    rows = (gate_rows,) if gate_rows else ()
    return (x.new_empty(*rows, N, k, dtype=gate_dtype), x.new_empty(N, k, **index),
            x.new_empty(N * k, **index), x.new_empty(N * k, **index),
            x.new_empty(E, **index), x.new_empty(2 * E + 2, **values))


@torch.library.custom_op("sut::route_top_k_backward", mutates_args=())
def route_top_k_backward_op(x: Tensor, weight: Optional[Tensor], active: Tensor, expert_idxs: Tensor,
                            grad_gates: Tensor, grad_sums: Tensor, keep: Optional[Tensor] = None,
                            keep_scale: float = 1.0, pre_tanh: bool = False
                            ) -> Tuple[Tensor, Tensor, Tensor]:
    """(dz (N, E), dx (N, D) or empty without a weight, h (N, D) with ``pre_tanh`` or empty)."""
    if kernel_backend(x) == "triton":
        from ..kernels.routing_triton import route_top_k_backward

        dz, dx, h = route_top_k_backward(
            x.contiguous(), None if weight is None else weight.contiguous(), active.contiguous(),
            expert_idxs, grad_gates.contiguous(), grad_sums.contiguous(),
            None if keep is None else keep.contiguous(), keep_scale, pre_tanh)
        return dz, (x.new_empty(0) if dx is None else dx), (x.new_empty(0) if h is None else h)
    return route_top_k_backward_reference(x, weight, active, expert_idxs, grad_gates, grad_sums,
                                          keep, keep_scale, pre_tanh)


@route_top_k_backward_op.register_fake
def _(x, weight, active, expert_idxs, grad_gates, grad_sums, keep=None, keep_scale=1.0,
      pre_tanh=False):
    E = x.size(1) if weight is None else weight.size(0)
    return (x.new_empty(x.size(0), E), (x.new_empty(0) if weight is None else torch.empty_like(x)),
            torch.empty_like(x) if pre_tanh else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, active, _, _, running, keep, keep_scale, pre_tanh, _ = (tuple(inputs) + (0,))[:10]
    ctx.save_for_backward(x, weight, active, output[1], keep)
    ctx.has_running = running is not None
    ctx.hidden = (keep_scale, pre_tanh)


def _backward(ctx, grad_gates, *grads):
    # autograd hands over zeros (not None) for an output the loss did not use
    x, weight, active, expert_idxs, keep = ctx.saved_tensors
    grad_sums = grads[-1]
    dz, dx, h = torch.ops.sut.route_top_k_backward(x, weight, active, expert_idxs, grad_gates,
                                                   grad_sums, keep, *ctx.hidden)
    # with a weight, its gradient dW = dz^T x (E, D), or dz^T h through the hidden layer: a
    # product the compiler sees (and sums over steps); without one, x are the logits
    hidden = h if ctx.hidden[1] else x
    grad_x, grad_w = (dz, None) if weight is None else (dx, dz.t().mm(hidden).to(weight.dtype))
    return (grad_x, grad_w, None, None, None, grad_sums if ctx.has_running else None, None, None,
            None, None)


route_top_k_op.register_autograd(_backward, setup_context=_setup_context)
