"""Relative-position terms for self-attention logits (docs/model.md#relative-positions).

* ``ClippedRelativePosition`` (Shaw et al.): 2W+1 learned vectors per head for offsets
  ``j - i`` clipped to [-W, W]; the logit of query i and key j gains ``q_i · r_{clip(j-i)}``.
* ``T5RelativeBias``: one learned scalar per head and log-spaced bucket of ``j - i``
  (Raffel et al. 2020), as the paper's CFQ model used.

Queries sit at positions ``q_start .. q_start + T - 1`` and keys at ``0 .. S - 1``.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..compiler import tracing

#: The relative vectors are padded with zero rows (never gathered) to a multiple of this
#: many offsets: cuBLAS runs an odd count such as 2W + 1 in bf16 as an alignment-1 kernel.
OFFSET_ALIGNMENT = 16


class ClippedRelativePosition(nn.Module):
    """Learned embeddings r_o (o in [-W, W]) of shape (2W+1, H, D)."""

    def __init__(self, num_heads: int, head_dim: int, window: int):
        super().__init__()
        if window < 0:
            raise ValueError(f"relative window W must be >= 0; got {window}")
        self.window = window
        self.embeddings = nn.Parameter(torch.empty(2 * window + 1, num_heads, head_dim))
        nn.init.normal_(self.embeddings, std=head_dim ** -0.5)

    def offsets(self, T: int, q_start: int, S: int):
        """The offsets that occur between queries q_start..q_start+T-1 and keys 0..S-1
        (at most T + S - 1 of them): ``(lo, r)`` with r (O, H, D) = r_lo .. r_hi."""
        W = self.window
        lo = max(-W, min(W, 0 - (q_start + T - 1)))
        hi = max(-W, min(W, (S - 1) - q_start))
        return lo, self.embeddings[lo + W: hi + W + 1]

    def aligned_offsets(self, T: int, q_start: int, S: int):
        """``offsets`` with r padded by zero rows to a multiple of :data:`OFFSET_ALIGNMENT`:
        ``(lo, r)``, r (O', H, D) with O' >= O."""
        lo, r = self.offsets(T, q_start, S)
        return lo, F.pad(r, (0, 0, 0, 0, 0, -r.size(0) % OFFSET_ALIGNMENT))

    def index(self, T: int, q_start: int, S: int, k: int, lo: int) -> torch.Tensor:
        """(T*k, S) long: which of the O offsets (from ``lo``) query row m and key j use."""
        device = self.embeddings.device
        i = torch.arange(q_start, q_start + T, device=device)
        j = torch.arange(S, device=device)
        idx = (j[None, :] - i[:, None]).clamp(-self.window, self.window) - lo  # (T, S)
        return idx.repeat_interleave(k, 0)

    def clipped(self, T: int, q_start: int, S: int) -> bool:
        """Whether some offset j - i between queries q_start..q_start+T-1 and keys 0..S-1
        lies outside [-W, W] (then several keys of a query share a clipped offset)."""
        return q_start + T - 1 > self.window or S - 1 - q_start > self.window

    def offset_scores(self, q: torch.Tensor, T: int, q_start: int, S: int):
        """``(lo, scores)``: q_m · r_o for every (aligned) offset o from ``lo``, (B, H, T*k, O'),
        one batched product over the heads; q: (B, H, T*k, D). The scores are a view of an
        (H, B, T*k, O') tensor: the layout the product writes and its gradient reads."""
        lo, r = self.aligned_offsets(T, q_start, S)
        B, H, M, D = q.shape
        scores = torch.bmm(q.transpose(0, 1).reshape(H, B * M, D), r.to(q.dtype).permute(1, 2, 0))
        return lo, scores.view(H, B, M, -1).transpose(0, 1)

    def forward(self, q: torch.Tensor, T: int, q_start: int, S: int) -> torch.Tensor:
        """q: (B, H, T*k, D), query row m at position q_start + m // k. Returns the logits
        term ``q_m · r_{clip(j - i_m)}`` (B, H, T*k, S), gathered from ``offset_scores``."""
        lo, scores = self.offset_scores(q, T, q_start, S)
        k = q.size(2) // T
        scores = scores.transpose(0, 1)  # (H, B, T*k, O'), contiguous
        if self.clipped(T, q_start, S) or not tracing():
            # autograd's backward, a scatter-add over the keys (eagerly also where nothing is
            # clipped: the shifted gathers' index arithmetic is a handful of kernels there,
            # in a compiled graph part of the gather's own)
            idx = self.index(T, q_start, S, k, lo)
            rel = scores.gather(3, idx.expand(scores.size(0), scores.size(1), -1, -1))
        else:
            rel = _UnclippedGather.apply(scores, k, q_start + lo, S)
        return rel.transpose(0, 1)


def _shifted(rows: torch.Tensor, k: int, shift: int, width: int) -> torch.Tensor:
    """out[..., m, c] = rows[..., m, c + shift] where that column lies in [0, rows.size(-1)),
    else 0, with ``shift`` s + m // k or s - m // k (``shift`` = (s, ±1)); rows (..., M, C)
    -> (..., M, width). One gather that inductor writes as a pointwise kernel (its index an
    affine function of m and c)."""
    s, sign = shift
    m = torch.arange(rows.size(-2), device=rows.device)
    col = torch.arange(width, device=rows.device)[None, :] + s + sign * (m // k)[:, None]
    inside = (col >= 0) & (col < rows.size(-1))
    picked = rows.gather(-1, col.clamp(0, rows.size(-1) - 1).expand(*rows.shape[:-1], width))
    return picked.masked_fill(~inside, 0)


class _UnclippedGather(torch.autograd.Function):
    """The clipped term's gather where no offset is clipped: query row m (position i = q0 +
    m // k) and key j use offset column c = j - i - lo, one key per column, so

        rel[m, j] = scores[m, j - i_m - lo]         d scores[m, c] = d rel[m, c + i_m + lo]

    (0 where c + i_m + lo is not a key: the offsets row m does not use, and the aligned
    padding), both pointwise gathers: no zero-filled buffer and scatter-add as autograd's
    backward of ``gather`` makes. scores (H, B, T*k, O'); ``shift`` = q_start + lo."""

    @staticmethod
    def forward(ctx, scores, k: int, shift: int, S: int):
        ctx.shape = k, shift, scores.size(-1)
        return _shifted(scores, k, (-shift, -1), S)

    @staticmethod
    def backward(ctx, grad):
        k, shift, width = ctx.shape
        return _shifted(grad, k, (shift, 1), width), None, None, None


def t5_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
              max_distance: int) -> torch.Tensor:
    """Bucket of ``j - i``: exact below num_buckets/2 (per direction), log-spaced up to
    max_distance, everything farther in the last bucket."""
    n = -relative_position
    bucket = torch.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    large = (max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(n < max_exact, n, large)


class T5RelativeBias(nn.Module):
    """Per-head scalar bias b_h[bucket(j - i)]."""

    def __init__(self, num_heads: int, bidirectional: bool, num_buckets: int = 32,
                 max_distance: int = 128):
        super().__init__()
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance
        self.bias = nn.Embedding(num_buckets, num_heads)
        nn.init.zeros_(self.bias.weight)

    def forward(self, T: int, q_start: int, S: int) -> torch.Tensor:
        """Returns (1, H, T, S), on the device of the bias table."""
        device = self.bias.weight.device
        i = torch.arange(q_start, q_start + T, device=device)
        j = torch.arange(S, device=device)
        buckets = t5_bucket(j[None, :] - i[:, None], self.bidirectional, self.num_buckets,
                            self.max_distance)
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0)
