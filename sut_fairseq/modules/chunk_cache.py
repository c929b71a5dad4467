"""The incremental-decoding cache of a chunked decoder (docs/chunked.md#incremental-decoding).

For B hypotheses, every entry reordered with the beam:

    count      (B,)               real tokens of the current chunk decoded so far: the slot
                                  of the next real token
    self_k/v   (L, B, H, g-1, D)  per step l, keys/values of the current chunk's earlier
                                  tokens' S_{l-1}, right-aligned (the newest at g-2)
    rows       (B, g-1, d)        their final states S_L, right-aligned (memory only)
    memory     (B, k, d)          M^c, written by the completed chunks (memory only)
    prefix     {l: (Σ h, count)}  global-mean halting: causal prefix sums over the chunk
    chunk_max  (B,)               most steps a token of the current chunk has executed

A new token is placed at index g-1 after its chunk's earlier tokens: its offsets to them
are the in-chunk offsets (relative positions are exact), and the keys of slots not yet
filled are masked. After the token the buffers shift by one; when the chunk completes
(count reaches g) the memory is written from its g rows, and the chunk starts empty.
"""
from typing import Dict, List, Optional, Tuple

import torch

#: step l -> (Σ over the earlier positions (B, d), their count (B,))
Prefix = Dict[int, Tuple[torch.Tensor, torch.Tensor]]


class StepKeyCache:
    """The recurrence's view of the cache for one incremental call (``StepInputs.cache``):
    at step l the keys and values of the chunk's earlier positions, ``past_k[l-1]``
    (B, H, t, D), then the new position's (B, H, 1, D), recorded (``new_k``, ``new_v``) for
    ``advance``. ``prefix_in``: global-mean halting's causal prefix sums over the earlier
    positions (or None); ``frozen_prefix``: their continuation when every new position
    halted early (``RecurrenceStep.freeze``)."""

    def __init__(self, num_steps: int, past_k: Optional[torch.Tensor] = None,
                 past_v: Optional[torch.Tensor] = None, prefix_in: Optional[Prefix] = None):
        self.num_steps, self.past_k, self.past_v = num_steps, past_k, past_v
        self.new_k: List[Optional[torch.Tensor]] = [None] * num_steps
        self.new_v: List[Optional[torch.Tensor]] = [None] * num_steps
        self.prefix_in, self.frozen_prefix = prefix_in, {}

    def record(self, step: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.new_k[step - 1], self.new_v[step - 1] = k, v

    def extend(self, step: int, k: torch.Tensor, v: torch.Tensor):
        """Record the new keys/values of ``step``; return [past; new] (B, H, t + 1, D)."""
        self.record(step, k, v)
        if self.past_k is None:  # the first position
            return k, v
        return torch.cat([self.past_k[step - 1], k], 2), torch.cat([self.past_v[step - 1], v], 2)


def start(h: torch.Tensor, num_steps: int, num_heads: int, head_dim: int, size: int,
          memory=None, prefix: bool = False) -> Dict:
    """An empty cache for the batch of new tokens h (B, 1, d); chunk size g = ``size``."""
    B, _, d = h.shape
    L, w = num_steps, size - 1
    cache = {"count": torch.zeros(B, dtype=torch.long, device=h.device),
             "chunk_max": torch.zeros(B, dtype=torch.long, device=h.device),
             "self_k": h.new_zeros(L, B, num_heads, w, head_dim),
             "self_v": h.new_zeros(L, B, num_heads, w, head_dim)}
    if memory is not None:
        cache["rows"] = h.new_zeros(B, w, d)
        cache["memory"] = memory.begin(h)
    if prefix:
        cache["prefix"] = empty_prefix(h, num_steps)
    return cache


def empty_prefix(h: torch.Tensor, num_steps: int) -> Prefix:
    """Zero prefix sums for every step the halting rule may read (1..L)."""
    B, _, d = h.shape
    return {l: (h.new_zeros(B, d), h.new_zeros(B)) for l in range(1, num_steps + 1)}


def key_padding(cache: Dict, size: int) -> torch.Tensor:
    """(B, g) bool: keys [earlier tokens of the chunk; the new token] that are not tokens of
    the chunk (index i < g-1-count)."""
    i = torch.arange(size, device=cache["count"].device)
    return i.unsqueeze(0) < (size - 1 - cache["count"]).unsqueeze(1)


def advance(cache: Dict, new_k: List[torch.Tensor], new_v: List[torch.Tensor], S: torch.Tensor,
            real: torch.Tensor, steps: torch.Tensor, size: int, memory=None,
            prefix: Optional[Prefix] = None) -> Tuple[Dict, torch.Tensor, torch.Tensor]:
    """The cache after the new tokens: new_k/new_v per step (B, H, 1, D); S its S_L
    (B, 1, d); real (B,) bool, the token is not padding (padding leaves the cache as it
    was); steps (B,) its executed steps; prefix: the halting rule's prefix sums after it.
    Returns the new cache, whether each token opened a chunk (B,) bool, and how much it
    raised its chunk's block applications (B,) long (the per-chunk accounting)."""
    keep = real.view(1, -1, 1, 1, 1)
    out = dict(cache)
    for name, new in (("self_k", new_k), ("self_v", new_v)):
        shifted = torch.cat([cache[name], torch.stack(new)], 3)[:, :, :, 1:]
        out[name] = torch.where(keep, shifted, cache[name])
    opened = real & cache["count"].eq(0)
    chunk_max = torch.where(opened, torch.zeros_like(steps), cache["chunk_max"])
    raised = torch.where(real, (steps - chunk_max).clamp(min=0), torch.zeros_like(steps))
    count = cache["count"] + real.long()
    done = count.eq(size)
    if memory is not None:
        rows = torch.cat([cache["rows"], S], 1)  # (B, g, d): the chunk's rows when done
        out["rows"] = torch.where(real.view(-1, 1, 1), rows[:, 1:], cache["rows"])
        if bool(done.any()):  # rows not done keep M (no real row)
            out["memory"] = memory.update(cache["memory"], rows, done.unsqueeze(1).expand(-1, size))
    if prefix is not None:
        zero = (~done).to(S.dtype)
        out["prefix"] = {l: (s * zero.unsqueeze(1), c * zero) for l, (s, c) in prefix.items()}
    out["count"] = torch.where(done, torch.zeros_like(count), count)
    out["chunk_max"] = chunk_max + raised
    return out, opened, raised


def reorder_prefix(prefix: Optional[Prefix], order: torch.Tensor) -> Optional[Prefix]:
    """The prefix sums (or None) indexed by ``order`` (B',)."""
    if prefix is None:
        return None
    return {l: (s.index_select(0, order), c.index_select(0, order)) for l, (s, c) in prefix.items()}


def reorder(cache: Dict, order: torch.Tensor) -> Dict:
    """Every entry of the cache indexed by ``order`` (B',) along its batch dimension."""
    out = {}
    for name, value in cache.items():
        if name in ("self_k", "self_v"):
            out[name] = value.index_select(1, order)
        elif name == "prefix":
            out[name] = reorder_prefix(value, order)
        else:
            out[name] = value.index_select(0, order)
    return out
