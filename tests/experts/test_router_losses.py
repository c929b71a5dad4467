"""L_MIM and the switch loss on exact small examples; statistics only inside the
criterion's forward; the criterion's scale switch."""
import math

import pytest
import torch

from sut_fairseq.criterions.losses import mim_loss, record_routing, switch_loss
from sut_fairseq.modules.router import RouterStats


def _stats(probs, picks=None):
    probs = torch.as_tensor(probs, dtype=torch.float64)
    s = RouterStats(probs.size(1))
    if picks is None:
        picks = probs.argmax(1, keepdim=True)
    s.add(probs, picks)
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


def test_mim_matches_direct_formula_over_several_calls():
    """Statistics of several calls (recurrent steps) add up to L_MIM over all their rows;
    rows the Router never sees (padding, halted) are tested through a real forward below."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(10, 5, dtype=torch.float64), -1)
    s = RouterStats(5)
    s.add(p[:4], p[:4].argmax(1, keepdim=True))
    s.add(p[4:], p[4:].argmax(1, keepdim=True))  # two steps accumulate
    g = p.mean(0)
    expect = -(p * p.log()).sum(1).mean() + (g * g.log()).sum()
    assert mim_loss(s).item() == pytest.approx(expect.item(), rel=1e-6)
    assert s.count.item() == 10


def test_losses_of_a_router_that_saw_nothing_or_one_position():
    """Nothing recorded: both losses are exactly 0. One position (|X| = 1, one pick):
    g(e) = g(e|x), so L_MIM = H(g) - H(g) = 0, and L_switch = E · g(e*) for its pick e*
    (E = 2, g = (0.7, 0.3), pick 0: 1.4)."""
    empty = RouterStats(3)
    assert mim_loss(empty).item() == 0.0 and switch_loss(empty).item() == 0.0
    one = _stats([[0.7, 0.3]], picks=torch.tensor([[0]]))
    assert mim_loss(one).item() == pytest.approx(0.0, abs=1e-12)
    assert switch_loss(one).item() == pytest.approx(1.4, rel=1e-12)


def test_switch_loss_balanced_and_collapsed():
    E = 4
    assert switch_loss(_stats(torch.eye(E).repeat(2, 1))).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, E)
    collapsed[:, 2] = 1
    assert switch_loss(_stats(collapsed)).item() == pytest.approx(E)


def _routers_of_two_sizes():
    """Five routers' statistics: three with E = 3 (one saw nothing), two with E = 5; the
    gate sums leaves that require a gradient, as in training."""
    torch.manual_seed(1)
    stats = []
    for E, rows in ((3, 7), (5, 4), (3, 0), (3, 9), (5, 6)):
        s = RouterStats(E, grad=True)
        if rows:
            p = torch.softmax(torch.randn(rows, E, dtype=torch.float64), -1).float()
            s.add(p, torch.randint(0, E, (rows, 2)), active=torch.rand(rows) > 0.3)
        stats.append(s)
    return stats


def test_stacked_losses_equal_each_routers_own():
    """``stack_stats`` groups routers by E ({3: three, 5: two}); L_MIM and L_switch of the
    stacked groups are, router by router, the one-router values (the same operations per
    element: bit for bit), and their sums' gradients reach each router's Σ g as the
    per-router sum's do."""
    from sut_fairseq.criterions.losses import stack_stats

    stats = _routers_of_two_sizes()
    groups = stack_stats(stats)
    assert [tuple(g.sum_probs.shape) for g in groups] == [(3, 3), (2, 5)]
    assert [tuple(g.count.shape) for g in groups] == [(3,), (2,)]
    order = [0, 2, 3, 1, 4]  # the routers in the groups' order
    for loss in (mim_loss, switch_loss):
        stacked = torch.cat([loss(g) for g in groups])
        assert torch.equal(stacked, torch.stack([loss(stats[i]) for i in order]))
        total = sum(loss(g).sum() for g in groups)
        grads = torch.autograd.grad(total, [s.sums for s in stats])  # Σ g's part of each router's
        expect = torch.autograd.grad(sum(loss(s) for s in stats), [s.sums for s in stats])
        for a, b in zip(grads, expect):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert loss(groups[0])[1].item() == 0.0  # the router that saw nothing


def test_auxiliary_terms_sum_the_routers_and_leave_out_weight_zero_router_terms():
    """``auxiliary_losses`` sums the routers' L_MIM and L_switch (written out here per
    router); ``weighted`` is mim·w1 + act·w2 + switch·w3 with a router term of weight 0 left
    out of the graph: a NaN switch or MIM term at weight 0 leaves the loss and the other
    term's gradient finite (0 · NaN would not); the ACT term stays at weight 0 (its
    gradient 0: the halting units stay in the graph, ``test_distributed.py``)."""
    from sut_fairseq.criterions.auxiliary import AuxiliaryLosses, auxiliary_losses

    stats = _routers_of_two_sizes()
    terms = auxiliary_losses(stats, {}, torch.zeros(()))
    torch.testing.assert_close(terms.mim, sum(mim_loss(s) for s in stats), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(terms.switch, sum(switch_loss(s) for s in stats), rtol=1e-6, atol=1e-7)
    act = {"enc": torch.tensor(2.5, requires_grad=True), "dec": torch.tensor(1.5)}
    both = AuxiliaryLosses(terms.mim, terms.switch, act, {})
    expect = 0.3 * terms.mim + 0.1 * (2.5 + 1.5) + 0.2 * terms.switch
    torch.testing.assert_close(both.weighted(0.3, 0.1, 0.2), expect)
    nan = torch.tensor(float("nan"), requires_grad=True)
    aux = AuxiliaryLosses(terms.mim, nan, act, {}).weighted(0.3, 0.1, 0.0)
    torch.testing.assert_close(aux, 0.3 * terms.mim + 0.1 * 4.0)
    grad = torch.autograd.grad(aux, stats[0].sums)[0][:3]  # the Σ g part (E = 3)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    aux = AuxiliaryLosses(nan, terms.switch, act, {}).weighted(0.0, 0.0, 0.2)
    torch.testing.assert_close(aux, 0.2 * terms.switch)
    assert torch.autograd.grad(aux, act["enc"])[0].item() == 0.0  # in the graph at weight 0
    # no halting side and no router weight: still a 0-dim tensor of the terms' dtype
    none = AuxiliaryLosses(terms.mim, terms.switch, {}, {}).weighted(0.0, 0.1, 0.0)
    assert torch.is_tensor(none) and none.dim() == 0 and none.dtype == terms.mim.dtype and none.item() == 0
    # the sums take the main loss's dtype (fp64 here) with fp32 statistics
    wide = auxiliary_losses(stats, {}, torch.zeros((), dtype=torch.float64))
    assert wide.mim.dtype == wide.switch.dtype == torch.float64
    torch.testing.assert_close(wide.mim, terms.mim.double())


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


def test_the_sums_of_gates_start_with_a_gradient_when_the_forward_differentiates_the_router():
    """In training the sums of gates (Σ g, Σ g log g) carry a gradient from a router's first
    call on; they start as leaves requiring one, so that a compiled step sees the same
    tensors at step 1 as after it (one graph: ``test_compiled_step.py``'s compilation
    bound). The counts never carry one; without autograd (validation) or with the model
    frozen (``--exit-loss offramps``' base model), nothing does, before or after a call."""
    from conftest import make_model

    model = make_model().train()
    src, prev = torch.randint(4, 40, (2, 5)), torch.randint(4, 40, (2, 4))

    def grads(stats):
        return {(s.sum_probs.requires_grad, s.sum_neg_entropy.requires_grad,
                 s.count.requires_grad, s.assignments.requires_grad) for s in stats}

    with record_routing(model) as stats:
        assert grads(stats) == {(True, True, False, False)}
        model(src, torch.tensor([5, 5]), prev)
        assert grads(stats) == {(True, True, False, False)}
    with torch.no_grad(), record_routing(model) as stats:
        assert grads(stats) == {(False, False, False, False)}
    model.requires_grad_(False)
    with record_routing(model) as stats:
        assert grads(stats) == {(False, False, False, False)}
        model(src, torch.tensor([5, 5]), prev)
        assert grads(stats) == {(False, False, False, False)}


def test_criterion_aux_scale_per_token_and_reference():
    from types import SimpleNamespace

    from fairseq.data import Dictionary
    from conftest import make_model
    from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
        SUTLabelSmoothedCrossEntropyCriterion,
    )

    model = make_model().train()  # dropout 0: deterministic; the auxiliary terms train
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


def _criterion_sample():
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(3)
    src, prev = torch.randint(4, 40, (3, 6), generator=g), torch.randint(4, 40, (3, 5), generator=g)
    prev[:, 0] = 2
    tgt = torch.cat([prev[:, 1:], torch.full((3, 1), 2)], 1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((3,), 6),
                            "prev_output_tokens": prev}, "target": tgt, "ntokens": 15}
    return sample


def test_validation_loss_is_the_label_smoothed_ce_alone():
    """In eval mode (fairseq's validation) ``loss`` leaves out the MIM, switch and ACT
    terms, whatever their weights; they are still logged under their own names. In
    training mode the same batch adds them."""
    from types import SimpleNamespace

    from conftest import make_model, randomise_halting
    from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
        SUTLabelSmoothedCrossEntropyCriterion,
    )

    model = make_model()
    randomise_halting(model)
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    sample = _criterion_sample()
    plain = SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    weighted = SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, mim_weight=0.1,
                                                     act_weight=1.0, switch_weight=0.5)
    with torch.no_grad():
        model.eval()
        loss_plain, _, log_plain = plain(model, sample)
        loss_eval, _, log_eval = weighted(model, sample)
        model.train()
        loss_train, _, _ = weighted(model, sample)
    assert loss_eval.item() == pytest.approx(loss_plain.item(), rel=1e-6)
    assert log_eval["loss"].item() == pytest.approx(loss_plain.item(), rel=1e-6)
    # the auxiliary terms are still measured at validation
    assert log_eval["act_enc"] > 0 and log_eval["mim"] != 0 and log_eval["switch"] > 0
    aux = (0.1 * log_eval["mim"] + 0.5 * log_eval["switch"]
           + 15 * (log_eval["act_enc"] / log_eval["positions_enc"]
                   + log_eval["act_dec"] / log_eval["positions_dec"]))
    assert loss_train.item() == pytest.approx(loss_plain.item() + aux, rel=1e-5)


def _router_counts(model, sample):
    with torch.no_grad(), record_routing(model) as stats:
        _, extra = model(**sample["net_input"])
    return stats, extra


def test_router_statistics_exclude_padding_and_halted_rows_in_a_real_forward():
    """Through the model's own forward: each router's statistics cover exactly the
    executed (position, step) pairs (count = Σ executed steps of its side), and adding
    padding to a sequence changes none of them (count, Σ g(·|x), Σ g log g)."""
    from conftest import make_model, randomise_halting

    model = make_model(halting_threshold=0.6, encoder_layers=4, decoder_layers=4)
    randomise_halting(model, seed=4)
    sample = _criterion_sample()
    one = {k: v[:1] for k, v in sample["net_input"].items()}
    stats, extra = _router_counts(model, {"net_input": one})
    enc_steps = extra["halting_encoder"].steps
    dec_steps = extra["halting_decoder"].steps
    assert (enc_steps < 4).any() and (dec_steps < 4).any(), "the test needs halted rows"
    # encoder: self-attention + FFD; decoder: self-attention, cross-attention, FFD
    expected = [enc_steps.sum()] * 2 + [dec_steps.sum()] * 3
    assert [s.count.item() for s in stats] == [int(n) for n in expected]

    padded = {
        "src_tokens": torch.cat([torch.ones(1, 3, dtype=torch.long), one["src_tokens"]], 1),
        "src_lengths": one["src_lengths"],
        "prev_output_tokens": torch.cat([one["prev_output_tokens"],
                                         torch.ones(1, 2, dtype=torch.long)], 1),
    }
    stats_padded, _ = _router_counts(model, {"net_input": padded})
    for a, b in zip(stats, stats_padded):
        assert a.count.item() == b.count.item()
        torch.testing.assert_close(a.sum_probs, b.sum_probs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.sum_neg_entropy, b.sum_neg_entropy, atol=1e-5, rtol=1e-5)
