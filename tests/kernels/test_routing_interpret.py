"""The router's Triton kernels (``kernels/routing_triton.py``) against the PyTorch reference
of ``sut::route_top_k``, on CPU in Triton's interpreter: the gates and the statistics'
sums within float rounding, the slots' experts and the whole sorted layout exactly, the
logits' gradient (fp32 and bf16 logits); and a router module on the op
(``SUT_KERNELS=triton``) against its PyTorch path, outputs and gradients. Blocks of 4 rows here, so the counting sort spans several blocks (ragged last
one). Run in a child pytest process with ``TRITON_INTERPRET=1`` when this one lacks it."""
import pytest
import torch

from sut_fairseq.kernels.testing import delegate_module, interpreter_active

IN_PROCESS = interpreter_active()


def _case(N, E, seed=0, inactive="some"):
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(N, E, generator=g)
    active = {"some": torch.rand(N, generator=g) > 0.3, "none": torch.zeros(N, dtype=torch.bool),
              "all": torch.ones(N, dtype=torch.bool)}[inactive]
    return logits, active


NAMES = ["gates", "expert_idxs", "sorted_expert_idxs", "sorted_scattered_idxs", "expert_offsets",
         "sums"]


def _assert_outputs_match(got, want, tol, exact_layout=True):
    """The op's six outputs: each of the reference's dtype and shape, the floats within
    ``tol``, the indices equal (with ``exact_layout``)."""
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.is_floating_point():
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
        elif exact_layout:
            assert torch.equal(a, b), (name, a, b)


@pytest.mark.parametrize("N, E, k, inactive", [
    (13, 5, 2, "some"), (13, 5, 2, "none"), (8, 24, 4, "all"), (1, 3, 3, "all"),
    (17, 2, 1, "some"), (9, 7, 7, "some"), (40, 12, 2, "some")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_the_reference(N, E, k, inactive, dtype):
    """bf16 logits (a bf16 run's router output) are read as fp32 by both; the gates come
    back in the logits' dtype (the expert layers' compute dtype); running sums added."""
    from sut_fairseq.kernels.routing_triton import route_top_k
    from sut_fairseq.ops.route_op import route_top_k_reference

    logits, active = _case(N, E, inactive=inactive)
    logits = logits.to(dtype)
    running = torch.randn(2 * E + 2, generator=torch.Generator().manual_seed(9))
    got = route_top_k(logits, None, active, k, gate_dtype=dtype, running=running)
    want = route_top_k_reference(logits, None, active, k, gate_dtype=dtype, running=running)
    names = ["gates", "expert_idxs", "sorted_expert_idxs", "sorted_scattered_idxs",
             "expert_offsets", "sums"]
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype == torch.bfloat16:  # the gates: one rounding (the interpreter's may truncate)
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3, msg=name)
        elif a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), (name, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, E, k, inactive", [(13, 5, 2, "some"), (8, 24, 4, "all"), (9, 7, 7, "some")])
def test_backward_kernel_equals_the_reference(N, E, k, inactive, dtype):
    from sut_fairseq.kernels.routing_triton import route_top_k_backward
    from sut_fairseq.ops.route_op import route_top_k_backward_reference, route_top_k_reference

    logits, active = _case(N, E, inactive=inactive)
    logits = logits.to(dtype)
    expert_idxs = route_top_k_reference(logits, None, active, k)[1]
    g = torch.Generator().manual_seed(5)
    grad_gates, grad_sums = torch.randn(N, k, generator=g), torch.randn(2 * E + 2, generator=g)
    got, no_x, no_h = route_top_k_backward(logits, None, active, expert_idxs, grad_gates, grad_sums)
    want = route_top_k_backward_reference(logits, None, active, expert_idxs, grad_gates, grad_sums)[0]
    assert no_x is None and no_h is None
    assert got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert got[~active].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, D, E, k", [(13, 70, 5, 2), (9, 16, 24, 4), (6, 129, 3, 3)])
def test_kernels_multiply_by_the_routers_last_layer(N, D, E, k, dtype):
    """Logits z = x W^T made in the kernels from the router's hidden layer x (N, D) and its
    last layer W (E, D), over blocks of D (ragged: 70 = 64 + 6, 129 = 2·64 + 1): every output
    as the reference's from ``F.linear``'s logits, and the gradient launch's dz and x's
    gradient dz W."""
    from sut_fairseq.kernels.routing_triton import route_top_k, route_top_k_backward
    from sut_fairseq.ops.route_op import route_top_k_backward_reference, route_top_k_reference

    g = torch.Generator().manual_seed(N + D)
    x = torch.tanh(torch.randn(N, D, generator=g)).to(dtype)
    weight = (torch.randn(E, D, generator=g) * 2 / D ** 0.5).to(dtype)
    active = torch.rand(N, generator=g) > 0.3
    running = torch.randn(2 * E + 2, generator=g)
    got = route_top_k(x, weight, active, k, gate_dtype=dtype, running=running)
    want = route_top_k_reference(x, weight, active, k, gate_dtype=dtype, running=running)
    # bf16: the logits rounded to bf16 (Triton's interpreter may truncate where F.linear
    # rounds to nearest: about 1e-3 in the probabilities' sums)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    _assert_outputs_match(got, want, tol)
    grad_gates, grad_sums = torch.randn(N, k, generator=g), torch.randn(2 * E + 2, generator=g)
    dz, dx, no_h = route_top_k_backward(x, weight, active, got[1], grad_gates, grad_sums)
    want_dz, want_dx, _ = route_top_k_backward_reference(x, weight, active, got[1], grad_gates, grad_sums)
    assert dz.dtype == dx.dtype == dtype and dx.shape == (N, D) and no_h is None
    torch.testing.assert_close(dz.float(), want_dz.float(), **tol)
    torch.testing.assert_close(dx.float(), want_dx.float(), **tol)
    assert dx[~active].abs().sum() == 0 and dx[active].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_keep", [False, True])
@pytest.mark.parametrize("N, D, E, k", [(13, 70, 5, 2), (9, 16, 24, 4)])
def test_kernels_form_the_hidden_layer(N, D, E, k, with_keep, dtype):
    """``pre_tanh``: the kernels read the hidden layer's pre-activation u (N, D) and form h
    = a tanh(u) ⊙ keep / (1 - p) as they load it (ragged D = 64 + 6; pre-activations
    up to |u| ~ 6, some below the series' 1/8): every output as the reference's, the
    gradient launch's dz, u's gradient and h itself."""
    from sut_fairseq.kernels.routing_triton import route_top_k, route_top_k_backward
    from sut_fairseq.ops.route_op import route_top_k_backward_reference, route_top_k_reference

    g = torch.Generator().manual_seed(N + D + with_keep)
    u = (2 * torch.randn(N, D, generator=g)).to(dtype)
    u[0, :8] = torch.linspace(-0.2, 0.2, 8).to(dtype)
    weight = (torch.randn(E, D, generator=g) * 2 / D ** 0.5).to(dtype)
    active = torch.rand(N, generator=g) > 0.3
    active[0] = True
    keep = torch.rand(N, D, generator=g) >= 0.25 if with_keep else None
    scale = 1 / 0.75 if with_keep else 1.0
    running = torch.randn(2 * E + 2, generator=g)
    got = route_top_k(u, weight, active, k, dtype, running, keep, scale, True)
    want = route_top_k_reference(u, weight, active, k, dtype, running, keep, scale, True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    # bf16: a rounding of the hidden layer may swap two near-equal picks
    _assert_outputs_match(got, want, tol, exact_layout=dtype == torch.float32)
    grad_gates, grad_sums = torch.randn(N, k, generator=g), torch.randn(2 * E + 2, generator=g)
    dz, du, h = route_top_k_backward(u, weight, active, want[1], grad_gates, grad_sums, keep,
                                     scale, True)
    want_dz, want_du, want_h = route_top_k_backward_reference(
        u, weight, active, want[1], grad_gates, grad_sums, keep, scale, True)
    assert dz.dtype == du.dtype == h.dtype == dtype and du.shape == h.shape == (N, D)
    for a, b in ((dz, want_dz), (du, want_du), (h, want_h)):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert du[~active].abs().sum() == 0 and h[~active].abs().sum() == 0 and du[active].abs().sum() > 0
    if with_keep:  # dropped elements: no hidden value, no gradient
        assert h[~keep].abs().sum() == 0 and du[~keep].abs().sum() == 0


def test_ties_pick_the_lowest_index():
    from sut_fairseq.kernels.routing_triton import route_top_k

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    _, expert_idxs, *_ = route_top_k(logits, None, torch.ones(2, dtype=torch.bool), 3)
    assert expert_idxs.tolist() == [[1, 2, 4], [0, 1, 2]]


@pytest.mark.parametrize("gating_dropout", [0.0, 0.3])
def test_router_on_the_op_equals_its_pytorch_path(monkeypatch, gating_dropout):
    """A router with statistics recorded, forward and backward, both paths: the Routing
    (every field), the statistics and the gradients of its weights and input. With gating
    dropout (training), one mask for both paths (the PyTorch path's dropout replaced by
    it): the kernels form tanh and the dropout of the hidden layer themselves."""
    from sut_fairseq.modules.router import Router, RouterStats

    torch.manual_seed(0)
    router = Router(8, 6, 2, 16, gating_dropout=gating_dropout).train()
    x0 = torch.randn(11, 8)
    active = torch.rand(11, generator=torch.Generator().manual_seed(3)) > 0.25
    if gating_dropout:
        keep = torch.rand(11, 16, generator=torch.Generator().manual_seed(5)) >= gating_dropout
        scale = 1 / (1 - gating_dropout)
        monkeypatch.setattr(Router, "_keep_mask", lambda self, u: (keep, scale))
        monkeypatch.setattr(router.dropout, "forward", lambda h: h * keep * scale)
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("SUT_KERNELS", backend)
        router.zero_grad()
        router.stats = RouterStats(6)
        x = x0.clone().requires_grad_()
        routing = router(x, active)
        loss = (routing.gates * torch.arange(1.0, 3.0)).sum() + router.stats.sum_probs.pow(2).sum() \
            + router.stats.sum_neg_entropy
        loss.backward()
        out[backend] = (routing, router.stats, x.grad, [p.grad.clone() for p in router.parameters()])
    (r0, s0, dx0, dp0), (r1, s1, dx1, dp1) = out["reference"], out["triton"]
    for field in ("expert_idxs", "sorted_expert_idxs", "sorted_scattered_idxs", "expert_offsets"):
        assert torch.equal(getattr(r0, field), getattr(r1, field)), field
    torch.testing.assert_close(r1.gates, r0.gates, rtol=1e-6, atol=1e-7)
    for field in ("sum_probs", "sum_neg_entropy", "count", "assignments"):
        torch.testing.assert_close(getattr(s1, field), getattr(s0, field), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(dp1, dp0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3])
def test_gate_rows_are_equal_and_their_gradients_summed(rows):
    """``gate_rows`` R: the kernels store the gates R times, (R, N, k), each row the (N, k)
    gates; the backward reads the gradient as R rows and equals the backward of their sum
    (as the reference's, which sums them); the op's output shape and the reference's agree."""
    from sut_fairseq.kernels.routing_triton import route_top_k, route_top_k_backward
    from sut_fairseq.ops.route_op import route_top_k_backward_reference, route_top_k_reference

    N, E, k = 13, 5, 2
    logits, active = _case(N, E)
    plain = route_top_k(logits, None, active, k)
    got = route_top_k(logits, None, active, k, gate_rows=rows)
    want = route_top_k_reference(logits, None, active, k, gate_rows=rows)
    assert got[0].shape == want[0].shape == (rows, N, k)
    for r in range(rows):
        assert torch.equal(got[0][r], plain[0])
    _assert_outputs_match(got, want, dict(rtol=1e-5, atol=1e-6))
    g = torch.Generator().manual_seed(6)
    grad_rows, grad_sums = torch.randn(rows, N, k, generator=g), torch.randn(2 * E + 2, generator=g)
    dz = route_top_k_backward(logits, None, active, plain[1], grad_rows, grad_sums)[0]
    dz_sum = route_top_k_backward(logits, None, active, plain[1], grad_rows.sum(0), grad_sums)[0]
    dz_ref = route_top_k_backward_reference(logits, None, active, plain[1], grad_rows, grad_sums)[0]
    torch.testing.assert_close(dz, dz_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dz, dz_ref, rtol=1e-5, atol=1e-6)
    assert dz.abs().sum() > 0


def test_a_gated_router_on_the_kernels_hands_gate_rows_to_its_map(monkeypatch):
    """MoE-FFD on the kernels (``SUT_KERNELS=triton``): its router returns gate rows (R, N,
    k) fp32, R the down projection's column tiles, row 0 the gates; output and every
    gradient equal the same layer with gate rows off (``_gate_rows`` 0: the partial sums
    added and cast by a kernel of their own), training with dropout on one mask."""
    from sut_fairseq.kernels.routed_linear_triton import max_column_tiles
    from sut_fairseq.modules import moe_ffd
    from sut_fairseq.modules.moe_ffd import MoEFeedForward
    from sut_fairseq.modules.router import Router

    monkeypatch.setenv("SUT_KERNELS", "triton")
    torch.manual_seed(0)
    ffd = MoEFeedForward(8, 20, 4, 2, 8, activation_fn="gelu", activation_dropout=0.2,
                         gating_dropout=0.3).train()
    x0 = torch.randn(10, 8)
    active = torch.rand(10, generator=torch.Generator().manual_seed(2)) > 0.2
    keep_h = torch.rand(10, 8, generator=torch.Generator().manual_seed(3)) >= 0.3
    keep_a = torch.rand(20, 20, generator=torch.Generator().manual_seed(4)) >= 0.2
    monkeypatch.setattr(Router, "_keep_mask", lambda self, u: (keep_h, 1 / 0.7))
    monkeypatch.setattr(moe_ffd, "keep_mask", lambda x, p, training, shape: (keep_a, 1 / 0.8))
    seen, original = [], Router.forward

    def forward(self, x, active):
        routing = original(self, x, active)
        seen.append(routing.gate_rows)
        return routing

    monkeypatch.setattr(Router, "forward", forward)
    outs = []
    for rows in (True, False):
        if not rows:
            monkeypatch.setattr(Router, "_gate_rows", lambda self, x: 0)
        ffd.zero_grad()
        x = x0.clone().requires_grad_()
        y = ffd(x, active)
        y.sin().sum().backward()
        outs.append((y, x.grad, [p.grad.clone() for p in ffd.parameters()]))
    R = max_column_tiles(20, torch.float32, x0.device)
    assert R > 1 and seen[0].shape == (R, 10, 2) and seen[0].dtype == torch.float32
    assert seen[1] is None
    monkeypatch.undo()
    monkeypatch.setenv("SUT_KERNELS", "triton")
    with torch.no_grad():  # decoding: no gradient, no gate rows
        assert ffd.router(x0, active).gate_rows is None
    (y1, dx1, dp1), (y0, dx0, dp0) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(dp1, dp0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ffd.router.fc1.weight.grad.abs().sum() > 0


if not IN_PROCESS:
    delegate_module(globals(), {"TRITON_INTERPRET": "1"})
