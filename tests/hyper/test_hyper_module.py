"""Hyper-modules (``modules/hyper_module.py``) piece by piece against plain references: the
router's scores with an explicit fp32 softmax (per example and per token, half precision),
the composed weights Σ_m s_m W^(m) + g in both bases, dtypes, the initialisation bounds,
the defaults, the example and prefix embeddings against loops, and the refusals. The
layer-level equalities (mixture of module outputs, one weight set per sentence) are
``test_hyper_ut.py``'s."""
import math

import pytest
import torch
import torch.nn.functional as F

from sut_fairseq.modules.hyper_module import (
    HyperLinear,
    HyperRouter,
    example_embedding,
    parse_components,
    prefix_embedding,
)

D = 6


def _layer(M, d_e, in_dim=4, out_dim=5, seed=0, **kw):
    layer = HyperLinear(in_dim, out_dim, D, M, d_e, key_dim=3, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return layer


def _scores(layer, z):
    """s = softmax((W_r LN(z)) Kᵀ / (τ √d_k)) in fp32."""
    r = layer.router
    logits = F.linear(r.query(r.norm(z)), r.keys) / (r.temperature * math.sqrt(r.keys.size(1)))
    return logits.float().softmax(-1)


@pytest.mark.parametrize("M, d_e", [(2, 4), (4, 2)])
def test_composed_weights_are_the_score_weighted_module_matrices(M, d_e):
    """W = Σ_m s_m reshape(G V_m) + g for each example, in either basis (modules when
    M < d_e, the generator otherwise)."""
    layer = _layer(M, d_e).double()
    z = torch.randn(3, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    s = _scores(layer, z).double()
    modules = torch.stack([sum(layer.values[m, j] * layer.generator[j] for j in range(d_e)) for m in range(M)])
    want = torch.einsum("bm,moi->boi", s, modules) + layer.generator_bias
    assert layer.basis == ("modules" if M < d_e else "generator")
    torch.testing.assert_close(layer.module_weights(), modules)
    torch.testing.assert_close(layer.compose(z), want)
    torch.testing.assert_close(layer.compose_transposed(z), want.transpose(1, 2))
    coeff, basis = layer.coefficients_and_basis(z)
    if M < d_e:
        torch.testing.assert_close(coeff, s) and torch.testing.assert_close(basis, modules)
    else:
        torch.testing.assert_close(coeff, s @ layer.values) and torch.testing.assert_close(basis, layer.generator)
    x = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(layer(x, z), torch.einsum("bti,boi->bto", x, want) + layer.bias)


@pytest.mark.parametrize("M, d_e", [(2, 4), (4, 2)])
def test_a_bf16_layer_composes_in_bf16_with_fp32_softmax_scores(M, d_e):
    """A bf16 model (fairseq's --bf16): the scores are the fp32 softmax of the bf16 logits,
    rounded once to bf16; coefficients, basis and weights in bf16; under CPU autocast an
    fp32 layer's output is autocast's bf16 (the parameters need no casts of their own)."""
    layer = _layer(M, d_e).bfloat16()
    z = torch.randn(64, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    s = layer.scores(z)
    r = layer.router
    logits = F.linear(r.query(r.norm(z)), r.keys) * (1.0 / math.sqrt(3))
    assert s.dtype == torch.bfloat16 and torch.equal(s, logits.float().softmax(-1).bfloat16())
    coeff, basis = layer.coefficients_and_basis(z)
    assert coeff.dtype == basis.dtype == layer.compose(z).dtype == torch.bfloat16
    fp32 = _layer(M, d_e)
    x, zf = torch.randn(64, 3, 4), z.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_token = fp32(x, zf), fp32(x, zf.unsqueeze(1).expand(64, 3, D))
    assert y.dtype == y_token.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), fp32(x, zf), rtol=0.05, atol=0.05)
    torch.testing.assert_close(y_token.float(), fp32(x, zf), rtol=0.05, atol=0.05)


def test_per_token_scores_are_a_distribution_over_the_modules():
    """z (B, T, d), one score vector per token: the softmax runs over the modules."""
    layer = _layer(3, 2)
    s = layer.scores(torch.randn(2, 5, D, generator=torch.Generator().manual_seed(4)))
    assert s.shape == (2, 5, 3)
    torch.testing.assert_close(s.sum(-1), torch.ones(2, 5))


def test_defaults_initialisation_and_options():
    """τ = 1, gain 1 and category "other" by default; G ~ U(±gain·a/√d_e) with a the Xavier
    bound of a dense (d_out, d_in) layer (the largest of 16,384 draws within 1 % of it);
    g = b = 0; the temperature reaches the router."""
    layer = HyperLinear(64, 128, D, 2, 2, key_dim=3)
    assert layer.router.temperature == 1.0 and layer.category == "other"
    bound = math.sqrt(6.0 / (64 + 128)) / math.sqrt(2)
    assert 0.99 * bound < layer.generator.abs().max() <= bound
    assert layer.generator_bias.abs().sum() == 0 and layer.bias.abs().sum() == 0
    scaled = HyperLinear(64, 128, D, 2, 2, key_dim=3, gain=0.5, temperature=0.25)
    assert 0.99 * 0.5 * bound < scaled.generator.abs().max() <= 0.5 * bound
    assert scaled.router.temperature == 0.25
    assert HyperRouter(D, 3, 2).temperature == 1.0 and HyperRouter(D, 3, 2).query.bias is None
    HyperLinear(4, 5, D, 1, 1, key_dim=3)                 # the smallest pool and embedding
    assert parse_components(" qkv, ,ffn ") == ("qkv", "ffn")
    assert parse_components(["out", "qkv"]) == ("out", "qkv")


@pytest.mark.parametrize("build, message", [
    (lambda: HyperLinear(4, 5, D, 2, 0, key_dim=3), "hyper embedding width must be >= 1; got 0"),
    (lambda: HyperRouter(D, 3, 0), "a hyper-module needs at least one module; got 0"),
    (lambda: HyperRouter(D, 3, 2, temperature=0.0), "router temperature must be > 0; got 0.0"),
    (lambda: HyperRouter(D, 3, 2, temperature=float("nan")), "router temperature must be > 0; got nan"),
    (lambda: _layer(2, 3)(torch.zeros(2, 3, 4), torch.zeros(2, 4, D)),
     "hyper context (2, 4, 6) fits neither per example nor per token for input (2, 3, 4)"),
])
def test_refusals_whole(build, message):
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value) == message


def test_example_and_prefix_embeddings_against_loops():
    """z = mean of h over the real positions (a row of one real position, a row of none:
    0); the prefix mean over real positions <= t, continued from earlier sums; the counts
    are exact integers."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 4, D, generator=g, dtype=torch.float64)
    real = torch.tensor([[True, False, True, True], [False, False, True, False], [False] * 4])
    z = example_embedding(h, real)
    for b in range(3):
        rows = [h[b, t] for t in range(4) if real[b, t]]
        want = sum(rows) / len(rows) if rows else torch.zeros(D, dtype=torch.float64)
        torch.testing.assert_close(z[b], want)
    prev = (torch.randn(3, D, generator=g, dtype=torch.float64), torch.tensor([2, 0, 1]))
    zp, (sums, counts) = prefix_embedding(h, real, prev)
    for b in range(3):
        total, count = prev[0][b].clone(), int(prev[1][b])
        for t in range(4):
            if real[b, t]:
                total, count = total + h[b, t], count + 1
            torch.testing.assert_close(zp[b, t], total / max(count, 1))
        torch.testing.assert_close(sums[b], total)
        assert counts[b].item() == count
    assert counts.dtype == torch.int64
    _, (_, first) = prefix_embedding(h, real)
    assert first.tolist() == [3, 1, 0] and first.dtype == torch.int64
