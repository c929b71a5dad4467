"""Inverted dropout with a cheaper CPU mask.

    y = x · m / (1 - p),   m ~ Bernoulli(1 - p) per element

On CPU one 32-bit draw gives two 16-bit uniform integers u and an element is kept when
u >= round(p · 2^16), much cheaper than ``F.dropout``'s per-element Bernoulli (timings:
docs/performance.md). The drop probability is p rounded to a multiple of 2^-16 (|error| <=
2^-17) and the scale uses that same probability, so E[y] = x exactly. CUDA tensors and p
within 2^-17 of 1 use ``F.dropout``; evaluation and p = 0 are the identity. Under
``torch.compile`` the mask is drawn by the custom op ``sut::keep_mask`` (the same draw,
opaque to the compiler; ``nondeterministic_seeded`` so that it is neither merged with another
call nor recomputed in the backward), not by inductor's per-element Philox.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..compiler import tracing

_LEVELS = 1 << 16


def _keep_mask(x: torch.Tensor, dropped_levels: int) -> torch.Tensor:
    """Bool mask of x's shape, True with probability 1 - dropped_levels / 2^16."""
    n = x.numel()
    # one draw of the default generator seeds this call's stream: a call consumes the same
    # randomness whatever its size, so runs that differ in one tensor's size keep other masks
    stream = torch.Generator(device=x.device)
    stream.manual_seed(int(torch.empty((), dtype=torch.int64).random_()))
    words = torch.empty((n + 1) // 2, dtype=torch.int32, device=x.device)
    words.random_(-(1 << 31), 1 << 31, generator=stream)  # every bit uniform
    u = words.view(torch.int16)[:n].view(x.shape)  # uniform on [-2^15, 2^15)
    return u >= dropped_levels - (1 << 15)


@torch.library.custom_op("sut::keep_mask", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def keep_mask_op(x: torch.Tensor, dropped_levels: int) -> torch.Tensor:
    """``_keep_mask`` as an operator opaque to the compiler (x gives the shape and device)."""
    return _keep_mask(x, dropped_levels)


@keep_mask_op.register_fake
def _(x, dropped_levels):
    return torch.empty_like(x, dtype=torch.bool)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Functional form of ``Dropout``."""
    if not training or p == 0.0:
        return x
    dropped = round(p * _LEVELS)
    if x.is_cuda or dropped >= _LEVELS or not x.is_floating_point():
        return F.dropout(x, p, training)
    if dropped == 0:
        return x
    scale = _LEVELS / (_LEVELS - dropped)
    draw = torch.ops.sut.keep_mask if tracing() else _keep_mask
    mask = draw(x, dropped).to(x.dtype)
    if x.dtype in (torch.float16, torch.bfloat16):
        return x * mask * scale  # the scale stays a float scalar: no rounding of 1 / (1 - p)
    # one pass forward and backward: autograd keeps the scaled mask, dx = dy ⊙ mask / (1 - p)
    return x * mask.mul_(scale)


def keep_mask(x: torch.Tensor, p: float, training: bool, shape=None):
    """A dropout mask for a kernel that applies it itself: (keep, bool of ``shape`` (x's
    by default) on x's device, 1 / (1 - p)), each element kept with probability 1 - p (a
    uniform draw >= p, which inductor makes one kernel; ``bernoulli_`` would add an aten
    fallback kernel); (None, 1.0) in evaluation and at p = 0 (the identity)."""
    if not training or p == 0.0:
        return None, 1.0
    shape = tuple(x.shape) if shape is None else tuple(shape)
    if p >= 1.0:
        return torch.zeros(shape, dtype=torch.bool, device=x.device), 0.0
    return torch.rand(shape, dtype=torch.float32, device=x.device) >= p, 1.0 / (1.0 - p)


class Dropout(nn.Module):
    """Drop-in for ``nn.Dropout(p)`` (same ``p`` attribute and semantics)."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1]; got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
