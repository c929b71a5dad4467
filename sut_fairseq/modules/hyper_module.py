"""Hyper-modules (Hyper-UT, docs/hyper_ut.md): a linear map whose weights are composed,
per example or per token and per step, as a soft mixture over a pool of M weight
embeddings chosen by a one-head attention router.

For one component c (a linear map d_in -> d_out) and an example embedding z (width d)::

    s = softmax( (W_r LN(z)) K_cᵀ / (τ √d_k) )      router: W_r d -> d_k, K_c (M, d_k)
    e = s V_c                                       V_c (M, d_e)
    W = reshape(G_c e + g_c)   (d_out, d_in)        G_c: d_e -> d_out·d_in, g_c (d_out·d_in)
    y = x Wᵀ + b_c                                  b_c (d_out) static

G_c is stored as ``generator`` (d_e, d_out, d_in), ``generator[j]`` = G^(j) (column j of
G_c reshaped), g_c as ``generator_bias`` (d_out, d_in). G_c being linear, W has two exact
factorings, ``Σ_m s_m W^(m) + g_c`` with ``W^(m) = reshape(G_c V_c[m])`` and
``Σ_j e_j G^(j) + g_c``; every application takes the one with fewer terms, r = min(M, d_e)
(``basis``). Two applications:

* per example (encoder), z (B, d): one weight set per sentence, materialised (transposed,
  (B, d_in, d_out)) from the r basis matrices and g in one product; x (B, T, d_in) ->
  (B, T, d_out) with one batched GEMM.
* per token (decoder), z (..., d) one per row of x (..., d_in): no per-token matrix;
  ``y = Σ_i c_i (B_i x) + g_c x + b_c`` over the basis B_1..B_r with coefficients c, one
  GEMM of x with [B_1; ..; B_r] (r·d_out rows) and a contraction with c.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

HYPER_COMPONENTS = ("qkv", "out", "ffn")


def parse_components(value) -> tuple:
    """``"qkv,out"`` -> ("qkv", "out") (whitespace and empty items ignored); a sequence
    is returned as a tuple. Unknown names are left for the caller to reject."""
    if isinstance(value, str):
        return tuple(c.strip() for c in value.split(",") if c.strip())
    return tuple(value)


class HyperRouter(nn.Module):
    """``s = softmax((W_r LN(z)) Kᵀ / (τ √d_k))`` over the M module keys: s (..., M) in z's
    dtype (the softmax in at least fp32)."""

    def __init__(self, ctx_dim: int, key_dim: int, num_modules: int, temperature: float = 1.0):
        super().__init__()
        if num_modules < 1:
            raise ValueError(f"a hyper-module needs at least one module; got {num_modules}")
        if not temperature > 0.0:
            raise ValueError(f"router temperature must be > 0; got {temperature}")
        self.norm = nn.LayerNorm(ctx_dim)
        self.query = nn.Linear(ctx_dim, key_dim, bias=False)
        self.keys = nn.Parameter(torch.randn(num_modules, key_dim))
        self.temperature = temperature

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        scale = 1.0 / (self.temperature * math.sqrt(self.keys.size(1)))  # 1 / (τ √d_k)
        logits = F.linear(self.query(self.norm(z)), self.keys) * scale
        return logits.softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32)).to(z.dtype)


class HyperLinear(nn.Module):
    """A linear map d_in -> d_out whose weight a hyper-module composes from z: in_dim,
    out_dim, ctx_dim, num_modules, embed_dim, key_dim, temperature are d_in, d_out, d, M,
    d_e, d_k, τ; ``category``: what the MAC count files x Wᵀ under (``analysis/macs.py``).
    Initialisation: V ~ N(0, 1), G ~ U(±a / √d_e) with the Xavier bound a (times ``gain``)
    of a dense (d_out, d_in) layer, so every W^(m) = G V_m has a dense layer's variance;
    g = 0, b = 0."""

    def __init__(self, in_dim: int, out_dim: int, ctx_dim: int, num_modules: int,
                 embed_dim: int, key_dim: int, temperature: float = 1.0, gain: float = 1.0,
                 category: str = "other"):
        super().__init__()
        if embed_dim < 1:
            raise ValueError(f"hyper embedding width must be >= 1; got {embed_dim}")
        self.in_dim, self.out_dim = in_dim, out_dim
        self.num_modules, self.embed_dim = num_modules, embed_dim
        self.category = category
        self.router = HyperRouter(ctx_dim, key_dim, num_modules, temperature)
        self.values = nn.Parameter(torch.randn(num_modules, embed_dim))
        bound = gain * math.sqrt(6.0 / (in_dim + out_dim)) / math.sqrt(embed_dim)
        self.generator = nn.Parameter(torch.empty(embed_dim, out_dim, in_dim).uniform_(-bound, bound))
        self.generator_bias = nn.Parameter(torch.zeros(out_dim, in_dim))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def scores(self, z: torch.Tensor) -> torch.Tensor:
        """Router scores s (..., M)."""
        return self.router(z)

    def module_weights(self) -> torch.Tensor:
        """W^(m) = reshape(G V_m), (M, d_out, d_in): the module basis."""
        return torch.einsum("me,eoi->moi", self.values, self.generator)

    @property
    def basis(self) -> str:
        """``"modules"`` when M < d_e, else ``"generator"``: W's factoring with r terms."""
        return "modules" if self.num_modules < self.embed_dim else "generator"

    def coefficients_and_basis(self, z: torch.Tensor):
        """(c (N, r), basis (r, d_out, d_in)) with W = Σ_i c_i basis_i + g for each row of
        z (N, d): (s, W^(1..M)) or (e = s V, G^(1..d_e)), see ``basis``."""
        if self.basis == "modules":
            return self.scores(z), self.module_weights()
        return torch.matmul(self.scores(z), self.values), self.generator

    def compose_transposed(self, z: torch.Tensor) -> torch.Tensor:
        """Per-example weights, transposed: Wᵀ = Σ_i c_i basis_iᵀ + gᵀ, z (B, d) ->
        (B, d_in, d_out) contiguous, as one product [c, 1] · [basisᵀ; gᵀ]: g folded in and
        the transposes taken on the r + 1 small matrices, not the B large ones."""
        coeff, basis = self.coefficients_and_basis(z)
        coeff = torch.cat([coeff, coeff.new_ones(coeff.size(0), 1)], 1)  # (B, r + 1)
        basis = torch.cat([basis, self.generator_bias[None]])  # (r + 1, d_out, d_in)
        return torch.mm(coeff, basis.transpose(1, 2).reshape(basis.size(0), -1)).view(
            -1, self.in_dim, self.out_dim)

    def compose(self, z: torch.Tensor) -> torch.Tensor:
        """Per-example weights W = Σ_i c_i basis_i + g: z (B, d) -> (B, d_out, d_in)."""
        return self.compose_transposed(z).transpose(1, 2)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Per example when z has one dimension fewer than x: x (B, T, d_in), z (B, d) ->
        x W_bᵀ + b (B, T, d_out), one W_b per row b. Per token when z (..., d) has x's leading
        shape: y = Σ_i c_i basis_i x + g x + b, the GEMM x (N, d_in) · basis (r·d_out, d_in)ᵀ
        -> (N, r, d_out), then the contraction with the coefficients c (N, r)."""
        if z.dim() == x.dim() - 1:
            return torch.baddbmm(self.bias, x, self.compose_transposed(z))
        if z.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"hyper context {tuple(z.shape)} fits neither per example nor "
                             f"per token for input {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_dim)
        coeff, basis = self.coefficients_and_basis(z.reshape(-1, z.size(-1)))
        r = basis.size(0)
        proj = F.linear(x2, basis.reshape(r * self.out_dim, self.in_dim))
        y = torch.bmm(coeff.unsqueeze(1), proj.view(-1, r, self.out_dim)).squeeze(1)
        y = y + F.linear(x2, self.generator_bias, self.bias)
        return y.view(*x.shape[:-1], self.out_dim)

    def extra_repr(self) -> str:
        return (f"in={self.in_dim}, out={self.out_dim}, modules={self.num_modules}, "
                f"embed={self.embed_dim}, temperature={self.router.temperature}")


def example_embedding(h: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Encoder z: masked mean of h (B, T, d) over the real positions -> (B, d)."""
    w = real.unsqueeze(-1)  # (B, T, 1) bool: the counts are exact integers in any dtype of h
    return (h * w).sum(1) / w.sum(1).clamp_min(1)


def prefix_embedding(h: torch.Tensor, real: torch.Tensor, prev=None):
    """Decoder z: causal prefix mean of h (B, T, d) over real positions <= t, continuing
    from ``prev = (sum (B, d), count (B,))`` of earlier positions (incremental decoding).
    Returns z (B, T, d) and the (sum, count) through the last position (count: int64)."""
    w = real.unsqueeze(-1)  # bool: exact integer counts, as the halting's global mean
    sums, counts = (h * w).cumsum(1), w.cumsum(1)
    if prev is not None:
        prev_sum, prev_count = prev
        sums, counts = sums + prev_sum.unsqueeze(1), counts + prev_count.view(-1, 1, 1)
    return sums / counts.clamp_min(1), (sums[:, -1], counts[:, -1, 0])
