"""``ops.short_softmax.softmax_lastdim``: the padded short rows against a softmax written out
(exp(x - max) / Σ exp(x - max), in float64), the gradient through the padding, and where
the padding applies."""
import pytest
import torch

from sut_fairseq.ops.short_softmax import VECTOR, softmax_lastdim


def written_out(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    e = (x - x.max(-1, keepdim=True).values).exp()
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("n", [2, 5, 12, 15, 16, 17, 40])
def test_equals_the_written_out_softmax(n):
    x = torch.randn(3, 7, n, generator=torch.Generator().manual_seed(n)) * 4
    x[0, 0, : n // 2] = float("-inf")  # hidden keys: a row partly -inf
    got = softmax_lastdim(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), written_out(x), atol=1e-7, rtol=1e-6)


def test_a_row_with_no_visible_entry_is_nan_as_torchs():
    x = torch.full((2, 12), float("-inf"))
    x[1, 3] = 0.0
    got = softmax_lastdim(x)
    assert torch.isnan(got[0]).all() and torch.isnan(x.softmax(-1)[0]).all()
    assert torch.equal(got[1], torch.nn.functional.one_hot(torch.tensor(3), 12).float())


@pytest.mark.parametrize("n", [4, 12])
def test_gradient_equals_the_plain_softmax_gradient(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, n, generator=g, requires_grad=True)
    w = torch.randn(6, n, generator=g)
    (softmax_lastdim(x) * w).sum().backward()
    padded = x.grad.clone()
    x.grad = None
    (x.softmax(-1) * w).sum().backward()
    torch.testing.assert_close(padded, x.grad, atol=1e-7, rtol=1e-6)


def test_pads_only_short_float32_rows_on_the_cpu():
    """The padded result is a view of a (..., 16) tensor; the others are softmax's own."""
    for n in (2, 12, 15):
        assert softmax_lastdim(torch.randn(4, n)).stride(0) == VECTOR  # through the padding
    for x in (torch.randn(4, 16), torch.randn(4, 40), torch.randn(4, 12, dtype=torch.float64),
              torch.randn(4, 1)):
        y = softmax_lastdim(x)
        assert y.is_contiguous() and torch.equal(y, x.softmax(-1))


def test_a_compiled_graph_keeps_the_plain_softmax_over_the_last_dimension():
    """Traced by dynamo (``aot_eager``: no code generated), the function is softmax(-1) over
    the last of three dimensions, not padded (a view of 16 would add a guard on n)."""
    x = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(softmax_lastdim, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    assert got.is_contiguous()
    torch.testing.assert_close(got, x.softmax(-1), atol=0, rtol=0)


def test_the_compiled_branch_run_eagerly_is_the_plain_softmax(compiling_branch):
    """The branch a compiled graph takes, run eagerly (so that mutation testing sees it):
    softmax(-1) over the last of three dimensions, the short rows not padded."""
    x = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(2))
    got = softmax_lastdim(x)
    assert got.is_contiguous()
    torch.testing.assert_close(got, x.softmax(-1), atol=0, rtol=0)
