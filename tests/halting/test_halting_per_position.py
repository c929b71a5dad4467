"""The vectorised halting recurrence equals a per-position scalar implementation of
stick-breaking halting (docs/model.md#stick-breaking; Algorithm 1 of the paper), in the
encoder and the decoder."""
import math

import pytest
import torch

from conftest import make_model, randomise_halting


def scalar_recurrence(side, x0, real, block_call):
    """Per-position loop over steps, with plain Python products (no log space).

    block_call(h_row (1,1,d), S (1,T,d) of row b, b, t) -> new h_row.
    Returns S_L (B,T,d), halting weights (B,T,L) and executed steps (B,T).
    """
    B, T, d = x0.shape
    L, thr = side.num_steps, side.halting.threshold
    h, S = x0.clone(), x0.clone()
    c = [[0.0] * T for _ in range(B)]
    remain = [[1.0] * T for _ in range(B)]
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
                    a_hat = torch.sigmoid(side.halting.unit(h[b:b + 1, t:t + 1]).double()).item()
                    alpha = a_hat * remain[b][t]
                    remain[b][t] *= 1.0 - a_hat
                    c[b][t] += alpha
                    acc[b, t] += alpha * h[b, t].double()
                    weights[b, t, l - 2] = alpha
                    if c[b][t] >= thr:
                        halted[b][t] = True
                        continue
                out = block_call(h[b:b + 1, t:t + 1], S[b:b + 1], b, t)
                new_h[b, t] = out[0, 0]
                new_S[b, t] = ((1.0 - c[b][t]) * out[0, 0].double() + acc[b, t]).float()
                steps[b][t] += 1
        h, S = new_h, new_S
    for b in range(B):
        for t in range(T):
            if real[b, t]:
                weights[b, t, steps[b][t] - 1] += 1.0 - c[b][t]
    return S, weights, torch.tensor(steps)


def _inputs(model, B=3, T=6, pad_rows=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, len(model.encoder.dictionary), (B, T), generator=g)
    if pad_rows:
        tokens[0, :2] = model.encoder.padding_idx  # left padding, as fairseq sources
    return tokens


@pytest.mark.parametrize("threshold", [0.999, 0.7, 0.35])
def test_encoder_matches_scalar_reference(threshold):
    model = make_model(halting_threshold=threshold, encoder_layers=4)
    randomise_halting(model)
    enc = model.encoder
    src = _inputs(model)
    pad = src.eq(enc.padding_idx)
    with torch.no_grad():
        out = enc(src)
        x0 = enc.side.embed_scale * enc.side.embed_tokens(src) + enc.side.embed_positions(src)

        def block_call(h_row, S_b, b, t):
            k, v = enc.side.block.self_kv(S_b)
            return enc.side.block(h_row, k, v, torch.ones(1, 1, dtype=torch.bool),
                             self_padding_mask=pad[b:b + 1], q_start=t)

        S_ref, w_ref, steps_ref = scalar_recurrence(enc.side, x0, ~pad, block_call)
    res = out["halting"][0]
    real = ~pad
    torch.testing.assert_close(out["encoder_out"][0].transpose(0, 1)[real], S_ref[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(res.weights.double(), w_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(res.steps, steps_ref)
    # the halting distribution sums to 1 on real positions, 0 on padding
    torch.testing.assert_close(res.weights.sum(-1), real.float())
    # L_ACT summand: Σ_l l·w_l with the remainder on the last executed step
    depth = (w_ref * torch.arange(1, enc.side.num_steps + 1, dtype=torch.float64)).sum(-1)
    torch.testing.assert_close(res.expected_depth.double(), depth, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(res.act_loss().double(), depth[real].mean(), atol=1e-6, rtol=1e-5)
    if threshold < 0.5:
        assert (steps_ref[real] < enc.side.num_steps).all(), "lowered threshold must halt early"
    if threshold == 0.7:
        assert len(set(steps_ref[real].tolist())) > 1, "want positions halting at different steps"


@pytest.mark.parametrize("threshold", [0.999, 0.7])
def test_decoder_matches_scalar_reference(threshold):
    model = make_model(halting_threshold=threshold, decoder_layers=4)
    randomise_halting(model, seed=3)
    dec = model.decoder
    src = _inputs(model, B=2, T=5)
    prev = _inputs(model, B=2, T=6, pad_rows=False, seed=1)
    prev[1, 4:] = dec.padding_idx  # right padding, as fairseq targets
    with torch.no_grad():
        enc_out = model.encoder(src)
        feats, extra = dec(prev, enc_out, features_only=True)
        x0 = dec.side.embed_scale * dec.side.embed_tokens(prev) + dec.side.embed_positions(prev)
        enc_states = enc_out["encoder_out"][0].transpose(0, 1)
        cross_k, cross_v = dec.side.block.cross_kv(enc_states)
        enc_pad = enc_out["encoder_padding_mask"][0]
        real = prev.ne(dec.padding_idx)

        def block_call(h_row, S_b, b, t):
            k, v = dec.side.block.self_kv(S_b[:, : t + 1])
            return dec.side.block(h_row, k, v, torch.ones(1, 1, dtype=torch.bool), q_start=t,
                             cross_k=cross_k[b:b + 1], cross_v=cross_v[b:b + 1],
                             cross_padding_mask=enc_pad[b:b + 1])

        S_ref, w_ref, steps_ref = scalar_recurrence(dec.side, x0, real, block_call)
    res = extra["halting_decoder"]
    torch.testing.assert_close(feats[real], S_ref[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(res.weights.double(), w_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(res.steps, steps_ref)


def test_no_halting_runs_all_steps_and_outputs_last_state():
    model = make_model(encoder_halting="none", decoder_halting="none")
    src = _inputs(model)
    res = model.encoder(src)["halting"][0]
    real = res.real
    assert (res.steps[real] == model.encoder.side.num_steps).all()
    assert (res.steps[~real] == 0).all()
    torch.testing.assert_close(res.expected_depth[real], torch.full_like(res.expected_depth[real], 3.0))


def test_halting_unit_starts_at_one_half():
    model = make_model()
    h = torch.randn(2, 5, 64)
    torch.testing.assert_close(torch.sigmoid(model.encoder.side.halting.unit(h)), torch.full((2, 5), 0.5))


def test_log_space_products_do_not_underflow():
    """64 steps with â near 1 and near 0: weights stay finite and sum to 1."""
    from sut_fairseq.modules.halting import build_halting

    for bias in (30.0, -30.0, 8.0):
        halting = build_halting("stick-breaking", 8, 0.0, threshold=1.0, normalize_input=False)
        torch.nn.init.constant_(halting.unit.fc2.bias, bias)
        h = torch.randn(2, 3, 8)
        real = torch.ones(2, 3, dtype=torch.bool)
        state = halting.begin(h, real)
        running = real
        for _ in range(63):
            state.steps = state.steps + running.long()
            running = halting.decide(h, running, state, 2)
        state.steps = state.steps + running.long()
        res = halting.finish(state, 64)
        assert torch.isfinite(res.weights).all()
        torch.testing.assert_close(res.weights.sum(-1), torch.ones(2, 3))
        if bias > 0:
            assert res.weights[..., 0].min() > 0.99


class _ScriptedUnit(torch.nn.Module):
    """A halting unit returning a prescribed logit at each call (the same for every row)."""

    def __init__(self, logits):
        super().__init__()
        self.logits, self.norm, self.calls = logits, None, 0

    def forward(self, x, rows=None):
        logit = self.logits[self.calls]
        self.calls += 1
        return torch.full(x.shape[:-1], logit, dtype=torch.float32)


def test_log_space_products_keep_stick_pieces_a_naive_product_loses():
    """α_l = â_l Π_{j<l} (1 - â_j) for logits where the fp32 product of (1 - sigmoid) is
    wrong: 1 - sigmoid(25) rounds to 0 (the product and every later α vanish), and
    1 - sigmoid(12) keeps only three digits. Expected values in float64, from
    log(1 - sigmoid(x)) = -log(1 + e^x) exactly; every position is kept running."""
    from sut_fairseq.modules.halting import LearnedHalting

    logits = [-69.0, 12.0, 25.0, 0.0, -5.0, 3.0, 9.0, 1.0]  # â: 1e-30, ~1, ~1, 0.5, ...
    halting = LearnedHalting("stick-breaking", 4, 0.0, threshold=1.0, normalize_input=False)
    halting.unit = _ScriptedUnit(logits)
    h = torch.randn(1, 2, 4)
    real = torch.ones(1, 2, dtype=torch.bool)
    state = halting.begin(h, real)
    for step in range(2, len(logits) + 2):
        halting.decide(h, real, state, step)  # keep every position running
    x = torch.tensor(logits, dtype=torch.float64)
    log_remain = torch.cat([torch.zeros(1, dtype=torch.float64),
                            torch.cumsum(-torch.nn.functional.softplus(x), 0)[:-1]])
    expected = torch.exp(torch.nn.functional.logsigmoid(x) + log_remain)
    alphas = torch.stack(state.alphas, -1)[0, 0].double()
    assert expected[3] > 1e-20  # the pieces after sigmoid(25) are small but not zero
    torch.testing.assert_close(alphas, expected, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("bias", [0.0, -3.0, 2.0])
def test_halting_bias_init_sets_the_initial_stick_pieces(bias):
    """--halting-bias-init B: at initialisation â = sigmoid(B) at every position and step,
    so the encoder's halting weights are α_j = â (1 − â)^(j−1), the last step taking the
    rest of the stick (sut_tiny has 3 steps: weights â, â(1 − â), (1 − â)²)."""
    model = make_model(halting_bias_init=bias, halting_threshold=1.0)
    src = torch.randint(4, 40, (2, 7))
    out = model.encoder(src, torch.full((2,), 7))
    weights = out["halting"][0].weights.double()
    a = 1.0 / (1.0 + math.exp(-bias))
    expected = torch.tensor([a, a * (1 - a), (1 - a) ** 2], dtype=torch.float64)
    torch.testing.assert_close(weights, expected.expand_as(weights), rtol=1e-5, atol=1e-6)


def test_halting_result_act_loss_and_executed_fraction_worked_by_hand():
    """L_ACT = Σ_real summand / #real (one real position: its own summand), and the
    executed fraction = Σ steps / (L · #real), with no real position at all giving 0."""
    from sut_fairseq.modules.halting import HaltingResult

    def result(depth, steps, real, L=4):
        depth, steps, real = torch.tensor(depth), torch.tensor(steps), torch.tensor(real)
        return HaltingResult(weights=torch.zeros(*real.shape, L), expected_depth=depth,
                             steps=steps, real=real, max_steps=L)

    one = result([[2.5, 9.0]], [[3, 0]], [[True, False]])
    assert one.act_loss().item() == 2.5
    assert one.executed_fraction() == 3 / 4
    two = result([[2.5, 1.5], [3.0, 7.0]], [[3, 2], [4, 0]], [[True, True], [True, False]])
    assert two.act_loss().item() == pytest.approx(7.0 / 3)
    assert two.executed_fraction() == 9 / 12
    none = result([[5.0]], [[0]], [[False]])
    assert none.act_loss().item() == 0.0 and none.executed_fraction() == 0.0
    assert result([[1.0]], [[1]], [[True]], L=1).executed_fraction() == 1.0  # L · #real = 1


# --- the halting unit's reading, the eager saving, the compiled branch, dtypes, devices --


def _unit_logit64(halting, x):
    """The halting unit in float64, written out: fc2(GELU(fc1(x)))."""
    u = halting.unit
    hidden = x @ u.fc1.weight.double().t() + u.fc1.bias.double()
    return (torch.nn.functional.gelu(hidden) @ u.fc2.weight.double().t() + u.fc2.bias.double()).squeeze(-1)


def _randomised(rule, causal, transition=False, d=6):
    from sut_fairseq.modules.halting import build_halting

    torch.manual_seed(3)
    halting = build_halting(rule, d, 0.0, threshold=0.9, normalize_input=True,
                            transition=transition, causal=causal)
    with torch.no_grad():
        for p in halting.parameters():
            p.copy_(torch.randn_like(p) * 0.7)
    return halting


@pytest.mark.parametrize("causal", [False, True])
def test_global_mean_reading_against_a_per_position_loop(causal):
    """The global-mean rule's first decision, α_1 = sigmoid(unit(m)) on real positions,
    where m is, per sequence, the mean of LN(h_t) over its real positions (encoder) or over
    its real positions t' <= t (decoder: the causal prefix mean; 0 before the first real
    one). Left padding, a sequence with one real position and B = 3 (each sequence its
    own count)."""
    halting = _randomised("global-mean", causal)
    B, T, d = 3, 5, 6
    h = torch.randn(B, T, d)
    real = torch.tensor([[False, False, True, True, True],
                         [False, False, False, True, False],
                         [True, True, True, True, True]])
    state = halting.begin(h, real)
    alpha = halting.decide(h, real, state, 1)  # reads h_1 = h, running = real
    norm = halting.unit.norm
    expected = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        ln = [norm(h[b, t]).double() for t in range(T)]
        reals = [t for t in range(T) if real[b, t]]
        for t in range(T):
            seen = [s for s in reals if s <= t] if causal else reals
            m = sum(ln[s] for s in seen) / max(1, len(seen)) if seen else torch.zeros(d, dtype=torch.float64)
            if real[b, t]:
                expected[b, t] = torch.sigmoid(_unit_logit64(halting, m))
    torch.testing.assert_close(state.alphas[0].double(), expected, rtol=1e-5, atol=1e-6)
    assert alpha.dtype == torch.bool


def test_a_threshold_tensor_overrides_the_rule_threshold():
    """``decide(..., threshold=t)`` halts against t, not the rule's own α_thresh."""
    halting = _randomised("stick-breaking", False)
    with torch.no_grad():
        halting.unit.fc2.weight.zero_()
        halting.unit.fc2.bias.fill_(0.0)  # â = 0.5 everywhere
    h, real = torch.randn(2, 4, 6), torch.ones(2, 4, dtype=torch.bool)
    assert halting.decide(h, real, halting.begin(h, real), 1).all()  # 0.5 < 0.9: runs on
    halts_all = halting.decide(h, real, halting.begin(h, real), 1, threshold=torch.tensor(0.4))
    assert not halts_all.any()


def test_the_per_position_reading_computes_the_hidden_layer_of_running_rows_only(monkeypatch):
    """The per-position rule computes the halting unit's hidden layer through
    ``sut::masked_linear`` with the running rows as its mask (the op computes only those
    rows: tests/experts/test_custom_ops.py); the others' α is 0, and the running rows'
    α is what the unit gives on every row."""
    from sut_fairseq.modules import halting as halting_module

    halting = _randomised("stick-breaking", False)
    h = torch.randn(2, 5, 6)
    real = torch.ones(2, 5, dtype=torch.bool)
    running = torch.tensor([[True, False, True, False, False], [True, True, False, False, True]])
    masks = []
    real_masked_linear = halting_module.masked_linear
    monkeypatch.setattr(halting_module, "masked_linear",
                        lambda x, linear, mask: masks.append(mask) or real_masked_linear(x, linear, mask))
    state = halting.begin(h, real)
    halting.decide(h, running, state, 1)
    assert len(masks) == 1 and torch.equal(masks[0], running)
    every = torch.sigmoid(_unit_logit64(halting, halting.unit.norm(h).double()))
    torch.testing.assert_close(state.alphas[0].double(), every * running, rtol=1e-5, atol=1e-6)


def test_mix_keeps_the_states_dtype():
    """S_l in bf16 stays bf16 (Eq. 3 is formed in fp32 and cast back)."""
    halting = _randomised("stick-breaking", False)
    h = torch.randn(2, 3, 6).bfloat16()
    real = torch.ones(2, 3, dtype=torch.bool)
    state = halting.begin(h, real)
    state.c = torch.full((2, 3), 0.25)
    S = halting.mix(h, h.clone(), real, state)
    assert S.dtype == torch.bfloat16


@pytest.mark.parametrize("rule", ["stick-breaking", "act", "none"])
def test_finish_builds_the_result_on_the_state_device(rule):
    """``finish`` makes its weights and depths on the state's device (meta here: a
    tensor made on the default device would not combine with the state's)."""
    from sut_fairseq.modules.halting import build_halting, HaltingState

    halting = build_halting(rule, 4, 0.0, threshold=0.9, normalize_input=False)
    meta = torch.device("meta")
    B, T = 2, 3
    state = HaltingState.from_tensors(
        torch.ones(B, T, dtype=torch.bool, device=meta), torch.zeros(B, T, device=meta),
        torch.zeros(B, T, device=meta), torch.zeros(B, T, 4, device=meta),
        torch.zeros(B, T, 4, device=meta), torch.ones(B, T, dtype=torch.long, device=meta))
    state.alphas = [torch.zeros(B, T, device=meta)]
    result = halting.finish(state, 4)
    assert result.weights.device == meta and result.expected_depth.device == meta
    assert result.weights.shape == (B, T, 4) and result.weights.dtype == torch.float32


@pytest.mark.parametrize("rule", ["stick-breaking", "act"])
def test_certain_halting_at_the_threshold_one(rule):
    """â = 1.0 exactly (a logit of 30 in fp32) with α_thresh = 1: the position halts at
    its first decision (the test is c + α >= α_thresh, equality included), its α is the
    whole mass and c reaches exactly 1 (ACT's remainder 1 - c, stick-breaking's â)."""
    from sut_fairseq.modules.halting import build_halting

    halting = build_halting(rule, 4, 0.0, threshold=1.0, normalize_input=False)
    torch.nn.init.constant_(halting.unit.fc2.bias, 30.0)
    h, real = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    state = halting.begin(h, real)
    assert not halting.decide(h, real, state, 1).any()
    assert torch.equal(state.alphas[0], torch.ones(2, 3))
    assert torch.equal(state.c, torch.ones(2, 3))
    state = halting.begin(h, real)  # with mass 1/4 already spent: α = 3/4 (ACT: 1 - c)
    state.c = torch.full((2, 3), 0.25)
    halting.decide(h, real, state, 2)
    if rule == "act":
        assert torch.equal(state.alphas[0], torch.full((2, 3), 0.75))
    assert torch.equal(state.c, torch.full((2, 3), 1.25 if rule != "act" else 1.0))


def test_halted_positions_keep_a_finite_log_remainder():
    """A halted position (running False) adds nothing to log Π(1 - â), even where
    log(1 - â) is exactly 0 (â underflows): its state stays finite and its α 0."""
    from sut_fairseq.modules.halting import build_halting

    halting = build_halting("stick-breaking", 4, 0.0, threshold=0.9, normalize_input=False)
    torch.nn.init.constant_(halting.unit.fc2.bias, -200.0)  # log(1 - â) == 0 in fp32
    h, real = torch.randn(1, 4, 4), torch.ones(1, 4, dtype=torch.bool)
    running = torch.tensor([[True, False, True, False]])
    state = halting.begin(h, real)
    halting.decide(h, running, state, 1)
    halting.decide(h, running, state, 2)
    assert torch.isfinite(state.log_remain).all() and torch.isfinite(state.c).all()
    assert torch.equal(state.alphas[1][~running], torch.zeros(2))


def test_halting_construction_defaults_options_and_refusals():
    """build_halting passes every option on; the defaults are per-position reading, the
    encoder side and â = 1/2 at start; bad rules and thresholds are refused by name."""
    from sut_fairseq.modules.halting import HaltingUnit, LearnedHalting, build_halting, check_threshold

    plain = build_halting("stick-breaking", 4, 0.0, threshold=0.9, normalize_input=False)
    assert plain.transition is False and plain.causal is False and plain.unit.norm is None
    assert plain.unit.fc1.in_features == 4 and plain.unit.fc2.bias.item() == 0.0
    full = build_halting("global-mean", 4, 0.0, 0.9, True, transition=True, causal=True, bias_init=-3.0)
    assert full.rule == "global-mean" and full.transition is True and full.causal is True
    assert full.unit.fc1.in_features == 8 and full.unit.fc2.bias.item() == -3.0
    assert isinstance(full.unit.norm, torch.nn.LayerNorm) and full.unit.norm.normalized_shape == (4,)
    direct = LearnedHalting("act", 4, 0.0, 0.9, False)
    assert direct.transition is False and direct.causal is False and direct.unit.fc2.bias.item() == 0.0
    assert HaltingUnit(4, 0.0, False, False).fc2.bias.item() == 0.0
    with pytest.raises(ValueError) as err:
        build_halting("sometimes", 4, 0.0, 0.9, False)
    assert str(err.value) == ("unknown halting rule 'sometimes'; choose from "
                              "('stick-breaking', 'global-mean', 'act', 'none')")
    with pytest.raises(ValueError) as err:
        LearnedHalting("act", 4, 0.0, 0.9, False, transition=True)
    assert str(err.value) == ("--halting-transition applies to 'stick-breaking' and "
                              "'global-mean', not to 'act'")
    check_threshold(1.0)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError) as err:
            check_threshold(bad)
        assert str(err.value) == f"halting threshold must be in (0, 1]; got {bad}"


def test_halting_state_starts_in_fp32_on_the_states_device():
    """c, log Π(1 - â) and Σ α h start at 0 in fp32 whatever h's dtype, shaped (B, T)
    and (B, T, d); the step counts are long, on h's device (meta here)."""
    from sut_fairseq.modules.halting import HaltingState

    h = torch.empty(2, 3, 4, dtype=torch.bfloat16, device="meta")
    state = HaltingState(h, torch.ones(2, 3, dtype=torch.bool, device="meta"))
    for t, shape in ((state.c, (2, 3)), (state.log_remain, (2, 3)), (state.weighted_sum, (2, 3, 4))):
        assert t.dtype == torch.float32 and t.shape == shape and t.device.type == "meta"
    assert state.steps.dtype == torch.long and state.steps.shape == (2, 3)
    assert state.steps.device.type == "meta"
    assert state.alphas == [] and state.prefix_in is None and state.prefix_out == {}


def test_the_recurrence_loop_hands_each_rule_call_its_arguments():
    """The recurrence's loop with a recording rule and block: ``begin`` gets the
    prefix sums, ``decide`` the step number l >= 2, and when every position has halted
    before step l the early-exit hook gets (S, h, l) with the last h."""
    from sut_fairseq.modules.halting import HaltingState, NoHalting
    from toy_recurrence import run_toy

    calls = []

    class Recording(NoHalting):
        def begin(self, h0, real, prefix_in=None):
            calls.append(("begin", prefix_in))
            return HaltingState(h0, real, prefix_in)

        def decide(self, h, running, state, step, threshold=None):
            calls.append(("decide", step))
            return running & (step < 3)  # everyone halts before step 3

    h0 = torch.randn(1, 2, 4)
    real = torch.ones(1, 2, dtype=torch.bool)
    exits = []
    prefix = {2: (torch.zeros(1, 4), torch.zeros(1))}
    S, result, state = run_toy(lambda h, S, running, l: h + l, h0, real, Recording(), 5,
                               on_early_exit=lambda S, h, l: exits.append((S, h, l)),
                               prefix_in=prefix)
    assert calls == [("begin", prefix), ("decide", 2), ("decide", 3)]
    assert len(exits) == 1 and exits[0][2] == 3
    torch.testing.assert_close(exits[0][1], h0 + 1 + 2)  # h after steps 1 and 2
    torch.testing.assert_close(S, h0 + 3)
    assert state.steps.tolist() == [[2, 2]]


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean"])
def test_the_transition_reading_is_the_earlier_state_then_the_later(rule):
    """[x(h_{l-2}); x(h_{l-1})] in that order: a unit that reads only the first half's
    first coordinate gives α from h_{l-2}, computed by hand (swapping the halves gives
    other values from step 2 on)."""
    from sut_fairseq.modules.halting import LearnedHalting

    halting = LearnedHalting(rule, 2, 0.0, 0.999, False, transition=True)
    with torch.no_grad():
        halting.unit.fc1.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
        halting.unit.fc1.bias.zero_()
        halting.unit.fc2.weight.copy_(torch.tensor([[1.0, 0.0]]))
        halting.unit.fc2.bias.zero_()
    h = [torch.tensor([[[0.8, 0.3]]]), torch.tensor([[[-1.5, 2.0]]]), torch.tensor([[[2.5, -0.7]]])]
    real = torch.ones(1, 1, dtype=torch.bool)
    state = halting.begin(h[0], real)
    running = real
    for step, h_prev in enumerate(h, 1):  # decide before step l from h_{l-1}
        running = halting.decide(h_prev, running, state, step)

    def gelu(v):
        return v * 0.5 * (1.0 + math.erf(v / math.sqrt(2.0)))

    def sigmoid(v):
        return 1.0 / (1.0 + math.exp(-v))

    # the first half read at step l is h_{l-2} (h_0 at steps 1 and 2), its first coordinate
    earlier = [h[0][0, 0, 0].item(), h[0][0, 0, 0].item(), h[1][0, 0, 0].item()]
    remain, expected = 1.0, []
    for value in earlier:
        p = sigmoid(gelu(value))
        expected.append(p * remain)
        remain *= 1.0 - p
    got = [a[0, 0].item() for a in state.alphas]
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean", "act"])
def test_halted_rows_keep_h_and_s_bit_for_bit(monkeypatch, rule):
    """Every parameter random (biases, LayerNorm gains: a row passed through the block
    would change): once a row stops running, its h and S enter every later step unchanged,
    bit for bit, on both sides."""
    from conftest import randomise_parameters
    from sut_fairseq.modules.recurrence import RecurrenceStep

    model = randomise_parameters(make_model(halting_threshold=0.6, encoder_layers=5,
                                            decoder_layers=5, encoder_halting=rule), seed=3)
    calls = []
    real_call = RecurrenceStep.forward

    def recording(self, h, S, running, step, *args, **kwargs):
        calls.append((id(self), step, h.clone(), S.clone(), running.clone()))
        return real_call(self, h, S, running, step, *args, **kwargs)

    monkeypatch.setattr(RecurrenceStep, "forward", recording)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 40, (4, 7), generator=g)
    prev = torch.randint(4, 40, (4, 6), generator=g)
    with torch.no_grad():
        model(src, torch.full((4,), 7), prev)
    halted_rows = 0
    for side in {c[0] for c in calls}:
        steps = [c for c in calls if c[0] == side]
        assert [c[1] for c in steps] == list(range(1, len(steps) + 1))
        for (_, _, h, S, running), (_, _, h_next, S_next, _) in zip(steps, steps[1:]):
            stopped = ~running
            halted_rows += int(stopped.sum())
            assert torch.equal(h_next[stopped], h[stopped]) and torch.equal(S_next[stopped], S[stopped])
    assert halted_rows > 0, "the test needs rows that halt before the last step"
