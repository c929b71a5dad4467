"""Halting rules for the universal recurrence (SPEC §2.2).

A rule decides, before each step l >= 2, which positions keep computing, and how the
state S used as attention keys/values and as the final output is formed:

* ``StickBreakingHalting`` (paper §3.2, Algorithm 1). The halting unit reads h_{l-1}:
  ``â_{l-1} = sigmoid(MLP(h_{l-1}))``, ``α_{l-1} = â_{l-1} Π_{j<l-1} (1 - â_j)``,
  ``c_{l-1} = Σ_{j<=l-1} α_j``. A position with ``c_{l-1} >= α_thresh`` has halted (its h
  and S are frozen); otherwise ``h_l = Block(h_{l-1}, S_{l-1})`` and
  ``S_l = (1 - c_{l-1}) h_l + Σ_{j<=l-1} α_j h_j`` (Eq. 3). The products are kept in log
  space and all halting quantities in fp32.
* ``NoHalting``: every real position runs all L steps; S_l = h_l (a plain UT).

Both expose per position the halting weights over steps (summing to 1: the α's plus the
remaining stick on the last computed step), the expected depth
``Σ_l l · weight_l`` (L_ACT's summand, Eq. 4) and the number of executed steps.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

HALTING_RULES = ("stick-breaking", "none")


@dataclass
class HaltingResult:
    """Per-position halting outcome of one recurrence; (B, T) unless stated.

    weights: (B, T, L) fp32 halting distribution over steps (0 on pad positions).
    expected_depth: Σ_l l · weights_l (differentiable; L_ACT's summand).
    steps: executed block applications per position (long).
    real: bool mask of non-pad positions.
    max_steps: L.
    """

    weights: torch.Tensor
    expected_depth: torch.Tensor
    steps: torch.Tensor
    real: torch.Tensor
    max_steps: int

    def num_positions(self) -> torch.Tensor:
        return self.real.sum()

    def act_loss(self) -> torch.Tensor:
        """L_ACT of Eq. 4: mean expected depth over real positions."""
        return (self.expected_depth * self.real).sum() / self.real.sum().clamp_min(1)


class HaltingState:
    """Running quantities of the stick-breaking process for every position.

    c: (B, T) cumulative halting mass Σ_j α_j; log_remain: log Π_j (1 - â_j);
    weighted_sum: (B, T, d) Σ_j α_j h_j; alphas: list of (B, T) α_j; steps: executed count.
    """

    def __init__(self, h: torch.Tensor, real: torch.Tensor):
        B, T = real.shape
        self.real = real
        self.c = h.new_zeros(B, T, dtype=torch.float32)
        self.log_remain = h.new_zeros(B, T, dtype=torch.float32)
        self.weighted_sum = torch.zeros_like(h, dtype=torch.float32)
        self.alphas: List[torch.Tensor] = []
        self.steps = torch.zeros(B, T, dtype=torch.long, device=h.device)


class HaltingUnit(nn.Module):
    """â = sigmoid(Linear(d, 1)(dropout(GELU(Linear(d, d)(h))))); the last layer starts at
    zero so that â = 0.5 everywhere at initialisation. Returns the logit (B, T) in fp32."""

    def __init__(self, embed_dim: int, dropout: float, normalize_input: bool):
        super().__init__()
        self.norm = nn.LayerNorm(embed_dim) if normalize_input else None
        self.fc1 = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(embed_dim, 1)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        return self.fc2(self.dropout(F.gelu(self.fc1(h)))).squeeze(-1).float()


class StickBreakingHalting(nn.Module):
    def __init__(self, embed_dim: int, dropout: float, threshold: float, normalize_input: bool):
        super().__init__()
        check_threshold(threshold)
        self.threshold = threshold
        self.unit = HaltingUnit(embed_dim, dropout, normalize_input)

    def begin(self, h0: torch.Tensor, real: torch.Tensor) -> HaltingState:
        return HaltingState(h0, real)

    def decide(self, h: torch.Tensor, running: torch.Tensor, state: HaltingState) -> torch.Tensor:
        """Before step l: read h_{l-1} (B, T, d) of the positions that computed it,
        add α_{l-1}, and return which positions compute step l (B, T) bool."""
        logit = self.unit(h)
        log_halt, log_continue = F.logsigmoid(logit), F.logsigmoid(-logit)
        alpha = torch.exp(log_halt + state.log_remain) * running  # α_{l-1}
        state.log_remain = state.log_remain + log_continue * running
        state.c = state.c + alpha
        state.weighted_sum = state.weighted_sum + alpha.unsqueeze(-1) * h.float()
        state.alphas.append(alpha)
        return running & (state.c < self.threshold)

    def mix(self, h: torch.Tensor, S: torch.Tensor, running: torch.Tensor,
            state: HaltingState) -> torch.Tensor:
        """S_l = (1 - c_{l-1}) h_l + Σ_{j<=l-1} α_j h_j on running positions, S_{l-1} elsewhere."""
        new_S = (1.0 - state.c).unsqueeze(-1) * h.float() + state.weighted_sum
        return torch.where(running.unsqueeze(-1), new_S.to(h.dtype), S)

    def finish(self, state: HaltingState, max_steps: int) -> HaltingResult:
        """The remaining stick 1 - c goes to the last executed step of each position."""
        B, T = state.real.shape
        weights = torch.zeros(B, T, max_steps, device=state.c.device)
        if state.alphas:
            weights[:, :, : len(state.alphas)] = torch.stack(state.alphas, -1)
        last = (state.steps - 1).clamp(min=0).unsqueeze(-1)
        remainder = ((1.0 - state.c) * state.real).unsqueeze(-1)
        weights = weights.scatter_add(2, last, remainder)
        return _result(weights, state, max_steps)


class NoHalting(nn.Module):
    """All L steps for every real position; the output is h_L."""

    threshold = None

    def begin(self, h0: torch.Tensor, real: torch.Tensor) -> HaltingState:
        return HaltingState(h0, real)

    def decide(self, h, running, state):
        return running

    def mix(self, h, S, running, state):
        return h

    def finish(self, state: HaltingState, max_steps: int) -> HaltingResult:
        B, T = state.real.shape
        weights = torch.zeros(B, T, max_steps, device=state.c.device)
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
                  normalize_input: bool) -> nn.Module:
    if rule == "stick-breaking":
        return StickBreakingHalting(embed_dim, dropout, threshold, normalize_input)
    if rule == "none":
        return NoHalting()
    raise ValueError(f"unknown halting rule {rule!r}; choose from {HALTING_RULES}")
