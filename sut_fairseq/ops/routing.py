"""Sorted routing layout shared by every expert operation.

A layer with E experts and top-k routing sends each of N tokens to k "slots";
slot ``s = n * k + j`` is the j-th choice of token n (M = N * k slots in all).
Slots whose token is halted or padding are routed to the sentinel expert ``E``:
they sort after every real expert and no expert op ever touches them, so they cost
nothing (the paper's "no-op expert").
"""
from dataclasses import dataclass
from typing import Optional

import torch

from ..compiler import tracing


@dataclass
class Routing:
    """Top-k routing of N tokens over E experts, in sorted (expert-grouped) order.

    expert_idxs (N, k) long: chosen expert per slot, ``num_experts`` for a no-op slot;
    gates (N, k) float: gate weight per slot (0 for no-op slots, rows sum to 1 for active
    tokens); sorted_expert_idxs (M,) long: ``expert_idxs.flatten()`` sorted (stable);
    sorted_scattered_idxs (M,) long: the slot of each sorted row; expert_offsets (E,) long:
    end offset of each expert's rows in the sorted order (rows from ``expert_offsets[-1]``
    on are no-op slots); num_experts: E."""

    expert_idxs: torch.Tensor
    gates: Optional[torch.Tensor]
    sorted_expert_idxs: torch.Tensor
    sorted_scattered_idxs: torch.Tensor
    expert_offsets: torch.Tensor
    num_experts: int
    #: (R, N, k) fp32: R rows equal to ``gates`` (``Router._gate_rows``), or None
    gate_rows: Optional[torch.Tensor] = None

    @property
    def kernel_gates(self) -> Optional[torch.Tensor]:
        """The gates a gated expert map takes: ``gate_rows`` where there are, else ``gates``."""
        return self.gate_rows if self.gate_rows is not None else self.gates

    @property
    def num_tokens(self) -> int:
        return self.expert_idxs.size(0)

    @property
    def k(self) -> int:
        return self.expert_idxs.size(1)

    @property
    def num_slots(self) -> int:
        return self.expert_idxs.numel()


def plain_gates(gates: torch.Tensor) -> torch.Tensor:
    """(N, k) gates of gates (N, k) or of gate rows (R, N, k) (R equal rows: the first)."""
    return gates[0] if gates.dim() == 3 else gates


def make_routing(expert_idxs: torch.Tensor, gates: Optional[torch.Tensor], num_experts: int) -> Routing:
    """The sorted layout of a (N, k) expert choice (``num_experts`` = no-op), without
    device-to-host synchronisation; gates None where they travel apart."""
    if (gates is not None and expert_idxs.shape != gates.shape) or expert_idxs.dim() != 2:
        raise ValueError(f"expert_idxs and gates must both be (N, k); got "
                         f"{tuple(expert_idxs.shape)} and "
                         f"{None if gates is None else tuple(gates.shape)}")
    flat = expert_idxs.reshape(-1)
    if not tracing():  # eager: one stable sort of the M keys
        sorted_expert_idxs, sorted_scattered_idxs = torch.sort(flat, stable=True)
        # scatter_add, not bincount: bincount reads the largest index on the host
        counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        return Routing(expert_idxs, gates, sorted_expert_idxs, sorted_scattered_idxs,
                       counts.cumsum(0)[:num_experts], num_experts)
    # Compiled (--compile-step): a counting sort, stable and equal to the sort above. Slot s
    # of expert e goes to start_e + its rank among e's slots, start_e = Σ_{e' < e} count_e'.
    # Inductor fuses it into a few kernels where torch.sort is a chain of radix passes on a
    # GPU; eager it is slower than the sort, hence the two paths (docs/performance.md).
    experts = torch.arange(num_experts + 1, device=flat.device)
    one_hot = (flat.unsqueeze(1) == experts).long()                 # (M, E + 1)
    counts = one_hot.sum(0)                                         # (E + 1,)
    ends = counts.cumsum(0)
    rank = (one_hot.cumsum(0) * one_hot).sum(1) - 1                 # (M,) rank within its expert
    position = (ends - counts).gather(0, flat) + rank               # (M,) where slot s sorts to
    slots = torch.arange(flat.numel(), device=flat.device)
    sorted_scattered_idxs = torch.empty_like(slots).scatter_(0, position, slots)
    return Routing(expert_idxs, gates, flat.gather(0, sorted_scattered_idxs),
                   sorted_scattered_idxs, ends[:num_experts], num_experts)


def slot_order(rows: torch.Tensor, sorted_scattered_idxs: torch.Tensor) -> torch.Tensor:
    """Sorted rows (A, W), A <= M (sorted rows past M belong to no slot) -> slot order
    (M, W): row r to slot ``sorted_scattered_idxs[r]``, zeros on the slots without a row."""
    M = sorted_scattered_idxs.size(0)
    A = min(rows.size(0), M)
    return rows.new_zeros(M, rows.size(1)).index_copy(0, sorted_scattered_idxs[:A], rows[:A])
