"""Softmax over the last dimension, fast on a CPU for short rows.

PyTorch's float32 softmax on a CPU vectorises along the last dimension 16 floats at a time;
a row shorter than that (a router over E = 12 experts, attention over the first 15
positions of a decoding) takes a scalar path about ten times slower than a row of 16
(``python benchmarks/short_softmax.py``). Such rows are padded with -inf to 16 entries
and the padding sliced off afterwards: exp(-inf) = 0, so the maximum and the sum of every
row, and therefore every probability, are unchanged (up to the order of the additions).
"""
import torch
import torch.nn.functional as F

from ..compiler import tracing

#: float32 elements per vector of PyTorch's CPU softmax kernel (AVX-512; AVX2's 8 divides it)
VECTOR = 16


def softmax_lastdim(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, -1) for x (..., n); on a CPU in float32 with 1 < n < 16 through the padded
    row (module docstring). The result may be a strided view of a (..., 16) tensor."""
    # a compiled graph keeps softmax (inductor writes its own); tracing() is tested first so
    # that dynamo reads no n, which would add a guard on it
    if (not tracing() and x.device.type == "cpu" and x.dtype == torch.float32
            and 1 < x.size(-1) < VECTOR):
        n = x.size(-1)
        return F.pad(x, (0, VECTOR - n), value=float("-inf")).softmax(-1)[..., :n]
    return x.softmax(-1)
