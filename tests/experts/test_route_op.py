"""``sut::route_top_k`` (``ops/route_op.py``) on its PyTorch backend: its hand-written
gradient against autograd through the reference's operations and a numerical gradient
check, its layout against ``make_routing``, its statistics against ``RouterStats.add``,
and which path a router takes. The Triton kernels behind it on CUDA:
tests/kernels/test_routing_interpret.py."""
import pytest
import torch

from sut_fairseq.modules.router import Router, RouterStats
from sut_fairseq.ops.route_op import route_top_k_reference
from sut_fairseq.ops.routing import make_routing


def _case(N=9, E=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(N, E, generator=g)).to(dtype)
    active = torch.rand(N, generator=g) > 0.3
    return logits, active, g


@pytest.mark.parametrize("k", [1, 2, 5])
def test_backward_equals_autograd_through_the_reference(k):
    """A loss on the gates and on the statistics' sums (the distribution's and the
    entropy's terms): the op's gradient of the logits equals autograd's through the
    reference's operations."""
    logits, active, g = _case()
    wg = torch.randn(9, k, generator=g, dtype=torch.float64)
    ws = torch.randn(2 * 5 + 2, generator=g, dtype=torch.float64)
    grads = []
    for fn in (torch.ops.sut.route_top_k, route_top_k_reference):
        z = logits.clone().requires_grad_()
        gates, *_, sums = fn(z, None, active, k, z.dtype, None)
        ((gates * wg).sum() + (sums * ws).sum()).backward()
        grads.append(z.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-13)
    assert grads[0][~active].abs().sum() == 0  # inactive rows: no gates, no statistics


@pytest.mark.parametrize("part", ["gates", "sums"])
def test_a_loss_on_one_output_alone(part):
    """Only the gates, or only the statistics, in the loss (autograd then hands the op's
    backward None for the other): the same gradient as autograd through the reference."""
    logits, active, g = _case()
    w = torch.randn(9, 2, generator=g, dtype=torch.float64) if part == "gates" else \
        torch.randn(12, generator=g, dtype=torch.float64)
    grads = []
    for fn in (torch.ops.sut.route_top_k, route_top_k_reference):
        z = logits.clone().requires_grad_()
        gates, *_, sums = fn(z, None, active, 2, z.dtype, None)
        ((gates if part == "gates" else sums) * w).sum().backward()
        grads.append(z.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-13)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("k", [1, 3])
def test_the_weights_form_equals_autograd_through_the_linear_layer(k):
    """With the router's last layer W (E, D) as an input, z = x W^T: the gradients of x and
    W equal autograd's through ``F.linear`` and the reference, and a numerical check."""
    g = torch.Generator().manual_seed(k)
    x0 = torch.randn(9, 7, generator=g, dtype=torch.float64)
    w0 = torch.randn(5, 7, generator=g, dtype=torch.float64)
    active = torch.rand(9, generator=g) > 0.3
    wg = torch.randn(9, k, generator=g, dtype=torch.float64)
    ws = torch.randn(12, generator=g, dtype=torch.float64)
    grads = []
    for fn in (torch.ops.sut.route_top_k, route_top_k_reference):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        gates, *_, sums = fn(x, w, active, k, x.dtype, None)
        ((gates * wg).sum() + (sums * ws).sum()).backward()
        grads.append((x.grad, w.grad))
    for got, want in zip(grads[0], grads[1]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    assert grads[0][0][~active].abs().sum() == 0 and grads[0][1].abs().sum() > 0

    def fn(x, w):
        gates, *_, sums = torch.ops.sut.route_top_k(x, w, active, k, x.dtype, None)
        return gates, sums[:11]

    assert torch.autograd.gradcheck(fn, (x0.clone().requires_grad_(), w0.clone().requires_grad_()))


@pytest.mark.parametrize("part", ["gates", "sums"])
def test_gradcheck(part):
    logits, active, _ = _case(N=5, E=4)

    def fn(z):
        gates, *_, sums = torch.ops.sut.route_top_k(z, None, active, 2, z.dtype, None)
        return gates if part == "gates" else sums[:2 * 4 + 1]

    assert torch.autograd.gradcheck(fn, (logits.clone().requires_grad_(),))


@pytest.mark.parametrize("N, E, k", [(9, 5, 2), (1, 3, 3), (16, 24, 4), (7, 2, 1)])
def test_layout_and_statistics_are_the_routers_pytorch_path(N, E, k):
    """The picks, gates and layout are ``make_routing`` of the masked top-k of softmax(z);
    the sums are those ``RouterStats.add`` accumulates from the distribution."""
    logits, active, _ = _case(N, E, dtype=torch.float32)
    gates, expert_idxs, sorted_e, sorted_s, offsets, sums = torch.ops.sut.route_top_k(
        logits, None, active, k, torch.float32, None)
    probs = logits.softmax(1)
    top_idx = probs.topk(k, 1).indices
    assert torch.equal(expert_idxs, top_idx.masked_fill(~active.unsqueeze(1), E))
    want = make_routing(expert_idxs, gates, E)
    assert torch.equal(sorted_e, want.sorted_expert_idxs) and torch.equal(sorted_s, want.sorted_scattered_idxs)
    assert torch.equal(offsets, want.expert_offsets)
    top = probs.gather(1, top_idx)
    torch.testing.assert_close(gates, top / top.sum(1, keepdim=True) * active.unsqueeze(1))
    stats = RouterStats(E)
    stats.add(probs, top_idx, active)
    torch.testing.assert_close(sums, stats.sums)


def test_a_vanishing_probability_keeps_the_statistics_finite():
    """A logit 40 below the rest (p ~ 1e-18 < the 1e-9 floor): p log(p + 1e-9) is ~0, not
    NaN, in the statistics and in their gradient."""
    logits, active, g = _case(N=4, E=3)
    logits[:, 2] = -40.0
    z = logits.clone().requires_grad_()
    gates, *_, sums = torch.ops.sut.route_top_k(z, None, active, 2, z.dtype, None)
    (sums[:7] * torch.randn(7, generator=g, dtype=torch.float64)).sum().backward()
    assert torch.isfinite(sums).all() and torch.isfinite(z.grad).all()
    want = route_top_k_reference(logits, None, active, 2)[-1]
    p = logits.softmax(1)
    torch.testing.assert_close(want[6], ((p * torch.log(p + 1e-9)).sum(1) * active).sum())


def test_backward_op_returns_the_logits_dtype():
    logits, active, g = _case(N=5, E=4, dtype=torch.bfloat16)
    experts = route_top_k_reference(logits, None, active, 2)[1]
    grad, no_x, no_h = torch.ops.sut.route_top_k_backward(
        logits, None, active, experts, torch.randn(5, 2, generator=g), torch.randn(10, generator=g))
    assert grad.dtype == torch.bfloat16 and grad.shape == (5, 4) and no_x.numel() == no_h.numel() == 0


def test_bf16_logits_give_gates_in_the_asked_dtype_and_a_bf16_gradient():
    """Gates in the expert layers' compute dtype (rounded once from fp32, as the router's
    PyTorch path casts them), statistics in fp32, the logits' gradient in their dtype."""
    logits, active, _ = _case(N=6, E=4, dtype=torch.float32)
    z = logits.bfloat16().requires_grad_()
    gates, *_, sums = torch.ops.sut.route_top_k(z, None, active, 2, torch.bfloat16, None)
    assert gates.dtype == torch.bfloat16 and sums.dtype == torch.float32
    want = route_top_k_reference(logits.bfloat16(), None, active, 2)[0]
    assert want.dtype == torch.float32 and torch.equal(gates, want.bfloat16())
    (gates.sum() + sums[:4].pow(2).sum()).backward()
    assert z.grad.dtype == torch.bfloat16


def test_router_takes_the_op_where_the_routed_ops_run_triton(monkeypatch):
    """``SUT_KERNELS=triton`` (as CUDA tensors): the op; the CPU default: the PyTorch
    path; a router that samples picks in training: the PyTorch path."""
    router = Router(8, 4, 2, 16)
    x = torch.randn(3, 8)
    monkeypatch.delenv("SUT_KERNELS", raising=False)
    assert not router._one_op(x)
    monkeypatch.setenv("SUT_KERNELS", "triton")
    assert router._one_op(x)
    sampling = Router(8, 4, 2, 16, sample_topk=1)
    assert not sampling._one_op(x) and sampling.eval()._one_op(x)


@pytest.mark.parametrize("with_keep", [False, True])
def test_the_hidden_layer_form_equals_autograd_through_tanh_and_dropout(with_keep):
    """``pre_tanh``: the op fed the hidden layer's pre-activation u equals the op fed h =
    tanh(u) ⊙ keep / (1 - p) zeroed on inactive rows (written out here), outputs and the
    gradients of u and W against autograd through those operations; inactive rows' u
    (even a NaN) change nothing."""
    g = torch.Generator().manual_seed(3)
    N, D, E = 9, 6, 5
    u0 = torch.randn(N, D, generator=g, dtype=torch.float64) * 2
    active = torch.rand(N, generator=g) > 0.3
    u0[~active] = float("nan")
    w0 = torch.randn(E, D, generator=g, dtype=torch.float64)
    keep = torch.rand(N, D, generator=g) >= 0.25 if with_keep else None
    scale = 1 / 0.75 if with_keep else 1.0
    wg = torch.randn(N, 2, generator=g, dtype=torch.float64)
    ws = torch.randn(2 * E + 2, generator=g, dtype=torch.float64)
    outs = []
    for fused in (True, False):
        u, w = u0.clone().requires_grad_(), w0.clone().requires_grad_()
        if fused:
            gates, *layout, sums = torch.ops.sut.route_top_k(u, w, active, 2, u.dtype, None, keep,
                                                             scale, True)
        else:
            h = torch.tanh(u) * (keep if with_keep else 1) * scale
            h = torch.where(active.unsqueeze(1), h, 0.0)
            gates, *layout, sums = route_top_k_reference(h, w, active, 2, u.dtype)
        ((gates * wg).sum() + (sums * ws).sum()).backward()
        outs.append((gates, layout, sums, u.grad, w.grad))
    (g1, l1, s1, du1, dw1), (g0, l0, s0, du0, dw0) = outs
    torch.testing.assert_close(g1, g0, rtol=1e-12, atol=1e-13)
    assert all(torch.equal(a, b) for a, b in zip(l1, l0))
    torch.testing.assert_close(s1, s0, rtol=1e-12, atol=1e-12)
    du0 = torch.where(active.unsqueeze(1), du0, 0.0)  # autograd's NaN x 0 on inactive rows
    torch.testing.assert_close(du1, du0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw1, dw0, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(du1).all() and du1[active].abs().sum() > 0


def test_pre_tanh_needs_the_last_layer_and_a_mask_of_its_shape():
    from sut_fairseq.kernels.routing_triton import _logits_args

    u = torch.randn(4, 6)
    with pytest.raises(ValueError, match="needs the router's last layer"):
        _logits_args(u, None, None, 1.0, True)
    with pytest.raises(ValueError, match=r"keep must be a bool mask of x's shape \(4, 6\)"):
        _logits_args(u, torch.randn(3, 6), torch.ones(4, 5, dtype=torch.bool), 2.0, True)


def test_a_training_router_on_the_op_draws_the_gating_dropout_mask():
    """The op's branch in training: a keep mask of the hidden layer's shape with about
    1 - p kept and the scale 1 / (1 - p); none in evaluation or at p = 0."""
    torch.manual_seed(0)
    router = Router(8, 4, 2, 64, gating_dropout=0.25).train()
    keep, scale = router._keep_mask(torch.zeros(500, 64))
    assert keep.dtype == torch.bool and keep.shape == (500, 64) and scale == pytest.approx(1 / 0.75)
    assert abs(keep.float().mean().item() - 0.75) < 0.01
    assert router.eval()._keep_mask(torch.zeros(3, 64)) == (None, 1.0)
    assert Router(8, 4, 2, 64).train()._keep_mask(torch.zeros(3, 64)) == (None, 1.0)


def test_traced_by_aot_autograd_as_eager():
    """Under ``torch.compile`` (AOT autograd, no inductor) the op's fake outputs and its
    backward trace: the same outputs and gradient as eager, bf16 logits included."""
    logits, active, g = _case(N=12, E=6, dtype=torch.float32)
    wg = torch.randn(12, 3, generator=g)

    def loss(z):
        gates, experts, sorted_e, sorted_s, offsets, sums = torch.ops.sut.route_top_k(z, None, active, 3, z.dtype, None)
        return (gates * wg).sum() + sums[:6].pow(2).sum() + sums[12], experts, sorted_s, offsets

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    for dtype in (torch.float32, torch.bfloat16):
        outs = []
        for fn in (loss, compiled):
            z = logits.to(dtype).requires_grad_()
            value, *layout = fn(z)
            value.backward()
            outs.append((value, layout, z.grad))
        torch.testing.assert_close(outs[1][0], outs[0][0])
        assert all(torch.equal(a, b) for a, b in zip(outs[1][1], outs[0][1]))
        torch.testing.assert_close(outs[1][2], outs[0][2])


@pytest.mark.parametrize("k", [1, 2])
def test_router_through_the_op_equals_its_pytorch_path(monkeypatch, k):
    """The router's op branch (the CUDA one) with the op's PyTorch backend, against the
    router's own PyTorch path: every field of the Routing, the statistics added to the
    running sums of an earlier call, and the gradients of the input and the router's
    weights; gates in the input's dtype."""
    torch.manual_seed(0)
    router = Router(8, 5, k, 16)
    x0 = torch.randn(10, 8)
    active = torch.rand(10, generator=torch.Generator().manual_seed(4)) > 0.3
    out = {}
    for one_op in (False, True):
        monkeypatch.setattr(Router, "_one_op", lambda self, x, use=one_op: use)
        router.zero_grad()
        router.stats = RouterStats(5)
        router(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.ones(4, dtype=torch.bool))
        x = x0.clone().requires_grad_()
        routing = router(x, active)
        s = router.stats
        loss = (routing.gates * torch.arange(1.0, k + 1.0)).sum() + s.sum_probs.pow(2).sum() + 3 * s.sum_neg_entropy
        loss.backward()
        out[one_op] = (routing, [s.sum_probs, s.sum_neg_entropy, s.count, s.assignments], x.grad,
                       [p.grad.clone() for p in router.parameters()])
    (r0, s0, dx0, dp0), (r1, s1, dx1, dp1) = out[False], out[True]
    for field in ("expert_idxs", "sorted_expert_idxs", "sorted_scattered_idxs", "expert_offsets"):
        assert torch.equal(getattr(r1, field), getattr(r0, field)), field
    assert r1.gates.dtype == torch.float32 and r1.num_experts == 5
    torch.testing.assert_close(r1.gates, r0.gates)
    for a, b in zip(s1, s0):
        torch.testing.assert_close(a.detach(), b.detach())
    assert not s1[2].requires_grad and not s1[3].requires_grad  # the counts carry no gradient
    torch.testing.assert_close(dx1, dx0)
    for a, b in zip(dp1, dp0):
        torch.testing.assert_close(a, b)


def test_the_triton_branch_hands_the_kernels_their_arguments(monkeypatch):
    """``SUT_KERNELS=triton`` with the kernels' launchers replaced by the reference
    functions (their contract; the kernels are checked against them in
    tests/kernels/test_routing_interpret.py): outputs and gradient equal the PyTorch
    backend's, and the launchers get contiguous logits and the asked gate dtype."""
    from sut_fairseq.kernels import routing_triton
    from sut_fairseq.ops.route_op import route_top_k_backward_reference

    calls = []

    def forward(logits, weight, active, k, gate_dtype, running, keep, keep_scale, pre_tanh,
                gate_rows):
        calls.append((logits.is_contiguous(), active.is_contiguous(), gate_dtype, keep, pre_tanh,
                      gate_rows))
        return route_top_k_reference(logits, weight, active, k, gate_dtype, running)

    def backward(logits, weight, active, expert_idxs, grad_gates, grad_sums, keep, keep_scale,
                 pre_tanh):
        calls.append(tuple(t.is_contiguous() for t in (logits, active, grad_gates, grad_sums)))
        dz, dx, _ = route_top_k_backward_reference(logits, weight, active, expert_idxs, grad_gates, grad_sums)
        return dz, (None if weight is None else dx), None

    logits, active, g = _case(N=8, E=5, dtype=torch.float32)
    w = torch.randn(8, 2, generator=g)
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("SUT_KERNELS", backend)
        monkeypatch.setattr(routing_triton, "route_top_k", forward)
        monkeypatch.setattr(routing_triton, "route_top_k_backward", backward)
        z = logits.t().contiguous().t().requires_grad_()  # column-major: the branch makes it contiguous
        running = torch.arange(12.0, dtype=torch.float64).requires_grad_()
        gates, *layout, sums = torch.ops.sut.route_top_k(z, None, active, 2, torch.float64, running)
        ((gates * w).sum() + sums[:5].pow(2).sum() + sums[10]).backward()
        out[backend] = (gates, layout, sums, z.grad, running.grad)
    assert calls == [(True, True, torch.float64, None, False, 0), (True, True, True, True)]
    (g1, l1, s1, d1, r1), (g0, l0, s0, d0, r0) = out["triton"], out["reference"]
    torch.testing.assert_close(r1, r0)
    assert g1.dtype == torch.float64
    torch.testing.assert_close(g1, g0)
    assert all(torch.equal(a, b) for a, b in zip(l1, l0))
    torch.testing.assert_close(s1, s0)
    torch.testing.assert_close(d1, d0)


def test_running_sums_are_added_and_get_the_sums_gradient():
    """``running`` (the forward's earlier calls) is added to the call's sums, and its
    gradient is the sums' gradient."""
    logits, active, g = _case(N=6, E=3)
    running = torch.randn(8, generator=g, dtype=torch.float64).requires_grad_()
    alone = torch.ops.sut.route_top_k(logits, None, active, 2, logits.dtype, None)[-1]
    added = torch.ops.sut.route_top_k(logits, None, active, 2, logits.dtype, running)[-1]
    torch.testing.assert_close(added, alone + running)
    w = torch.randn(8, generator=g, dtype=torch.float64)
    (added * w).sum().backward()
    torch.testing.assert_close(running.grad, w)
