"""Early exits for the decoder's shared block: PABEE patience and DeeBERT entropy.

``--decoder-halting pabee|entropy`` replaces the halting unit of the decoder recurrence by
an off-ramp after every step l < L (per target position t, dropping t)::

    o_l = W_out · LN_l(h_l)          (l = 1 .. L-1)

LN_l is a LayerNorm of its own per step and W_out the decoder's (tied) output projection,
so an off-ramp adds 2d parameters (a V × d head per step would add V·d each). The main
output head after step L is unchanged: ``o_L = W_out · S_L`` (``W_out · LN(S_L)`` with
pre-LN blocks).

Before step l+1 every running position evaluates o_l and decides:

* ``pabee`` (Zhou et al. 2020, patience-based early exit), with ŷ_l = argmax o_l::

      cnt_1 = 0;   cnt_l = cnt_{l-1} + 1 if ŷ_l = ŷ_{l-1}, else 0   (l >= 2)
      exit after step l when cnt_l = P       (--exit-patience P; P = 0: never)

  so the earliest exit is after step P + 1, and an argmax sequence (a, b, b, b) with
  P = 2 exits after step 4.
* ``entropy`` (Xin et al. 2020, DeeBERT)::

      H_l = −Σ_v p_v ln p_v,   p = softmax(o_l)   (nats)
      exit after step l when H_l < S          (--exit-entropy S; S = 0: never)

  Any distribution over V symbols has H <= ln V, so S > ln V exits every position after
  step 1.

An exited position is frozen as a halted one is (h and S keep their values, its expert
layers route it to no expert, later positions read its frozen state as keys/values) and
the decoder emits its off-ramp's logits o_exit instead of the main head's. A position
that never exits runs all L steps and emits the main head's logits, so with P = 0 or
S = 0 decoding is exactly the no-exit model's (the off-ramps are then not evaluated at
all). Decisions are per position and per hypothesis: under beam search every
hypothesis' new position decides for itself, and nothing besides the per-step keys and
values is cached.

In training mode nothing exits: every position runs all L steps and the states
h_1 .. h_{L-1} are handed to the criterion, which trains the off-ramps
(``--exit-loss weighted|offramps``). Positions that read an exited position's frozen
state at inference see something training never showed them.

P and S are read at every forward, so ``--model-overrides "{'exit_patience': 2}"``,
``"{'exit_entropy': 0.1}"`` and even ``"{'decoder_halting': 'entropy'}"`` (both rules
share the off-ramps) change them after training.
"""
import math
import numbers
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules import LayerNorm

from .halting import HaltingResult, HaltingState

EXIT_RULES = ("pabee", "entropy")


def check_patience(patience) -> None:
    if not (isinstance(patience, numbers.Integral) and not isinstance(patience, bool) and patience >= 0):
        raise ValueError(f"--exit-patience={patience!r} is invalid: must be an integer >= 0 "
                         "(0 = never exit)")


def check_entropy(entropy) -> None:
    ok = isinstance(entropy, numbers.Real) and not isinstance(entropy, bool)
    if not (ok and math.isfinite(entropy) and entropy >= 0.0):
        raise ValueError(f"--exit-entropy={entropy!r} is invalid: must be a finite number >= 0 "
                         "(nats; 0 = never exit)")


class OffRampProjection(nn.Module):
    """``x (N, d) -> x Wᵀ (N, V)`` with the decoder's output projection W (V, d), passed in
    at each call (the weight is the decoder's, not a parameter of this module). A module
    of its own so that ``sut_fairseq.analysis.macs`` counts its V·d MACs per row."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


@dataclass
class ExitOutput:
    """What the exit rule hands to the decoder's output and to the criterion.

    exit_step: (B, T) long, the step l < L whose off-ramp a position emitted; 0 where it
        ran all L steps (the main head's logits stand).
    logits: (B, T, V) off-ramp logits o_exit on the exited positions (other rows are
        zeros); None when no position exited.
    hidden: training only: [h_1, ..., h_{L-1}], each (B, T, d), for the exit losses.
    """

    exit_step: torch.Tensor
    logits: Optional[torch.Tensor] = None
    hidden: List[torch.Tensor] = field(default_factory=list)

    def apply(self, main_logits: torch.Tensor) -> torch.Tensor:
        """(B, T, V): o_exit on exited positions, the main head's logits elsewhere."""
        if self.logits is None:
            return main_logits
        exited = self.exit_step.gt(0).unsqueeze(-1)
        return torch.where(exited, self.logits.to(main_logits.dtype), main_logits)


class ExitState(HaltingState):
    """HaltingState plus, per position (B, T): the last off-ramp argmax ``prev_pred`` and
    the PABEE counter ``count``; the exit record; the output weight W_out (V, d)."""

    def __init__(self, h: torch.Tensor, real: torch.Tensor, weight: torch.Tensor):
        super().__init__(h, real)
        B, T = real.shape
        self.weight = weight
        self.prev_pred = torch.zeros(B * T, dtype=torch.long, device=h.device)
        self.count = torch.zeros(B * T, dtype=torch.long, device=h.device)
        self.output = ExitOutput(torch.zeros(B, T, dtype=torch.long, device=h.device))


class ExitHalting(nn.Module):
    """The ``pabee`` / ``entropy`` rules on the recurrence's halting interface (``begin``,
    ``decide``, ``mix``, ``finish``); the decoder passes W_out through ``bind``.

    Args:
        rule: ``pabee`` or ``entropy``. embed_dim: d. max_steps: L (off-ramps after steps
        1 .. L-1). patience: P >= 0. entropy: S >= 0 (nats).
    """

    threshold = None  # no α_thresh: ``--halting-threshold`` leaves this side alone

    def __init__(self, rule: str, embed_dim: int, max_steps: int, patience: int, entropy: float):
        super().__init__()
        if rule not in EXIT_RULES:
            raise ValueError(f"unknown exit rule {rule!r}; choose from {EXIT_RULES}")
        if max_steps < 2:
            raise ValueError(f"exit rules need at least 2 decoder steps; got {max_steps}")
        check_patience(patience)
        check_entropy(entropy)
        self.rule, self.patience, self.entropy = rule, int(patience), float(entropy)
        self.max_steps = max_steps
        self.exits_enabled = True  # False: no exits (``sut_fairseq.analysis.macs`` static counts)
        self.norms = nn.ModuleList(LayerNorm(embed_dim) for _ in range(max_steps - 1))
        self.project = OffRampProjection()

    def never_exits(self) -> bool:
        limit = self.patience if self.rule == "pabee" else self.entropy
        return not self.exits_enabled or limit == 0

    def offramp(self, h: torch.Tensor, step: int, weight: torch.Tensor) -> torch.Tensor:
        """o_step = W_out LN_step(h): h (..., d), weight (V, d) -> logits (..., V)."""
        if not 1 <= step < self.max_steps:
            raise ValueError(f"off-ramps follow steps 1..{self.max_steps - 1}; got step {step}")
        return self.project(self.norms[step - 1](h), weight)

    def bind(self, weight: torch.Tensor) -> "BoundExitHalting":
        return BoundExitHalting(self, weight)

    def begin(self, h0: torch.Tensor, real: torch.Tensor, prefix_in=None,
              weight: Optional[torch.Tensor] = None) -> ExitState:
        if weight is None:
            raise ValueError("the exit rules need the output projection: use ExitHalting.bind(weight)")
        return ExitState(h0, real, weight)

    def decide(self, h: torch.Tensor, running: torch.Tensor, state: ExitState, step: int,
               threshold=None) -> torch.Tensor:
        """Before step ``step``: off-ramp l = step − 1 on h_l (B, T, d) of the running
        positions; returns who computes step ``step`` (B, T) bool (no threshold: the
        rules' patience and entropy bound decide)."""
        l = step - 1
        if self.training:
            state.output.hidden.append(h)
            return running
        if self.never_exits():
            return running
        rows = running.reshape(-1).nonzero().squeeze(1)
        logits = self.offramp(h.reshape(-1, h.size(-1)).index_select(0, rows), l, state.weight)
        if self.rule == "pabee":
            pred = logits.argmax(-1)
            if l == 1:
                count = torch.zeros_like(pred)
            else:
                count = torch.where(pred.eq(state.prev_pred.index_select(0, rows)),
                                    state.count.index_select(0, rows) + 1, torch.zeros_like(pred))
            state.prev_pred = state.prev_pred.index_copy(0, rows, pred)
            state.count = state.count.index_copy(0, rows, count)
            stop = count.eq(self.patience)
        else:
            logp = F.log_softmax(logits.float(), -1)
            entropy = -(logp.exp() * logp).sum(-1)
            stop = entropy < self.entropy
        if not bool(stop.any()):
            return running
        out = state.output
        exit_rows = rows[stop]
        B, T = running.shape
        if out.logits is None:
            out.logits = logits.new_zeros(B, T, logits.size(-1))
        out.logits = out.logits.view(B * T, -1).index_copy(0, exit_rows, logits[stop]).view(B, T, -1)
        out.exit_step = out.exit_step.view(-1).index_fill(0, exit_rows, l).view(B, T)
        halts = torch.zeros_like(running.reshape(-1)).index_fill(0, exit_rows, True)
        return running & ~halts.view(B, T)

    def mix(self, h: torch.Tensor, S: torch.Tensor, running: torch.Tensor, state: ExitState) -> torch.Tensor:
        """S_l = h_l (frozen rows keep their h, hence their S)."""
        return h

    def finish(self, state: ExitState, max_steps: int) -> HaltingResult:
        """All weight on the last executed step; the expected depth is the executed steps."""
        B, T = state.real.shape
        last = (state.steps - 1).clamp(min=0).unsqueeze(-1)
        weights = torch.zeros(B, T, max_steps, device=state.c.device).scatter(
            2, last, state.real.float().unsqueeze(-1))
        return HaltingResult(weights=weights, expected_depth=state.steps.float() * state.real,
                             steps=state.steps, real=state.real, max_steps=max_steps)


class BoundExitHalting:
    """An ``ExitHalting`` with the output weight of one forward (what
    ``SideRecurrence.run`` receives as its halting rule)."""

    def __init__(self, rule: ExitHalting, weight: torch.Tensor):
        self.rule, self.weight = rule, weight

    def begin(self, h0, real, prefix_in=None) -> ExitState:
        return self.rule.begin(h0, real, prefix_in, self.weight)

    def decide(self, h, running, state, step, threshold=None):
        return self.rule.decide(h, running, state, step)

    def mix(self, h, S, running, state):
        return self.rule.mix(h, S, running, state)

    def finish(self, state, max_steps):
        return self.rule.finish(state, max_steps)
