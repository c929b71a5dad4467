"""A router's choice from its logits as one custom op, ``sut::route_top_k``: the
distribution, the k picks, their renormalised gates and the sorted layout of
``ops/routing.py``, in two Triton launches on CUDA (``kernels/routing_triton.py``) where
the PyTorch ops are about 16 kernels; PyTorch (``route_top_k_reference``) elsewhere.

For logits z (N, E), active rows a (N,) and k picks:

    p = softmax(z)                        (N, E)
    i_j = argmax_e p^(j), p^(j+1) = p^(j) with its pick masked     (N, k), ties: lowest index
    g_j = a · p_{i_j} / S,  S = max(Σ_j p_{i_j}, 1e-9)               (N, k)
    expert of slot (n, j) = i_j if a_n else E (the no-op expert)

Gradient (p and g carry one; the indices none): with G the gates' gradient and P the
distribution's (from the routing statistics),

    ∂/∂p_{i_j} += a (G_j - Σ_l G_l p_{i_l} / S) / S      (S ≥ max_e p_e ≥ 1/E, the floor idle)
    ∂/∂z = p ⊙ (P' - Σ_e P'_e p_e),  P' = P + the scattered term above
"""
from typing import Tuple

import torch
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


def route_top_k_reference(logits: Tensor, active: Tensor, k: int):
    """The op's outputs from PyTorch operations (module docstring): probs (N, E), top_idx
    (N, k), gates (N, k), expert_idxs (N, k), sorted_expert_idxs (M,),
    sorted_scattered_idxs (M,), expert_offsets (E,)."""
    E = logits.size(1)
    probs = logits.softmax(1)
    top_idx = top_k_by_argmax(probs, k)
    top = probs.gather(1, top_idx)
    keep = active.unsqueeze(1)
    gates = top / top.sum(1, keepdim=True).clamp_min(EPS) * keep
    routing = make_routing(top_idx.masked_fill(~keep, E), gates, E)
    return (probs, top_idx, gates, routing.expert_idxs, routing.sorted_expert_idxs,
            routing.sorted_scattered_idxs, routing.expert_offsets.clone())


@torch.library.custom_op("sut::route_top_k", mutates_args=())
def route_top_k_op(logits: Tensor, active: Tensor, k: int) -> Tuple[Tensor, Tensor, Tensor, Tensor,
                                                                    Tensor, Tensor, Tensor]:
    if kernel_backend(logits) == "triton":
        from ..kernels.routing_triton import route_top_k

        return route_top_k(logits.contiguous(), active.contiguous(), k)
    return route_top_k_reference(logits, active, k)


@route_top_k_op.register_fake
def _(logits, active, k):
    N, E = logits.shape
    index = dict(dtype=torch.long, device=logits.device)
    return (logits.new_empty(N, E), logits.new_empty(N, k, **index), logits.new_empty(N, k),
            logits.new_empty(N, k, **index), logits.new_empty(N * k, **index),
            logits.new_empty(N * k, **index), logits.new_empty(E, **index))


def _setup_context(ctx, inputs, output):
    _, active, _ = inputs
    probs, top_idx, gates = output[:3]
    ctx.save_for_backward(probs, top_idx, active)


def _backward(ctx, grad_probs, _top_idx, grad_gates, *_indices):
    probs, top_idx, active = ctx.saved_tensors
    grad = torch.zeros_like(probs) if grad_probs is None else grad_probs
    if grad_gates is not None:
        top = probs.gather(1, top_idx)
        total = top.sum(1, keepdim=True).clamp_min(EPS)
        g = grad_gates * active.unsqueeze(1)
        grad = grad.scatter_add(1, top_idx, (g - (g * top).sum(1, keepdim=True) / total) / total)
    return probs * (grad - (grad * probs).sum(1, keepdim=True)), None, None


route_top_k_op.register_autograd(_backward, setup_context=_setup_context)
