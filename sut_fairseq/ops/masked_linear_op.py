"""A linear map of the rows a mask selects, as a custom op: ``sut::masked_linear``.

    y_r = x_r Wᵀ + b   where mask_r,   y_r = 0 elsewhere         x (N, in), W (out, in)

A compiled recurrence step has static shapes, so it cannot gather the running rows
itself; this op does it inside: on a CPU it computes only the selected rows (reading the
mask on the host is free there), so the routers, the halting unit and the self-attention
key/value projections of a compiled step still skip halted positions. Its gradient is a
second op with the same row selection:

    dx_r = dy_r W (selected rows, else 0),   dW = Σ_r dy_rᵀ x_r,   db = Σ_r dy_r

On CUDA (no host synchronisation) ``masked_linear`` computes every row and zeroes the
others with ``dense_masked_linear``: plain operations that inductor fuses, no custom op.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .reference_linear import _autocast_dtype, as_custom_op


def _rows(mask: Tensor) -> Optional[Tensor]:
    """The selected rows' indices (R,), or None when every row is selected (nothing halted
    yet: the op then works on the tensors as they are, no gather or scatter)."""
    rows = mask.nonzero().squeeze(1)
    return None if rows.numel() == mask.numel() else rows


def _scatter(rows: Optional[Tensor], y: Tensor, n: int) -> Tensor:
    """y (R, m) of the selected rows -> (n, m) with zeros elsewhere (y itself for every row)."""
    return y if rows is None else y.new_zeros(n, y.size(1)).index_copy_(0, rows, y)


def dense_masked_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Tensor) -> Tensor:
    """Every row computed, the unselected ones set to 0 by a select (a non-finite one gives
    0, as on the CPU): x (N, in), W (out, in), mask (N,) bool -> (N, out)."""
    return torch.where(mask.unsqueeze(1), F.linear(x, weight, bias), 0.0)


def _dense(x: Tensor) -> bool:
    """Whether ``masked_linear`` takes ``dense_masked_linear`` (CUDA) over the custom op."""
    return x.is_cuda


def selected_rows_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Tensor) -> Tensor:
    """The selected rows only (the op's body): x (N, in), W (out, in), mask (N,) -> (N, out).
    Every row selected (nothing halted yet): the plain map, no gather or scatter."""
    rows = _rows(mask)
    xs = x if rows is None else x.index_select(0, rows)
    return _scatter(rows, F.linear(xs, weight, bias), x.size(0))


@torch.library.custom_op("sut::masked_linear", mutates_args=())
def masked_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Tensor) -> Tensor:
    """``selected_rows_linear`` with its gradient (``masked_affine``'s CPU path)."""
    return selected_rows_linear(x, weight, bias, mask)


@masked_linear_op.register_fake
def _(x, weight, bias, mask):
    return x.new_empty(x.size(0), weight.size(0))


@torch.library.custom_op("sut::masked_linear_backward", mutates_args=())
def masked_linear_backward_op(grad: Tensor, x: Tensor, weight: Tensor, mask: Tensor, need_x: bool,
                              need_w: bool, need_b: bool) -> Tuple[Tensor, Tensor, Tensor]:
    rows = _rows(mask)
    g, xs = (grad, x) if rows is None else (grad.index_select(0, rows), x.index_select(0, rows))
    # a gradient not asked for is an empty tensor, one each (a custom op's outputs may not alias)
    grad_x = _scatter(rows, g @ weight, x.size(0)) if need_x else x.new_empty(0)
    # dW in the weight's own layout (a transposed view's gradient accumulates without copies)
    transposed = weight.t().is_contiguous()
    grad_w = ((xs.t() @ g).t() if transposed else g.t() @ xs) if need_w else x.new_empty(0)
    grad_b = g.sum(0) if need_b else x.new_empty(0)
    return grad_x, grad_w, grad_b


@masked_linear_backward_op.register_fake
def _(grad, x, weight, mask, need_x, need_w, need_b):
    return (torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(weight) if need_w else x.new_empty(0),
            x.new_empty(weight.size(0)) if need_b else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, _, mask = inputs
    ctx.save_for_backward(x, weight, mask)


def _backward(ctx, grad):
    needs = ctx.needs_input_grad[:3]  # x, W, b (False for a None bias)
    grads = torch.ops.sut.masked_linear_backward(grad, *ctx.saved_tensors, *needs)
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None,)


masked_linear_op.register_autograd(_backward, setup_context=_setup_context)


def masked_linear(x: Tensor, linear: nn.Linear, mask: Tensor) -> Tensor:
    """``linear`` on the rows of x (..., in) where mask (...) is True; 0 elsewhere.
    Under autocast the operands are cast to its dtype first, as ``nn.Linear`` does."""
    return masked_affine(x, linear.weight, linear.bias, mask)


def masked_affine(x: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Tensor) -> Tensor:
    """``masked_linear`` of the map x Wᵀ + b: W (out, in), b (out,) or None."""
    dtype = _autocast_dtype(x.device.type) or x.dtype
    bias = None if bias is None else bias.to(dtype)
    if _dense(x):
        op = dense_masked_linear
    elif as_custom_op(x, weight, bias):
        op = torch.ops.sut.masked_linear
    else:  # eager, no gradient (decoding): the op's body without its dispatch
        op = selected_rows_linear
    y = op(x.reshape(-1, x.size(-1)).to(dtype), weight.to(dtype), bias, mask.reshape(-1))
    return y.view(*x.shape[:-1], y.size(-1))


class MaskedAffine(nn.Module):
    """``masked_affine`` as a module without parameters (the weights are passed), so that
    counting MACs by module hooks sees the rows it computed; a mask of None selects every
    row. x (..., in), W (out, in), b (out,) or None, mask (...) bool or None -> (..., out)."""

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                mask: Optional[Tensor] = None) -> Tensor:
        if mask is None:
            return F.linear(x, weight, bias)
        return masked_affine(x, weight, bias, mask)
