"""Numerics under mixed precision and deep recurrences (issue 9).

* ``sut_tiny`` through the criterion under CPU autocast (bf16, and fp16 which CPU autocast
  also supports): finite loss, auxiliary terms and gradients, fp32 halting weights that
  sum to 1, and a loss within 1% of the fp32 one.
* 64 steps per side with the halting unit's logits pushed so that â ≈ 0 (every position
  runs all 64 steps, the stick Π(1 - â) ≈ 1) or â ≈ 1 (the remaining stick underflows:
  (1 - â)^l ~ 1e-3^63 is far below fp32's range in linear space): no NaN, no negative
  weight, weights summing to 1, and α_l equal to the float64 closed form
  â (1 - â)^(l-1) where fp32 can represent it.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import make_model, randomise_halting
from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
    SUTLabelSmoothedCrossEntropyCriterion,
)

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _sample(B=4, S=9, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    src[0, :4] = 1  # left padding
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    target = torch.cat([prev[:, 1:], torch.full((B, 1), 2)], 1)
    prev[B - 1, T - 2:] = target[B - 1, T - 2:] = 1  # right padding in the decoder
    return {"net_input": {"src_tokens": src, "src_lengths": src.ne(1).sum(1),
                          "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(1).sum())}


def _criterion(model):
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    return SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, mim_weight=0.1, act_weight=0.01)


def _grads(model):
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, bad
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _assert_distribution(result, atol=1e-5):
    w = result.weights
    assert w.dtype == torch.float32 and torch.isfinite(w).all() and (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), result.real.float(), atol=atol, rtol=0)
    depth = result.expected_depth[result.real]
    assert torch.isfinite(depth).all() and (depth >= 1 - atol).all()
    assert (depth <= result.max_steps + atol).all()


def _forward_backward(model, sample, dtype):
    model.zero_grad()
    torch.manual_seed(5)  # same dropout masks and sampled experts in every precision
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss, sample_size, log = _criterion(model)(model, sample)
        out, extra = model(**sample["net_input"])
    loss.backward()
    return loss, log, out, extra


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_mixed_precision_through_the_criterion(precision):
    # with dropout and sampled experts: everything finite, halting weights a distribution
    model = make_model(dropout=0.1, sample_topk=1, halting_threshold=0.7).train()
    randomise_halting(model, std=4.0)
    sample = _sample()
    loss, log, out, extra = _forward_backward(model, sample, PRECISIONS[precision])
    assert out.dtype == PRECISIONS[precision]  # autocast really ran the model in low precision
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    for key in ("mim", "switch", "act_enc", "act_dec"):
        assert math.isfinite(log[key]), (key, log)
    _grads(model)
    for side in ("halting_encoder", "halting_decoder"):
        _assert_distribution(extra[side])
    # some positions halted early, so the precision of the halting decisions mattered
    assert log["steps_dec"] < 3 * log["positions_dec"]

    # without randomness (a low-precision halting decision may differ from fp32's, which
    # changes how much randomness later layers draw), loss and gradient match fp32
    model = make_model(halting_threshold=0.7).train()
    randomise_halting(model, std=4.0)
    ref_loss, _, _, _ = _forward_backward(model, sample, None)
    ref_grad = _grads(model)
    loss, _, _, _ = _forward_backward(model, sample, PRECISIONS[precision])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    assert torch.nn.functional.cosine_similarity(_grads(model), ref_grad, dim=0) > 0.99


def _deep_model(bias, threshold):
    model = make_model(encoder_layers=64, decoder_layers=64, halting_threshold=threshold).train()
    for side in (model.encoder.side, model.decoder.side):
        with torch.no_grad():
            side.halting.unit.fc2.weight.zero_()  # â = sigmoid(bias) at every position and step
            side.halting.unit.fc2.bias.fill_(bias)
    return model


def _closed_form(bias, steps, L=64):
    """float64 stick-breaking weights of a constant â = sigmoid(bias) over ``steps`` executed
    steps: α_l = â (1 - â)^(l-1) for l < steps and the remaining stick (1 - â)^(steps-1) on
    the last one; in log space (1 - â computed as a difference would lose every digit)."""
    log_a = -math.log1p(math.exp(-bias))  # log sigmoid(bias)
    log_1ma = -bias + log_a  # log (1 - sigmoid(bias)) = log sigmoid(-bias)
    w = [math.exp(log_a + (l - 1) * log_1ma) for l in range(1, steps)]
    return torch.tensor(w + [math.exp((steps - 1) * log_1ma)] + [0.0] * (L - steps),
                        dtype=torch.float64)


# (halting-unit bias, α_thresh, executed steps or None = whenever c reaches 1 in fp32)
EXTREMES = {
    "a_hat~1e-13": (-30.0, 0.999, 64),  # never halts: 64 steps, α_l ≈ 9e-14 each, stick ≈ 1
    "a_hat~1e-13, thresh 1": (-30.0, 1.0, 64),
    "a_hat~1-1e-13": (30.0, 0.999, 1),  # halts at the first decision
    "a_hat~1-3e-4, thresh 1": (8.0, 1.0, None),  # runs until c rounds to 1 in fp32
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(EXTREMES))
def test_64_steps_with_extreme_halting_logits(case, precision):
    bias, threshold, steps = EXTREMES[case]
    model = _deep_model(bias, threshold)
    sample = _sample(B=2, S=6, T=5)
    loss, log, out, extra = _forward_backward(model, sample, PRECISIONS.get(precision))
    assert torch.isfinite(loss) and torch.isfinite(out).all()
    _grads(model)
    for side in ("halting_encoder", "halting_decoder"):
        result = extra[side]
        _assert_distribution(result, atol=1e-6)
        executed = result.steps[result.real]
        assert (executed == executed[0]).all()  # â is the same everywhere
        if steps is None:
            assert 2 <= executed[0] <= 8
        else:
            assert executed[0] == steps
        # the fp32 halting arithmetic (also under bf16 autocast, whose 8-bit mantissa would
        # be off by ~4e-3) equals the float64 closed form
        expected = _closed_form(bias, int(executed[0]))
        for w in result.weights[result.real]:
            torch.testing.assert_close(w.double(), expected, atol=2e-7, rtol=1e-4)
    if bias < 0:  # α_l ≈ 9e-14 are kept, not flushed to 0
        enc = extra["halting_encoder"]
        assert (enc.weights[enc.real][:, :63] > 0).all()


@pytest.mark.parametrize("bias", [8.0, 30.0, -30.0])
def test_stick_underflow_in_log_space_gives_zeros_not_nan(bias):
    """Keep 64 decisions running regardless of the threshold (as if α_thresh could not be
    reached): the remaining stick (1 - â)^l falls far below fp32's smallest number for
    â ≈ 1; α_l must underflow to 0 (never NaN or negative) and c must stay <= 1."""
    model = _deep_model(bias, 1.0)
    halting = model.encoder.side.halting
    h = torch.randn(2, 5, 64)
    real = torch.ones(2, 5, dtype=torch.bool)
    state = halting.begin(h, real)
    with torch.no_grad():
        for step in range(2, 66):
            halting.decide(h, real, state, step)
    alphas = torch.stack(state.alphas, -1)  # (B, T, 64)
    assert torch.isfinite(alphas).all() and (alphas >= 0).all()
    assert torch.isfinite(state.c).all() and (state.c <= 1 + 1e-6).all()
    assert torch.isfinite(state.log_remain).all()
    expected = _closed_form(bias, 65)[:64]  # α_1..α_64 of the closed form
    torch.testing.assert_close(alphas[0, 0].double(), expected, atol=1e-30, rtol=1e-4)
    if bias > 0:
        assert (alphas[..., -1] == 0).all()  # underflowed to exactly 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_64_steps_with_positions_halting_at_different_steps(precision):
    model = make_model(encoder_layers=64, decoder_layers=64, halting_threshold=0.999).train()
    randomise_halting(model, std=2.0, seed=3)
    for side in (model.encoder.side, model.decoder.side):
        with torch.no_grad():
            side.halting.unit.fc2.bias.fill_(-2.0)  # â around 0.1: from 30 steps to all 64
    sample = _sample(B=3, S=8, T=6, seed=1)
    loss, log, out, extra = _forward_backward(model, sample, PRECISIONS.get(precision))
    assert torch.isfinite(loss) and torch.isfinite(out).all()
    _grads(model)
    for side in ("halting_encoder", "halting_decoder"):
        result = extra[side]
        _assert_distribution(result, atol=1e-6)
        steps = result.steps[result.real]
        assert steps.max() > 20 and steps.min() < steps.max()
