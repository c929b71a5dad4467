"""MoMHA's self-attention as one FlexAttention kernel (``--flex-attention``; CUDA).

The logits of query row m (position i_m = q_start + m // k) and key j are

    logits_mj = q_m · k_j / √D + rel_mj     (-inf where the key is hidden)

with ``rel`` the clipped term ``q_m · r_{clip(j - i_m)} / √D`` (gathered from the offset
scores ``qr`` (B, H, T·k, O')) or the T5 bias ``b_h[bucket(j - i_m)]`` (a (1, H, T, S)
table), added with the hidden-key mask in a ``score_mod``: unlike the SDPA path, no
(B, H, T·k, S) bias or gradient is made. No dropout; no CPU backward (the default path runs).
"""
from typing import Optional

import torch
from torch.nn.attention.flex_attention import flex_attention

from .. import compiler


def attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, picks: int, q_start: int,
           hidden: Optional[torch.Tensor], qr: Optional[torch.Tensor], window: int, lo: int,
           t5: Optional[torch.Tensor]) -> torch.Tensor:
    """q (B, H, M = T·picks, D); key/value (B, H, S, D); hidden: bool (B|1, 1, M|1, S) or
    None (``momha.hidden_keys``); one relative term at most: ``qr`` (B, H, M, O') the
    scaled scores of the offsets from ``lo`` (window W), or ``t5`` (1, H, T, S).
    Returns (B, H, M, D)."""
    B, M, S = q.size(0), q.size(2), key.size(2)
    mask = None if hidden is None else hidden.expand(B, 1, M, S)

    def score_mod(score, b, h, m, j):
        if qr is not None:  # offset j - i_m clipped to [-W, W], counted from lo
            score = score + qr[b, h, m, (j - (q_start + m // picks)).clamp(-window, window) - lo]
        if t5 is not None:
            score = score + t5[0, h, m // picks, j]
        if mask is not None:
            score = torch.where(mask[b, 0, m, j], float("-inf"), score)
        return score

    kernel = compiler.fused(flex_attention) if q.is_cuda else flex_attention  # eager on CPU
    return kernel(q, key, value, score_mod=score_mod)
