"""Mixture of multi-head attention, MoMHA (E, k, H, D, W) — docs/model.md#mixture-of-multi-head-attention.

K and V are dense and shared (d -> H·D each); expert e owns ``Wq_e: d -> H·D`` and
``Wo_e: H·D -> d``. Every query position picks k experts; for each pick, H heads of
scaled dot-product attention against the shared K/V heads; the output is
``Σ_e g_e · Wo_e(concat heads) + b_o``. With E = k = 1 it is dense multi-head attention.

The k picks of a position are k consecutive query rows per head (the routed projections'
slot order), so one attention over (B, H, T·k, D) queries serves all experts without
copying K/V: ``scaled_dot_product_attention``, plain tensor operations on CPU with clipped
relative positions (``_attend_clipped``), or FlexAttention on CUDA (``--flex-attention``).
With E = 1 there is no router: the projections map the active rows (``ExpertLinear.dense``).
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import flex_attention
from .expert_linear import ExpertLinear, rename_parameters
from .relative_position import ClippedRelativePosition, T5RelativeBias
from .router import Router
from ..ops.short_softmax import softmax_lastdim


def hidden_keys(T: int, picks: int, q_start: int, S: int, causal: bool,
                key_padding_mask: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """Which keys each query row m = t·picks + j (position q_start + t, pick j) may not
    see: bool (B|1, 1, T·picks|1, S), True = hidden (the causal and padding masks), or None.
    A query whose every key is masked (all padding) would give NaN; such rows never run,
    so their keys are left unmasked and their unused output stays finite."""
    hidden = None
    if causal:
        i = torch.arange(q_start, q_start + T, device=device)
        hidden = (torch.arange(S, device=device)[None, :] > i[:, None])
        hidden = (hidden if picks == 1 else hidden.repeat_interleave(picks, 0))[None, None]
    if key_padding_mask is not None:
        pad = key_padding_mask
        if causal:  # query i sees keys 0..i: blind when they are all padding
            blind = (~pad).cumsum(-1)[:, q_start:q_start + T].eq(0)  # (B, T)
            blind = blind if picks == 1 else blind.repeat_interleave(picks, 1)
            pad = pad[:, None, None, :] & ~blind[:, None, :, None]
        else:
            pad = padding_hidden(pad)
        hidden = pad if hidden is None else hidden | pad
    return hidden


def padding_hidden(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) bool, True = padding -> (B, 1, 1, S): the padding keys hidden, except in an
    all-padding row (see ``hidden_keys``)."""
    return (key_padding_mask & ~key_padding_mask.all(-1, keepdim=True))[:, None, None, :]


def mask_bias(hidden: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Additive logits bias of a ``hidden_keys`` mask: -inf on hidden keys, 0 elsewhere."""
    return None if hidden is None else torch.zeros(
        hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))


class MixtureOfMultiHeadAttention(nn.Module):
    """MoMHA with query/output width d = embed_dim and key/value input width kv_dim.
    relative: None, ``"clipped"`` (window W) or ``"t5"`` (self-attention only; T5 buckets
    are unidirectional when causal); flex: FlexAttention on CUDA (no dropout, no groups)."""

    def __init__(self, embed_dim: int, kv_dim: int, num_experts: int, top_k: int,
                 num_heads: int, head_dim: int, router_hidden_dim: int,
                 attention_dropout: float = 0.0, gating_dropout: float = 0.0,
                 sample_topk: int = 0, relative: Optional[str] = None, window: int = 0,
                 causal: bool = False, flex: bool = False):
        super().__init__()
        if flex and attention_dropout:
            raise ValueError(f"FlexAttention has no dropout: attention_dropout must be 0, got {attention_dropout}")
        self.num_heads, self.head_dim, self.causal, self.flex = num_heads, head_dim, causal, flex
        inner = num_heads * head_dim
        router = Router(embed_dim, num_experts, top_k, router_hidden_dim, gating_dropout, sample_topk,
                        gated_dim=num_heads * head_dim)
        k_proj, v_proj = nn.Linear(kv_dim, inner), nn.Linear(kv_dim, inner)
        self.q_proj = ExpertLinear(num_experts, embed_dim, inner)
        self.o_proj = ExpertLinear(num_experts, inner, embed_dim, shared_bias=True)  # b_o after Σ_e
        # made first, registered after the experts: the initialisation draws and parameter
        # order (a checkpoint's optimizer state) of the layer before ExpertLinear
        self.router, self.k_proj, self.v_proj = router, k_proj, v_proj
        self.attention_dropout = attention_dropout
        for proj in (self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=2 ** -0.5)
            nn.init.zeros_(proj.bias)
        if relative not in (None, "clipped", "t5"):
            raise ValueError(f"relative position must be None, 'clipped' or 't5'; got {relative!r}")
        self.relative = None if relative is None else (
            ClippedRelativePosition(num_heads, head_dim, window) if relative == "clipped"
            else T5RelativeBias(num_heads, bidirectional=not causal))

    def upgrade_state_dict_named(self, state_dict, name):
        """Renames the parameters of checkpoints before ``ExpertLinear``."""
        rename_parameters(state_dict, name, {"q_weight": "q_proj.weight", "q_bias": "q_proj.bias",
                                             "o_weight": "o_proj.weight", "o_bias": "o_proj.bias"})

    def project_kv(self, kv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """kv: (B, S, kv_dim) -> keys and values, each (B, H, S, D)."""
        shape = (kv.size(0), kv.size(1), self.num_heads, self.head_dim)
        return (self.k_proj(kv).view(shape).transpose(1, 2),
                self.v_proj(kv).view(shape).transpose(1, 2))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                active: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None,
                q_start: int = 0, grid_rows: Optional[Tuple[torch.Tensor, int]] = None) -> torch.Tensor:
        """query: (B, T, d) at positions q_start..; key/value: (B, H, S, D) at 0..S-1, or
        (B / G, H, S, D) shared by each group of G consecutive query rows (beam search's
        cross-attention, ``decoder_cache.CrossKV``; not causal, no relative term);
        active: (B, T) bool (inactive rows go to no expert and output 0 + b_o);
        key_padding_mask: (B, S) bool, True = padding (B / G rows with groups);
        grid_rows: with shared keys, (places (B,), N): the query rows are some of N = G ·
        key.size(0) rows (decoding on the running rows alone), at those places; they are put
        there (zeros elsewhere) for the grouped attention and read back. Returns (B, T, d)."""
        B, T, d = query.shape
        H, D, S = self.num_heads, self.head_dim, key.size(2)
        places, grid = grid_rows if grid_rows is not None else (None, B)
        groups = grid // key.size(0)
        if key.size(0) != grid and (self.causal or self.relative is not None or grid % key.size(0)):
            raise ValueError(f"{grid} query rows over {key.size(0)} key rows: shared keys are "
                             "for non-causal attention without relative positions")
        running = active.reshape(-1)
        if self.router.num_experts == 1:  # dense multi-head attention on the active rows
            routing, k, q = None, 1, self.q_proj.dense(query.reshape(B * T, d), running)
        else:
            routing = self.router(query.reshape(B * T, d), running)
            k, q = routing.k, self.q_proj(query.reshape(B * T, d), routing, fan_out=routing.k)
        # query rows in slot order (position t, pick j): row m = t·k + j, position t = m // k
        q = q.view(B, T * k, H, D).transpose(1, 2)  # (B, H, T·k, D)
        if places is not None:  # the rows in their places of the grid
            q = q.new_zeros(grid, H, T * k, D).index_copy_(0, places, q)
        if groups > 1:  # one attention per key row: (B / G, H, G·T·k, D)
            q = q.reshape(grid // groups, groups, H, T * k, D).transpose(1, 2).reshape(
                grid // groups, H, groups * T * k, D)

        hidden = self._hidden_keys(q, T, q_start, S, key_padding_mask)
        key, value = key.to(q.dtype), value.to(q.dtype)
        if self._flex_applies(q, groups):
            o = self._attend_flex(q, key, value, T, q_start, hidden)
        elif isinstance(self.relative, ClippedRelativePosition) and not q.is_cuda:
            o = self._attend_clipped(q, key, value, T, q_start, hidden)
        else:
            o = F.scaled_dot_product_attention(
                q, key, value, attn_mask=self._attention_bias(q, T, q_start, S, hidden),
                dropout_p=self.attention_dropout if self.training else 0.0)
        # slot rows again; with groups, (B / G, G·T·k) flattens to the same (B, T·k) rows
        o = o.transpose(1, 2).reshape(grid, T * k, H * D)
        if places is not None:
            o = o.index_select(0, places)
        o = o.reshape(B * T * k, H * D)
        if routing is None:
            return self.o_proj.dense(o, running).view(B, T, d)
        return self.o_proj(o, routing, fan_out=1, gates=routing.kernel_gates).view(B, T, d)

    def _flex_applies(self, q: torch.Tensor, groups: int) -> bool:
        """FlexAttention runs where asked (``--flex-attention``), on CUDA, one query row per
        key row (beam groups take the default path)."""
        return self.flex and q.is_cuda and groups == 1

    def _hidden_keys(self, q, T: int, q_start: int, S: int,
                     key_padding_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``hidden_keys`` for the T·k query rows of q (B, H, T·k, D)."""
        return hidden_keys(T, q.size(2) // T, q_start, S, self.causal, key_padding_mask, q.device)

    def _attention_bias(self, q, T: int, q_start: int, S: int,
                        hidden: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Additive logits bias (B|1, H|1, T·k, S): -inf on hidden keys, plus the
        relative terms."""
        bias = mask_bias(hidden, q.dtype)
        if isinstance(self.relative, ClippedRelativePosition):
            rel = self.relative(q, T, q_start, S) * self.head_dim ** -0.5
        elif isinstance(self.relative, T5RelativeBias):
            rel = self.relative(T, q_start, S).repeat_interleave(q.size(2) // T, 2).to(q.dtype)
        else:
            return bias
        return rel if bias is None else rel + bias

    def _attend_flex(self, q, key, value, T: int, q_start: int,
                     hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """``flex_attention.attend`` with the clipped term's offset scores ``q·r / √D``
        (B, H, T·k, O') or the T5 table (1, H, T, S). q: (B, H, T·k, D); key/value:
        (B, H, S, D). Returns (B, H, T·k, D)."""
        S, qr, t5, lo, window = key.size(2), None, None, 0, 0
        if isinstance(self.relative, ClippedRelativePosition):
            lo, qr = self.relative.offset_scores(q * self.head_dim ** -0.5, T, q_start, S)
            window = self.relative.window
        elif isinstance(self.relative, T5RelativeBias):
            t5 = self.relative(T, q_start, S).to(q.dtype)
        return flex_attention.attend(q, key, value, q.size(2) // T, q_start, hidden, qr, window, lo, t5)

    def _attend_clipped(self, q, key, value, T: int, q_start: int,
                        hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """Attention with clipped relative positions as plain tensor operations (on CPU,
        SDPA with a bias that needs a gradient takes its slow math path):

            logits_mj = (q_m · k_j + q_m · r_{clip(j - i_m)}) / √D  (-inf where hidden)
            o_m = Σ_j softmax_j(logits_m) v_j

        The O relative vectors r are appended to the keys: one matmul gives q·k
        (B, H, T·k, S) and q·r (B, H, T·k, O). q: (B, H, T·k, D); key/value: (B, H, S, D).
        Returns (B, H, T·k, D)."""
        B, H, M, D = q.shape
        S = key.size(2)
        lo, r = self.relative.offsets(T, q_start, S)  # r (O, H, D)
        idx = self.relative.index(T, q_start, S, M // T, lo).expand(B, H, -1, -1)
        q = q * D ** -0.5
        if T == 1:  # one position (incremental decoding): q·r apart, the cached keys not copied
            qr = torch.matmul(q.transpose(0, 1).reshape(H, B * M, D), r.to(q.dtype).permute(1, 2, 0))
            logits = torch.matmul(q, key.transpose(2, 3)) + qr.view(H, B, M, -1).transpose(0, 1).gather(3, idx)
        else:
            keys = torch.cat([key, r.to(q.dtype).transpose(0, 1).unsqueeze(0).expand(B, -1, -1, -1)], 2)
            a = torch.matmul(q, keys.transpose(2, 3))  # (B, H, T·k, S + O)
            logits = a[..., :S] + a[..., S:].gather(3, idx)
        if hidden is not None:
            logits = logits.masked_fill(hidden, float("-inf"))
        p = softmax_lastdim(logits)
        if self.training and self.attention_dropout > 0.0:
            p = F.dropout(p, self.attention_dropout)
        return torch.matmul(p, value)
