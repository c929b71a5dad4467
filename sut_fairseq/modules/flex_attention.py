"""MoMHA's self-attention as one FlexAttention kernel (``--flex-attention``; CUDA).

The logits of query row m (position i_m = q_start + m // k) and key j are

    logits_mj = q_m · k_j / √D + rel_mj     (-inf where the key is hidden)

with ``rel`` the clipped relative term ``q_m · r_{clip(j - i_m)} / √D`` or the T5 bias
``b_h[bucket(j - i_m)]``. The default path materialises rel and the mask as a (B, H, T·k, S)
bias for ``scaled_dot_product_attention``, whose backward writes that bias's gradient
(B, H, T·k, S) and scatters it back to the O offsets. Here the term enters inside the kernel
through a ``score_mod``: for the clipped term the O' (aligned) scores ``q·r / √D`` per row,
(B, H, T·k, O'), are one product beforehand and the kernel gathers ``qr[b, h, m, offset]``;
the T5 bias is a (1, H, T, S) table; the hidden keys read -inf from the (B|1, 1, T·k|1, S)
mask. The gradient of ``qr`` (or of the T5 table) comes back from FlexAttention's backward,
so no (B, H, T·k, S) tensor is made in either direction.

No block mask: at the recipes' lengths one 128 x 128 tile covers a sentence's queries
and keys, so skipping masked tiles saves nothing; the masks go through the ``score_mod``.
FlexAttention has no dropout (the option needs ``--attention-dropout 0``) and no backward
on a CPU: there the default path runs (``MixtureOfMultiHeadAttention.forward``), and the
tests compare the two forwards on the CPU without gradients.
"""
from typing import Optional

import torch
from torch.nn.attention.flex_attention import flex_attention

from .. import compiler


def kernel(q: torch.Tensor):
    """FlexAttention for q's device: compiled on CUDA (one fused Triton kernel; inside a
    compiled step, compiled with the step), the eager reference on a CPU."""
    return compiler.fused(flex_attention) if q.is_cuda else flex_attention


def attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, picks: int, q_start: int,
           hidden: Optional[torch.Tensor], qr: Optional[torch.Tensor] = None, window: int = 0,
           lo: int = 0, t5: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (B, H, M = T·picks, D); key/value (B, H, S, D); hidden: bool (B|1, 1, M|1, S) or
    None (``momha.hidden_keys``); one relative term at most: ``qr`` (B, H, M, O') the
    scaled scores of the offsets from ``lo`` (window W), or ``t5`` (1, H, T, S).
    Returns (B, H, M, D)."""
    B, H, M, _ = q.shape
    S = key.size(2)
    mask = None if hidden is None else hidden.expand(B, 1, M, S)

    def score_mod(score, b, h, m, j):
        if qr is not None:  # offset j - i_m clipped to [-W, W], counted from lo
            score = score + qr[b, h, m, (j - (q_start + m // picks)).clamp(-window, window) - lo]
        if t5 is not None:
            score = score + t5[0, h, m // picks, j]
        if mask is not None:
            score = torch.where(mask[b, 0, m, j], float("-inf"), score)
        return score

    return kernel(q)(q, key, value, score_mod=score_mod)
