"""The SUT block shared by every step of one side (paper Fig. 3 left).

Encoder: MoMHA self-attention -> MoE-FFD. Decoder: causal MoMHA self-attention ->
MoMHA cross-attention -> MoE-FFD. Each sub-layer is ``x + dropout(f(x))`` followed by
LayerNorm (post-LN) or preceded by it (pre-LN, ``normalize_before``); with E = k = 1 a
Transformer layer. ``--gated-ffn``: GUT's gate between the block's output and input state.
``--hyper-modules`` (docs/hyper_ut.md): hyper-module sub-layers reading ``hyper_z``.
With a chunk memory (``--encoder-memory-slots``, docs/chunked.md) a dense pre-LN memory
attention follows the self-attention: ``x ← x + dropout(MHA(LN(x), LN(M), LN(M)))``.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules import LayerNorm

from ..ops.masked_linear_op import MaskedAffine
from .dropout import Dropout
from .hyper_block import HyperConfig, HyperFeedForward, HyperSelfAttention
from .memory import MemoryAttention
from .moe_ffd import MoEFeedForward
from .momha import MixtureOfMultiHeadAttention


class SUTBlock(nn.Module):
    def __init__(self, args, decoder: bool):
        super().__init__()
        d = args.decoder_embed_dim if decoder else args.encoder_embed_dim
        router_hidden = args.router_hidden_dim or d
        self.normalize_before = args.decoder_normalize_before if decoder else args.encoder_normalize_before
        self.dropout = Dropout(args.dropout)

        def attention(kv_dim, relative, causal, flex=False):
            return MixtureOfMultiHeadAttention(
                d, kv_dim, args.att_experts, args.att_topk, args.att_heads, args.att_head_dim,
                router_hidden, attention_dropout=args.attention_dropout,
                gating_dropout=args.gating_dropout, sample_topk=args.sample_topk,
                relative=relative, window=args.rel_window, causal=causal, flex=flex)

        relative = None if args.rel_pos == "none" else args.rel_pos
        hyper = HyperConfig.from_args(args)
        parts = hyper.components if hyper is not None else ()
        if "qkv" in parts or "out" in parts:
            self.self_attn = HyperSelfAttention(d, args.att_heads, args.att_head_dim, hyper,
                                                args.attention_dropout, causal=decoder)
        else:
            self.self_attn = attention(d, relative, causal=decoder, flex=args.flex_attention)
        self.self_attn_norm = LayerNorm(d)
        self.kv_rows = MaskedAffine()  # changed rows' K/V projection (recurrence.KeyValueCarry)
        prefix = "decoder" if decoder else "encoder"
        memory = (getattr(args, f"{prefix}_chunk_size") > 0
                  and getattr(args, f"{prefix}_memory_slots") > 0)
        self.memory_attn = MemoryAttention(
            d, args.att_heads, args.att_head_dim, args.attention_dropout) if memory else None
        self.cross_attn = attention(args.encoder_embed_dim, None, causal=False) if decoder else None
        if decoder:
            self.cross_attn_norm = LayerNorm(d)
        if "ffn" in parts:
            self.ffd = HyperFeedForward(d, args.ffd_hidden_dim, hyper, args.activation_fn,
                                        args.activation_dropout)
        else:
            self.ffd = MoEFeedForward(
                d, args.ffd_hidden_dim, args.ffd_experts, args.ffd_topk, router_hidden,
                activation_fn=args.activation_fn, activation_dropout=args.activation_dropout,
                gating_dropout=args.gating_dropout, sample_topk=args.sample_topk)
        self.ffd_norm = LayerNorm(d)
        self.gate = FeedForwardGate(d) if args.gated_ffn else None
        self.hyper_attn = isinstance(self.self_attn, HyperSelfAttention)
        self.hyper_ffd = isinstance(self.ffd, HyperFeedForward)
        self.hyper = self.hyper_attn or self.hyper_ffd
        #: self-attention keys/values change with the step's mixture: recompute every row
        self.hyper_kv = self.hyper_attn and self.self_attn.hyper_kv

    def self_kv(self, S: torch.Tensor, hyper_z: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, T, D) of the halted states S (B, T, d); ``hyper_z``: the
        step's example embedding when the key/value projections are hyper-modules."""
        x = self.self_attn_norm(S) if self.normalize_before else S
        return self.self_attn.project_kv(x, *((hyper_z,) if self.hyper_attn else ()))

    def cross_kv(self, encoder_out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, S, D) of the encoder output (B, S, d_enc): once per forward."""
        return self.cross_attn.project_kv(encoder_out)

    def _sublayer(self, x, norm, f):
        y = x + self.dropout(f(norm(x) if self.normalize_before else x))
        return y if self.normalize_before else norm(y)

    def forward(self, h: torch.Tensor, self_k: torch.Tensor, self_v: torch.Tensor,
                running: torch.Tensor, self_padding_mask: Optional[torch.Tensor] = None,
                q_start: int = 0, cross_k: Optional[torch.Tensor] = None,
                cross_v: Optional[torch.Tensor] = None,
                cross_padding_mask: Optional[torch.Tensor] = None,
                hyper_z: Optional[torch.Tensor] = None,
                memory_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                cross_rows: Optional[Tuple[torch.Tensor, int]] = None) -> torch.Tensor:
        """h: (B, T, d) queries (un-halted states); self_k/self_v: (B, H, S, D) from the
        halted states; running: (B, T) bool; hyper_z: (B, d) or (B, T, d); memory_kv: keys
        and values (B, H, k, D) of the chunk's memory; cross_rows: the rows' places among
        the N rows of a beam grid whose sentences' keys cross_k holds (``MoMHA``'s
        ``grid_rows``). Returns the new h (B, T, d)."""
        attn_z = (hyper_z,) if self.hyper_attn else ()  # only the hyper sub-layers read z
        ffd_z = (hyper_z,) if self.hyper_ffd else ()
        x = self._sublayer(h, self.self_attn_norm, lambda q: self.self_attn(
            q, self_k, self_v, running, self_padding_mask, q_start, *attn_z))
        if memory_kv is not None:  # chunk-wise recurrence: read the memory (pre-LN always)
            x = x + self.dropout(self.memory_attn(x, *memory_kv))
        if self.cross_attn is not None:
            x = self._sublayer(x, self.cross_attn_norm, lambda q: self.cross_attn(
                q, cross_k, cross_v, running, cross_padding_mask, grid_rows=cross_rows))
        out = self._sublayer(x, self.ffd_norm, lambda q: self.ffd(q, running, *ffd_z))
        if self.gate is not None:  # GUT: h_l = G * out + (1 - G) * h_{l-1}
            g = self.gate(x)
            out = g * out + (1.0 - g) * h
        return out


class FeedForwardGate(nn.Module):
    """G = sigmoid(W2 · GELU(W1 · LN(a) + b1) + b2), per position and channel, from the
    attention sub-layers' output a (GUT, Ray Chowdhury & Caragea 2024, Eq. 10)."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = LayerNorm(d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc2(F.gelu(self.fc1(self.norm(a)))))
