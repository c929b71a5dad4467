"""Early exits of the decoder (``--decoder-halting pabee|entropy``): the PABEE counter and
the entropy rule against scalar references, P = 0 / S = 0 against the no-exit model,
S > ln V, monotonicity in P and S, incremental == full under beam reordering, the exit
losses against hand computations, the off-ramp MAC count and the option checks."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from conftest import make_model, randomise_halting, run_incremental
from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import SUTLabelSmoothedCrossEntropyCriterion
from sut_fairseq.models.validation import validate_args
from sut_fairseq.modules.exits import ExitHalting
from toy_recurrence import run_toy
from sut_fairseq.models.standalone import model_args

V = 40  # make_model's dictionary


# ---- the rules on scripted off-ramp outputs ---------------------------------------------

def scripted_rule(rule, table, max_steps, **kw):
    """An ExitHalting whose off-ramp l returns, for the position whose h[..., 0] is r,
    ``table[r][l - 1]`` (an argmax symbol for pabee: a one-hot logit of height 5; a logit
    vector for entropy)."""
    exits = ExitHalting(rule, 4, max_steps, kw.get("patience", 0), kw.get("entropy", 0.0)).eval()

    def offramp(h, step, weight):
        rows = h[:, 0].long().tolist()
        if rule == "pabee":
            return torch.stack([F.one_hot(torch.tensor(table[r][step - 1]), 3).float() * 5 for r in rows])
        return torch.stack([table[r][step - 1] for r in rows])

    exits.offramp = offramp
    return exits


def run_scripted(exits, n_rows, max_steps):
    """The recurrence over n_rows positions with an identity block; returns (steps, exit_step)."""
    h0 = torch.zeros(1, n_rows, 4)
    h0[0, :, 0] = torch.arange(n_rows).float()
    real = torch.ones(1, n_rows, dtype=torch.bool)
    _, result, state = run_toy(lambda h, S, running, l: h, h0, real,
                               exits.bind(torch.zeros(3, 4)), max_steps)
    return result.steps[0].tolist(), state.output.exit_step[0].tolist()


def reference_pabee(preds, patience, max_steps):
    """Scalar PABEE: cnt_1 = 0, cnt_l = cnt_{l-1} + 1 if ŷ_l = ŷ_{l-1} else 0; exit after
    step l < L when cnt_l = P (P = 0: never). Returns the executed steps."""
    if patience == 0:
        return max_steps
    count = 0
    for l in range(1, max_steps):
        count = 0 if l == 1 or preds[l - 1] != preds[l - 2] else count + 1
        if count == patience:
            return l
    return max_steps


def test_pabee_counter_on_a_hand_sequence():
    """Argmax sequence (a, b, b, b, ...) with P = 2: cnt = 0, 0, 1, 2, so exit after step 4."""
    a, b = 0, 1
    table = [[a, b, b, b, b, b, b], [a, a, a, a, a, a, a], [a, b, a, b, a, b, a], [a, b, b, a, a, a, b]]
    steps, exit_step = run_scripted(scripted_rule("pabee", table, 7, patience=2), 4, 7)
    assert steps == [4, 3, 7, 6]
    assert exit_step == [4, 3, 0, 6]  # 0: ran all L steps, the main head's output stands
    steps, _ = run_scripted(scripted_rule("pabee", table, 7, patience=1), 4, 7)
    assert steps == [3, 2, 7, 3]


@pytest.mark.parametrize("patience", [0, 1, 2, 3, 5])
def test_pabee_matches_the_scalar_reference(patience):
    g = torch.Generator().manual_seed(patience)
    L, n = 6, 200
    table = torch.randint(0, 2, (n, L), generator=g).tolist()  # two symbols: long runs happen
    steps, _ = run_scripted(scripted_rule("pabee", table, L, patience=patience), n, L)
    assert steps == [reference_pabee(row, patience, L) for row in table]
    if patience in (1, 2):
        assert len(set(steps)) > 2, "the test needs positions exiting at several steps"


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.8, 1.2])
def test_entropy_rule_matches_the_scalar_reference(threshold):
    g = torch.Generator().manual_seed(1)
    L, n = 5, 100
    table = [[torch.randn(6, generator=g) * 2 for _ in range(L)] for _ in range(n)]
    steps, exit_step = run_scripted(scripted_rule("entropy", table, L, entropy=threshold), n, L)

    def reference(row):
        for l in range(1, L):
            p = [math.exp(x) for x in row[l - 1].tolist()]
            p = [x / sum(p) for x in p]
            if -sum(x * math.log(x) for x in p) < threshold:
                return l
        return L

    assert steps == [reference(row) for row in table]
    assert exit_step == [s if s < L else 0 for s in steps]


# ---- the rules in the model ----------------------------------------------------------------

def _batch(seed=0, B=4, S=6, T=7):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (B, S), generator=g)
    src[1, :2] = 1
    prev = torch.randint(4, V, (B, T), generator=g)
    prev[:, 0] = 2
    return src, prev


def _exit_model(rule, L=5, spread=False, **kw):
    """``spread``: off-ramp l scales its logits by 0.5 l (LayerNorm gain), so that the
    entropies fall with depth and the entropy rule exits at several steps."""
    model = make_model(decoder_halting=rule, decoder_layers=L, halting_threshold=0.7, **kw)
    randomise_halting(model, seed=2)  # the encoder halts at different steps
    if spread:
        with torch.no_grad():
            for l, norm in enumerate(model.decoder.side.halting.norms, start=1):
                norm.weight.fill_(0.5 * l)
    return model




@pytest.mark.parametrize("rule,option", [("pabee", {"exit_patience": 0}), ("entropy", {"exit_entropy": 0})])
def test_zero_patience_or_entropy_reproduces_no_exit_decoding_exactly(rule, option):
    exits = _exit_model(rule, **option)
    plain = _exit_model("none")
    src, prev = _batch()
    with torch.no_grad():
        enc_e, enc_p = exits.encoder(src), plain.encoder(src)
        out_e, extra_e = exits.decoder(prev, enc_e)
        out_p, extra_p = plain.decoder(prev, enc_p)
        inc_e, steps_e, _ = run_incremental(exits, enc_e, prev, reorder=torch.tensor([3, 0, 0, 2]))
        inc_p, steps_p, _ = run_incremental(plain, enc_p, prev, reorder=torch.tensor([3, 0, 0, 2]))
    assert torch.equal(out_e, out_p)
    assert torch.equal(inc_e, inc_p)
    assert torch.equal(extra_e["halting_decoder"].steps, extra_p["halting_decoder"].steps)
    assert (steps_e == 5).all() and extra_e["decoder_exits"].logits is None


def test_entropy_above_log_vocabulary_exits_after_step_one():
    """H(p) <= ln V for any p over V symbols, so S = ln V + 0.01 stops everything after
    step 1, and every position emits W_out LN_1(h_1)."""
    model = _exit_model("entropy", exit_entropy=math.log(V) + 0.01)
    src, prev = _batch()
    with torch.no_grad():
        enc = model.encoder(src)
        logits, extra = model.decoder(prev, enc)
        feats, _ = model.decoder(prev, enc, features_only=True)  # the frozen h_1
        ref = F.linear(model.decoder.side.halting.norms[0](feats), model.decoder.output_projection.weight)
        _, inc_steps, _ = run_incremental(model, enc, prev)
    assert (extra["halting_decoder"].steps == 1).all() and (inc_steps == 1).all()
    assert (extra["decoder_exits"].exit_step == 1).all()
    torch.testing.assert_close(logits, ref, atol=1e-6, rtol=1e-6)


def test_executed_steps_are_monotone_in_patience_and_entropy():
    """Positions that read no other position's state (one target position per sequence:
    the first decoding step of many sources) exit no later for a smaller P or a larger S."""
    model = _exit_model("pabee", L=6)
    g = torch.Generator().manual_seed(5)
    src = torch.randint(4, V, (64, 6), generator=g)
    prev = torch.full((64, 1), 2)
    with torch.no_grad():
        enc = model.encoder(src)

        def steps(rule, **option):
            for key, value in option.items():
                setattr(model.decoder.side.halting, key, value)
            model.decoder.side.halting.rule = rule
            return model.decoder(prev, enc)[1]["halting_decoder"].steps[:, 0]

        by_patience = [steps("pabee", patience=p) for p in (1, 2, 3, 4)] + [steps("pabee", patience=0)]
        by_entropy = [steps("entropy", entropy=s) for s in (4.0, 3.5, 3.0, 2.0, 1.0, 0.0)]
    for runs in (by_patience, by_entropy):
        for fewer, more in zip(runs, runs[1:]):
            assert (fewer <= more).all()
        assert (runs[0] < runs[-1]).any(), "the test needs the option to matter"
    # and on whole sequences at the first position, which reads only itself
    src, prev = _batch()
    with torch.no_grad():
        enc = model.encoder(src)
        model.decoder.side.halting.rule = "pabee"
        first = []
        for p in (1, 2, 3, 0):
            model.decoder.side.halting.patience = p
            first.append(model.decoder(prev, enc)[1]["halting_decoder"].steps[:, 0])
    for fewer, more in zip(first, first[1:]):
        assert (fewer <= more).all()


@pytest.mark.parametrize("rule,option,seed", [("pabee", {"exit_patience": 2}, 1),
                                              ("entropy", {"exit_entropy": 2.0, "spread": True}, 3)])
def test_incremental_equals_full_forward_with_exits(rule, option, seed):
    model = _exit_model(rule, **option)
    src, prev = _batch(seed=seed)
    with torch.no_grad():
        enc = model.encoder(src)
        full, extra = model.decoder(prev, enc)
        inc, steps, _ = run_incremental(model, enc, prev)
    steps_full = extra["halting_decoder"].steps
    assert torch.equal(steps, steps_full)
    assert (steps_full < 5).any() and (steps_full == 5).any(), "the test needs exits and non-exits"
    assert (steps_full.max(0).values < 5).any(), "the test needs whole-batch early exits"
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    # per hypothesis under beam reordering: equal to decoding each final history from scratch
    reorder = torch.tensor([2, 0, 0, 3])
    with torch.no_grad():
        inc, _, final_prev = run_incremental(model, enc, prev, reorder=reorder)
        order = torch.arange(4)
        for _ in range(prev.size(1) - 1):
            order = order.index_select(0, reorder)
        full, _ = model.decoder(final_prev, model.encoder.reorder_encoder_out(enc, order))
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def test_exited_positions_emit_their_offramp_and_freeze():
    model = _exit_model("entropy", exit_entropy=2.0, spread=True)
    src, prev = _batch(seed=3)
    with torch.no_grad():
        enc = model.encoder(src)
        logits, extra = model.decoder(prev, enc)
        feats, _ = model.decoder(prev, enc, features_only=True)
    out = extra["decoder_exits"]
    exited = out.exit_step > 0
    assert exited.any() and (~exited).any() and len(set(out.exit_step[exited].tolist())) > 1
    W = model.decoder.output_projection.weight
    for b, t in exited.nonzero().tolist():
        l = int(out.exit_step[b, t])
        ref = F.linear(model.decoder.side.halting.norms[l - 1](feats[b, t]), W)  # the frozen h_l
        torch.testing.assert_close(logits[b, t], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[~exited], F.linear(feats[~exited], W), atol=1e-5, rtol=1e-5)


# ---- training: the exit losses -------------------------------------------------------------

def _criterion(model, exit_loss, **kw):
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    return SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, exit_loss=exit_loss, **kw)


def _sample(model):
    src, prev = _batch(seed=4)
    target = torch.cat([prev[:, 1:], torch.full((prev.size(0), 1), 2)], 1)
    target[0, -2:] = 1  # padding
    prev = prev.clone()
    prev[0, -1] = 1
    return {"net_input": {"src_tokens": src, "src_lengths": src.ne(1).sum(1), "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(1).sum())}


def _reference_step_losses(model, sample):
    """CE_l by fairseq's label_smoothed_nll_loss, with h_l from the same weights run for
    exactly l steps (a model of l decoder steps without halting: S_l = h_l)."""
    L = model.decoder.side.num_steps
    target = sample["target"].reshape(-1, 1)
    losses = []
    for l in range(1, L + 1):
        short = make_model(decoder_halting="none", decoder_layers=l, halting_threshold=0.7)
        short.load_state_dict({k: v for k, v in model.state_dict().items() if "decoder.side.halting" not in k})
        short.train()
        feats, _ = short.decoder(sample["net_input"]["prev_output_tokens"], short.encoder(
            sample["net_input"]["src_tokens"]), features_only=True)
        W = model.decoder.output_projection.weight
        head = model.decoder.side.halting.norms[l - 1](feats) if l < L else feats
        lprobs = F.log_softmax(F.linear(head, W), -1).reshape(-1, W.size(0))
        losses.append(label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=1)[0])
    return losses


def _train_model(rule="pabee"):
    model = _exit_model(rule, L=4)
    with torch.no_grad():  # off-ramp LayerNorms away from their identity initialisation
        g = torch.Generator().manual_seed(8)
        for norm in model.decoder.side.halting.norms:
            norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g))
            norm.bias.copy_(0.1 * torch.randn(norm.bias.shape, generator=g))
    return model.train()


def test_weighted_exit_loss_is_the_pabee_average():
    model = _train_model()
    sample = _sample(model)
    loss, sample_size, log = _criterion(model, "weighted")(model, sample)
    ce = _reference_step_losses(model, sample)
    L = len(ce)
    expected = sum(l * c for l, c in enumerate(ce, start=1)) / (L * (L + 1) / 2)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-5)
    for l in range(1, L + 1):
        torch.testing.assert_close(log[f"exit_loss_{l}"], ce[l - 1].detach(), atol=1e-4, rtol=1e-5)
    loss.backward()
    assert model.decoder.side.halting.norms[0].weight.grad is not None
    assert model.decoder.side.block.ffd.up.weight.grad.abs().sum() > 0


def test_offramps_exit_loss_trains_the_offramps_only():
    model = _train_model("entropy")
    sample = _sample(model)
    loss, _, log = _criterion(model, "offramps")(model, sample)
    ce = _reference_step_losses(model, sample)
    torch.testing.assert_close(loss, sum(ce[:-1]), atol=1e-4, rtol=1e-5)
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, _ in model.decoder.side.halting.norms.named_parameters(prefix="decoder.side.halting.norms")}
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in trained)


def test_exit_loss_errors_name_the_problem():
    model = make_model().train()
    with pytest.raises(ValueError, match="--exit-loss weighted needs a model with off-ramps"):
        _criterion(model, "weighted")(model, _sample(model))
    with pytest.raises(ValueError, match="--mim-weight 0.01"):
        _criterion(model, "offramps", mim_weight=0.01)


def test_exit_loss_none_keeps_the_plain_objective():
    """``--exit-loss none`` on an exit model is the label-smoothed CE (fairseq's
    ``label_smoothed_nll_loss``, summed over the target tokens) of the main head of a model
    without exits holding the same weights: all L steps run in training, the off-ramps
    add nothing."""
    model = _train_model()
    sample = _sample(model)
    loss, _, log = _criterion(model, "none")(model, sample)
    plain = make_model(decoder_halting="none", decoder_layers=4, halting_threshold=0.7).train()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "decoder.side.halting" not in k})
    net = sample["net_input"]
    logits, extra = plain(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
    assert "decoder_exits" not in extra and (extra["halting_decoder"].steps[net["prev_output_tokens"].ne(1)] == 4).all()
    lprobs = F.log_softmax(logits, -1).reshape(-1, V)
    expected, _ = label_smoothed_nll_loss(lprobs, sample["target"].reshape(-1, 1), 0.1, ignore_index=1)
    assert not any(k.startswith("exit_loss_") for k in log)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-5)


# ---- MACs and options ----------------------------------------------------------------------------

def test_macs_count_the_offramps_per_running_position_and_step():
    from sut_fairseq.analysis.macs import count_forward

    model = _exit_model("pabee", exit_patience=2)
    src, prev = _batch(seed=1)
    net_input = {"src_tokens": src, "src_lengths": src.ne(1).sum(1), "prev_output_tokens": prev}
    with torch.no_grad():
        steps = model(**net_input)[1]["halting_decoder"].steps
    L, d = 5, model.decoder.output_projection.weight.size(1)
    evaluated = int(steps.clamp(max=L - 1).sum())  # off-ramps 1 .. min(steps, L-1)
    dynamic = count_forward(model, net_input, "dynamic")
    assert dynamic.parts["offramp"] == evaluated * V * d
    assert dynamic.steps["decoder"][0] == int(steps.sum())
    static = count_forward(model, net_input, "static")
    assert static.parts["offramp"] == 0 and static.steps["decoder"][0] == L * prev.numel()
    assert model.decoder.side.halting.exits_enabled  # restored after the static count


_PATIENCE = "is invalid: must be an integer >= 0 (0 = never exit)"
_ENTROPY = "is invalid: must be a finite number >= 0 (nats; 0 = never exit)"
_ONE_STEP = ("is invalid: the exit rules need --decoder-layers >= 2 (got --decoder-layers 1: one step "
             "leaves nothing to exit before)")
_UNREAD = "is invalid: it is read only by --decoder-halting pabee|entropy, and --decoder-halting is"


@pytest.mark.parametrize("option,value,message", [
    ("exit_patience", -1, f"--exit-patience=-1 {_PATIENCE}"),
    ("exit_patience", 1.5, f"--exit-patience=1.5 {_PATIENCE}"),
    ("exit_entropy", -0.1, f"--exit-entropy=-0.1 {_ENTROPY}"),
    ("exit_entropy", float("nan"), f"--exit-entropy=nan {_ENTROPY}"),
    ("exit_entropy", float("inf"), f"--exit-entropy=inf {_ENTROPY}"),
    ("encoder_halting", "pabee",
     "--encoder-halting='pabee' is invalid: choose from ('stick-breaking', 'global-mean', 'act', 'none') "
     "(the exit rules ('pabee', 'entropy') are for the decoder)"),
])
def test_bad_exit_options_are_rejected_with_their_value(option, value, message):
    args = model_args("sut_tiny", share_all_embeddings=True, decoder_halting="pabee")
    setattr(args, option, value)
    with pytest.raises(ValueError) as err:
        validate_args(args)
    assert str(err.value) == message


@pytest.mark.parametrize("options,message", [
    (dict(decoder_halting="pabee", decoder_layers=1), f"--decoder-halting='pabee' {_ONE_STEP}"),
    (dict(decoder_halting="entropy", decoder_layers=1, encoder_layers=3), f"--decoder-halting='entropy' {_ONE_STEP}"),
    (dict(decoder_halting="stick-breaking", exit_patience=2),
     f"--exit-patience=2 {_UNREAD} 'stick-breaking' (leave --exit-patience at its default 3)"),
    (dict(decoder_halting="none", exit_entropy=0.5),
     f"--exit-entropy=0.5 {_UNREAD} 'none' (leave --exit-entropy at its default 0.1)"),
    (dict(encoder_halting="act", exit_entropy=0.0),  # the decoder follows the encoder
     f"--exit-entropy=0.0 {_UNREAD} 'act' (leave --exit-entropy at its default 0.1)"),
])
def test_exit_options_that_would_be_ignored_are_refused_naming_both_options(options, message):
    """Before these checks, one decoder step silently meant ``--decoder-halting none``
    (and ``--exit-loss`` failed at the first update), and the exit options were ignored
    under the other halting rules."""
    with pytest.raises(ValueError) as err:
        make_model(**options)
    assert str(err.value) == message


def test_the_other_exit_rules_option_is_kept_for_the_sweep():
    """Both exit rules share the off-ramps: ``--exit-entropy`` under pabee (and
    ``--exit-patience`` under entropy) is accepted, as the exit sweep's
    ``--model-overrides "{'decoder_halting': 'entropy', 'exit_entropy': S}"`` on a pabee
    checkpoint leaves the checkpoint's patience in its arguments; the value is then read
    after the switch."""
    model = make_model(decoder_halting="pabee", decoder_layers=3, exit_patience=2, exit_entropy=0.7)
    assert (model.decoder.side.halting.patience, model.decoder.side.halting.entropy) == (2, 0.7)
    model = make_model(decoder_halting="entropy", decoder_layers=3, exit_patience=1, exit_entropy=0.5)
    assert (model.decoder.side.halting.rule, model.decoder.side.halting.patience) == ("entropy", 1)


def test_exit_module_checks_its_own_arguments():
    with pytest.raises(ValueError, match=r"--exit-patience=-2 is invalid"):
        ExitHalting("pabee", 8, 4, -2, 0.1)
    with pytest.raises(ValueError, match="unknown exit rule 'margin'"):
        ExitHalting("margin", 8, 4, 2, 0.1)


def test_rules_share_the_offramps_so_either_loads_the_other():
    """--model-overrides "{'decoder_halting': 'entropy'}" on a pabee checkpoint."""
    pabee = _exit_model("pabee")
    entropy = _exit_model("entropy")
    entropy.load_state_dict(pabee.state_dict())
    extra = set(pabee.state_dict()) - set(_exit_model("none").state_dict())
    assert extra == {f"decoder.side.halting.norms.{i}.{p}" for i in range(4) for p in ("weight", "bias")}


def test_training_runs_every_step_and_hands_over_the_states():
    """In training nothing exits, even with a rule that would stop everything after step
    1 at inference, and the criterion gets h_1 .. h_{L-1}."""
    model = _exit_model("entropy", exit_entropy=math.log(V) + 0.01).train()
    src, prev = _batch()
    _, extra = model(src, None, prev)
    assert (extra["halting_decoder"].steps == 5).all()
    out = extra["decoder_exits"]
    assert len(out.hidden) == 4 and out.logits is None and (out.exit_step == 0).all()
    assert all(h.shape == (4, 7, 64) for h in out.hidden)
