"""The expert router on its own: top-k gating against a per-row loop and exact hand-worked
examples, the statistics it records (value and dtype), inactive rows going to the no-op
expert, the eager-CPU, every-row (CUDA) and compiled paths, dtypes, and Gumbel sampling in
training (exact draws, frequencies, the clamp of the uniforms) against greedy evaluation."""
import math

import pytest
import torch

from sut_fairseq.modules.router import EPS, Router, RouterStats


def _reference(router, x, active):
    """Per-row loop in float64: softmax(W2 tanh(W1 x + b1)), the k largest gates in
    descending order, renormalised; inactive rows -> (E, gate 0). Also the statistics over
    the active rows (Σ g, Σ Σ g log g, |X|, picks per expert)."""
    E, k = router.num_experts, router.top_k
    W1 = router.fc1.weight.detach().double()
    b1 = router.fc1.bias.detach().double()
    W2 = router.fc2.weight.detach().double()
    idx = torch.full((x.size(0), k), E, dtype=torch.long)
    gates = torch.zeros(x.size(0), k, dtype=torch.float64)
    sum_probs = torch.zeros(E, dtype=torch.float64)
    neg_ent, count = 0.0, 0
    picks = torch.zeros(E, dtype=torch.float64)
    for n in range(x.size(0)):
        if not active[n]:
            continue
        logits = W2 @ torch.tanh(W1 @ x[n].double() + b1)
        e = [math.exp(v) for v in (logits - logits.max()).tolist()]
        p = [v / sum(e) for v in e]
        order = sorted(range(E), key=lambda j: -p[j])[:k]
        total = sum(p[j] for j in order)
        for j, e_j in enumerate(order):
            idx[n, j] = e_j
            gates[n, j] = p[e_j] / total
            picks[e_j] += 1
        sum_probs += torch.tensor(p, dtype=torch.float64)
        neg_ent += sum(v * math.log(v) for v in p)
        count += 1
    return idx, gates, dict(sum_probs=sum_probs, sum_neg_entropy=neg_ent, count=count,
                            assignments=picks)


def _check_stats(stats, ref, E, atol=1e-5):
    for name in ("sum_probs", "sum_neg_entropy", "count", "assignments"):
        assert getattr(stats, name).dtype == torch.float32, name
    assert stats.sum_probs.shape == (E,) and stats.assignments.shape == (E,)
    assert stats.count.shape == () and stats.sum_neg_entropy.shape == ()
    assert stats.count.item() == ref["count"]
    assert torch.equal(stats.assignments, ref["assignments"].float())
    torch.testing.assert_close(stats.sum_probs.double(), ref["sum_probs"], atol=atol, rtol=1e-5)
    assert stats.sum_neg_entropy.item() == pytest.approx(ref["sum_neg_entropy"], abs=atol, rel=1e-5)


def _fixed_router(probs, top_k, sample_topk=0, dtype=torch.float32):
    """A router whose g(·|x) is ``probs`` for every input: fc1 = 0·x + atanh(1/2), so the
    hidden unit is 1/2, and fc2 = 2·log(probs), so the logits are log(probs)."""
    probs = torch.as_tensor(probs, dtype=torch.float64)
    r = Router(3, probs.numel(), top_k, 1, sample_topk=sample_topk)
    with torch.no_grad():
        r.fc1.weight.zero_()
        r.fc1.bias.fill_(math.atanh(0.5))
        r.fc2.weight.copy_((2 * probs.log()).unsqueeze(1))
    return r.to(dtype)


def _fixed_logits_router(logits, top_k, sample_topk=0, dtype=torch.float32):
    """Same construction with the logits given directly (fc2 = 2·logits)."""
    logits = torch.as_tensor(logits, dtype=torch.float64)
    r = Router(3, logits.numel(), top_k, 1, sample_topk=sample_topk)
    with torch.no_grad():
        r.fc1.weight.zero_()
        r.fc1.bias.fill_(math.atanh(0.5))
        r.fc2.weight.copy_((2 * logits).unsqueeze(1))
    return r.to(dtype)


# ---------------------------------------------------------------- RouterStats


@pytest.mark.parametrize("device", [None, "cpu", "meta"])
def test_stats_start_at_zero_float32_on_the_given_device(device):
    """Every sum starts as a float32 zero of its shape ((E,), (), (), (E,)) on the device
    asked for (the meta device stands in for an accelerator: a sum left on the CPU would
    show); no device means the default one. None requires a gradient unless asked
    (``grad``: then the two sums of gates do, the counts never)."""
    s = RouterStats(5, device=device)
    want = torch.device(device) if device is not None else torch.empty(0).device
    shapes = dict(sum_probs=(5,), sum_neg_entropy=(), count=(), assignments=(5,))
    for name, shape in shapes.items():
        t = getattr(s, name)
        assert t.device == want, name
        assert t.dtype == torch.float32 and tuple(t.shape) == shape, name
        assert not t.requires_grad, name
        if want.type != "meta":
            assert (t == 0).all(), name
    s = RouterStats(5, device=device, grad=True)
    assert [getattr(s, name).requires_grad for name in shapes] == [True, True, False, False]


# ---------------------------------------------------------------- greedy routing


@pytest.mark.parametrize("E,k", [(2, 1), (5, 2), (6, 3), (4, 4)])
def test_eval_routing_matches_per_row_loop(E, k):
    """In eval mode both paths give, per active row, the k experts of largest g(e|x) in
    descending order with gates g renormalised over them; inactive rows get the no-op
    expert E with gate 0; the statistics are those of the active rows only."""
    torch.manual_seed(10 * E + k)
    router = Router(7, E, k, 5, sample_topk=min(1, k)).eval()  # sampling is off in eval
    x = torch.randn(13, 7)
    active = torch.tensor([True, False, True, True, False, True, True,
                           True, False, True, True, True, False])
    router.stats = RouterStats(E)
    routing = router(x, active)
    idx, gates, stats = _reference(router, x, active)
    assert torch.equal(routing.expert_idxs, idx)
    assert routing.gates.dtype == torch.float32
    torch.testing.assert_close(routing.gates.double(), gates, atol=1e-6, rtol=1e-5)
    assert routing.num_experts == E
    _check_stats(router.stats, stats, E)


def test_hand_worked_top2_of_three():
    """g = (0.5, 0.3, 0.2) for every row, k = 2, rows (active, inactive, active): the picks
    are (0, 1) with gates (0.625, 0.375), the inactive row gets (3, 3) with gates 0; the
    statistics: |X| = 2, Σ g = (1, 0.6, 0.4), Σ Σ g log g = 2 (0.5 ln 0.5 + 0.3 ln 0.3 +
    0.2 ln 0.2) = -2.0593, picks (2, 2, 0)."""
    router = _fixed_router([0.5, 0.3, 0.2], top_k=2).eval()
    x = torch.randn(3, 3)
    active = torch.tensor([True, False, True])
    router.stats = RouterStats(3)
    routing = router(x, active)
    assert routing.expert_idxs.tolist() == [[0, 1], [3, 3], [0, 1]]
    torch.testing.assert_close(routing.gates, torch.tensor([[0.625, 0.375], [0.0, 0.0], [0.625, 0.375]]))
    s = router.stats
    assert s.count.dtype == torch.float32 and s.count.item() == 2.0
    torch.testing.assert_close(s.sum_probs, torch.tensor([1.0, 0.6, 0.4]))
    assert s.sum_neg_entropy.item() == pytest.approx(
        2 * (0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)), abs=1e-5)
    assert s.sum_neg_entropy.item() == pytest.approx(-2.0593, abs=1e-4)
    assert s.assignments.tolist() == [2.0, 2.0, 0.0]
    # k = 1: gate 1 on the best expert; k = E: the gates are g itself, best first
    for k, gates in ((1, [[1.0]]), (3, [[0.5, 0.3, 0.2]])):
        r = _fixed_router([0.2, 0.5, 0.3], top_k=k).eval()
        out = r(x[:1], torch.tensor([True]))
        assert out.expert_idxs.tolist() == [[1, 2, 0][:k]]
        torch.testing.assert_close(out.gates, torch.tensor(gates))


def test_the_router_skips_the_hidden_layer_of_inactive_rows():
    """The router routes every row (static shapes, eager and compiled alike) but computes
    the hidden layer of the active rows only (``masked_linear``), so NaN garbage in
    inactive rows reaches neither the gates, nor the picks, nor the statistics, and the
    active rows get the per-row reference."""
    torch.manual_seed(4)
    router = Router(6, 5, 2, 4).eval()
    x = torch.randn(9, 6)
    active = torch.tensor([True, False, True, True, False, True, False, True, True])
    idx, gates, stats = _reference(router, x, active)
    x[~active] = float("nan")
    seen = []
    router.fc1.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    router.stats = RouterStats(5)
    with torch.no_grad():
        routing = router(x, active)
    assert seen == [], "the hidden layer goes through masked_linear, not fc1 on every row"
    assert torch.equal(routing.expert_idxs, idx)
    assert torch.isfinite(routing.gates).all()
    torch.testing.assert_close(routing.gates.double(), gates, atol=1e-6, rtol=1e-5)
    _check_stats(router.stats, stats, 5)


def test_low_precision_router_computes_gates_in_fp32_and_returns_the_input_dtype():
    """A bfloat16 router: g(·|x) is the float32 softmax of its bfloat16 logits (the
    statistics carry it at fp32 accuracy), and the Routing's gates come back in the
    input's dtype."""
    torch.manual_seed(5)
    router = Router(8, 6, 2, 8).to(torch.bfloat16).eval()
    x = torch.randn(10, 8, dtype=torch.bfloat16)
    active = torch.ones(10, dtype=torch.bool)
    active[3] = False
    probs, top_idx, top_gates = router._route(x)
    assert probs.dtype == torch.float32 and top_gates.dtype == torch.float32
    with torch.no_grad():
        logits = router.fc2(torch.tanh(router.fc1(x)))
    assert logits.dtype == torch.bfloat16
    want = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(probs, want, atol=1e-6, rtol=1e-6)
    router.stats = RouterStats(6)
    routing = router(x, active)
    assert routing.gates.dtype == torch.bfloat16
    torch.testing.assert_close(router.stats.sum_probs, want[active].sum(0), atol=1e-6, rtol=1e-6)
    top = want.topk(2, dim=1)
    assert torch.equal(routing.expert_idxs[active], top.indices[active])
    ref_gates = (top.values / top.values.sum(1, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(routing.gates[active], ref_gates[active])
    assert (routing.gates[~active] == 0).all() and (routing.expert_idxs[~active] == 6).all()


def test_double_router_keeps_double_precision():
    """fp32 *at least*: a float64 router keeps float64 probabilities and gates."""
    torch.manual_seed(6)
    router = Router(4, 3, 2, 4).double().eval()
    probs, _, top_gates = router._route(torch.randn(5, 4, dtype=torch.float64))
    assert probs.dtype == torch.float64 and top_gates.dtype == torch.float64


# ---------------------------------------------------------------- sampling in training


def _gumbel_reference(logits, probs, k, n_sample, u):
    """Greedy k - n picks by g, then the n largest of logits + Gumbel(u) among the rest,
    u clamped to [EPS, 1 - EPS] (row loop, float64)."""
    out = []
    for row in range(logits.size(0)):
        p = probs[row].tolist()
        greedy = sorted(range(len(p)), key=lambda j: -p[j])[:k - n_sample]
        score = {}
        for j in range(len(p)):
            if j not in greedy:
                uj = min(max(float(u[row, j]), EPS), 1 - EPS)
                score[j] = float(logits[row, j]) - math.log(-math.log(uj))
        out.append(greedy + sorted(score, key=lambda j: -score[j])[:n_sample])
    return out


@pytest.mark.parametrize("k,n_sample", [(1, 1), (3, 1), (3, 2)])
def test_training_samples_by_gumbel_top_n_exact_draws(k, n_sample):
    """In training, k - n experts are taken greedily and n are sampled without replacement
    by Gumbel-top-n with the uniforms drawn from the global generator (reproduced here from
    the same seed); eval with the same router is greedy."""
    torch.manual_seed(7)
    E = 6
    router = Router(5, E, k, 4, sample_topk=n_sample).double().train()
    x = torch.randn(40, 5, dtype=torch.float64)
    active = torch.ones(40, dtype=torch.bool)
    with torch.no_grad():
        logits = router.fc2(torch.tanh(router.fc1(x)))
    probs = logits.softmax(-1)
    torch.manual_seed(123)
    routing = router(x, active)
    torch.manual_seed(123)
    u = torch.rand(40, E, dtype=torch.float64)
    want = _gumbel_reference(logits, probs, k, n_sample, u)
    assert routing.expert_idxs.tolist() == want
    greedy = probs.topk(k, dim=1).indices
    assert not torch.equal(routing.expert_idxs, greedy), "some draw must differ from greedy"
    top = probs.gather(1, routing.expert_idxs)
    torch.testing.assert_close(routing.gates, top / top.sum(1, keepdim=True))
    router.eval()
    assert torch.equal(router(x, active).expert_idxs, greedy)


@pytest.mark.parametrize("k", [1, 2])
def test_sampled_expert_frequencies_follow_g(k):
    """g = (0.4, 0.3, 0.2, 0.1), one sampled slot, 20000 rows: with k = 1 the sampled
    expert is e with frequency g(e); with k = 2 slot 0 is always expert 0 and slot 1 is e
    with frequency g(e) / (1 - g(0)) over e = 1, 2, 3 (sampling without replacement)."""
    g = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    router = _fixed_router(g, top_k=k, sample_topk=1).train()
    N = 20000
    torch.manual_seed(8)
    idx = router(torch.zeros(N, 3), torch.ones(N, dtype=torch.bool)).expert_idxs
    if k == 2:
        assert (idx[:, 0] == 0).all()
        want = torch.cat([torch.zeros(1, dtype=torch.float64), g[1:] / g[1:].sum()])
    else:
        want = g
    freq = torch.bincount(idx[:, -1], minlength=4).double() / N
    torch.testing.assert_close(freq, want, atol=0.012, rtol=0)


def test_uniform_zero_is_clamped_to_eps(monkeypatch):
    """A uniform of exactly 0 (torch.rand can return it) is clamped to EPS: its Gumbel noise
    is -log(-log EPS) = -3.03, finite, so an expert with g = 0.98 still wins over two with
    g = 0.01 drawing u = 1/2 (noise 0.37); unclamped it would be -inf and never chosen."""
    router = _fixed_router([0.98, 0.01, 0.01], top_k=1, sample_topk=1).train()
    u = torch.tensor([[0.0, 0.5, 0.5]])
    monkeypatch.setattr(torch, "rand_like", lambda t: u.to(t.dtype).expand_as(t).clone())
    routing = router(torch.zeros(2, 3), torch.ones(2, dtype=torch.bool))
    assert routing.expert_idxs.tolist() == [[0], [0]]
    assert -math.log(-math.log(EPS)) == pytest.approx(-3.031, abs=1e-3)


def test_largest_uniform_is_clamped_to_one_minus_eps_in_double(monkeypatch):
    """In float64 (where 1 - EPS is representable) the largest uniform torch.rand can
    return, 1 - 2^-53, is clamped to 1 - EPS: its noise is -log(-log(1 - EPS)) = 20.7, not
    36.7. Logits (0, 28), uniforms (1 - 2^-53, 1/2): expert 1 wins (28.37 > 20.72), the
    unclamped noise would pick expert 0."""
    router = _fixed_logits_router([0.0, 28.0], top_k=1, sample_topk=1, dtype=torch.float64).train()
    u = torch.tensor([[1 - 2.0 ** -53, 0.5]], dtype=torch.float64)
    assert u[0, 0].item() < 1.0
    monkeypatch.setattr(torch, "rand_like", lambda t: u.to(t.dtype).expand_as(t).clone())
    routing = router(torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, dtype=torch.bool))
    assert routing.expert_idxs.tolist() == [[1], [1]]
    assert -math.log(-math.log(1 - EPS)) == pytest.approx(20.72, abs=1e-2)
    assert -math.log(-math.log(1 - 2.0 ** -53)) == pytest.approx(36.74, abs=1e-2)


# ---------------------------------------------------------------- construction and paths

def test_sampling_is_off_unless_asked_for():
    """The default ``sample_topk`` is 0: a training router picks greedily, as in evaluation."""
    torch.manual_seed(0)
    router = Router(4, 5, 2, 6)
    assert router.sample_topk == 0
    x, active = torch.randn(40, 4), torch.ones(40, dtype=torch.bool)
    first, second = router.train()(x, active), router(x, active)
    greedy = router.eval()(x, active)
    assert torch.equal(first.expert_idxs, second.expert_idxs)
    assert torch.equal(first.expert_idxs, greedy.expert_idxs)


def test_sample_topk_above_k_is_refused_with_the_range():
    with pytest.raises(ValueError, match=r"^sample-topk must be in \[0, k=2\]; got 3$"):
        Router(4, 5, 2, 6, sample_topk=3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_one_expert_needs_no_parameters_and_sends_inactive_rows_to_the_no_op_expert(dtype):
    router = Router(4, 1, 1, 6)
    assert list(router.parameters()) == []
    active = torch.tensor([True, False, True, False])
    r = router(torch.randn(4, 4, dtype=dtype), active)
    assert r.expert_idxs.tolist() == [[0], [1], [0], [1]]  # 1 = E, the no-op expert
    assert r.gates.dtype == dtype and r.gates.squeeze(1).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert r.expert_offsets.tolist() == [2]


