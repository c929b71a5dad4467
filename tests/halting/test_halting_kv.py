"""``--encoder-halting-kv`` / ``--decoder-halting-kv`` (docs/model.md#keys-and-values): the
self-attention keys and values of step l come from the halted mixture S_{l-1}
(``mixture``, the default: the SUT paper's Fig. 3, Algorithm 1 of the GUT paper) or from
the un-halted states h_{l-1} (``state``: GUT's Algorithm 3, GUTLB's Algorithm 4).

Against a per-step loop written here (float64, every weight random), in the encoder and
the decoder, under stick-breaking and global-mean halting; the two options differ once a
position holds halted mass; ``state`` runs the same in the compiled step's modules, the
chunked recurrence and incremental decoding; the default and the checkpoints of models
built before the option are unchanged.
"""
import copy

import pytest
import torch

from conftest import make_model, randomise_halting, randomise_parameters, run_incremental
from sut_fairseq.models.standalone import _Task, model_args, synthetic_dictionary
from sut_fairseq.models.sut_transformer import SUTTransformerModel
from sut_fairseq.modules.recurrence import build_compiled, step_module

THRESHOLD = 0.6
L = 4
HALTING_SCALE = 0.1
HALTING_BIAS = -1.0


def build(kv, rule="stick-breaking", seed=0, threshold=THRESHOLD, **overrides):
    """sut_tiny, L = 4 steps per side, α_thresh 0.6, every parameter random, float64; the
    halting units' last layer scaled down so that â is near sigmoid(-0.8) = 0.31 and
    positions stop after 2, 3 or 4 steps (with â ~ 0.3 a position runs step 3 holding
    halted mass α_1 h_1 in S_2, the first state where S and h differ)."""
    model = make_model(halting_threshold=threshold, encoder_layers=L, decoder_layers=L,
                       encoder_halting=rule, encoder_halting_kv=kv, seed=seed, **overrides)
    randomise_parameters(model, seed=seed + 7)
    with torch.no_grad():
        for side in (model.encoder.side, model.decoder.side):
            side.halting.unit.fc2.weight.mul_(HALTING_SCALE)
            side.halting.unit.fc2.bias.fill_(HALTING_BIAS)
    return model


def inputs(B=3, S=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    src[0, :2] = 1  # left padding
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    return src, prev


def halting_probability(side, h, real, rule):
    """â_{l-1} (B, T) from h_{l-1} (B, T, d): per position (stick-breaking), or from the
    mean of h over the real positions (global-mean: the whole sequence in the encoder, the
    positions <= t in the decoder)."""
    unit = side.halting.unit
    x = h if unit.norm is None else unit.norm(h)
    if rule == "global-mean":
        w = real.unsqueeze(-1).to(x.dtype)
        if side.halting.causal:
            x = (x * w).cumsum(1) / w.cumsum(1).clamp_min(1)
        else:
            x = ((x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)).expand_as(x)
    return torch.sigmoid(unit(x).double())


def reference(side, x0, real, rule, kv, attend):
    """The recurrence step by step (Algorithms 1 and 3 of the GUT paper):

        before step l >= 2: α_{l-1} = â_{l-1} Π_{j<l-1} (1 - â_j), c_{l-1} = Σ α; a position
                            with c_{l-1} >= α_thresh stops (h and S frozen)
        X   = S_{l-1} (mixture) or h_{l-1} (state)
        h_l = Block(queries h_{l-1}, keys and values of X)
        S_l = (1 - c_{l-1}) h_l + Σ_{j<=l-1} α_j h_j

    ``attend(h, k, v, running)``: the block with the side's other inputs. Returns S_L and
    the executed steps (B, T)."""
    h = S = x0.double()
    B, T, d = h.shape
    c = torch.zeros(B, T, dtype=torch.float64)
    remain = torch.ones(B, T, dtype=torch.float64)
    acc = torch.zeros(B, T, d, dtype=torch.float64)
    running, steps = real.clone(), torch.zeros(B, T, dtype=torch.long)
    for l in range(1, side.num_steps + 1):
        if l > 1:
            a_hat = halting_probability(side, h, real, rule)
            alpha = torch.where(running, a_hat * remain, torch.zeros_like(c))
            remain = torch.where(running, remain * (1 - a_hat), remain)
            c, acc = c + alpha, acc + alpha.unsqueeze(-1) * h
            running = running & (c < side.halting.threshold)
            if not running.any():
                break
        k, v = side.block.self_kv(h if kv == "state" else S)
        h = torch.where(running.unsqueeze(-1), attend(h, k, v, running), h)
        S = torch.where(running.unsqueeze(-1), (1 - c).unsqueeze(-1) * h + acc, S)
        steps = steps + running.long()
    return S, steps


def encoder_reference(model, src, kv, rule):
    enc = model.encoder
    pad = src.eq(enc.padding_idx)
    x0 = enc.side.embed_scale * enc.side.embed_tokens(src) + enc.side.embed_positions(src)

    def attend(h, k, v, running):
        return enc.side.block(h, k, v, running, self_padding_mask=pad)

    return reference(enc.side, x0, ~pad, rule, kv, attend)


def decoder_reference(model, enc_out, prev, kv, rule):
    dec = model.decoder
    x0 = dec.side.embed_scale * dec.side.embed_tokens(prev) + dec.side.embed_positions(prev)
    cross_k, cross_v = dec.side.block.cross_kv(enc_out["encoder_out"][0].transpose(0, 1))
    enc_pad = enc_out["encoder_padding_mask"][0]
    pad = prev.eq(dec.padding_idx)

    def attend(h, k, v, running):
        return dec.side.block(h, k, v, running, self_padding_mask=pad, cross_k=cross_k,
                         cross_v=cross_v, cross_padding_mask=enc_pad)

    return reference(dec.side, x0, ~pad, rule, kv, attend)


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean"])
@pytest.mark.parametrize("kv", ["mixture", "state"])
def test_both_sides_equal_the_per_step_reference(kv, rule):
    model = build(kv, rule)
    assert model.encoder.side.recurrence.step.kv_from_state == model.decoder.side.recurrence.step.kv_from_state == (kv == "state")
    src, prev = inputs()
    with torch.no_grad():
        enc_out = model.encoder(src)
        feats, extra = model.decoder(prev, enc_out, features_only=True)
        S_enc, steps_enc = encoder_reference(model, src, kv, rule)
        S_dec, steps_dec = decoder_reference(model, enc_out, prev, kv, rule)
    real = src.ne(1)
    assert torch.equal(enc_out["halting"][0].steps, steps_enc)
    torch.testing.assert_close(enc_out["encoder_out"][0].transpose(0, 1)[real], S_enc[real],
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(extra["halting_decoder"].steps, steps_dec)
    torch.testing.assert_close(feats, S_dec, atol=1e-5, rtol=1e-5)
    # positions that stop early, and positions that run step 3 or later, whose keys and
    # values differ between the options (S_1 = h_1; S_2 holds the halted mass α_1 h_1)
    assert (steps_enc[real] < L).any() and (steps_dec < L).any(), "the test needs early halting"
    assert (steps_enc[real] >= 3).any() and (steps_dec >= 3).any(), "the test needs step 3"


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean"])
def test_state_and_mixture_differ_once_a_position_holds_halted_mass(rule):
    """The same weights under both options: steps 1 and 2 read the same keys and values
    (S_0 = h_0, S_1 = h_1), step 3 on reads S_2 = (1 - α_1) h_2 + α_1 h_1 or h_2, so the
    outputs differ."""
    src, prev = inputs()
    outs = []
    for kv in ("mixture", "state"):
        model = build(kv, rule, decoder_halting_kv=kv)
        with torch.no_grad():
            enc_out = model.encoder(src)
            feats, _ = model.decoder(prev, enc_out, features_only=True)
        outs.append((enc_out["encoder_out"][0], feats, enc_out["halting"][0].weights))
    (e0, d0, w0), (e1, d1, w1) = outs
    assert ((w0[..., 0] > 0.1) & (w0[..., 2:].sum(-1) > 0)).any(), \
        "the test needs a position that holds halted mass and runs step 3"
    assert not torch.allclose(e0, e1, atol=1e-3) and not torch.allclose(d0, d1, atol=1e-3)


def test_the_options_are_per_side_and_the_decoder_follows_the_encoder():
    assert make_model(encoder_halting_kv="state").decoder.side.recurrence.step.kv_from_state
    model = make_model(encoder_halting_kv="state", decoder_halting_kv="mixture")
    assert model.encoder.side.recurrence.step.kv_from_state and not model.decoder.side.recurrence.step.kv_from_state
    model = make_model(decoder_halting_kv="state")
    assert not model.encoder.side.recurrence.step.kv_from_state and model.decoder.side.recurrence.step.kv_from_state


def test_the_default_is_mixture_and_an_old_checkpoints_arguments_still_build():
    """Arguments without the options (a checkpoint saved before them) build the model with
    ``mixture``, whose outputs are the default model's; its state dict loads unchanged."""
    args = model_args("sut_tiny", halting_threshold=THRESHOLD, share_all_embeddings=True,
                      dropout=0.0)
    del args.encoder_halting_kv, args.decoder_halting_kv
    dictionary = synthetic_dictionary(40)
    torch.manual_seed(0)
    old = SUTTransformerModel.build_model(args, _Task(dictionary, dictionary)).eval()
    assert args.encoder_halting_kv == args.decoder_halting_kv == "mixture"
    assert not old.encoder.side.recurrence.step.kv_from_state and not old.decoder.side.recurrence.step.kv_from_state
    default = make_model(halting_threshold=THRESHOLD)
    explicit = make_model(halting_threshold=THRESHOLD, encoder_halting_kv="mixture")
    assert old.state_dict().keys() == default.state_dict().keys()
    for model in (default, explicit):
        model.load_state_dict(old.state_dict())  # the same parameters, strict
        randomise_halting(model, seed=4)
    randomise_halting(old, seed=4)
    src, prev = inputs()
    with torch.no_grad():
        logits = [m(src, src.ne(1).sum(1), prev)[0] for m in (old, default, explicit)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


@pytest.mark.parametrize("value", ["halted", "S"])
def test_an_unknown_value_is_refused_with_the_option_named(value):
    args = model_args("sut_tiny", share_all_embeddings=True)
    args.decoder_halting_kv = value
    dictionary = synthetic_dictionary(40)
    with pytest.raises(ValueError, match=rf"--decoder-halting-kv='{value}' is invalid: "
                                         r"choose from \('mixture', 'state'\)"):
        SUTTransformerModel.build_model(args, _Task(dictionary, dictionary))


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean", "act"])
@pytest.mark.parametrize("threshold", [0.6, 0.3])
def test_incremental_decoding_equals_the_full_forward_under_state(rule, threshold):
    """The cache holds the keys/values of h_{l-1}; when every new position halted before
    step l (the early-exit hook: at the low threshold in the batch, and whenever a position
    stops early when the rows are decoded one at a time) the cache takes those of its
    frozen h for the steps it skips, which the later positions that run them read."""
    model = build("mixture", rule, threshold=threshold, decoder_halting_kv="state")
    src, prev = inputs(T=7, seed=2)
    with torch.no_grad():
        enc = model.encoder(src)
        full, extra = model.decoder(prev, enc)
        inc, steps, _ = run_incremental(model, enc, prev)
        alone = [run_incremental(model, model.encoder.reorder_encoder_out(enc, torch.tensor([b])),
                                 prev[b:b + 1])[0] for b in range(prev.size(0))]
        mixture = copy.deepcopy(model)
        mixture.decoder.side.recurrence.step.kv_from_state = False
        other, _ = mixture.decoder(prev, enc)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(alone), full, atol=1e-5, rtol=1e-5)
    assert torch.equal(steps, extra["halting_decoder"].steps)
    assert (steps < L).any(), "the test needs positions that halt early"
    if threshold == 0.3:
        assert (steps.max(0).values < L).any(), "the test needs whole-batch early exits"
    else:
        assert (steps >= 3).any() and not torch.allclose(other, full, atol=1e-4), \
            "the test needs positions whose keys and values differ between the options"


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean"])
@pytest.mark.parametrize("step_embedding", ["none", "timestep"])
def test_the_compiled_steps_modules_read_h_under_state(rule, step_embedding):
    """The compiled form of the step (``TensorStep``, run as a module, without torch.compile):
    the keys/values of h_{l-1}, carried for the rows that did not run (no step embedding)
    or projected every step (with one), equal the eager step's."""
    model = build("state", rule, decoder_halting_kv="state", encoder_step_embedding=step_embedding)
    compiled = copy.deepcopy(model)
    for side, name in ((compiled.encoder.side, "encoder"), (compiled.decoder.side, "decoder")):
        side.compiled_step = build_compiled(side.recurrence.step, name)
        assert step_module(side.compiled_step).kv_from_state
        side.compiled_step.compiled = side.compiled_step.step  # the module itself
    src, prev = inputs()
    with torch.no_grad():
        got, got_extra = compiled(src, src.ne(1).sum(1), prev)
        want, want_extra = model(src, src.ne(1).sum(1), prev)
    for key in ("halting_encoder", "halting_decoder"):
        assert torch.equal(got_extra[key].steps, want_extra[key].steps)
    assert (want_extra["halting_encoder"].steps[src.ne(1)] < L).any()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("loop", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["step", "loop"])
def test_compile_step_builds_and_traces_the_state_step(loop, monkeypatch):
    """``--compile-step`` / ``--compile-loop`` hand the option to the compiled step, which
    torch.compile traces whole (``aot_eager``: the graph without generated code) and which
    then gives the eager model's output."""
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    option = dict(compile_loop=True) if loop else dict(compile_step=True)
    eager = make_model(halting_threshold=THRESHOLD, encoder_layers=3, decoder_layers=3,
                       encoder_halting_kv="state", decoder_halting_kv="mixture")
    randomise_halting(eager, seed=2)
    compiled = make_model(halting_threshold=THRESHOLD, encoder_layers=3, decoder_layers=3,
                          encoder_halting_kv="state", decoder_halting_kv="mixture", **option)
    compiled.load_state_dict(eager.state_dict())
    assert step_module(compiled.encoder.side.compiled_step).kv_from_state
    assert not step_module(compiled.decoder.side.compiled_step).kv_from_state
    src, prev = inputs()
    with torch.no_grad():
        want, want_extra = eager(src, src.ne(1).sum(1), prev)
        got, got_extra = compiled(src, src.ne(1).sum(1), prev)
    for side in (compiled.encoder.side, compiled.decoder.side):
        assert side.compiled_step.compiled is not None and not side.compiled_step.failed
    for key in ("halting_encoder", "halting_decoder"):
        assert torch.equal(got_extra[key].steps, want_extra[key].steps)
    assert (want_extra["halting_encoder"].steps[src.ne(1)] >= 3).any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_one_chunk_without_memory_is_the_unchunked_model_under_state():
    """The chunked recurrence runs the side's step, so ``state`` reaches it: one chunk
    (g >= n) without memory equals the unchunked model (checked against the reference
    above), in the full forward and in incremental decoding."""
    one_chunk = dict(encoder_chunk_size=64, decoder_chunk_size=64, encoder_memory_slots=0,
                     decoder_memory_slots=0, tlb_encoder_out="tokens")
    plain, chunked = build("state"), build("state", **one_chunk)
    mixture = build("mixture", **one_chunk)
    src, prev = inputs(T=6, seed=3)
    with torch.no_grad():
        outs = []
        for m in (plain, chunked, mixture):
            enc = m.encoder(src)
            logits, extra = m.decoder(prev, enc)
            inc, inc_steps, _ = run_incremental(m, enc, prev)
            outs.append((enc["encoder_out"][0], logits, inc, inc_steps, extra["halting_decoder"].steps))
    (e0, l0, i0, s0, f0), (e1, l1, i1, s1, f1), (e2, l2, _, _, _) = outs
    torch.testing.assert_close(e1, e0, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(i1, l1, atol=1e-5, rtol=1e-5)
    assert torch.equal(s1, f1) and torch.equal(f1, f0)
    assert (s0 < L).any(), "the test needs positions that halt early"
    assert not torch.allclose(e2, e1, atol=1e-4) and not torch.allclose(l2, l1, atol=1e-4)


@pytest.mark.parametrize("arch,overrides", [
    ("sut_tiny", dict(decoder_step_embedding="timestep")),
    ("sut_tiny", dict(decoder_step_embedding="coordinate")),
    ("hyper_ut_cpvr", dict(encoder_embed_dim=32)),
], ids=["timestep", "coordinate", "hyper-modules"])
def test_step_embeddings_and_hyper_modules_read_h_under_state_in_incremental_decoding(arch, overrides):
    """The other key/value sources take h_{l-1} too: h_{l-1} + E_l (step embeddings) and
    the hyper-modules' W_k(z_l) h_{l-1} (Hyper-UT); incremental decoding, one row at a time
    so that halted positions fill the skipped steps, equals the full forward."""
    model = make_model(arch, halting_threshold=THRESHOLD, encoder_layers=2, decoder_layers=L,
                       decoder_halting_kv="state", **overrides)
    randomise_halting(model, std=1.0, seed=6)
    src, prev = inputs(T=6, seed=4)
    with torch.no_grad():
        enc = model.encoder(src)
        full, extra = model.decoder(prev, enc)
        alone = [run_incremental(model, model.encoder.reorder_encoder_out(enc, torch.tensor([b])),
                                 prev[b:b + 1]) for b in range(prev.size(0))]
        mixture = copy.deepcopy(model)
        mixture.decoder.side.recurrence.step.kv_from_state = False
        other, _ = mixture.decoder(prev, enc)
    steps = extra["halting_decoder"].steps
    torch.testing.assert_close(torch.cat([a[0] for a in alone]), full, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat([a[1] for a in alone]), steps)
    assert (steps < L).any() and (steps >= 3).any(), "the test needs early halting"
    assert not torch.allclose(other, full, atol=1e-5), "state must change the decoder"
