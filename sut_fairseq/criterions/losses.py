"""Auxiliary losses of the routers and the context that collects their statistics
(docs/model.md#losses).

For one router and the set X of (position, step) pairs where it was used:

    g(e)     = mean_{x in X} g(e|x)
    H(e)     = -Σ_e g(e) log g(e)
    H(e|x)   = -mean_{x in X} Σ_e g(e|x) log g(e|x)
    L_MIM    = H(e|x) - H(e)            (to minimise; = -MI, paper Eq. 1)

Balanced one-hot routing over E experts gives -log E; collapse onto one expert gives 0;
uniform routing for every token gives 0. The Switch-Transformer load-balancing loss
``L_switch = E · Σ_e f_e · g(e)`` (f_e: fraction of the top-k assignments that went to e)
is the Table 2 "- MIM loss" ablation.
"""
import contextlib
from typing import Dict, Iterator, List

import torch
import torch.nn as nn

from ..modules.router import EPS, Router, RouterStats


def mim_loss(stats: RouterStats) -> torch.Tensor:
    """L_MIM = H(e|x) - H(e) of one router's recorded statistics (0 if it saw nothing:
    every sum is 0): a 0-d tensor, or (R,) for ``stack_stats``' R routers at once."""
    n = stats.count.clamp_min(1.0)
    marginal = stats.sum_probs / n.unsqueeze(-1)
    h_marginal = -(marginal * torch.log(marginal + EPS)).sum(-1)
    h_conditional = -stats.sum_neg_entropy / n
    return h_conditional - h_marginal


def switch_loss(stats: RouterStats) -> torch.Tensor:
    """E · Σ_e f_e · g(e) (= 1 when balanced; E when collapsed; 0 if it saw nothing): a
    0-d tensor, or (R,) for ``stack_stats``' R routers."""
    n = stats.count.clamp_min(1.0)
    fraction = stats.assignments / stats.assignments.sum(-1, keepdim=True).clamp_min(1.0)
    return stats.sum_probs.size(-1) * (fraction * stats.sum_probs / n.unsqueeze(-1)).sum(-1)


def stack_stats(stats: List[RouterStats]) -> List[RouterStats]:
    """One ``RouterStats`` per distinct expert count among ``stats``, its sums the routers'
    stacked (R, 2 E + 2), so that the losses of all routers take a few kernels, not a few
    per router."""
    groups: Dict[int, List[RouterStats]] = {}
    for s in stats:
        groups.setdefault(s.num_experts, []).append(s)
    return [RouterStats.of_sums(torch.stack([s.sums for s in group]), E) for E, group in groups.items()]


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[List[RouterStats]]:
    """Collect routing statistics of every (non-trivial) router during one forward.

    Statistics exist only inside this context (the criterion's forward): nothing is kept
    between steps, during generation or after an exception.
    """
    routers = [m for m in model.modules() if isinstance(m, Router) and m.num_experts > 1]
    collected = []
    # the sums of gates will carry a gradient (a frozen model's routers give none); the
    # routers' zeros of each kind come from one buffer (one fill, not one per router)
    for grad in (False, True):
        group = [r for r in routers
                 if (torch.is_grad_enabled() and r.fc1.weight.requires_grad) == grad]
        if not group:
            continue
        sizes = [2 * r.num_experts + 2 for r in group]
        zeros = torch.zeros(sum(sizes), device=group[0].fc1.weight.device, requires_grad=grad)
        for router, sums in zip(group, zeros.split(sizes)):
            router.stats = RouterStats.of_sums(sums, router.num_experts)
    for router in routers:
        collected.append(router.stats)
    try:
        yield collected
    finally:
        for router in routers:
            router.stats = None
