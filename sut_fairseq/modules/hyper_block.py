"""Hyper-UT sub-layers of the shared block (docs/hyper_ut.md): self-attention and the
feed-forward network whose linear maps are hyper-modules (``hyper_module.HyperLinear``).

``--hyper-components`` chooses which maps are composed per step: ``qkv`` (the query, key
and value projections), ``out`` (the attention output projection), ``ffn`` (both
feed-forward maps); the others are dense ``nn.Linear`` initialised as the dense MoMHA /
MoE-FFD (E = k = 1) would be. Every hyper-linear call takes the step's example embedding
z: (B, d) per example (encoder) or (B, T, d) per token (decoder). The attention is plain
multi-head scaled dot-product attention (no relative positions); cross-attention stays a
dense MoMHA in ``SUTBlock``. Halted and padding rows are computed like running ones (the
recurrence discards them): a per-example weight set serves the whole sentence in one GEMM.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq import utils

from .dropout import Dropout
from .hyper_module import HyperLinear, parse_components
from .momha import hidden_keys, mask_bias


class HyperConfig:
    """The hyper-module options of a model: M, d_e, d_k (0 = d), τ, components."""

    def __init__(self, num_modules: int, embed_dim: int, key_dim: int, temperature: float,
                 components):
        self.num_modules, self.embed_dim = num_modules, embed_dim
        self.key_dim, self.temperature = key_dim, temperature
        self.components = parse_components(components)

    @classmethod
    def from_args(cls, args) -> Optional["HyperConfig"]:
        """None when hyper-modules are off (``--hyper-modules 0``)."""
        if args.hyper_modules <= 0:
            return None
        return cls(args.hyper_modules, args.hyper_embed_dim, args.hyper_key_dim,
                   args.hyper_router_temp, args.hyper_components)

    def linear(self, in_dim: int, out_dim: int, ctx_dim: int, hyper: bool, gain: float = 1.0,
               category: str = "other") -> nn.Module:
        """A HyperLinear, or a dense nn.Linear (Xavier-uniform with ``gain``, zero bias)."""
        if hyper:
            return HyperLinear(in_dim, out_dim, ctx_dim, self.num_modules, self.embed_dim,
                               self.key_dim or ctx_dim, self.temperature, gain, category)
        layer = nn.Linear(in_dim, out_dim)
        nn.init.xavier_uniform_(layer.weight, gain=gain)
        nn.init.zeros_(layer.bias)
        return layer


def apply_linear(layer: nn.Module, x: torch.Tensor, z: Optional[torch.Tensor]) -> torch.Tensor:
    """``layer(x, z)`` for a hyper-module, ``layer(x)`` for a dense one."""
    if isinstance(layer, HyperLinear):
        if z is None:
            raise ValueError("a hyper-module needs the step's example embedding z")
        return layer(x, z)
    return layer(x)


class HyperSelfAttention(nn.Module):
    """Multi-head self-attention (H heads of D) with hyper-module projections and the
    interface of ``MixtureOfMultiHeadAttention``: ``project_kv`` gives (B, H, S, D)."""

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, config: HyperConfig,
                 attention_dropout: float = 0.0, causal: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.causal = num_heads, head_dim, causal
        inner = num_heads * head_dim
        qkv, out = "qkv" in config.components, "out" in config.components
        self.q_proj = config.linear(embed_dim, inner, embed_dim, qkv, category="att_proj")
        self.k_proj = config.linear(embed_dim, inner, embed_dim, qkv, gain=2 ** -0.5, category="kv")
        self.v_proj = config.linear(embed_dim, inner, embed_dim, qkv, gain=2 ** -0.5, category="kv")
        self.out_proj = config.linear(inner, embed_dim, embed_dim, out, category="att_proj")
        self.hyper_kv = qkv
        self.attention_dropout = attention_dropout

    def project_kv(self, kv: torch.Tensor, z: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = kv.shape
        k = apply_linear(self.k_proj, kv, z).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        v = apply_linear(self.v_proj, kv, z).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                active: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None,
                q_start: int = 0, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query (B, T, d) at positions q_start..; key/value (B, H, S, D). ``active`` is
        accepted for the MoMHA interface: every row is computed."""
        B, T, d = query.shape
        H, D, S = self.num_heads, self.head_dim, key.size(2)
        q = apply_linear(self.q_proj, query, z).view(B, T, H, D).transpose(1, 2)
        bias = mask_bias(hidden_keys(T, 1, q_start, S, self.causal, key_padding_mask, q.device),
                         q.dtype)
        o = F.scaled_dot_product_attention(
            q, key.to(q.dtype), value.to(q.dtype), attn_mask=bias,
            dropout_p=self.attention_dropout if self.training else 0.0)
        return apply_linear(self.out_proj, o.transpose(1, 2).reshape(B, T, H * D), z)


class HyperFeedForward(nn.Module):
    """``fc2(act(fc1 x))`` with hyper-module (or dense) fc1: d -> D and fc2: D -> d."""

    def __init__(self, embed_dim: int, hidden_dim: int, config: HyperConfig,
                 activation_fn: str = "relu", activation_dropout: float = 0.0):
        super().__init__()
        ffn = "ffn" in config.components
        self.fc1 = config.linear(embed_dim, hidden_dim, embed_dim, ffn, category="ffd")
        self.fc2 = config.linear(hidden_dim, embed_dim, embed_dim, ffn, category="ffd")
        self.activation_fn = utils.get_activation_fn(activation_fn)
        self.activation_dropout = Dropout(activation_dropout)

    def forward(self, x: torch.Tensor, active: torch.Tensor,
                z: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.activation_dropout(self.activation_fn(apply_linear(self.fc1, x, z)))
        return apply_linear(self.fc2, h, z)
