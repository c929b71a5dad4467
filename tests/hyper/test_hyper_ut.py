"""Hyper-UT hyper-modules (docs/hyper_ut.md): the composed weights, the example
embeddings of the encoder (per sentence) and the decoder (causal prefix), incremental
decoding, option validation, the MAC count and a training step of ``hyper_ut_cpvr``."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model, randomise_halting, run_incremental
from sut_fairseq.modules.hyper_module import HyperLinear

# hyper_ut_cpvr shrunk: d 32, 2 heads of 8, FFN 48, 4 steps, M 4, d_e 6, d_k 12
SMALL = dict(encoder_embed_dim=32, decoder_embed_dim=32, att_heads=2, att_head_dim=8,
             ffd_hidden_dim=48, encoder_layers=4, decoder_layers=4, hyper_modules=4,
             hyper_embed_dim=6, hyper_key_dim=12)


def small_model(seed=0, dtype=torch.float64, **overrides):
    model = make_model("hyper_ut_cpvr", dict_size=40, seed=seed, **{**SMALL, **overrides})
    randomise_halting(model, seed=seed + 5)
    _randomise_hyper(model, seed=seed + 7)
    return model.to(dtype)


def _randomise_hyper(model, seed):
    """Non-zero g and b and sharper routers, so that every term of W matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, HyperLinear):
                m.generator_bias.copy_(torch.randn(m.generator_bias.shape, generator=g) * 0.1)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
                m.router.keys.mul_(3.0)


def _layer(M, d_in=5, d_out=7, ctx=6, d_e=4, d_k=3, seed=0):
    torch.manual_seed(seed)
    layer = HyperLinear(d_in, d_out, ctx, M, d_e, d_k, temperature=0.7).double()
    with torch.no_grad():
        layer.generator_bias.normal_()
        layer.bias.normal_()
    return layer


# ---- 1, 2: the composition --------------------------------------------------------------

def test_single_module_is_a_dense_layer():
    layer = _layer(M=1)
    x, z = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    W = torch.einsum("e,eoi->oi", layer.values[0], layer.generator) + layer.generator_bias
    expected = x @ W.T + layer.bias
    torch.testing.assert_close(layer(x, z), expected, atol=1e-12, rtol=1e-12)
    z_tok = torch.randn(3, 4, 6, dtype=torch.float64)
    torch.testing.assert_close(layer(x, z_tok), expected, atol=1e-12, rtol=1e-12)
    assert torch.equal(layer.scores(z), torch.ones(3, 1, dtype=torch.float64))


def _loop_reference(layer, x, z):
    """Σ_m s_m x W^(m)ᵀ + x gᵀ + b with an explicit loop over modules (x, z with the same
    leading shape), W^(m) = Σ_j V[m, j] G^(j), s from the router written out."""
    r = layer.router
    q = F.layer_norm(z, z.shape[-1:], r.norm.weight, r.norm.bias, r.norm.eps) @ r.query.weight.T
    s = torch.softmax(q @ r.keys.T / (r.temperature * math.sqrt(r.keys.size(1))), -1)
    y = x @ layer.generator_bias.T + layer.bias
    for m in range(layer.num_modules):
        W_m = sum(layer.values[m, j] * layer.generator[j] for j in range(layer.embed_dim))
        y = y + s[..., m:m + 1] * (x @ W_m.T)
    return y


def _assert_same_gradients(y, ref, wrt):
    w = torch.randn_like(y)
    for g, g_ref in zip(torch.autograd.grad((y * w).sum(), wrt, retain_graph=True),
                        torch.autograd.grad((ref * w).sum(), wrt, retain_graph=True)):
        torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("M, basis", [(3, "modules"), (5, "generator")])  # d_e = 4
def test_output_is_the_mixture_of_module_outputs_per_example(M, basis):
    layer = _layer(M=M)
    assert layer.basis == basis  # the factoring of W with min(M, d_e) terms
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    z = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    y, ref = layer(x, z), _loop_reference(layer, x, z[:, None, :].expand(3, 4, 6))
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    _assert_same_gradients(y, ref, [x, z, *layer.parameters()])
    with torch.no_grad():
        assert not torch.allclose(layer.scores(z)[0], layer.scores(z)[1])  # the mix differs


@pytest.mark.parametrize("M, basis", [(3, "modules"), (5, "generator")])  # d_e = 4
def test_output_is_the_mixture_of_module_outputs_per_token(M, basis):
    layer = _layer(M=M)
    assert layer.basis == basis  # the factoring of W with min(M, d_e) terms
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    z = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    y, ref = layer(x, z), _loop_reference(layer, x, z)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    _assert_same_gradients(y, ref, [x, z, *layer.parameters()])  # every input and parameter
    x, z = x.detach(), z.detach()
    layer32 = _layer(M=M).float()
    with torch.no_grad():
        torch.testing.assert_close(layer32(x.float(), z.float()),
                                   _loop_reference(layer32, x.float(), z.float()), atol=1e-5, rtol=1e-5)


# ---- 3: encoder example embedding -------------------------------------------------------

def _record_hyper_calls(model):
    calls = []
    handles = [m.register_forward_hook(lambda mod, inp, out: calls.append((mod, inp[0], inp[1], out)))
               for m in model.encoder.modules() if isinstance(m, HyperLinear)]
    return calls, handles


def _explicit_weight(layer, z):
    """W = Σ_m s_m W^(m) + g for one example embedding z (d,), everything written out:
    s = softmax((W_r LN(z)) Kᵀ / (τ √d_k)), W^(m) = Σ_j V[m, j] G^(j). Returns (d_out, d_in)."""
    r = layer.router
    q = F.layer_norm(z, z.shape[-1:], r.norm.weight, r.norm.bias, r.norm.eps) @ r.query.weight.T
    s = torch.softmax(q @ r.keys.T / (r.temperature * math.sqrt(r.keys.size(1))), -1)
    W = layer.generator_bias.clone()
    for m in range(layer.num_modules):
        W = W + s[m] * sum(layer.values[m, j] * layer.generator[j] for j in range(layer.embed_dim))
    return W


def test_encoder_weights_are_one_set_per_sentence():
    """Every hyper-linear call of the encoder applies, to every position of sentence b
    (padding included), the one weight set W_b composed from that sentence's z_b, and z_b
    is the masked mean of the step's input h over the sentence's real positions."""
    model = small_model()
    src = torch.randint(4, 40, (3, 6), generator=torch.Generator().manual_seed(0))
    src[1, :2] = 1
    real = src.ne(1)
    calls, handles = _record_hyper_calls(model)
    block_inputs = []
    handles.append(model.encoder.side.block.register_forward_pre_hook(
        lambda mod, args, kwargs: block_inputs.append((args[0], kwargs["hyper_z"])), with_kwargs=True))
    with torch.no_grad():
        model.encoder(src)
        for h in handles:
            h.remove()
        assert len(calls) == 6 * 4  # q, k, v, out, fc1, fc2 at each of the 4 steps
        assert len(block_inputs) == 4
        for h, z in block_inputs:  # z_l: the masked mean of h_{l-1}, sentence by sentence
            for b in range(3):
                torch.testing.assert_close(z[b], h[b][real[b]].mean(0), atol=1e-12, rtol=1e-12)
        zs = [z for _, z in block_inputs]
        for layer, x, z, y in calls:
            assert z.shape == (3, 32)  # one example embedding per sentence and step
            assert any(z is step_z for step_z in zs)
            for b in range(3):
                W = _explicit_weight(layer, z[b])
                torch.testing.assert_close(y[b], x[b] @ W.T + layer.bias, atol=1e-10, rtol=1e-10)
            W0, W1 = _explicit_weight(layer, z[0]), _explicit_weight(layer, z[1])
            assert not torch.allclose(W0, W1), "the test needs sentences with different weights"


def reference_hyper_encoder(model, src):
    """A plain loop for ``--encoder-halting none``: h_0 = scaled embedding + positions;
    z_l = masked mean of h_{l-1} over the real positions (B, d), recomputed at every step;
    h_l = Block(h_{l-1}, keys/values of h_{l-1}, z_l). Returns S_L (B, S, d)."""
    enc = model.encoder
    pad = src.eq(enc.padding_idx)
    w = (~pad).unsqueeze(-1).to(torch.float64)
    h = enc.side.embed_scale * enc.side.embed_tokens(src) + enc.side.embed_positions(src).to(torch.float64)
    for _ in range(enc.side.num_steps):
        z = (h * w).sum(1) / w.sum(1)
        k, v = enc.side.block.self_kv(h, z)
        h = enc.side.block(h, k, v, ~pad, self_padding_mask=pad, hyper_z=z)
    return h if enc.side.final_norm is None else enc.side.final_norm(h)


def reference_hyper_decoder(model, prev, enc_out):
    """A plain loop for ``--decoder-halting none``: z_{t,l} = mean of h_{l-1} over the real
    positions <= t (B, T, d), recomputed at every step; h_l = Block(h_{l-1}, causal
    keys/values of h_{l-1} under z_l, the encoder output, z_l). Returns the logits."""
    dec = model.decoder
    pad = prev.eq(dec.padding_idx)
    w = (~pad).unsqueeze(-1).to(torch.float64)
    h = dec.side.embed_scale * dec.side.embed_tokens(prev) + dec.side.embed_positions(prev).to(torch.float64)
    cross_k, cross_v = dec.side.block.cross_kv(enc_out["encoder_out"][0].transpose(0, 1))
    for _ in range(dec.side.num_steps):
        z = torch.stack([(h[:, : t + 1] * w[:, : t + 1]).sum(1) / w[:, : t + 1].sum(1).clamp_min(1)
                         for t in range(prev.size(1))], 1)
        k, v = dec.side.block.self_kv(h, z)
        h = dec.side.block(h, k, v, ~pad, self_padding_mask=pad, cross_k=cross_k, cross_v=cross_v,
                      cross_padding_mask=enc_out["encoder_padding_mask"][0], hyper_z=z)
    return dec.output_layer(h if dec.side.final_norm is None else dec.side.final_norm(h))


@pytest.mark.parametrize("components", ["qkv,out,ffn", "ffn"])
def test_example_embeddings_follow_the_state_of_every_step(components):
    """Encoder and decoder (teacher-forced and incremental) against the plain loops, so
    z must be recomputed from h_{l-1} at each step (z from h_0 at every step differs)."""
    model = small_model(seed=8, hyper_components=components, encoder_halting="none",
                        decoder_halting="none")
    src, prev = _decoder_inputs(seed=8)
    prev[2, :2] = 1  # a left-padded target
    real_src, real_tgt = src.ne(1), prev.ne(1)
    with torch.no_grad():
        enc = model.encoder(src)
        torch.testing.assert_close(enc["encoder_out"][0].transpose(0, 1)[real_src],
                                   reference_hyper_encoder(model, src)[real_src], atol=1e-9, rtol=1e-9)
        expected = reference_hyper_decoder(model, prev, enc)
        full, _ = model.decoder(prev, enc)
        inc, _, _ = run_incremental(model, enc, prev)
    torch.testing.assert_close(full[real_tgt], expected[real_tgt], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(inc[real_tgt], expected[real_tgt], atol=1e-9, rtol=1e-9)


def test_encoder_output_ignores_padding_and_batch_mates():
    model = small_model(seed=1)
    g = torch.Generator().manual_seed(0)
    sent = torch.randint(4, 40, (1, 5), generator=g)
    others = torch.randint(4, 40, (2, 7), generator=g)
    pad = torch.ones(1, 2, dtype=sent.dtype)
    with torch.no_grad():
        alone = model.encoder(sent)["encoder_out"][0][:, 0]  # (5, d)
        left = model.encoder(torch.cat([pad, sent], 1))["encoder_out"][0][2:, 0]
        right = model.encoder(torch.cat([sent, pad], 1))["encoder_out"][0][:5, 0]
        batch = torch.cat([others, torch.cat([pad, sent], 1)], 0)
        batched = model.encoder(batch)["encoder_out"][0][2:, 2]
        steps = model.encoder(batch)["halting"][0].steps
    for other in (left, right, batched):
        torch.testing.assert_close(other, alone, atol=1e-6, rtol=0)
    assert steps[steps > 0].unique().numel() > 1, "the test needs positions that halt at different steps"


# ---- 4, 5: decoder ----------------------------------------------------------------------

def _decoder_inputs(seed=0, B=3, S=6, T=7):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    src[1, :2] = 1
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    return src, prev


def test_decoder_is_causal():
    model = small_model(seed=2)
    src, prev = _decoder_inputs()
    changed = prev.clone()
    changed[:, 4] = (changed[:, 4] - 4 + 7) % 36 + 4
    with torch.no_grad():
        enc = model.encoder(src)
        a, _ = model.decoder(prev, enc, features_only=True)
        b, _ = model.decoder(changed, enc, features_only=True)
    torch.testing.assert_close(b[:, :4], a[:, :4], atol=1e-10, rtol=0)
    assert (b[:, 4:] - a[:, 4:]).abs().max() > 1e-3




@pytest.mark.parametrize("halting,threshold", [("act", 0.99), ("act", 0.6), ("none", 0.99),
                                               ("global-mean", 0.6), ("stick-breaking", 0.6),
                                               ("pabee", 0.99)])
def test_incremental_equals_full_forward(halting, threshold):
    extra_options = {"exit_patience": 1} if halting == "pabee" else {}  # exits from step 2
    model = small_model(seed=3, dtype=torch.float32, decoder_halting=halting,
                        halting_threshold=threshold, **extra_options)
    src, prev = _decoder_inputs(seed=3)
    prev[2, :2] = 1  # a left-padded target (--left-pad-target)
    with torch.no_grad():
        enc = model.encoder(src)
        full, extra = model.decoder(prev, enc)
        inc, steps, _ = run_incremental(model, enc, prev)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    assert torch.equal(steps, extra["halting_decoder"].steps)
    if halting == "pabee" or (halting != "none" and threshold < 0.99):
        assert (steps[prev.ne(1)] < 4).any(), "the test needs positions that halt early"
        assert (steps.max(0).values < 4).any(), "the test needs whole-batch early exits"


@pytest.mark.parametrize("halting", ["act", "none", "global-mean"])
def test_incremental_equals_full_forward_after_beam_reordering(halting):
    """Under beam reordering the cache's hyper prefix sums (every rule) and the halting
    rule's own prefix sums (global-mean) follow their hypotheses."""
    model = small_model(seed=4, dtype=torch.float32, decoder_halting=halting,
                        halting_threshold=0.6)
    src, prev = _decoder_inputs(seed=4)
    reorder = torch.tensor([2, 0, 0])
    with torch.no_grad():
        enc = model.encoder(src)
        inc, _, final_prev = run_incremental(model, enc, prev, reorder=reorder)
        order = torch.arange(3)
        for _ in range(prev.size(1) - 1):
            order = order.index_select(0, reorder)
        full, _ = model.decoder(final_prev, model.encoder.reorder_encoder_out(enc, order))
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


# ---- 6: options -------------------------------------------------------------------------

_DENSE = "is invalid: --hyper-modules 4 needs dense experts: E = k = 1 (hyper-modules replace expert routing)"


@pytest.mark.parametrize("overrides,message", [
    (dict(att_experts=4, att_topk=2), f"--att-experts=4 {_DENSE}"),
    (dict(att_experts=2), f"--att-experts=2 {_DENSE}"),
    (dict(ffd_experts=3), f"--ffd-experts=3 {_DENSE}"),
    (dict(ffd_experts=3, ffd_topk=2), f"--ffd-experts=3 {_DENSE}"),
    (dict(hyper_components="qkv,mlp"),
     "--hyper-components='qkv,mlp' is invalid: unknown component(s) mlp; choose a comma list from "
     "('qkv', 'out', 'ffn')"),
    (dict(hyper_components="qkv,mlp,attn"),
     "--hyper-components='qkv,mlp,attn' is invalid: unknown component(s) mlp, attn; choose a comma list "
     "from ('qkv', 'out', 'ffn')"),
    (dict(hyper_components=","),
     "--hyper-components=',' is invalid: --hyper-modules 4 needs at least one of ('qkv', 'out', 'ffn')"),
    (dict(hyper_modules=-1), "--hyper-modules=-1 is invalid: must be an integer >= 0 (0 = off)"),
    (dict(hyper_embed_dim=0), "--hyper-embed-dim=0 is invalid: must be a positive integer"),
    (dict(hyper_router_temp=0.0), "--hyper-router-temp=0.0 is invalid: must be a finite number > 0"),
    (dict(hyper_router_temp=-1.0), "--hyper-router-temp=-1.0 is invalid: must be a finite number > 0"),
    (dict(hyper_router_temp=float("inf")), "--hyper-router-temp=inf is invalid: must be a finite number > 0"),
    (dict(hyper_key_dim=-2), "--hyper-key-dim=-2 is invalid: must be an integer >= 0 (0 = the model width)"),
    (dict(rel_pos="clipped"),
     "--rel-pos='clipped' is invalid: --hyper-modules 4 supports only 'none' (the hyper self-attention "
     "has no relative position term)"),
    (dict(encoder_step_embedding="timestep"),
     "--encoder-step-embedding='timestep' is invalid: --hyper-modules 4 supports only 'none'"),
    (dict(decoder_step_embedding="coordinate"),
     "--decoder-step-embedding='coordinate' is invalid: --hyper-modules 4 supports only 'none'"),
])
def test_invalid_hyper_options_are_rejected(overrides, message):
    with pytest.raises(ValueError) as err:
        make_model("hyper_ut_cpvr", dict_size=40, **{**SMALL, **overrides})
    assert str(err.value) == message


def test_bad_component_is_rejected_even_when_off():
    with pytest.raises(ValueError, match=r"unknown component\(s\) attn"):
        make_model("ut_cpvr", dict_size=40, hyper_components="attn", **{
            k: v for k, v in SMALL.items() if not k.startswith("hyper")})


@pytest.mark.parametrize("components", ["ffn", "out", "qkv", "qkv,ffn"])
def test_component_subsets(components):
    model = small_model(seed=5, dtype=torch.float32, hyper_components=components,
                        decoder_halting="act", halting_threshold=0.6)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, HyperLinear)}
    expected = {"qkv": {"q_proj", "k_proj", "v_proj"}, "out": {"out_proj"}, "ffn": {"fc1", "fc2"}}
    assert names == set().union(*(expected[c] for c in components.split(",")))
    assert not any(isinstance(m, HyperLinear) for m in model.decoder.side.block.cross_attn.modules())
    src, prev = _decoder_inputs(seed=5)
    with torch.no_grad():
        enc = model.encoder(src)
        full, _ = model.decoder(prev, enc)
        inc, _, _ = run_incremental(model, enc, prev)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def test_presets():
    from sut_fairseq.models.standalone import model_args

    for arch, modules in (("hyper_ut_cpvr", 8), ("ut_cpvr", 0)):
        a = model_args(arch, share_all_embeddings=True)
        from sut_fairseq.models.architectures import PRESETS
        PRESETS[arch](a)
        assert (a.encoder_embed_dim, a.decoder_embed_dim, a.att_heads, a.att_head_dim) == (64, 64, 4, 16)
        assert (a.att_experts, a.att_topk, a.ffd_experts, a.ffd_topk, a.ffd_hidden_dim) == (1, 1, 1, 1, 256)
        assert (a.encoder_layers, a.decoder_layers) == (16, 16)
        assert (a.encoder_halting, a.decoder_halting, a.halting_threshold) == ("act", "act", 0.99)
        assert a.encoder_normalize_before and a.decoder_normalize_before
        assert (a.rel_pos, a.dropout, a.hyper_modules) == ("none", 0.1, modules)
        if modules:
            assert (a.hyper_embed_dim, a.hyper_components) == (32, "qkv,out,ffn")


# ---- MACs -------------------------------------------------------------------------------

def _router(layer, rows):
    ctx, d_k = layer.router.query.in_features, layer.router.query.out_features
    return rows * (ctx + ctx * d_k + layer.num_modules * d_k + layer.num_modules * layer.embed_dim)


def test_macs_of_a_hyper_linear_match_a_hand_count():
    from sut_fairseq.analysis.macs import count_call

    x, z, zt = torch.randn(2, 9, 5), torch.randn(2, 6), torch.randn(2, 9, 6)
    # M 5 >= d_e 4: the generator basis, coefficients e = s V
    layer = HyperLinear(5, 7, 6, num_modules=5, embed_dim=4, key_dim=2).eval()
    assert layer.basis == "generator"
    c = count_call(layer, lambda: layer(x, z))
    # router: LN 6 + W_r 6·2 + keys 5·2 + values 5·4 = 48 per z
    assert c.parts["router"] == 2 * 48
    assert c.parts["hyper"] == 2 * (4 * 7 * 5 + 7 * 5)  # generator + g, per sentence
    assert c.other == 18 * (35 + 7)  # x Wᵀ + b per token (category of a standalone layer)
    assert c.total == 2 * 48 + 2 * 175 + 18 * (35 + 7)
    c = count_call(layer, lambda: layer(x, zt))
    assert c.parts["router"] == 18 * 48
    assert c.parts["hyper"] == 18 * (5 * 4 * 7 + 4 * 7)  # d_e-fold projection + contraction
    assert c.total == 18 * 48 + 18 * (140 + 28) + 18 * (35 + 7)
    # M 3 < d_e 4: the module basis, W^(m) = G V_m composed once per call (3·4·7·5 = 420),
    # coefficients s: the router computes no e = s V
    layer = HyperLinear(5, 7, 6, num_modules=3, embed_dim=4, key_dim=2).eval()
    assert layer.basis == "modules"
    c = count_call(layer, lambda: layer(x, z))
    assert c.parts["router"] == 2 * (6 + 12 + 6)
    assert c.parts["hyper"] == 420 + 2 * (3 * 7 * 5 + 7 * 5)  # W^(m); Σ_m s_m W^(m) + g, per sentence
    assert c.total == 2 * 24 + 420 + 2 * 140 + 18 * (35 + 7)
    c = count_call(layer, lambda: layer(x, zt))
    assert c.parts["router"] == 18 * (6 + 12 + 6)
    assert c.parts["hyper"] == 420 + 18 * (5 * 3 * 7 + 3 * 7)  # W^(m); 3-fold projection + contraction
    assert c.total == 18 * 24 + 420 + 18 * 126 + 18 * (35 + 7)


@pytest.mark.parametrize("d_e", [2, 5])  # M = 3: the generator basis, the module basis
def test_macs_of_the_hyper_encoder_and_decoder_match_a_hand_count(d_e):
    from sut_fairseq.analysis.macs import count_call

    torch.manual_seed(0)
    model = make_model("hyper_ut_cpvr", dict_size=40, encoder_embed_dim=8, decoder_embed_dim=8,
                       att_heads=2, att_head_dim=3, ffd_hidden_dim=10, encoder_layers=2,
                       decoder_layers=3, hyper_modules=3, hyper_embed_dim=d_e, hyper_key_dim=5,
                       encoder_halting="none", decoder_halting="none")
    S, T, d, inner, D_ff, H, Dh, Le, Ld, M = 4, 3, 8, 6, 10, 2, 3, 2, 3, 3
    src = torch.randint(4, 40, (1, S))
    prev = torch.randint(4, 40, (1, T))
    maps = [(d, inner), (d, inner), (d, inner), (inner, d), (d, D_ff), (D_ff, d)]  # q k v o fc1 fc2
    modules = M < d_e
    r = M if modules else d_e  # terms of W's factoring
    # per example embedding: LN, W_r, keys (and the mixture e = s V in the generator basis)
    router = d + d * 5 + M * 5 + (0 if modules else M * d_e)
    # per call: the module matrices W^(m) = G V_m (module basis only)
    compose = sum(M * d_e * d_o * d_i for d_i, d_o in maps) if modules else 0
    per_token = [(d_i * d_o + d_o) for d_i, d_o in maps]

    enc = count_call(model, lambda: model.encoder(src))
    assert enc.parts["router"] == Le * 6 * router
    assert enc.parts["hyper"] == Le * (compose + sum(r * d_o * d_i + d_o * d_i for d_i, d_o in maps))
    assert enc.parts["att_proj"] == Le * S * (per_token[0] + per_token[3])
    assert enc.parts["kv"] == Le * S * (per_token[1] + per_token[2])
    assert enc.parts["ffd"] == Le * S * (per_token[4] + per_token[5])
    assert enc.parts["att_core"] == Le * S * H * (S * Dh + S + S * Dh)
    # the rest: pre-LN LayerNorms (1 per element): h and S before attention, FFN input, final
    assert enc.other == Le * 3 * S * d + S * d

    with torch.no_grad():
        enc_out = model.encoder(src)
    dec = count_call(model, lambda: model.decoder(prev, enc_out))
    assert dec.parts["router"] == Ld * 6 * T * router
    assert dec.parts["hyper"] == Ld * (compose + T * sum(d_i * r * d_o + r * d_o for d_i, d_o in maps))
    assert dec.parts["ffd"] == Ld * T * (per_token[4] + per_token[5])


# ---- 7: end to end ----------------------------------------------------------------------

def test_hyper_ut_cpvr_trains_one_step_with_gradients_on_every_hyper_parameter():
    from types import SimpleNamespace

    from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
        SUTLabelSmoothedCrossEntropyCriterion,
    )
    from sut_fairseq.models.standalone import build_model

    torch.manual_seed(0)  # fairseq's argument parsing, the preset, then the overrides
    model = build_model("hyper_ut_cpvr", dict_size=40, share_all_embeddings=True,
                        encoder_layers=3, decoder_layers=3, hyper_embed_dim=4, hyper_modules=3,
                        ffd_hidden_dim=32)
    assert model.encoder.side.block.hyper and model.decoder.side.block.hyper
    assert model.encoder.side.num_steps == model.decoder.side.num_steps == 3
    assert model.encoder.side.halting.rule == model.decoder.side.halting.rule == "act"
    criterion = SUTLabelSmoothedCrossEntropyCriterion(
        SimpleNamespace(target_dictionary=model.decoder.dictionary), False, 0.1,
        mim_weight=0.0, act_weight=0.1)
    g = torch.Generator().manual_seed(1)
    B, S, T = 4, 9, 3
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    sample = {"net_input": {"src_tokens": torch.randint(4, 40, (B, S), generator=g),
                            "src_lengths": torch.full((B,), S), "prev_output_tokens": prev},
              "target": torch.cat([prev[:, 1:], torch.full((B, 1), 2)], 1), "ntokens": B * T}
    hyper = {n: p for n, p in model.named_parameters()
             if any(n.startswith(m + ".") for m, mod in model.named_modules()
                    if isinstance(mod, HyperLinear))}
    assert len(hyper) == 2 * 6 * 8  # 2 sides × 6 maps × (LN w, b, W_r, K, V, G, g, b)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(2):
        opt.zero_grad()
        loss, _, _ = criterion(model, sample)
        assert torch.isfinite(loss)
        loss.backward()
        for name, p in hyper.items():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
        opt.step()


def test_gated_ffn_combines_with_hyper_modules():
    model = small_model(seed=6, dtype=torch.float32, gated_ffn=True, decoder_halting="act",
                        halting_threshold=0.6)
    assert model.decoder.side.block.gate is not None
    src, prev = _decoder_inputs(seed=6)
    with torch.no_grad():
        enc = model.encoder(src)
        full, _ = model.decoder(prev, enc)
        inc, _, _ = run_incremental(model, enc, prev)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def test_expert_report_finds_no_router_in_a_hyper_model():
    """Hyper-modules route no tokens: the expert report's router list is empty (its command
    line then stops with a clear error instead of failing inside a hook)."""
    from sut_fairseq.analysis.expert_report import routers

    assert routers(small_model()) == {}
    assert set(routers(make_model("sut_tiny", dict_size=40))) >= {"encoder self-attn", "encoder FFD"}
