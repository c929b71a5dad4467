"""The universal recurrence: one shared block applied up to L times under a halting rule.

    h_0 = S_0 = embeddings
    for l = 1..L:
        if l >= 2: running = halting.decide(h_{l-1})       # α_{l-1}, who still computes
                   stop early when no position is running
        h_l = Block(query = h_{l-1}, key/value = S_{l-1}) on running positions, else h_{l-1}
        S_l = halting.mix(h_l, S_{l-1})                     # expected halted state (Eq. 3)
    output S_L

Queries come from the un-halted states h, keys/values from the halted states S
(paper Fig. 3 right); with ``--*-halting-kv state`` the block step takes its keys/values
from h_{l-1} instead (GUT's Algorithm 3; ``side_step.SideStep``). Inactive positions are passed to the block as ``running = False``
so its expert layers route them to no expert.
"""
from typing import Callable, Optional, Tuple

import torch

from .halting import HaltingResult, HaltingState

BlockStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def universal_recurrence(
    block_step: BlockStep,
    h0: torch.Tensor,
    real: torch.Tensor,
    halting,
    max_steps: int,
    on_early_exit: Optional[Callable[[torch.Tensor, torch.Tensor, int], None]] = None,
    prefix_in=None,
) -> Tuple[torch.Tensor, HaltingResult, HaltingState]:
    """Run the recurrence.

    Args:
        block_step: ``(h (B,T,d), S (B,T,d), running (B,T) bool, step l) -> h_new (B,T,d)``
            (a model side's ``SideStep.bind(ctx)``, ``side_step.py``).
        h0: (B, T, d) embeddings; real: (B, T) bool, False on padding.
        halting: a rule from ``halting.py``; max_steps: L.
        on_early_exit: called as ``(S, h, l)`` when every position has halted before
            step l (the incremental decoder fills its caches for steps l..L with the
            frozen rows).
        prefix_in: causal prefix sums of earlier positions (incremental decoding with
            ``global-mean`` halting), see ``HaltingState``.
    Returns:
        S_L (B, T, d), the HaltingResult and the final HaltingState.
    """
    state = halting.begin(h0, real, prefix_in)
    h, S, running = h0, h0, real
    for step in range(1, max_steps + 1):
        if step > 1:
            running = halting.decide(h, running, state, step)
            if not bool(running.any()):
                if on_early_exit is not None:
                    on_early_exit(S, h, step)
                break
        h_new = block_step(h, S, running, step)
        h = torch.where(running.unsqueeze(-1), h_new, h)
        state.steps = state.steps + running.long()
        S = halting.mix(h, S, running, state)
    return S, halting.finish(state, max_steps), state
