"""Chunk-wise recurrence: the universal recurrence run chunk after chunk, with a memory
carried between chunks (TLB, GUTLB; docs/chunked.md).

The real tokens of a sequence are cut into chunks of g: real token i (its 0-based rank among
the real tokens of its row) goes to chunk ⌊i/g⌋, slot i mod g, so an example gives the same
chunks however it is padded or batched. For every chunk c = 0 .. N-1 (batched):

    C_0 = the chunk's embeddings                                    (B, w, d)
    S_L, halting = the side's recurrence over C_0, reading the memory M^c (recurrence.py)
    M^{c+1} = write(M^c, S_L's real rows)                           (modules/memory.py)

w = min(g, longest sequence's real tokens) is the batch's chunk width (shorter chunks are
padded); the outputs go back to the token layout.
"""
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from .halting import HaltingResult, HaltingState

# (C_0 (B, w, d), the chunk's real rows (B, w) bool, its memory M^c (B, k, d) or None, the
# halting rule) -> the recurrence's S_L (B, w, d), HaltingResult and HaltingState
ChunkRecurrence = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], object],
                           Tuple[torch.Tensor, HaltingResult, HaltingState]]


class ChunkLayout:
    """Where each real token of a (B, T) batch goes among N = ``num_chunks`` chunks of width
    w = ``width``: ``slot`` (B, T) long, its slot in its chunk (0 on padding); ``chunk_real``
    (B, N, w) bool, the slots that hold a token; ``real`` (B, T) bool."""

    def __init__(self, real: torch.Tensor, size: int):
        if size < 1:
            raise ValueError(f"chunk size must be >= 1; got {size}")
        B, T = real.shape
        rank = (real.long().cumsum(1) - 1).clamp(min=0)
        longest = int(real.sum(1).max()) if B else 0
        self.real, self.size = real, size
        self.num_chunks = max(1, math.ceil(longest / size))
        self.width = max(1, min(size, longest))
        self.slot = torch.where(real, rank % size, torch.zeros_like(rank))
        # flat index in (N·w + 1): the last entry is where padding is sent and dropped
        flat = (rank // size) * self.width + self.slot
        self.index = torch.where(real, flat, torch.full_like(flat, self.num_chunks * self.width))
        self.chunk_real = self.gather(real)

    def _index(self, x: torch.Tensor) -> torch.Tensor:
        return self.index.view(*self.index.shape, *([1] * (x.dim() - 2))).expand_as(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, ...) in the token layout -> (B, N, w, ...), zero on empty slots."""
        B, rest = x.size(0), x.shape[2:]
        flat = x.new_zeros(B, self.num_chunks * self.width + 1, *rest).scatter(1, self._index(x), x)
        return flat[:, :-1].reshape(B, self.num_chunks, self.width, *rest)

    def scatter(self, y: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """y: (B, N, w, ...) -> (B, T, ...) in the token layout; padding takes ``fill``."""
        B, rest = y.size(0), y.shape[3:]
        flat = y.reshape(B, self.num_chunks * self.width, *rest)
        flat = torch.cat([flat, flat.new_zeros(B, 1, *rest)], 1)
        out = flat.gather(1, self._index(fill))
        return torch.where(self.real.view(*self.real.shape, *([1] * len(rest))), out, fill)


def local_positions(embed_positions, slot: torch.Tensor, real: torch.Tensor, size: int) -> torch.Tensor:
    """fairseq's sinusoidal positions (B, T, d) of the slots (B, T) long, restarting at 0 in
    every chunk (``--encoder-chunk-positions local``); zero on padding (``real`` False)."""
    fake = torch.full((1, size), embed_positions.padding_idx + 1, device=slot.device)
    table = embed_positions(fake)[0]  # (g, d): positions 0 .. g-1
    positions = table.index_select(0, slot.reshape(-1)).view(*slot.shape, -1)
    return positions * real.unsqueeze(-1).to(positions.dtype)


class StepCap:
    """A halting rule whose positions run at most ``cap`` (B, w) steps (GUTLB's min(L, n_c + 1));
    a capped position stops as a halted one does (its remaining mass goes to its last step)."""

    def __init__(self, rule, cap: torch.Tensor):
        self.rule, self.cap = rule, cap
        self.begin, self.mix, self.finish = rule.begin, rule.mix, rule.finish

    def decide(self, h, running, state, step, threshold=None):
        return self.rule.decide(h, running, state, step, threshold) & (self.cap >= step)


def step_cap(real: torch.Tensor, max_steps: int, causal: bool) -> torch.Tensor:
    """(B, w) long: min(L, n_c + 1) with n_c the chunk's real tokens (encoder), or the
    chunk's real tokens up to and including the position (causal: the decoder cannot see
    the rest of its chunk)."""
    seen = real.long().cumsum(1) if causal else real.long().sum(1, keepdim=True).expand_as(real)
    return (seen + 1).clamp(max=max_steps)


@dataclass
class ChunkedHaltingResult(HaltingResult):
    """A ``HaltingResult`` in the token layout (B, T), plus per chunk (B, N): chunk_real, the
    chunk holds a real token; chunk_depth, the mean expected depth of its real tokens
    (GUTLB's encoder: the chunk's one decision); chunk_steps, the block applications on the
    chunk (its tokens' largest executed steps; 0 without real tokens). The incremental
    decoder's per-token result has N = 1: chunk_real says whether the token opened a chunk,
    chunk_steps how much it raised its chunk's count (so that the sums over decoding steps
    are the full forward's). memories: M^c read by chunk c, (B, k, d) each (empty without
    memory); final_memory: M^N, or None when it was not needed."""

    chunk_real: torch.Tensor = None
    chunk_depth: torch.Tensor = None
    chunk_steps: torch.Tensor = None
    memories: List[torch.Tensor] = None
    final_memory: Optional[torch.Tensor] = None

    def act_loss(self) -> torch.Tensor:
        """L_ACT per chunk: mean over real chunks of the chunk's expected depth."""
        real = self.chunk_real.to(self.chunk_depth.dtype)
        return (self.chunk_depth * real).sum() / real.sum().clamp_min(1)

    def act_units(self) -> torch.Tensor:
        return self.chunk_real.sum()

    @classmethod
    def combine(cls, results: List[HaltingResult], layout: ChunkLayout,
                memories: List[torch.Tensor], final_memory: Optional[torch.Tensor]):
        """The per-chunk results (each over (B, w)) of one chunked recurrence."""
        def tokens(name, fill):
            return layout.scatter(torch.stack([getattr(r, name) for r in results], 1), fill)

        B, T = layout.real.shape
        L = results[0].max_steps
        depth_c = torch.stack([r.expected_depth for r in results], 1)  # (B, N, w)
        steps_c = torch.stack([r.steps for r in results], 1)
        real_c = layout.chunk_real.to(depth_c.dtype)
        return cls(weights=tokens("weights", layout.real.new_zeros(B, T, L, dtype=torch.float32)),
                   expected_depth=tokens("expected_depth", depth_c.new_zeros(B, T)),
                   steps=tokens("steps", steps_c.new_zeros(B, T)), real=layout.real, max_steps=L,
                   chunk_real=layout.chunk_real.any(2),
                   chunk_depth=(depth_c * real_c).sum(2) / real_c.sum(2).clamp_min(1),
                   chunk_steps=(steps_c * layout.chunk_real).amax(2),
                   memories=memories, final_memory=final_memory)


def chunked_recurrence(run_chunk: ChunkRecurrence, h0: torch.Tensor, layout: ChunkLayout,
                       halting, max_steps: int, memory=None, memory_reset: bool = False,
                       write_last: bool = False, cap_steps: bool = False, causal: bool = False,
                       ) -> Tuple[torch.Tensor, ChunkedHaltingResult]:
    """Run the side's recurrence ``run_chunk`` chunk after chunk over h0 (B, T, d), the
    embeddings in the token layout of ``layout``; halting: the side's rule; max_steps: L;
    memory: a ``ChunkMemory`` (None: the chunks are independent). memory_reset: every chunk
    reads M^0 (the flip-flop experiment's test-time control; a ValueError in training mode,
    where nothing would pass between the chunks); write_last: also write the last chunk
    (M^N, for the encoder's output); cap_steps: at most min(L, n_c + 1) steps per position
    (``StepCap``), counting the chunk's tokens up to each position if ``causal`` (decoder).
    Returns S_L (B, T, d) (padding rows: h0) and the ``ChunkedHaltingResult``."""
    if memory_reset and memory is not None and memory.training:
        raise ValueError("--tlb-memory-reset is a test-time control and the model is in training "
                         "mode (fairseq-train): train without it and set it for evaluation with "
                         "--model-overrides \"{'tlb_memory_reset': True}\"")
    chunks = layout.gather(h0)  # (B, N, w, d)
    M0 = memory.begin(h0) if memory is not None else None
    M, read, outputs, results = M0, [], [], []
    for c in range(layout.num_chunks):
        real_c = layout.chunk_real[:, c]
        M = M0 if memory_reset else M
        rule = StepCap(halting, step_cap(real_c, max_steps, causal)) if cap_steps else halting
        S, result, _ = run_chunk(chunks[:, c], real_c, M, rule)
        outputs.append(S)
        results.append(result)
        if M is not None:
            read.append(M)
            if c < layout.num_chunks - 1 or write_last:
                M = memory.update(M, S, real_c)
    final = M if M is not None and write_last else None
    S = layout.scatter(torch.stack(outputs, 1), h0)
    return S, ChunkedHaltingResult.combine(results, layout, read, final)
