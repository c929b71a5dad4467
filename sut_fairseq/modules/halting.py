"""Halting rules for the universal recurrence (docs/model.md#halting).

Before each step l >= 2 a rule reads the states and decides which positions keep
computing; it also forms the state S used as attention keys/values and as the output.
All halting quantities are kept in fp32; products of (1 - â) in log space.

Rules (``--encoder-halting`` / ``--decoder-halting``):

* ``stick-breaking`` (paper §3.2, Algorithm 1): ``â_{l-1} = sigmoid(MLP(h_{l-1}))``,
  ``α_{l-1} = â_{l-1} Π_{j<l-1} (1 - â_j)``, ``c_{l-1} = Σ_{j<=l-1} α_j``; a position with
  ``c_{l-1} >= α_thresh`` has halted (h and S frozen); otherwise
  ``h_l = Block(h_{l-1}, S_{l-1})`` and ``S_l = (1 - c_{l-1}) h_l + Σ_{j<=l-1} α_j h_j`` (Eq. 3).
* ``global-mean`` (GUT, Ray Chowdhury & Caragea 2024, §5.1): the same stick breaking on
  the masked mean of the states: one decision per sequence (encoder), or per causal
  prefix (decoder, positions <= t: no future token leaks, incremental decoding is exact).
* ``act`` (Graves 2016 / Dehghani et al. 2019): ``p_{l-1} = sigmoid(MLP(h_{l-1}))``; a
  position halts at the first step n where ``Σ_{j<=n} p_j >= α_thresh`` (= 1 − ε); its
  weights are p_1..p_{n-1} and the remainder ``R = 1 - Σ_{j<n} p_j`` on step n. The ponder
  cost N + R (N executed steps) replaces the expected depth in L_ACT.
* ``none``: every real position runs all L steps; S_l = h_l (a plain UT).

``--halting-transition`` (``stick-breaking``, ``global-mean``; GUT's transition-aware
halting) makes the unit read ``[x(h_{l-2}); x(h_{l-1})]`` (x: the state, or its mean), the
last completed transition, so that the decision can still skip step l.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.masked_linear_op import masked_linear
from .dropout import Dropout

HALTING_RULES = ("stick-breaking", "global-mean", "act", "none")


@dataclass
class HaltingResult:
    """Per-position halting outcome of one recurrence."""

    weights: torch.Tensor  # (B, T, L) fp32 halting distribution over steps (0 on padding)
    expected_depth: torch.Tensor  # (B, T) L_ACT summand: Σ_l l · weights_l, or N + R (act)
    steps: torch.Tensor  # (B, T) long: executed block applications
    real: torch.Tensor  # (B, T) bool: non-pad positions
    max_steps: int  # L

    def num_positions(self) -> torch.Tensor:
        """Real positions; ``act_units``: what ``act_loss`` averages over (chunked: chunks)."""
        return self.real.sum()

    act_units = num_positions

    def act_loss(self) -> torch.Tensor:
        """L_ACT of Eq. 4: mean of the summand over real positions."""
        return (self.expected_depth * self.real).sum() / self.real.sum().clamp_min(1)

    def executed_fraction(self) -> float:
        """Executed (position, step) pairs / (L × real positions)."""
        return self.steps.sum().item() / max(1, self.real.sum().item() * self.max_steps)


class HaltingState:
    """Running quantities of one recurrence for every position, (B, T) unless stated.
    prefix_in / prefix_out: causal prefix sums of earlier positions' states per step
    (incremental decoding), keyed by the step whose decision read them."""

    def __init__(self, h: torch.Tensor, real: torch.Tensor,
                 prefix_in: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = None):
        self.real, self.prev_h, self.prefix_in = real, h, prefix_in  # prev_h: h_{l-2}
        self.c = h.new_zeros(real.shape, dtype=torch.float32)  # cumulative halting mass
        self.log_remain = h.new_zeros(real.shape, dtype=torch.float32)  # log Π_j (1 - â_j)
        self.weighted_sum = torch.zeros_like(h, dtype=torch.float32)  # (B, T, d) Σ_j α_j h_j
        self.alphas: List[torch.Tensor] = []  # α_j
        self.steps = torch.zeros(real.shape, dtype=torch.long, device=h.device)  # executed
        self.prefix_out: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_tensors(cls, real: torch.Tensor, c: torch.Tensor, log_remain: torch.Tensor,
                     weighted_sum: torch.Tensor, prev_h: torch.Tensor,
                     steps: torch.Tensor) -> "HaltingState":
        """A state holding the given tensors (a compiled step's inputs), no α yet."""
        state = cls.__new__(cls)
        state.real, state.c, state.log_remain = real, c, log_remain
        state.weighted_sum, state.prev_h, state.steps = weighted_sum, prev_h, steps
        state.alphas, state.prefix_in, state.prefix_out = [], None, {}
        return state


class HaltingUnit(nn.Module):
    """â = sigmoid(Linear(d', 1)(dropout(GELU(Linear(d', d)(x))))), d' = d, or 2d reading a
    transition; the last layer starts at weight 0 and bias ``bias_init`` b, so that
    â = sigmoid(b) everywhere at initialisation. Returns the logit (...) in fp32."""

    def __init__(self, embed_dim: int, dropout: float, normalize_input: bool, transition: bool,
                 bias_init: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(embed_dim) if normalize_input else None
        self.fc1 = nn.Linear(2 * embed_dim if transition else embed_dim, embed_dim)
        self.dropout = Dropout(dropout)
        self.fc2 = nn.Linear(embed_dim, 1)
        nn.init.zeros_(self.fc2.weight)
        nn.init.constant_(self.fc2.bias, bias_init)

    def forward(self, x: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (..., d') -> logits (...); ``rows`` (...) bool: only those rows' hidden layer is
        computed (the other logits are then b, and the rules mask them)."""
        hidden = self.fc1(x) if rows is None else masked_linear(x, self.fc1, rows)
        return width_one_linear(self.dropout(F.gelu(hidden)), self.fc2)


def width_one_linear(a: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear`` (d -> 1) of a (..., d) as a product and a sum, not a width-1 GEMM (which
    cuBLAS runs misaligned in bf16); under autocast the product is fp32, not bf16:

        logit = Σ_i a_i w_i + b                                   -> (...) fp32
    """
    return ((a * linear.weight[0]).sum(-1) + linear.bias[0]).float()


class LearnedHalting(nn.Module):
    """The rules with a halting unit (stick-breaking, global-mean, act); threshold:
    α_thresh in (0, 1]; causal: decoder side (global-mean reads the causal prefix mean)."""

    def __init__(self, rule: str, embed_dim: int, dropout: float, threshold: float,
                 normalize_input: bool, transition: bool = False, causal: bool = False,
                 bias_init: float = 0.0):
        super().__init__()
        check_threshold(threshold)
        if transition and rule == "act":
            raise ValueError("--halting-transition applies to 'stick-breaking' and "
                             "'global-mean', not to 'act'")
        self.rule, self.threshold = rule, threshold
        self.transition, self.causal = transition, causal
        self.unit = HaltingUnit(embed_dim, dropout, normalize_input, transition, bias_init)

    def begin(self, h0: torch.Tensor, real: torch.Tensor, prefix_in=None) -> HaltingState:
        return HaltingState(h0, real, prefix_in)

    def _reading(self, h: torch.Tensor, state: HaltingState, step: int) -> torch.Tensor:
        """(B, T, d) or, for the encoder's global mean, (B, 1, d)."""
        if self.unit.norm is not None:
            h = self.unit.norm(h)
        if self.rule != "global-mean":
            return h
        w = state.real.unsqueeze(-1)  # (B, T, 1) bool: the counts below are exact integers
        if not self.causal:
            return (h * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1)
        sums, counts = (h * w).cumsum(1), w.cumsum(1)
        if state.prefix_in is not None and step in state.prefix_in:
            prev_sum, prev_count = state.prefix_in[step]
            sums, counts = sums + prev_sum.unsqueeze(1), counts + prev_count.view(-1, 1, 1)
        state.prefix_out[step] = (sums[:, -1], counts[:, -1, 0])
        return sums / counts.clamp_min(1)

    def decide(self, h: torch.Tensor, running: torch.Tensor, state: HaltingState,
               step: int, threshold: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Before step l: add α_{l-1} from h_{l-1} (B, T, d) and return which positions
        compute step l (B, T) bool. ``threshold``: α_thresh as a 0-d tensor (a compiled
        step's input, so that changing it compiles nothing again)."""
        threshold = self.threshold if threshold is None else threshold
        x = self._reading(h, state, step)
        if self.transition:
            x = torch.cat([self._reading(state.prev_h, state, step - 1), x], -1)
        state.prev_h = h
        if x.size(1) != running.size(1):  # one reading per sequence (global mean)
            logit = self.unit(x).expand(running.shape)
        else:  # per position: sut::masked_linear skips the hidden layer of halted rows
            logit = self.unit(x, running)
        if self.rule == "act":
            p = torch.sigmoid(logit) * running
            halts = running & (state.c + p >= threshold)
            alpha = torch.where(halts, 1.0 - state.c, p)  # the remainder on the halting step
        else:
            log_halt, log_continue = F.logsigmoid(logit), F.logsigmoid(-logit)
            alpha = torch.exp(log_halt + state.log_remain) * running
            state.log_remain = state.log_remain + log_continue * running
            halts = running & (state.c + alpha >= threshold)
        state.c = state.c + alpha
        state.weighted_sum = state.weighted_sum + alpha.unsqueeze(-1) * h.float()
        state.alphas.append(alpha)
        return running & ~halts

    def mix(self, h: torch.Tensor, S: torch.Tensor, running: torch.Tensor,
            state: HaltingState) -> torch.Tensor:
        """S_l = (1 - c_{l-1}) h_l + Σ_{j<=l-1} α_j h_j on running positions, S_{l-1} elsewhere."""
        new_S = (1.0 - state.c).unsqueeze(-1) * h.float() + state.weighted_sum
        return torch.where(running.unsqueeze(-1), new_S.to(h.dtype), S)

    def finish(self, state: HaltingState, max_steps: int) -> HaltingResult:
        """The remaining mass 1 - c goes to the last executed step of each position."""
        weights = torch.zeros(*state.real.shape, max_steps, device=state.c.device)
        if state.alphas:
            weights[:, :, : len(state.alphas)] = torch.stack(state.alphas, -1)
        last = (state.steps - 1).clamp(min=0).unsqueeze(-1)
        weights = weights.scatter_add(2, last, ((1.0 - state.c) * state.real).unsqueeze(-1))
        if self.rule == "act":  # ponder cost N + R: the remainder R on the last step N
            depth = state.steps.float() + weights.gather(2, last).squeeze(-1) * state.real
            return HaltingResult(weights, depth * state.real, state.steps, state.real, max_steps)
        return _result(weights, state, max_steps)


class NoHalting(nn.Module):
    """All L steps for every real position; the output is h_L."""

    threshold = None
    begin = LearnedHalting.begin

    def decide(self, h, running, state, step, threshold=None):
        return running

    def mix(self, h, S, running, state):
        return h

    def finish(self, state: HaltingState, max_steps: int) -> HaltingResult:
        weights = torch.zeros(*state.real.shape, max_steps, device=state.c.device)
        weights[:, :, -1] = state.real.float()
        return _result(weights, state, max_steps)


def _result(weights: torch.Tensor, state: HaltingState, max_steps: int) -> HaltingResult:
    depth = torch.arange(1, max_steps + 1, device=weights.device, dtype=weights.dtype)
    return HaltingResult(weights=weights, expected_depth=(weights * depth).sum(-1),
                         steps=state.steps, real=state.real, max_steps=max_steps)


def check_threshold(threshold: float) -> None:
    if not (0.0 < float(threshold) <= 1.0):
        raise ValueError(f"halting threshold must be in (0, 1]; got {threshold}")


def build_halting(rule: str, embed_dim: int, dropout: float, threshold: float,
                  normalize_input: bool, transition: bool = False,
                  causal: bool = False, bias_init: float = 0.0) -> nn.Module:
    if rule == "none":
        return NoHalting()
    if rule in ("stick-breaking", "global-mean", "act"):
        return LearnedHalting(rule, embed_dim, dropout, threshold, normalize_input,
                              transition, causal, bias_init)
    raise ValueError(f"unknown halting rule {rule!r}; choose from {HALTING_RULES}")
