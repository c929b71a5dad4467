"""The CPU dropout: Bernoulli(1 - p) keep mask, inverted scaling, exact backward."""
import pytest
import torch

from sut_fairseq.modules.dropout import Dropout, dropout


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_keep_rate_scale_and_independence(p):
    torch.manual_seed(0)
    x = torch.ones(1_000_001)  # odd: the last 16-bit draw is half used
    y = dropout(x, p, True)
    kept = y != 0
    n = x.numel()
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sd
    # every kept value is x / (1 - p') with p' = p rounded to 2^-16
    p_eff = round(p * 65536) / 65536
    assert abs(p_eff - p) <= 2 ** -17
    assert torch.equal(y[kept], torch.full((int(kept.sum()),), 1 / (1 - p_eff)))
    # the two halves of one 32-bit draw are independent: P(both kept) = (1 - p)^2
    pairs = kept[: n - 1].view(-1, 2)
    both = pairs.all(1).float().mean().item()
    assert abs(both - (1 - p) ** 2) < 5 * ((1 - p) ** 2 * (1 - (1 - p) ** 2) / pairs.size(0)) ** 0.5


def test_backward_is_the_same_mask_and_scale():
    torch.manual_seed(1)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.3, True)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    ratio = torch.where(x != 0, y / x, torch.zeros_like(y)).detach()  # mask / (1 - p)
    torch.testing.assert_close(x.grad, upstream * ratio)


def test_seeded_and_varies_between_calls():
    x = torch.randn(4096)
    torch.manual_seed(7)
    a, b = dropout(x, 0.2, True), dropout(x, 0.2, True)
    torch.manual_seed(7)
    assert torch.equal(dropout(x, 0.2, True), a)
    assert not torch.equal(a, b)


def test_identity_cases_and_bad_p():
    x = torch.randn(5, 7)
    assert dropout(x, 0.2, False) is x and dropout(x, 0.0, True) is x
    assert torch.count_nonzero(dropout(x, 1.0, True)) == 0
    module = Dropout(0.25).eval()
    assert module(x) is x and module.p == 0.25
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\]; got 1.5"):
        Dropout(1.5)


def test_bfloat16_keeps_its_dtype():
    torch.manual_seed(0)
    x = torch.randn(256, 64, dtype=torch.bfloat16, requires_grad=True)
    y = dropout(x, 0.2, True)
    y.sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


def test_each_call_consumes_one_draw_whatever_its_size():
    """Masks of later calls do not depend on the size of earlier ones (as with CPU bernoulli_)."""
    x, small, large = torch.randn(300), torch.randn(10), torch.randn(10_000)
    torch.manual_seed(3)
    dropout(small, 0.2, True)
    a = dropout(x, 0.2, True)
    torch.manual_seed(3)
    dropout(large, 0.2, True)
    assert torch.equal(dropout(x, 0.2, True), a)


def test_half_precision_scale_is_not_rounded():
    x = torch.ones(4096, dtype=torch.bfloat16)
    y = dropout(x, 0.1, True)
    kept = y[y != 0].float()
    expected = torch.tensor(65536 / (65536 - round(0.1 * 65536))).bfloat16().float()
    assert torch.equal(kept, torch.full_like(kept, expected.item()))


def test_module_in_training_drops_and_accepts_the_closed_interval():
    """``Dropout(p)`` in training mode is ``dropout(x, p, True)`` (same seed, same mask);
    p = 0 and p = 1 are valid (the identity and all zeros), p < 0 is refused."""
    x = torch.randn(2000)
    module = Dropout(0.3).train()
    torch.manual_seed(5)
    y = module(x)
    torch.manual_seed(5)
    assert torch.equal(y, dropout(x, 0.3, True)) and not torch.equal(y, x)
    assert Dropout(0.0).train()(x) is x
    assert torch.count_nonzero(Dropout(1.0).train()(x)) == 0
    with pytest.raises(ValueError, match=r"got -0.1"):
        Dropout(-0.1)


def test_a_probability_below_the_mask_resolution_is_the_identity():
    """p < 2^-17 rounds to no dropped level: x itself, no mask drawn."""
    x = torch.randn(100)
    assert dropout(x, 1e-6, True) is x


def _compiled_dropout(p):
    """dropout(x, p) compiled whole (inductor, as ``--compile-step`` compiles)."""
    return torch.compile(lambda x: dropout(x, p, True), fullgraph=True, dynamic=False)


def test_compiled_dropout_draws_the_eager_mask():
    """Under ``torch.compile`` the mask is the eager CPU mask, drawn by ``sut::keep_mask``
    (not inductor's per-element Philox): with the same seed, compiled == eager exactly."""
    x = torch.randn(300, 64)
    torch.manual_seed(5)
    eager = dropout(x, 0.3, True)
    f = _compiled_dropout(0.3)
    f(x)  # compile (draws once)
    torch.manual_seed(5)
    assert torch.equal(f(x), eager)


def test_compiled_dropout_is_one_graph_with_the_mask_op():
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda x: dropout(x, 0.3, True))(torch.randn(50, 8))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    code = explained.graphs[0].code
    assert "sut.keep_mask" in code and "dropout" not in code.replace("keep_mask", "")


def test_compiled_backward_reuses_the_forward_mask_and_calls_differ():
    """The backward multiplies by the forward's mask (the op is not recomputed, which would
    draw a new mask), and two calls in one graph draw two masks (the op is not merged)."""
    torch.manual_seed(0)
    x = (torch.rand(400, 32) + 0.5).requires_grad_()
    f = _compiled_dropout(0.5)
    y = f(x)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() * 2.0)
    g = torch.compile(lambda x: dropout(x, 0.5, True) - dropout(x, 0.5, True), fullgraph=True)
    assert (g(x.detach()) != 0).float().mean() > 0.3  # ~ 1/2 of the rows differ


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_once_the_product_with_the_exact_scale(dtype):
    """In fp16/bf16 every kept value is x · 2^16 / (2^16 - round(p · 2^16)) computed in float64
    and rounded once to x's dtype, and so is the gradient (upstream times the scale): the scale
    is not first rounded to x's dtype (for p = 0.1 the bf16 scale 1.109375 is 0.16 % off
    1.11112, which changes the rounded product of about a third of these random x)."""
    torch.manual_seed(0)
    x = torch.randn(4096).to(dtype).requires_grad_()
    upstream = torch.randn(4096).to(dtype)
    y = dropout(x, 0.1, True)
    y.backward(upstream)
    kept = y.detach() != 0
    scale = 65536 / (65536 - round(0.1 * 65536))
    expected = (x.detach().double() * scale).to(dtype)
    expected_grad = (upstream.double() * scale).to(dtype)
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert 0.85 < kept.float().mean().item() < 0.95
    assert torch.equal(y.detach()[kept], expected[kept])
    assert torch.equal(x.grad[kept], expected_grad[kept])
    assert torch.count_nonzero(x.grad[~kept]) == 0
    # the test can tell: the product with the rounded scale differs for many of these x
    rounded_scale = (x.detach() * torch.tensor(scale, dtype=dtype))[kept]
    assert (rounded_scale != expected[kept]).float().mean().item() > 0.1


def test_float32_kept_values_are_x_times_the_float32_scale():
    """In fp32 a kept value is x times the scale rounded to fp32 (the product rounded once to
    fp32: the scaled mask autograd keeps holds fp32 values), the gradient likewise."""
    torch.manual_seed(0)
    x = torch.randn(4096, requires_grad=True)
    upstream = torch.randn(4096)
    y = dropout(x, 0.1, True)
    y.backward(upstream)
    kept = y.detach() != 0
    scale32 = torch.tensor(65536 / (65536 - round(0.1 * 65536)), dtype=torch.float32).double()
    torch.testing.assert_close(y.detach()[kept], (x.detach().double() * scale32).float()[kept], rtol=0, atol=0)
    torch.testing.assert_close(x.grad[kept], (upstream.double() * scale32).float()[kept], rtol=0, atol=0)
    assert torch.count_nonzero(x.grad[~kept]) == 0
