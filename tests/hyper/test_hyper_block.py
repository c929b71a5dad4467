"""Hyper-UT's sub-layers (``modules/hyper_block.py``) against plain references: the
self-attention head by head with an explicit softmax (dense and hyper projections, causal
from a query offset, padding), the feed-forward network, the dense layers' Xavier gains,
the options read from the command line, the defaults and the refusal. The models that use
them are ``test_hyper_ut.py``'s."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import randomise_parameters as _randomise

from sut_fairseq.modules.hyper_block import (
    HyperConfig,
    HyperFeedForward,
    HyperSelfAttention,
    apply_linear,
)
from sut_fairseq.modules.hyper_module import HyperLinear

D_MODEL, H, D_HEAD = 8, 2, 3


def _config(components="qkv,out,ffn", modules=3):
    return HyperConfig(modules, 4, 5, 1.0, components)


def _linear(layer, x, z):
    """A dense layer's x Wᵀ + b, or a hyper-module's with the weights it composes from z
    (per example: z (B, d) for x (B, T, d_in))."""
    if not isinstance(layer, HyperLinear):
        return x @ layer.weight.t() + layer.bias
    W = layer.compose(z)                                          # (B, d_out, d_in)
    return torch.einsum("bti,boi->bto", x, W) + layer.bias


def attention_reference(attn, query, kv, z, q_start=0, padding=None):
    """softmax(q·k / sqrt(D)) v per head, query row t at position q_start + t seeing keys
    s <= q_start + t when causal and no padding key, then the output projection."""
    B, T, _ = query.shape
    S = kv.size(1)
    q, k, v = _linear(attn.q_proj, query, z), _linear(attn.k_proj, kv, z), _linear(attn.v_proj, kv, z)
    out = torch.zeros(B, T, H * D_HEAD, dtype=query.dtype)
    for b in range(B):
        for h in range(H):
            cols = slice(h * D_HEAD, (h + 1) * D_HEAD)
            for t in range(T):
                scores = q[b, t, cols] @ k[b, :, cols].t() / math.sqrt(D_HEAD)
                hidden = torch.zeros(S, dtype=torch.bool)
                if attn.causal:
                    hidden |= torch.arange(S) > q_start + t
                if padding is not None:
                    hidden |= padding[b]
                out[b, t, cols] = torch.softmax(scores.masked_fill(hidden, float("-inf")), 0) @ v[b, :, cols]
    return _linear(attn.out_proj, out, z)


@pytest.mark.parametrize("components", ["qkv,out", "qkv", "out", "ffn"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_against_a_per_head_softmax(components, causal):
    attn = _randomise(HyperSelfAttention(D_MODEL, H, D_HEAD, _config(components), causal=causal))
    g = torch.Generator().manual_seed(1)
    B, T, S = 2, 2, 5
    query = torch.randn(B, T, D_MODEL, generator=g, dtype=torch.float64)
    kv = torch.randn(B, S, D_MODEL, generator=g, dtype=torch.float64)
    z = torch.randn(B, D_MODEL, generator=g, dtype=torch.float64)
    padding = torch.tensor([[True, False, False, False, False], [False, False, False, False, False]])
    k, v = attn.project_kv(kv, z)
    assert k.shape == v.shape == (B, H, S, D_HEAD)
    active = torch.ones(B, T, dtype=torch.bool)
    got = attn(query, k, v, active, key_padding_mask=padding, q_start=2, z=z)
    torch.testing.assert_close(got, attention_reference(attn, query, kv, z, q_start=2, padding=padding))
    if causal:      # the default query offset is 0
        torch.testing.assert_close(attn(query, k, v, active, z=z), attention_reference(attn, query, kv, z))


def test_self_attention_defaults_and_dtypes(monkeypatch):
    """Not causal and no attention dropout by default; keys/values kept in fp32 read by
    bf16 queries are cast to bf16, and so is the additive mask SDPA receives."""
    attn = HyperSelfAttention(D_MODEL, H, D_HEAD, _config())
    assert attn.causal is False and attn.attention_dropout == 0.0 and attn.hyper_kv is True
    seen = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, attn_mask.dtype, kw.get("dropout_p")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    g = torch.Generator().manual_seed(2)
    kv, z = torch.randn(1, 3, D_MODEL, generator=g), torch.randn(1, D_MODEL, generator=g)
    k, v = attn.project_kv(kv, z)
    attn.train().bfloat16()(torch.randn(1, 2, D_MODEL, generator=g).bfloat16(), k, v, None,
                            key_padding_mask=torch.tensor([[False, True, False]]), z=z.bfloat16())
    assert seen == [(torch.bfloat16,) * 4 + (0.0,)]


def test_attention_dropout_only_in_training():
    attn = _randomise(HyperSelfAttention(D_MODEL, H, D_HEAD, _config(), attention_dropout=0.5))
    g = torch.Generator().manual_seed(3)
    query, kv = torch.randn(2, 3, D_MODEL, generator=g, dtype=torch.float64), torch.randn(2, 4, D_MODEL, generator=g, dtype=torch.float64)
    z = torch.randn(2, D_MODEL, generator=g, dtype=torch.float64)
    k, v = attn.project_kv(kv, z)
    evaluated = attn(query, k, v, None, z=z)
    torch.testing.assert_close(evaluated, attention_reference(attn, query, kv, z))
    torch.manual_seed(0)
    assert not torch.allclose(attn.train()(query, k, v, None, z=z), evaluated)


def test_the_causal_mask_is_made_on_the_queries_device():
    attn = HyperSelfAttention(D_MODEL, H, D_HEAD, _config("out"), causal=True).to("meta")
    query, kv = torch.empty(2, 3, D_MODEL, device="meta"), torch.empty(2, 3, D_MODEL, device="meta")
    k, v = attn.project_kv(kv)
    out = attn(query, k, v, None, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool, device="meta"),
               z=torch.empty(2, D_MODEL, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3, D_MODEL)


def test_feed_forward_is_fc2_act_fc1():
    """Dense or hyper maps; ReLU and no dropout by default; dropout only in training."""
    g = torch.Generator().manual_seed(4)
    x, z = torch.randn(2, 3, D_MODEL, generator=g, dtype=torch.float64), torch.randn(2, D_MODEL, generator=g, dtype=torch.float64)
    for components in ("ffn", "qkv"):
        ffn = _randomise(HyperFeedForward(D_MODEL, 6, _config(components)))
        assert isinstance(ffn.fc1, HyperLinear) == (components == "ffn")
        want = _linear(ffn.fc2, torch.relu(_linear(ffn.fc1, x, z)), z)
        torch.testing.assert_close(ffn(x, None, z), want)
        torch.testing.assert_close(ffn.train()(x, None, z), want)          # no dropout by default
    gelu = _randomise(HyperFeedForward(D_MODEL, 6, _config(), activation_fn="gelu", activation_dropout=0.5))
    # fairseq's gelu runs in fp32
    torch.testing.assert_close(gelu(x, None, z), _linear(gelu.fc2, F.gelu(_linear(gelu.fc1, x, z)), z),
                               rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    assert not torch.allclose(gelu.train()(x, None, z), gelu.eval()(x, None, z))


def test_a_hyper_module_without_z_is_refused_and_a_dense_one_ignores_it():
    config = _config()
    hyper, dense = config.linear(4, 5, D_MODEL, True), config.linear(4, 5, D_MODEL, False)
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError) as err:
        apply_linear(hyper, x, None)
    assert str(err.value) == "a hyper-module needs the step's example embedding z"
    torch.testing.assert_close(apply_linear(dense, x, torch.randn(2, D_MODEL)), dense(x))


def test_options_from_the_command_line():
    args = SimpleNamespace(hyper_modules=1, hyper_embed_dim=6, hyper_key_dim=0, hyper_router_temp=0.5,
                           hyper_components="qkv, ffn")
    config = HyperConfig.from_args(args)
    assert (config.num_modules, config.embed_dim, config.key_dim, config.temperature,
            config.components) == (1, 6, 0, 0.5, ("qkv", "ffn"))
    assert HyperConfig.from_args(SimpleNamespace(**{**vars(args), "hyper_modules": 0})) is None
    layer = config.linear(4, 5, D_MODEL, True)          # key_dim 0: the router's keys are d wide
    assert layer.router.keys.shape == (1, D_MODEL) and layer.category == "other"


def test_dense_and_hyper_layers_start_with_their_gains():
    """Dense: Xavier-uniform with the gain (1 by default; 2^-1/2 for keys and values, as
    the dense MoMHA), zero bias. Hyper: each module matrix's bound scaled alike (HyperLinear
    takes the gain)."""
    config = _config("out")
    for gain, layer in ((1.0, config.linear(64, 128, D_MODEL, False)),
                        (0.5, config.linear(64, 128, D_MODEL, False, gain=0.5))):
        bound = gain * math.sqrt(6 / (64 + 128))
        assert 0.99 * bound < layer.weight.abs().max() <= bound and torch.equal(layer.bias, torch.zeros(128))
    attn = HyperSelfAttention(64, 4, 32, config)      # dense q, k, v; hyper out
    for proj, gain in ((attn.q_proj, 1.0), (attn.k_proj, 2 ** -0.5), (attn.v_proj, 2 ** -0.5)):
        bound = gain * math.sqrt(6 / (64 + 128))
        assert 0.99 * bound < proj.weight.abs().max() <= bound
    hyper = HyperSelfAttention(64, 4, 32, _config("qkv"))
    for proj, gain in ((hyper.q_proj, 1.0), (hyper.k_proj, 2 ** -0.5), (hyper.v_proj, 2 ** -0.5)):
        bound = gain * math.sqrt(6 / (64 + 128)) / math.sqrt(4)          # d_e = 4
        assert 0.99 * bound < proj.generator.abs().max() <= bound
    assert (hyper.q_proj.category, hyper.k_proj.category) == ("att_proj", "kv")
