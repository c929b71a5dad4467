"""L_MIM and the switch loss on exact small examples; statistics only inside the
criterion's forward; the criterion's scale switch."""
import math

import pytest
import torch

from sut_fairseq.losses import mim_loss, record_routing, switch_loss
from sut_fairseq.modules.router import RouterStats


def _stats(probs, picks=None):
    s = RouterStats()
    probs = torch.as_tensor(probs, dtype=torch.float64)
    if picks is None:
        picks = probs.argmax(1, keepdim=True)
    s.add(probs, torch.ones(probs.size(0), dtype=torch.float64), picks)
    return s


@pytest.mark.parametrize("E", [2, 4, 8])
def test_mim_sanity_values(E):
    balanced = torch.eye(E).repeat(3, 1)  # one-hot, every expert equally often
    assert mim_loss(_stats(balanced)).item() == pytest.approx(-math.log(E), abs=1e-6)
    collapsed = torch.zeros(3 * E, E)
    collapsed[:, 0] = 1
    assert mim_loss(_stats(collapsed)).item() == pytest.approx(0.0, abs=1e-6)
    uniform = torch.full((3 * E, E), 1.0 / E)
    assert mim_loss(_stats(uniform)).item() == pytest.approx(0.0, abs=1e-6)


def test_mim_matches_direct_formula_and_ignores_inactive_rows():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(10, 5, dtype=torch.float64), -1)
    active = torch.tensor([1, 1, 0, 1, 1, 0, 1, 1, 1, 1], dtype=torch.float64)
    s = RouterStats()
    s.add(p[:4], active[:4], p[:4].argmax(1, keepdim=True))
    s.add(p[4:], active[4:], p[4:].argmax(1, keepdim=True))  # two steps accumulate
    q = p[active.bool()]
    g = q.mean(0)
    expect = -(q * q.log()).sum(1).mean() + (g * g.log()).sum()
    assert mim_loss(s).item() == pytest.approx(expect.item(), rel=1e-6)


def test_switch_loss_balanced_and_collapsed():
    E = 4
    assert switch_loss(_stats(torch.eye(E).repeat(2, 1))).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, E)
    collapsed[:, 2] = 1
    assert switch_loss(_stats(collapsed)).item() == pytest.approx(E)


def test_routing_statistics_exist_only_inside_the_context():
    from conftest import make_model

    model = make_model().train()
    src, prev = torch.randint(4, 40, (2, 5)), torch.randint(4, 40, (2, 4))
    with record_routing(model) as stats:
        model(src, torch.tensor([5, 5]), prev)
    assert len(stats) == 2 + 3  # encoder: self-attn + ffd; decoder: self + cross + ffd
    # sut_tiny: 3 encoder steps x 2 rows x 5 positions per encoder router
    assert stats[0].count.item() == 3 * 2 * 5
    routers = [m for m in model.modules() if type(m).__name__ == "Router"]
    assert all(r.stats is None for r in routers)
    model(src, torch.tensor([5, 5]), prev)  # no recording outside the context
    assert all(r.stats is None for r in routers)


def test_criterion_aux_scale_per_token_and_reference():
    from types import SimpleNamespace

    from fairseq.data import Dictionary
    from conftest import make_model
    from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
        SUTLabelSmoothedCrossEntropyCriterion,
    )

    model = make_model()
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    src, prev, tgt = torch.randint(4, 40, (2, 5)), torch.randint(4, 40, (2, 4)), torch.randint(4, 40, (2, 4))
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([5, 5]),
                            "prev_output_tokens": prev}, "target": tgt, "ntokens": 8}

    def run(**kw):
        torch.manual_seed(0)
        crit = SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, **kw)
        return crit(model, sample)

    base, n, log = run()
    assert n == 8
    with_act, _, log_act = run(act_weight=0.5)
    act = (log["act_enc"] / log["positions_enc"]) + (log["act_dec"] / log["positions_dec"])
    assert (with_act - base).item() == pytest.approx(8 * 0.5 * act, rel=1e-5)
    ref, _, _ = run(act_weight=0.5, aux_loss_scale="reference")
    assert (ref - base).item() == pytest.approx(0.5 * act, rel=1e-5)
    with_mim, _, log_mim = run(mim_weight=2.0)
    assert (with_mim - base).item() == pytest.approx(2.0 * log_mim["mim"], rel=1e-4)
    assert log_mim["mim"] < 0  # some information between tokens and experts
    assert log["steps_enc"] == 3 * 10 and log["positions_dec"] == 8
