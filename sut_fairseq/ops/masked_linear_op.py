"""A linear map of the rows a mask selects, as a custom op: ``sut::masked_linear``.

    y_r = x_r Wᵀ + b   where mask_r,   y_r = 0 elsewhere         x (N, in), W (out, in)

A compiled recurrence step has static shapes, so it cannot gather the running rows
itself; this op does it inside, where the data may decide shapes: on a CPU it computes
only the selected rows (reading the mask on the host is free there), so the routers, the
halting unit and the self-attention key/value projections of a compiled step still skip
halted positions. Its gradient is a second op with the same row selection:

    dx_r = dy_r W (selected rows, else 0),   dW = Σ_r dy_rᵀ x_r,   db = Σ_r dy_r

On CUDA every row is computed and the others zeroed (no host synchronisation), which
needs no custom op: ``masked_linear`` then calls ``dense_masked_linear``, plain tensor
operations that inductor sees (the mask's product fuses with its neighbours, autograd's
backward is the formula above), instead of an opaque op of 3 kernels forward and 5
backward.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .reference_linear import _autocast_dtype

_EMPTY = 0  # size of a gradient that was not asked for


def _rows(mask: Tensor) -> Tensor:
    return mask.nonzero().squeeze(1)


def dense_masked_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Tensor) -> Tensor:
    """Every row, the unselected ones zeroed: y_r = x_r Wᵀ + b where mask_r, else 0;
    x (N, in), W (out, in), mask (N,) bool -> (N, out). (A select, not a product with the
    mask: a non-finite unselected row gives 0, as on the CPU.)"""
    return torch.where(mask.unsqueeze(1), F.linear(x, weight, bias), 0.0)


def _dense(x: Tensor) -> bool:
    """Whether ``masked_linear`` computes every row as plain operations (CUDA) rather than
    in the custom op (CPU: the selected rows only)."""
    return x.is_cuda


@torch.library.custom_op("sut::masked_linear", mutates_args=())
def masked_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Tensor) -> Tensor:
    """The selected rows only (``masked_affine`` calls it on the CPU; CUDA takes
    ``dense_masked_linear`` before it)."""
    rows = _rows(mask)
    out = x.new_zeros(x.size(0), weight.size(0))
    return out.index_copy_(0, rows, F.linear(x.index_select(0, rows), weight, bias))


@masked_linear_op.register_fake
def _(x, weight, bias, mask):
    return x.new_empty(x.size(0), weight.size(0))


@torch.library.custom_op("sut::masked_linear_backward", mutates_args=())
def masked_linear_backward_op(grad: Tensor, x: Tensor, weight: Tensor, mask: Tensor, need_x: bool,
                              need_w: bool, need_b: bool) -> Tuple[Tensor, Tensor, Tensor]:
    rows = _rows(mask)
    g, xs = grad.index_select(0, rows), x.index_select(0, rows)
    empty = x.new_empty(_EMPTY)
    grad_x = empty
    if need_x:
        grad_x = torch.zeros_like(x).index_copy_(0, rows, g @ weight)
    grad_w = g.t() @ xs if need_w else empty
    grad_b = g.sum(0) if need_b else empty
    return grad_x, grad_w, grad_b


@masked_linear_backward_op.register_fake
def _(grad, x, weight, mask, need_x, need_w, need_b):
    empty = x.new_empty(_EMPTY)
    return (torch.empty_like(x) if need_x else empty, torch.empty_like(weight) if need_w else empty,
            x.new_empty(weight.size(0)) if need_b else empty)


def _setup_context(ctx, inputs, output):
    x, weight, bias, mask = inputs
    ctx.save_for_backward(x, weight, mask)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight, mask = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and ctx.has_bias
    grad_x, grad_w, grad_b = torch.ops.sut.masked_linear_backward(grad, x, weight, mask,
                                                                 need_x, need_w, need_b)
    return (grad_x if need_x else None, grad_w if need_w else None,
            grad_b if need_b else None, None)


masked_linear_op.register_autograd(_backward, setup_context=_setup_context)


def masked_linear(x: Tensor, linear: nn.Linear, mask: Tensor) -> Tensor:
    """``linear`` on the rows of x (..., in) where mask (...) is True; 0 elsewhere.
    Under autocast the operands are cast to its dtype first, as ``nn.Linear`` does."""
    return masked_affine(x, linear.weight, linear.bias, mask)


def masked_affine(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Tensor) -> Tensor:
    """``masked_linear`` of the map x Wᵀ + b: W (out, in), b (out,) or None."""
    dtype = _autocast_dtype(x.device.type) or x.dtype
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    shape = x.shape[:-1]
    op = dense_masked_linear if _dense(x) else torch.ops.sut.masked_linear
    y = op(x.reshape(-1, x.size(-1)).to(dtype), weight, bias, mask.reshape(-1))
    return y.view(*shape, y.size(-1))


class MaskedAffine(nn.Module):
    """``masked_affine`` as a module without parameters of its own (the weights are
    passed), so that counting MACs by module hooks sees the rows it computed:

        y_r = x_r Wᵀ + b   where mask_r (every row when mask is None),   0 elsewhere

    x (..., in), W (out, in), b (out,) or None, mask (...) bool or None -> (..., out)."""

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                mask: Optional[Tensor] = None) -> Tensor:
        if mask is None:
            return F.linear(x, weight, bias)
        return masked_affine(x, weight, bias, mask)
