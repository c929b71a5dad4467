"""The halting family on one interface (issue 4): stick-breaking, global-mean (with and
without the transition reading), Graves/Dehghani ACT, none; the GUT gate; accounting."""
import pytest
import torch

from conftest import make_model, randomise_halting

RULES = [("stick-breaking", False), ("global-mean", False), ("global-mean", True),
         ("stick-breaking", True), ("act", False), ("none", False)]


def _model(rule, transition, threshold=0.8, **kw):
    model = make_model(encoder_halting=rule, decoder_halting=rule, halting_transition=transition,
                       halting_threshold=threshold, encoder_layers=4, decoder_layers=4, **kw)
    randomise_halting(model, seed=7)
    return model


def _batch(seed=0, B=3, S=7, T=6):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    src[0, :3] = 1
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    prev[B - 1, 4:] = 1
    return src, prev


@pytest.mark.parametrize("rule,transition", RULES)
def test_weights_are_a_distribution(rule, transition):
    model = _model(rule, transition)
    src, prev = _batch()
    with torch.no_grad():
        _, extra = model(src, torch.tensor([4, 7, 7]), prev)
    for res in (extra["halting_encoder"], extra["halting_decoder"]):
        assert (res.weights >= 0).all()
        torch.testing.assert_close(res.weights.sum(-1), res.real.float(), atol=1e-6, rtol=0)
        assert ((res.steps >= 1) == res.real).all()


@pytest.mark.parametrize("rule,transition", RULES)
def test_padding_changes_no_real_position(rule, transition):
    """One sentence alone == the same sentence left-padded inside a longer batch."""
    model = _model(rule, transition)
    src, prev = _batch()
    alone_src = src[1:2, :5]
    padded = torch.cat([torch.full((1, 2), 1), alone_src], 1)  # two more pad columns
    with torch.no_grad():
        a = model.encoder(alone_src)
        b = model.encoder(padded)
        out_a, xa = model.decoder(prev[1:2], a)
        out_b, xb = model.decoder(prev[1:2], b)
    torch.testing.assert_close(a["encoder_out"][0][:, 0], b["encoder_out"][0][2:, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(a["halting"][0].steps[0], b["halting"][0].steps[0, 2:])
    torch.testing.assert_close(a["halting"][0].weights[0], b["halting"][0].weights[0, 2:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)


def test_global_mean_makes_one_decision_per_sequence_in_the_encoder():
    model = _model("global-mean", False, threshold=0.6)
    src, _ = _batch()
    with torch.no_grad():
        res = model.encoder(src)["halting"][0]
    for b in range(src.size(0)):
        w = res.weights[b][res.real[b]]
        assert (w == w[0]).all(), "every real position of a sequence shares its α's"
        assert (res.steps[b][res.real[b]] == res.steps[b][res.real[b]][0]).all()


@pytest.mark.parametrize("transition", [False, True])
def test_decoder_prefix_mean_is_causal_and_incremental_equals_full(transition):
    model = _model("global-mean", transition, threshold=0.6)
    src, prev = _batch(B=2)
    prev = prev[:, :6].clone()
    prev[:, 4:] = torch.tensor([[7, 8], [9, 10]])
    changed = prev.clone()
    changed[:, -1] = 30  # a later token
    with torch.no_grad():
        enc = model.encoder(src[:2])
        full, extra = model.decoder(prev, enc)
        full2, extra2 = model.decoder(changed, enc)
        # Halting decisions of earlier positions are exactly unchanged; their outputs agree
        # to float rounding only, not bitwise: a changed token changes which rows each
        # expert's matmul receives, and BLAS rounding depends on the matrix height.
        assert torch.equal(extra["halting_decoder"].steps[:, :-1], extra2["halting_decoder"].steps[:, :-1])
        torch.testing.assert_close(full[:, :-1], full2[:, :-1], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(full[:, -1], full2[:, -1]), "the changed token must matter"
        state, outs = {}, []
        for t in range(prev.size(1)):
            out, _ = model.decoder(prev[:, : t + 1], enc, incremental_state=state)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    assert (extra["halting_decoder"].steps < 4).any(), "want some early halting"


def scalar_act(side, x0, real, block_call, eps_threshold):
    """Graves (2016) ACT per position: halt at the first n with Σ_{j<=n} p_j >= 1 - ε;
    weights p_1..p_{n-1} and the remainder R on step n; ponder cost N + R."""
    B, T, d = x0.shape
    L = side.num_steps
    h, S = x0.clone(), x0.clone()
    c = [[0.0] * T for _ in range(B)]
    acc = torch.zeros(B, T, d, dtype=torch.float64)
    halted = [[False] * T for _ in range(B)]
    steps = [[0] * T for _ in range(B)]
    weights = torch.zeros(B, T, L, dtype=torch.float64)
    for l in range(1, L + 1):
        new_h, new_S = h.clone(), S.clone()
        for b in range(B):
            for t in range(T):
                if not real[b, t] or halted[b][t]:
                    continue
                if l > 1:
                    p = torch.sigmoid(side.halting.unit(h[b:b + 1, t:t + 1]).double()).item()
                    if c[b][t] + p >= eps_threshold:
                        weights[b, t, l - 2] = 1.0 - c[b][t]
                        acc[b, t] += (1.0 - c[b][t]) * h[b, t].double()
                        c[b][t] = 1.0
                        halted[b][t] = True
                        continue
                    weights[b, t, l - 2] = p
                    c[b][t] += p
                    acc[b, t] += p * h[b, t].double()
                out = block_call(h[b:b + 1, t:t + 1], S[b:b + 1], b, t)
                new_h[b, t] = out[0, 0]
                new_S[b, t] = ((1.0 - c[b][t]) * out[0, 0].double() + acc[b, t]).float()
                steps[b][t] += 1
        h, S = new_h, new_S
    ponder = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if real[b, t]:
                weights[b, t, steps[b][t] - 1] += 1.0 - c[b][t]
                ponder[b, t] = steps[b][t] + weights[b, t, steps[b][t] - 1]
    return S, weights, torch.tensor(steps), ponder


@pytest.mark.parametrize("threshold", [0.99, 0.6])
def test_act_matches_scalar_graves_loop(threshold):
    model = _model("act", False, threshold=threshold)
    enc = model.encoder
    src, _ = _batch()
    pad = src.eq(enc.padding_idx)
    with torch.no_grad():
        out = enc(src)
        x0 = enc.side.embed_scale * enc.side.embed_tokens(src) + enc.side.embed_positions(src)

        def block_call(h_row, S_b, b, t):
            k, v = enc.side.block.self_kv(S_b)
            return enc.side.block(h_row, k, v, torch.ones(1, 1, dtype=torch.bool),
                             self_padding_mask=pad[b:b + 1], q_start=t)

        S_ref, w_ref, steps_ref, ponder_ref = scalar_act(enc.side, x0, ~pad, block_call, threshold)
    res, real = out["halting"][0], ~pad
    torch.testing.assert_close(out["encoder_out"][0].transpose(0, 1)[real], S_ref[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(res.weights.double(), w_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(res.steps, steps_ref)
    torch.testing.assert_close(res.expected_depth.double(), ponder_ref, atol=1e-6, rtol=1e-5)
    if threshold < 0.9:
        assert (steps_ref[real] < enc.side.num_steps).any()


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean", "act"])
def test_lowering_the_threshold_never_increases_executed_steps(rule):
    src, prev = _batch(seed=3, B=4, S=9, T=7)
    totals = []
    for threshold in (1.0, 0.999, 0.9, 0.7, 0.5, 0.3, 0.1):
        model = _model(rule, False, threshold=threshold)
        with torch.no_grad():
            _, extra = model(src, None, prev)
        totals.append(extra["halting_encoder"].steps.sum().item() + extra["halting_decoder"].steps.sum().item())
    assert all(a >= b for a, b in zip(totals, totals[1:])), totals
    assert totals[-1] < totals[0]


def test_gated_ffn_closed_gate_keeps_the_state():
    model = make_model(gated_ffn=True, encoder_halting="none", decoder_halting="none")
    with torch.no_grad():
        model.encoder.side.block.gate.fc2.bias.fill_(-1e4)  # G = 0: h_l = h_{l-1}
    src, _ = _batch()
    with torch.no_grad():
        out = model.encoder(src)["encoder_out"][0].transpose(0, 1)
        x0 = model.encoder.side.embed_scale * model.encoder.side.embed_tokens(src) + model.encoder.side.embed_positions(src)
    torch.testing.assert_close(out, x0)


def test_transition_with_act_is_rejected():
    with pytest.raises(ValueError, match="--halting-transition"):
        make_model(encoder_halting="act", decoder_halting="act", halting_transition=True)


def test_step_meter_counts_eval_forwards_only():
    model = _model("stick-breaking", False, threshold=0.6)
    src, prev = _batch()
    with torch.no_grad():
        model(src, None, prev)
    meter = model.step_meter
    assert 0 < meter.fraction("enc") < 1 and 0 < meter.fraction("dec") < 1
    assert "encoder steps executed" in meter.summary()
    executed = dict(meter.executed)
    model.train()
    model(src, None, prev)
    assert meter.executed == executed


@pytest.mark.parametrize("argv0, registered", [
    ("/venv/bin/fairseq-generate", True), ("fairseq-interactive", True),
    ("/site-packages/fairseq_cli/generate.py", True), ("fairseq-train", False),
    ("benchmarks/generate_throughput.py", False), ("data-prep/cpvr/generate_data.py", False)])
def test_the_exit_summary_is_printed_by_fairseq_generation_tools_only(argv0, registered, monkeypatch):
    """fairseq-generate / -interactive print each model's executed-step summary at exit;
    other programs that build models (benchmarks, training) do not."""
    from sut_fairseq.modules import accounting

    monkeypatch.setattr(accounting, "_METERS", [])
    monkeypatch.setattr(accounting.atexit, "register", lambda fn: None)
    monkeypatch.setattr(accounting.sys, "argv", [argv0])
    meter = accounting.StepMeter({"enc": 1, "dec": 1})
    accounting.register_for_exit_summary(meter)
    assert accounting._METERS == ([meter] if registered else [])
