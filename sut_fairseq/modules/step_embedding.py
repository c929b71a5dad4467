"""The Universal Transformer's step (timestep) and coordinate embeddings.

The UT adds, before every application of the shared block, a sinusoid of the step index
(Dehghani et al. 2019) in the UT paper's interleaved layout (fairseq's puts all sines
first); with d the model width and j = 0 .. ⌈d/2⌉ − 1::

    TE(t)_{2j}   = sin(t / 10000^{2j/d})
    TE(t)_{2j+1} = cos(t / 10000^{2j/d})

``--encoder-step-embedding`` / ``--decoder-step-embedding``:

* ``none`` (default): nothing is added.
* ``timestep``: E_l = TE(l) for step l (1-based block application); h_0 is the token
  embedding plus fairseq's sinusoidal positions.
* ``coordinate``: the UT's coordinate embedding ``E_l = P^l_i = PE(i) + TE(l)``, with
  ``PE(i)`` the same sinusoid of the 1-based position i (counting real tokens, so left
  padding does not shift it); h_0 is the scaled token embedding alone.

What is added enters the residual stream: ``h_l = Block(h_{l-1} + E_l, S_{l-1} + E_l)``
(queries, and the source of the self-attention keys/values); halted positions carry no
embedding of the steps they skipped. The keys: post-LN, carried keys + ``W_k TE(l)``
(``step_kv_bias``; exact, the projection being affine), pre-LN every row projected again
(``recurrence.carried_kv`` / ``prenorm_stepped_kv``).
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq import utils


STEP_EMBEDDINGS = ("none", "timestep", "coordinate")


def sinusoid(index: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved sinusoid of ``index`` (any shape, integer or float): returns
    ``index.shape + (dim,)`` in float64 with ``[..., 2j] = sin(index / 10000^{2j/dim})`` and
    ``[..., 2j+1] = cos(index / 10000^{2j/dim})``; for odd ``dim`` the last entry is a sine."""
    if dim < 1:
        raise ValueError(f"sinusoid width must be >= 1; got {dim}")
    even = torch.arange(0, dim, 2, dtype=torch.float64, device=index.device)  # 2j
    angle = index.to(torch.float64).unsqueeze(-1) / torch.pow(10000.0, even / dim)
    out = torch.stack([torch.sin(angle), torch.cos(angle)], -1).flatten(-2)  # sin, cos, sin, ...
    return out[..., :dim]


class StepEmbedding(nn.Module):
    """The step embedding of one side (``timestep`` or ``coordinate``); no parameters or
    buffers: the sinusoids are computed in float64 and cast to the states' dtype."""

    def __init__(self, mode: str, embed_dim: int):
        super().__init__()
        if mode not in STEP_EMBEDDINGS or mode == "none":
            raise ValueError(f"step embedding must be 'timestep' or 'coordinate' to build one; got {mode!r}")
        self.mode, self.embed_dim = mode, embed_dim

    def input_positions(self, positions: torch.Tensor):
        """What h_0 adds to the scaled token embedding: fairseq's positions, or 0 with the
        coordinate embedding (its positions enter at every step instead)."""
        return 0 if self.mode == "coordinate" else positions

    def positions(self, tokens: torch.Tensor, padding_idx: int, like: torch.Tensor) -> Optional[torch.Tensor]:
        """``coordinate``: PE(i) (B, T, d) for tokens (B, T), i = 1, 2, ... over the real
        tokens (0 on padding, whose keys are masked anyway); ``timestep``: None."""
        if self.mode != "coordinate":
            return None
        index = utils.make_positions(tokens, padding_idx) - padding_idx  # 1-based, 0 on padding
        return sinusoid(index, self.embed_dim).to(like.dtype)

    def timestep(self, step: int, like: torch.Tensor) -> torch.Tensor:
        """TE(step) as a (d,) tensor of ``like``'s dtype and device."""
        return sinusoid(torch.tensor(float(step), device=like.device), self.embed_dim).to(like.dtype)

    def table(self, num_steps: int, like: torch.Tensor) -> torch.Tensor:
        """TE(1..L) as an (L, d) tensor of ``like``'s dtype and device (one row per step)."""
        steps = torch.arange(1, num_steps + 1, device=like.device)
        return sinusoid(steps, self.embed_dim).to(like.dtype)

    def add(self, x: torch.Tensor, step: int, positions: Optional[torch.Tensor]) -> torch.Tensor:
        """x (B, T, d) + E_step: ``x + TE(step)``, or ``x + PE(i) + TE(step)`` (coordinate)."""
        return add_embedding(x, self.timestep(step, x), positions)


def add_embedding(x: torch.Tensor, te: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
    """x (B, T, d) + E_l: ``x + te`` with te = TE(l) (d,), or ``(x + PE(i)) + te`` with
    ``positions`` PE (B, T, d)."""
    return x + te if positions is None else x + positions + te


def step_kv_bias(block, te: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``W_k TE(l)`` and ``W_v TE(l)`` of the block's self-attention (no bias), each shaped
    (1, H, 1, D) to add to keys/values (B, H, T, D)."""
    attn = block.self_attn
    H, D = attn.num_heads, attn.head_dim
    return (F.linear(te, attn.k_proj.weight).view(1, H, 1, D),
            F.linear(te, attn.v_proj.weight).view(1, H, 1, D))


def build_step_embedding(mode: str, embed_dim: int) -> Optional[StepEmbedding]:
    if mode not in STEP_EMBEDDINGS:
        raise ValueError(f"unknown step embedding {mode!r}; choose from {STEP_EMBEDDINGS}")
    return None if mode == "none" else StepEmbedding(mode, embed_dim)
