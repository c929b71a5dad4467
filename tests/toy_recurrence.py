"""The recurrence's loop (``SideRecurrence.run``) over a toy block, for tests of the loop
and of the halting rules that need no real block: ``fn(h, S, running, l) -> h_new``
replaces the block, and the step's halting half is the real one (``advance``)."""
from typing import Callable

import torch

from sut_fairseq.modules.recurrence import SideRecurrence, StepInputs, advance


class ToyStep:
    """``RecurrenceStep``'s call signature with ``fn`` as the block; carries nothing."""

    carries_kv = False
    halting = None

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, h, S, running, step, state, rule, carry, inputs, te=None, decide_next=True):
        return advance(h, self.fn(h, S, running, step), S, running, step, state, rule, decide_next)


def run_toy(fn: Callable, h0: torch.Tensor, real: torch.Tensor, rule, max_steps: int, **options):
    """S_L, the HaltingResult and the HaltingState of ``max_steps`` steps of ``fn`` over h0
    (B, T, d) with queries ``real`` (B, T) under ``rule`` (``options``: ``on_early_exit``,
    ``prefix_in``)."""
    inputs = StepInputs(self_padding_mask=~real, real=real)
    return SideRecurrence(ToyStep(fn), max_steps).run(h0, inputs, rule, **options)
