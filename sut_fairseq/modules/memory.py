"""The memory of chunk-wise recurrence (TLB / GUTLB, docs/chunked.md).

k memory slots M (B, k, d) carry information from one chunk of a sequence to the next.
Every attention here is dense, pre-LN and has no position term (Eq. 3 of the GUTLB paper:
Attention(Q, K, V) = MHA(LN(Q), LN(K), LN(V)) + Q):

    read, in every step of the shared block, after its self-attention (Attention2):
        A ← A + dropout(MHA(LN_q(A), LN_m(M^c), LN_m(M^c)))
    write, after the recurrence over chunk c, U unshared blocks u = 1..U (Attention3_u):
        A_u = M_{u-1} + dropout(MHA(LN_q(M_{u-1}), LN_s(S_L), LN_s(S_L)))   S_L: the chunk's real rows
        M_u = A_u + dropout(W_2 GELU(W_1 LN(A_u) + b_1) + b_2)             (FeedForward_u, width d)
        M^{c+1} = M_U
    M^0: a learned (k, d) parameter, zeros at initialisation (as the authors' code).
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules import LayerNorm

from .dropout import Dropout
from .momha import mask_bias, padding_hidden


class MemoryAttention(nn.Module):
    """MHA(LN_q(x), LN_kv(m), LN_kv(m)) with H heads of size D, no positions, no residual;
    keys and values are projected once per memory (``project_kv``)."""

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, attention_dropout: float = 0.0):
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.attention_dropout = attention_dropout
        self.q_norm, self.kv_norm = LayerNorm(embed_dim), LayerNorm(embed_dim)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(embed_dim, inner) for _ in range(3))
        self.out_proj = nn.Linear(inner, embed_dim)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=2 ** -0.5)
            nn.init.zeros_(proj.bias)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, m: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """m: (B, S, d) -> keys and values of LN_kv(m), each (B, H, S, D)."""
        x = self.kv_norm(m)
        return self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def forward(self, x: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: (B, T, d) queries; key/value: (B, H, S, D) from ``project_kv``;
        key_padding_mask: (B, S) bool, True = not a key. Returns (B, T, d)."""
        B, T, _ = x.shape
        q = self._heads(self.q_proj(self.q_norm(x)))
        bias = None if key_padding_mask is None else mask_bias(padding_hidden(key_padding_mask), q.dtype)
        o = F.scaled_dot_product_attention(q, key.to(q.dtype), value.to(q.dtype), attn_mask=bias,
                                           dropout_p=self.attention_dropout if self.training else 0.0)
        return self.out_proj(o.transpose(1, 2).reshape(B, T, -1))


class MemoryFeedForward(nn.Module):
    """W_2 GELU(W_1 LN(x) + b_1) + b_2 with W_1, W_2: d x d (no residual)."""

    def __init__(self, embed_dim: int, activation_dropout: float = 0.0):
        super().__init__()
        self.norm = LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, embed_dim)
        self.fc2 = nn.Linear(embed_dim, embed_dim)
        self.dropout = Dropout(activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(F.gelu(self.fc1(self.norm(x)))))


class ChunkMemory(nn.Module):
    """M^0 (k = ``slots``, d = ``embed_dim``) and the memory update of one side: U =
    ``update_layers`` write blocks, their attention of H = ``num_heads`` heads of D =
    ``head_dim``. ``out_norm``: hold LN_out, applied to the final memory the encoder hands to
    the decoder (``--tlb-encoder-out memory|both``)."""

    def __init__(self, embed_dim: int, slots: int, update_layers: int, num_heads: int,
                 head_dim: int, dropout: float = 0.0, attention_dropout: float = 0.0,
                 activation_dropout: float = 0.0, out_norm: bool = False):
        super().__init__()
        if slots < 1 or update_layers < 1:
            raise ValueError(f"a chunk memory needs slots >= 1 and update layers >= 1; "
                             f"got slots={slots}, update_layers={update_layers}")
        self.initial = nn.Parameter(torch.zeros(slots, embed_dim))  # M^0
        self.write_attn = nn.ModuleList(MemoryAttention(embed_dim, num_heads, head_dim, attention_dropout)
                                        for _ in range(update_layers))
        self.write_ffn = nn.ModuleList(MemoryFeedForward(embed_dim, activation_dropout)
                                       for _ in range(update_layers))
        self.dropout = Dropout(dropout)
        self.out_norm = LayerNorm(embed_dim) if out_norm else None

    @property
    def slots(self) -> int:
        return self.initial.size(0)

    def begin(self, like: torch.Tensor) -> torch.Tensor:
        """M^0 for every example of ``like`` (B, ..., d): (B, k, d) in its dtype."""
        return self.initial.to(like.dtype).unsqueeze(0).expand(like.size(0), -1, -1)

    def update(self, M: torch.Tensor, S: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """M^{c+1} from M^c (B, k, d) and the chunk's final states S_L (B, w, d), of which the
        rows ``real`` (B, w) are tokens. An example without a real row keeps M^c."""
        new = M
        for attn, ffn in zip(self.write_attn, self.write_ffn):
            k, v = attn.project_kv(S)
            new = new + self.dropout(attn(new, k, v, key_padding_mask=~real))
            new = new + self.dropout(ffn(new))
        return torch.where(real.any(1).view(-1, 1, 1), new, M)

    def output(self, M: torch.Tensor) -> torch.Tensor:
        """LN_out(M) (B, k, d): the memory rows the decoder's cross-attention reads."""
        return self.out_norm(M)
