"""What ``sut_label_smoothed_cross_entropy`` logs (``reduce_metrics``), worked by hand from
logging outputs: the auxiliary losses per target token, L_ACT per halting unit, executed
steps per real position, steps per chunk, the exit losses in base 2 in step order, each
weighted by its own denominator when fairseq averages several batches; nothing logged for
a side without positions or chunks."""
import math

import pytest
from fairseq.logging import metrics

from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import SUTLabelSmoothedCrossEntropyCriterion

Criterion = SUTLabelSmoothedCrossEntropyCriterion
BASE = dict(loss=0.0, nll_loss=0.0, ntokens=1, nsentences=1)


def _reduce(*batches):
    """``reduce_metrics`` once per batch (a list of logging outputs), as fairseq's trainer
    calls it once per update, inside one aggregation; the smoothed values."""
    with metrics.aggregate(new_root=True) as agg:
        for logging_outputs in batches:
            Criterion.reduce_metrics(logging_outputs)
        return agg.get_smoothed_values()


def test_one_batch_of_two_logging_outputs_by_hand():
    logs = [dict(BASE, sample_size=10, mim=1.23456, switch=0.5, act_enc=7.0, act_units_enc=4,
                 act_dec=2.0, act_units_dec=3, steps_enc=14, positions_enc=4, steps_dec=10,
                 positions_dec=3, chunks_enc=2, chunk_steps_enc=8, exit_loss_10=0.7,
                 exit_loss_2=1.4, exit_loss_1=2.8),
            dict(BASE, sample_size=6, mim=0.1, switch=0.25, act_enc=3.0, act_units_enc=2,
                 act_dec=0.0, act_units_dec=0, steps_enc=5, positions_enc=2, steps_dec=0,
                 positions_dec=0, chunks_enc=1, chunk_steps_enc=2, exit_loss_10=0.1,
                 exit_loss_2=0.2, exit_loss_1=0.4)]
    values = _reduce(logs)
    assert values["mim"] == round(1.33456 / 16, 4) and values["switch"] == round(0.75 / 16, 4)
    # each rounded as fairseq prints it (4 decimals for the losses, 3 for the rest)
    assert values["act_enc"] == round(10.0 / 6, 3) == 1.667 and values["act_dec"] == round(2.0 / 3, 3)
    assert values["steps_enc"] == round(19 / 6, 3) == 3.167 and values["steps_dec"] == round(10 / 3, 3)
    assert values["chunk_steps_enc"] == round(10 / 3, 3) == 3.333 and "chunk_steps_dec" not in values
    for key, total in (("exit_loss_1", 3.2), ("exit_loss_2", 1.6), ("exit_loss_10", 0.8)):
        assert values[key] == round(total / 16 / math.log(2), 3), key
    exits = [k for k in values if k.startswith("exit_loss_")]
    assert exits == ["exit_loss_1", "exit_loss_2", "exit_loss_10"]          # in step order
    assert Criterion.logging_outputs_can_be_summed() is True


def test_batches_are_averaged_with_each_metrics_own_weight():
    """Two updates: each value is weighted by its denominator (target tokens for the
    auxiliary and exit losses, halting units for L_ACT, positions for steps, chunks for
    chunk steps)."""
    first = dict(BASE, sample_size=2, mim=1.0, switch=2.0, act_enc=1.0, act_units_enc=1, steps_enc=2,
                 positions_enc=1, act_dec=4.0, act_units_dec=4, steps_dec=12, positions_dec=3,
                 chunks_dec=1, chunk_steps_dec=5, exit_loss_1=2.0)
    second = dict(BASE, sample_size=6, mim=0.0, switch=0.0, act_enc=9.0, act_units_enc=3, steps_enc=4,
                  positions_enc=4, act_dec=1.0, act_units_dec=1, steps_dec=2, positions_dec=1,
                  chunks_dec=3, chunk_steps_dec=3, exit_loss_1=0.0)
    values = _reduce([first], [second])
    # per batch: mim 0.5 / 0 (weights 2, 6); act_enc 1 / 3 (weights 1, 3); steps_enc 2 / 1
    # (weights 1, 4); act_dec 1 / 1; steps_dec 4 / 2 (weights 3, 1); chunk steps 5 / 1 (1, 3)
    assert values["mim"] == round((0.5 * 2) / 8, 4) and values["switch"] == round((1.0 * 2) / 8, 4)
    assert values["act_enc"] == round((1 * 1 + 3 * 3) / 4, 3)
    assert values["steps_enc"] == round((2 * 1 + 1 * 4) / 5, 3)
    assert values["steps_dec"] == round((4 * 3 + 2 * 1) / 4, 3)
    assert values["chunk_steps_dec"] == round((5 * 1 + 1 * 3) / 4, 3)
    assert values["exit_loss_1"] == round((1.0 / math.log(2)) * 2 / 8, 3)


def test_a_side_without_positions_or_chunks_logs_nothing():
    """(A batch without target tokens never reaches here: fairseq's own reduce divides by
    ``sample_size`` first.)"""
    log = dict(BASE, sample_size=4, mim=1.0, switch=1.0, act_enc=1.0, act_units_enc=1, steps_enc=1,
               positions_enc=0, exit_loss_1=1.0)
    values = _reduce([log])
    assert {"mim", "switch", "exit_loss_1"} <= set(values)
    assert not {"act_enc", "steps_enc", "act_dec", "steps_dec", "chunk_steps_enc",
                "chunk_steps_dec"} & set(values)


def test_a_logging_output_without_an_exit_loss_adds_nothing_to_it():
    """The exit losses are summed over the logging outputs that have them: one without
    (a validation-style output, which the criterion logs without exit losses) adds 0, not
    an error and not 1, while its target tokens still count."""
    with_exits = dict(BASE, sample_size=4, exit_loss_1=2.0, exit_loss_2=1.0)
    without = dict(BASE, sample_size=4)
    values = _reduce([with_exits, without])
    assert values["exit_loss_1"] == round(2.0 / 8 / math.log(2), 3)
    assert values["exit_loss_2"] == round(1.0 / 8 / math.log(2), 3)


# --------------------------------------------------------------------------- forward's logging output

def _sample(B=3, S=6, T=5, seed=3):
    import torch

    g = torch.Generator().manual_seed(seed)
    src, prev = torch.randint(4, 40, (B, S), generator=g), torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    tgt = torch.cat([prev[:, 1:], torch.full((B, 1), 2)], 1)
    tgt[0, -2:] = 1                                   # padding in the target
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((B,), S),
                          "prev_output_tokens": prev}, "target": tgt, "ntokens": int(tgt.ne(1).sum())}


def _criterion(model, **kw):
    from types import SimpleNamespace

    return Criterion(SimpleNamespace(target_dictionary=model.decoder.dictionary), kw.pop("sentence_avg", False),
                     0.1, **kw)


def test_the_logging_output_of_a_batch_by_hand():
    """Every key of the logging output against what it counts: the NLL of the logits, the
    batch's tokens and sentences, L_ACT and its units, executed steps and real positions
    per side, the correct predictions of the non-padding targets (--report-accuracy)."""
    import torch
    import torch.nn.functional as F

    from conftest import make_model, randomise_halting

    model = make_model(encoder_layers=3, decoder_layers=3)
    randomise_halting(model)
    sample = _sample()
    crit = _criterion(model, report_accuracy=True)
    with torch.no_grad():
        logits, extra = model(**sample["net_input"])
        # rows 1 and 2 of the target are the model's own predictions: 10 correct at least
        sample["target"][1:] = logits[1:].argmax(-1)
        loss, sample_size, log = crit(model, sample)
    target = sample["target"]
    keep = target.ne(1)
    lprobs = F.log_softmax(logits.double(), -1)
    nll = -lprobs.gather(2, target.unsqueeze(2)).squeeze(2)[keep].sum()
    enc, dec = extra["halting_encoder"], extra["halting_decoder"]
    assert sample_size == sample["ntokens"] == 13
    assert set(log) == {"loss", "nll_loss", "ntokens", "nsentences", "sample_size", "mim", "switch",
                        "act_enc", "act_dec", "act_units_enc", "act_units_dec", "steps_enc", "steps_dec",
                        "positions_enc", "positions_dec", "n_correct", "total"}
    assert log["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert (log["ntokens"], log["nsentences"], log["sample_size"]) == (13, 3, 13)
    # the decoder's positions are its input tokens (no padding here), not the targets
    assert log["act_units_enc"] == enc.act_units().item() == 18 and log["act_units_dec"] == 15
    assert log["act_enc"] == pytest.approx(enc.act_loss().item() * 18, rel=1e-5)
    assert log["steps_enc"] == enc.steps.sum().item() and log["positions_enc"] == 18
    assert log["steps_dec"] == dec.steps.sum().item() and log["positions_dec"] == 15
    assert log["n_correct"].item() == logits.argmax(-1)[keep].eq(target[keep]).sum().item() >= 10
    assert log["total"].item() == 13


def test_sentence_averaging_counts_sentences():
    import torch

    from conftest import make_model

    model = make_model()
    sample = _sample(B=3, T=5)
    with torch.no_grad():
        _, sample_size, log = _criterion(model, sentence_avg=True)(model, sample)
    assert sample_size == log["sample_size"] == log["nsentences"] == 3 and log["ntokens"] == 13
    assert "n_correct" not in log and "total" not in log          # --report-accuracy is off by default


def test_the_off_ramp_stage_refuses_what_would_move_the_frozen_model():
    """``--exit-loss offramps`` with any auxiliary weight, or with --fp16 / --bf16 alone
    (fairseq's flattened optimiser), is refused with the whole reason; the memory-efficient
    optimisers and --amp are accepted."""
    from types import SimpleNamespace

    task = SimpleNamespace(target_dictionary=None)
    for weights in (dict(mim_weight=0.1), dict(act_weight=0.1), dict(switch_weight=0.1)):
        with pytest.raises(ValueError) as err:
            Criterion(task, False, 0.1, exit_loss="offramps", **weights)
        got = {k: weights.get(k, 0.0) for k in ("mim_weight", "act_weight", "switch_weight")}
        assert str(err.value) == (
            "--exit-loss offramps trains the off-ramps only, with the rest of the model frozen; "
            "the auxiliary losses would train it: got --mim-weight {mim_weight}, --act-weight "
            "{act_weight}, --switch-weight {switch_weight} (set them to 0)".format(**got))
    for flag in ("fp16", "bf16"):
        with pytest.raises(ValueError) as err:
            Criterion(task, False, 0.1, exit_loss="offramps", **{flag: True})
        assert str(err.value) == (
            f"--exit-loss offramps cannot train with --{flag}: fairseq's FP16Optimizer gives the "
            "frozen parameters zero gradients, so --weight-decay (and Adam moments restored from "
            f"the first stage) would change the frozen model; use --memory-efficient-{flag} (it "
            "skips parameters without a gradient) or fp32")
    for accepted in (dict(fp16=True, memory_efficient_fp16=True), dict(bf16=True, memory_efficient_bf16=True),
                     dict(fp16=True, amp=True)):
        Criterion(task, False, 0.1, exit_loss="offramps", **accepted)


def test_a_model_without_routers_logs_zero_auxiliary_losses():
    """A dense UT (no routers): the MIM and switch terms are 0, not missing."""
    import torch

    from conftest import make_model

    model = make_model("ut_cpvr", encoder_layers=2, decoder_layers=2)
    with torch.no_grad():
        loss, _, log = _criterion(model, mim_weight=0.5, switch_weight=0.5)(model.train(), _sample())
    assert log["mim"] == 0.0 and log["switch"] == 0.0 and torch.isfinite(loss)


def test_chunked_sides_log_their_chunks():
    """With chunk-wise recurrence on both sides, the real chunks and the block applications
    per chunk of each side."""
    import torch

    from conftest import make_model

    model = make_model(encoder_chunk_size=3, encoder_memory_slots=2, decoder_chunk_size=2,
                       decoder_memory_slots=2)
    sample = _sample(B=2, S=7, T=5)
    with torch.no_grad():
        _, _, log = _criterion(model)(model, sample)
        _, extra = model(**sample["net_input"])
    for side, key in (("enc", "halting_encoder"), ("dec", "halting_decoder")):
        halting = extra[key]
        assert log[f"chunks_{side}"] == halting.chunk_real.sum().item() > 0
        assert log[f"chunk_steps_{side}"] == halting.chunk_steps.sum().item() > 0
    assert log["chunks_enc"] == 2 * 3       # 7 tokens in chunks of 3, both sentences


def test_unreduced_losses_are_per_target_token():
    """``reduce=False`` (fairseq's per-sentence scoring): a loss per target position, 0 on
    padding, summing to the reduced loss (eval: no auxiliary terms)."""
    import torch

    from conftest import make_model

    model = make_model()
    sample = _sample()
    crit = _criterion(model)
    with torch.no_grad():
        reduced, _, _ = crit(model, sample)
        per_token, _, _ = crit(model, sample, reduce=False)
    assert per_token.numel() == sample["target"].numel()
    assert per_token.view(3, 5)[0, -2:].abs().sum() == 0
    assert per_token.sum().item() == pytest.approx(reduced.item(), rel=1e-5)


def test_weighted_exit_loss_trains_the_states_through_the_off_ramps():
    """``--exit-loss weighted``: the off-ramps' CE reaches the shared block through h_l (it
    is not detached as in ``offramps``): the block's gradient differs from the main head's
    share alone, L · CE_L / (L (L + 1) / 2)."""
    import torch

    from conftest import make_model

    model = make_model(decoder_halting="pabee", decoder_layers=3).train()
    sample = _sample()
    params = [p for p in model.decoder.side.block.parameters() if p.requires_grad]
    loss, _, _ = _criterion(model, exit_loss="weighted")(model, sample)
    weighted = torch.autograd.grad(loss, params, allow_unused=True)
    main, _, _ = _criterion(model)(model, sample)
    share = torch.autograd.grad(main * 3 / 6, params, allow_unused=True)
    differs = [not torch.allclose(a, b) for a, b in zip(weighted, share) if a is not None and b is not None]
    assert any(differs)


def test_an_exit_loss_without_off_ramps_is_refused_whole():
    import torch

    from conftest import make_model

    model = make_model().train()
    with pytest.raises(ValueError) as err, torch.no_grad():
        _criterion(model, exit_loss="weighted")(model, _sample())
    assert str(err.value) == ("--exit-loss weighted needs a model with off-ramps: "
                              "--decoder-halting pabee or entropy (and --decoder-layers >= 2)")
