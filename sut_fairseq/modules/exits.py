"""Early exits for the decoder's shared block: PABEE patience and DeeBERT entropy
(docs/exits.md). ``--decoder-halting pabee|entropy`` replaces the decoder's halting unit by
an off-ramp after every step l < L (per target position t, dropping t)::

    o_l = W_out · LN_l(h_l)          (l = 1 .. L-1)

with a LayerNorm of its own per step and the decoder's (tied) output projection W_out (2d
parameters per off-ramp; the main head after step L is unchanged). Before step l+1 every
running position evaluates o_l and decides:

* ``pabee`` (Zhou et al. 2020, patience-based early exit), with ŷ_l = argmax o_l::

      cnt_1 = 0;   cnt_l = cnt_{l-1} + 1 if ŷ_l = ŷ_{l-1}, else 0   (l >= 2)
      exit after step l when cnt_l = P       (--exit-patience P; P = 0: never)

* ``entropy`` (Xin et al. 2020, DeeBERT)::

      H_l = −Σ_v p_v ln p_v,   p = softmax(o_l)   (nats)
      exit after step l when H_l < S          (--exit-entropy S; S = 0: never)

An exited position is frozen as a halted one is and the decoder emits its off-ramp's logits
instead of the main head's, per position and per beam hypothesis; with P = 0 or S = 0 the
off-ramps are not evaluated and decoding is exactly the no-exit model's. In training nothing
exits: h_1 .. h_{L-1} go to the criterion, which trains the off-ramps (``--exit-loss``).
P, S and the rule are read at every forward, so ``--model-overrides`` can change them.
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
    if isinstance(patience, bool) or not isinstance(patience, numbers.Integral) or patience < 0:
        raise ValueError(f"--exit-patience={patience!r} is invalid: must be an integer >= 0 "
                         "(0 = never exit)")


def check_entropy(entropy) -> None:
    ok = isinstance(entropy, numbers.Real) and not isinstance(entropy, bool)
    if not (ok and math.isfinite(entropy) and entropy >= 0.0):
        raise ValueError(f"--exit-entropy={entropy!r} is invalid: must be a finite number >= 0 "
                         "(nats; 0 = never exit)")


class OffRampProjection(nn.Module):
    """``x (N, d) -> x Wᵀ (N, V)`` with the decoder's output projection W (V, d) passed in; a
    module of its own so that ``sut_fairseq.analysis.macs`` counts its V·d MACs per row."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


@dataclass
class ExitOutput:
    """What the exit rule hands to the decoder's output and to the criterion: exit_step
    (B, T) long, the step l < L whose off-ramp a position emitted (0: it ran all L steps);
    logits (B, T, V), the off-ramp logits o_exit on exited positions (zeros elsewhere; None
    when none exited); hidden, in training only, [h_1, ..., h_{L-1}] each (B, T, d)."""

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
    ``decide``, ``mix``, ``finish``), with off-ramps after steps 1 .. L-1 (L = max_steps);
    the decoder passes W_out through ``bind``."""

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
        """Before step ``step``: off-ramp l = step − 1 on h_l (B, T, d) of the running positions
        decides who computes step ``step`` (B, T) bool; ``threshold`` is unused."""
        l = step - 1
        if self.training:
            state.output.hidden.append(h)
        if self.training or self.never_exits():
            return running
        rows = running.reshape(-1).nonzero().squeeze(1)
        logits = self.offramp(h.reshape(-1, h.size(-1)).index_select(0, rows), l, state.weight)
        if self.rule == "pabee":
            pred = logits.argmax(-1)
            same = pred.eq(state.prev_pred.index_select(0, rows)) & (l > 1)  # cnt_1 = 0
            count = torch.where(same, state.count.index_select(0, rows) + 1, torch.zeros_like(pred))
            state.prev_pred = state.prev_pred.index_copy(0, rows, pred)
            state.count = state.count.index_copy(0, rows, count)
            stop = count.eq(self.patience)
        else:
            logp = F.log_softmax(logits.float(), -1)
            stop = -(logp.exp() * logp).sum(-1) < self.entropy  # H_l < S
        if not bool(stop.any()):
            return running
        out = state.output
        exit_rows = rows[stop]
        B, T = running.shape
        if out.logits is None:
            out.logits = logits.new_zeros(B, T, logits.size(-1))
        out.logits = out.logits.view(B * T, -1).index_copy(0, exit_rows, logits[stop]).view(B, T, -1)
        out.exit_step = out.exit_step.view(-1).index_fill(0, exit_rows, l).view(B, T)
        return running.reshape(-1).index_fill(0, exit_rows, False).view(B, T)

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
        self.mix, self.finish = rule.mix, rule.finish

    def begin(self, h0, real, prefix_in=None) -> ExitState:
        return self.rule.begin(h0, real, prefix_in, self.weight)

    def decide(self, h, running, state, step, threshold=None):
        return self.rule.decide(h, running, state, step)
