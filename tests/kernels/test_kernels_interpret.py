"""Triton routed-linear kernels vs the PyTorch reference, on CPU in Triton's interpreter.

See docs/model.md#kernels. The forward output and every gradient (input, weights, biases, gates) of
``triton_routed_linear`` equal ``reference_routed_linear`` for the four uses MoE-FFD and
MoMHA make, on ragged expert loads, empty experts, k = 1, k = E, all rows halted (routed to
the sentinel expert), a single row (decoding), and dims that are not block multiples.

The interpreter needs ``TRITON_INTERPRET=1`` before ``triton`` is imported. When this
process already imported triton without it (e.g. ``pytest tests/``), or never had it set,
the tests run in a child pytest process started with ``TRITON_INTERPRET=1`` and report its
outcomes (``sut_fairseq/kernels/testing.py``); this process's environment is left alone.
"""
import pytest
import torch

from sut_fairseq.kernels.testing import delegate_module, interpreter_active
from sut_fairseq.ops.routed_linear import reference_routed_linear
from sut_fairseq.ops.routing import make_routing

from kernel_cases import (GATED, IN_DIM, OUT_DIM, ROUTINGS, USES, assert_match, routing_indices,
                          three_steps)

IN_PROCESS = interpreter_active()

def _problem(routing_name, use, dtype=torch.float32, seed=0, out_dim=None):
    g = torch.Generator().manual_seed(seed)
    idx, E = routing_indices(routing_name, g)
    N, k = idx.shape
    gates = torch.rand(N, k, generator=g)
    gates = gates / gates.sum(1, keepdim=True) * (idx < E)
    routing = make_routing(idx, gates, E)
    rows, kwargs, has_bias = USES[use]
    out_dim = out_dim or (36 if routing_name == "multi_tile" else OUT_DIM)
    n_rows = N if rows == "token" else N * k
    x = torch.randn(n_rows, IN_DIM, generator=g).to(dtype)
    w = (torch.randn(E, IN_DIM, out_dim, generator=g) / IN_DIM ** 0.5).to(dtype)
    b = torch.randn(E, out_dim, generator=g).to(dtype) if has_bias else None
    kwargs = dict(kwargs, fan_out=k if rows == "token" else 1)
    gate_arg = gates.to(dtype) if use in GATED else None
    return x, w, b, routing, kwargs, gate_arg, g


def _run(fn, x, w, b, routing, kwargs, gates, g_seed=1, autocast=None):
    """Forward + backward of ``fn``; returns [y, dx, dw, db, dgates] (None where absent)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b, gates)]
    x_, w_, b_, gates_ = leaves
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        y = fn(x_, w_, b_, routing, gates=gates_, **kwargs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(g_seed)).to(y.dtype)
    y.backward(dy)
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def _triton(*args, **kwargs):
    from sut_fairseq.kernels import triton_routed_linear

    return triton_routed_linear(*args, **kwargs)


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("routing_name", ROUTINGS)
def test_fp32_matches_reference(routing_name, use):
    x, w, b, routing, kwargs, gates, _ = _problem(routing_name, use)
    got = _run(_triton, x, w, b, routing, kwargs, gates)
    want = _run(reference_routed_linear, x, w, b, routing, kwargs, gates)
    assert_match(got, want, 2e-5)


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("routing_name", ["ragged", "multi_tile"])
def test_half_matches_reference(routing_name, dtype, use):
    x, w, b, routing, kwargs, gates, _ = _problem(routing_name, use, dtype=dtype)
    got = _run(_triton, x, w, b, routing, kwargs, gates)
    want = _run(reference_routed_linear, x, w, b, routing, kwargs, gates)
    assert got[0].dtype == dtype
    assert_match(got, want, 4e-3 if dtype == torch.float16 else 3e-2)


@pytest.mark.parametrize("use", list(USES))
def test_autocast_matches_reference(use):
    """fp32 parameters under CPU autocast (bf16): the inputs are cast explicitly, the
    gradients come back in the parameters' dtype."""
    x, w, b, routing, kwargs, gates, _ = _problem("ragged", use)
    got = _run(_triton, x, w, b, routing, kwargs, gates, autocast=torch.bfloat16)
    want = _run(reference_routed_linear, x, w, b, routing, kwargs, gates, autocast=torch.bfloat16)
    assert got[0].dtype == torch.bfloat16
    assert all(t is None or t.dtype == torch.float32 for t in got[1:])
    assert_match(got, want, 3e-2)


def test_sentinel_rows_are_zero():
    """Halted / padding slots produce zero rows and zero gradients."""
    for use in USES:
        x, w, b, routing, kwargs, gates, _ = _problem("all_halted", use)
        y, dx, dw, db, dg = _run(_triton, x, w, b, routing, kwargs, gates)
        for t in (y, dx, dw, db, dg):
            assert t is None or not t.any(), use
    x, w, b, routing, kwargs, gates, _ = _problem("ragged", "momha_q")
    y = _run(_triton, x, w, b, routing, kwargs, gates)[0]
    halted = (routing.expert_idxs == routing.num_experts).reshape(-1)
    assert halted.any() and not y[halted].any()
    x, w, b, routing, kwargs, gates, _ = _problem("ragged", "ffd_up")
    y = _run(_triton, x, w, b, routing, kwargs, gates)[0]
    assert not y[int(routing.expert_offsets[-1]):].any()


def test_partial_gradients():
    """Only some inputs need gradients (e.g. frozen experts, detached gates)."""
    x, w, b, routing, kwargs, gates, _ = _problem("ragged", "ffd_down")
    from sut_fairseq.kernels import triton_routed_linear

    for need in [(True, False, False, False), (False, True, True, False), (False, False, False, True)]:
        leaves = [t.clone().requires_grad_(n) for t, n in zip((x, w, b, gates), need)]
        ref = [t.clone().requires_grad_(n) for t, n in zip((x, w, b, gates), need)]
        y = triton_routed_linear(leaves[0], leaves[1], leaves[2], routing, gates=leaves[3], **kwargs)
        y_ref = reference_routed_linear(ref[0], ref[1], ref[2], routing, gates=ref[3], **kwargs)
        dy = torch.randn_like(y)
        y.backward(dy)
        y_ref.backward(dy)
        for t, r in zip(leaves, ref):
            assert (t.grad is None) == (r.grad is None)
            if t.grad is not None:
                torch.testing.assert_close(t.grad, r.grad, atol=2e-5, rtol=2e-5)


def test_no_host_reads(monkeypatch):
    """Forward and backward never read device values on the host (no sync on a GPU)."""
    import sut_fairseq.kernels  # noqa: F401  (import before patching)

    problems = [_problem("ragged", use) for use in USES]

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for x, w, b, routing, kwargs, gates, _ in problems:
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b, gates)]
        y = _triton(leaves[0], leaves[1], leaves[2], routing, gates=leaves[3], **kwargs)
        y.backward(torch.ones_like(y))


def _config_pairs(precision):
    import sut_fairseq.kernels.grouped_gemm as gg

    gemm = gg.shipped_configs(gg.routed_gemm_kernel, precision)
    wgrad = gg.shipped_configs(gg.routed_wgrad_kernel, precision)
    n = max(len(gemm), len(wgrad))
    return [(gemm[i % len(gemm)], wgrad[i % len(wgrad)]) for i in range(n)]


@pytest.mark.parametrize("precision,index", [(p, i) for p in ("tf32", "ieee") for i in range(len(_config_pairs(p)))])
def test_shipped_configs_interpreted(precision, index, monkeypatch):
    """Every autotuned GPU configuration (block sizes larger than these dims) gives the
    reference result too."""
    import sut_fairseq.kernels.grouped_gemm as gg

    gemm, wgrad = _config_pairs(precision)[index]
    monkeypatch.setitem(gg.INTERPRET_CONFIGS, gg.routed_gemm_kernel, gemm)
    monkeypatch.setitem(gg.INTERPRET_CONFIGS, gg.routed_wgrad_kernel, wgrad)
    for use in ("ffd_down", "momha_q"):
        x, w, b, routing, kwargs, gates, _ = _problem("multi_tile", use, out_dim=40)
        got = _run(_triton, x, w, b, routing, kwargs, gates)
        want = _run(reference_routed_linear, x, w, b, routing, kwargs, gates)
        assert_match(got, want, 2e-5)


def test_autotuning_leaves_no_stale_gate_gradient_partials(monkeypatch):
    """On a GPU the first launch of each shape tries several configurations on the same
    buffers. The gate-gradient partials hold one row per column tile (cdiv(N, BLOCK_N)) and
    the backward sums every row it allocated: a 16-wide trial followed by a chosen 32-wide
    run must not leave the 16-wide trial's third row in the sum. Replays the autotuner
    (Triton's own, timing made up so the wider configuration wins) on the interpreter."""
    import triton

    import sut_fairseq.kernels.grouped_gemm as gg
    from sut_fairseq.kernels import launch
    import sut_fairseq.kernels.routed_linear_triton as rlf

    narrow, wide = (triton.Config({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": 16, "GROUP_M": 2}) for n in (16, 32))
    timings = iter([2.0, 1.0] * 4)   # every tuning launch: narrow tried first, wide faster

    def fake_bench(fn, quantiles=None, **kwargs):
        fn()
        t = next(timings)
        return [t, t, t] if quantiles else t

    tuned = {kernel: gg.autotuned(kernel, fn=launch.interpreted(kernel), configs=configs, do_bench=fake_bench)
             for kernel, configs in ((gg.routed_gemm_kernel, [narrow, wide]),
                                     (gg.routed_wgrad_kernel, [gg.INTERPRET_CONFIGS[gg.routed_wgrad_kernel]]))}
    monkeypatch.setattr(rlf, "_launch", lambda kernel, grid_fn, args, device: tuned[kernel][grid_fn](**args))
    assert gg.INTERPRET_CONFIGS[gg.routed_gemm_kernel].kwargs["BLOCK_N"] == 16   # partials sized for 16
    for use in sorted(GATED):
        x, w, b, routing, kwargs, gates, _ = _problem("multi_tile", use, out_dim=40)   # 3 vs 2 tiles
        got = _run(_triton, x, w, b, routing, kwargs, gates)
        want = _run(reference_routed_linear, x, w, b, routing, kwargs, gates)
        assert_match(got, want, 2e-5)
    assert tuned[gg.routed_gemm_kernel].best_config is wide


def test_autotuner_keeps_its_choices_on_disk(monkeypatch):
    """Every process (each fairseq-train / fairseq-generate call) would otherwise time every
    configuration of every key afresh: the shipped kernels ask Triton to cache the choice."""
    import triton

    import sut_fairseq.kernels.grouped_gemm as gg

    assert gg.AUTOTUNE_CACHES_RESULTS  # the Triton the package installs with can
    seen = {}

    def record(**options):
        seen.update(options)
        return lambda fn: fn

    monkeypatch.setattr(triton, "autotune", record)
    gg.autotuned(gg.routed_gemm_kernel)
    assert seen["cache_results"] is True
    assert seen["key"] == gg._KEYS[gg.routed_gemm_kernel] and "prune_configs_by" in seen


@pytest.mark.parametrize("routing_name", ROUTINGS)
def test_outputs_are_written_whole(routing_name, monkeypatch):
    """The forward output, the input gradient's rows and the gate-gradient partials are
    allocated uninitialised (#48): here filled with NaN, and with two more partial rows
    than column tiles (as for a wider autotuned BLOCK_N), every result still equals the
    reference: the kernel writes the no-op rows' zeros and the unused partial rows."""
    import sut_fairseq.kernels.routed_linear_triton as rlf

    tiles = rlf.max_column_tiles
    monkeypatch.setattr(rlf, "_written_whole", lambda like, shape, dtype=None: torch.full(
        shape, float("nan"), dtype=dtype or like.dtype, device=like.device))
    monkeypatch.setattr(rlf, "max_column_tiles", lambda n, dtype, device: tiles(n, dtype, device) + 2)
    for use in USES:
        x, w, b, routing, kwargs, gates, _ = _problem(routing_name, use)
        got = _run(_triton, x, w, b, routing, kwargs, gates)
        want = _run(reference_routed_linear, x, w, b, routing, kwargs, gates)
        assert_match(got, want, 2e-5)


def test_gate_gradient_bias_term_equals_the_old_matmul():
    """The gate gradient with a bias, its term dout_n . b_e now summed in the kernel,
    against the code before #48: the kernel's partials without the bias term plus
    ``(dout @ b^T)`` gathered by expert (0 for a no-op slot)."""
    import sut_fairseq.kernels.routed_linear_triton as rlf

    x, w, b, routing, kwargs, gates, _ = _problem("ragged", "ffd_down")
    got = _run(_triton, x, w, b, routing, kwargs, gates)[4]
    dout = torch.randn(routing.num_tokens, w.size(2), generator=torch.Generator().manual_seed(1))
    N, k, M = routing.num_tokens, routing.k, routing.num_slots
    partial = torch.zeros(rlf.max_column_tiles(w.size(1), x.dtype, x.device), M)
    rlf.routed_gemm(dout, False, k, w, True, None, torch.zeros(M, w.size(1)), True,
                    gates.reshape(-1), routing, aux=x, aux_grouped=True, dg=partial)
    per_expert = torch.cat([dout @ b.t(), torch.zeros(N, 1)], 1)  # (N, E + 1)
    old = partial.sum(0).view(N, k) + per_expert.gather(1, routing.expert_idxs)
    torch.testing.assert_close(got, old, atol=1e-5, rtol=1e-5)


def _wgrad_launches(monkeypatch):
    """Whether each weight-gradient launch added a running sum (a list, appended to)."""
    from sut_fairseq.kernels import routed_linear_triton

    launches = []
    inner = routed_linear_triton.routed_wgrad

    def recording(*args, acc_w=None, acc_b=None):
        launches.append(acc_w is not None)
        return inner(*args, acc_w=acc_w, acc_b=acc_b)

    monkeypatch.setattr(routed_linear_triton, "routed_wgrad", recording)
    return launches


@pytest.mark.parametrize("mode", ["per-step", "deferred"])
@pytest.mark.parametrize("use", list(USES))
def test_weight_gradients_of_three_steps_equal_autograds_sums(use, mode, monkeypatch):
    """The kernels over three steps of one parameter against the reference with each call's
    own gradient summed by autograd (ops/weight_grads.py): per step, the launches of steps
    2 and 1 add the running sum as they store their tiles; deferred, steps 3 and 2 leave
    their rows to step 1's backward, whose one launch covers every step."""
    from sut_fairseq.ops import weight_grads

    want = three_steps(reference_routed_linear, use, in_recurrence=False)
    monkeypatch.setenv("SUT_WEIGHT_GRADS", mode)
    weight_grads.Stats.reset()
    launches = _wgrad_launches(monkeypatch)
    got = three_steps(_triton, use)
    if mode == "deferred":
        assert weight_grads.Stats.peak > 0 and weight_grads.Stats.held == 0 and launches == [False]
    else:
        assert launches == [False, True, True]
    assert_match(got[:3] + [None, None], want[:3] + [None, None], 2e-5)
    for g, w in zip(got[3] + got[4], want[3] + want[4]):
        assert_match([None, g, None, None, None], [None, w, None, None, None], 2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_weight_gradient_adds_a_running_sum(dtype):
    """dW = acc_w + Σ x^T (g dy), db = acc_b + Σ g dy in the running sums' dtype, every
    expert's tile (an expert with no rows: the running sum itself); acc_b needs acc_w."""
    x, w, b, routing, kwargs, gates, g = _problem("ragged", "ffd_down", dtype=dtype)
    acc_w, acc_b = torch.randn(w.shape, generator=g).to(dtype), torch.randn(b.shape, generator=g).to(dtype)
    dy = torch.randn(gates.size(0), w.size(2), generator=g).to(dtype)  # token rows, k slots each
    common = (dy, x, w, b, gates, routing.expert_idxs, routing.sorted_expert_idxs,
              routing.sorted_scattered_idxs, routing.expert_offsets, kwargs["fan_out"], True,
              False, "triton", False, True, True, False, None, "", None, 1.0)
    _, dw, db, _ = torch.ops.sut.routed_linear_backward(*common)
    _, dw_acc, db_acc, _ = torch.ops.sut.routed_linear_backward(*common, acc_w, acc_b)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(dw_acc.float(), acc_w.float() + dw.float(), **tol)
    torch.testing.assert_close(db_acc.float(), acc_b.float() + db.float(), **tol)
    empty = [e for e in range(w.size(0)) if not (routing.expert_idxs == e).any()]
    assert empty and all(torch.equal(dw_acc[e], acc_w[e]) for e in empty)
    with pytest.raises(ValueError, match="acc_b needs need_b and acc_w"):
        torch.ops.sut.routed_linear_backward(*common, None, acc_b)


def _run_activated(fn, u, w, b, routing, kwargs, gates):
    """``_run`` with the map's input x = act(u) ⊙ keep · scale made without a gradient and
    u as ``pre``: [y, du, dw, db, dgates]."""
    from sut_fairseq.ops.routed_linear import activated

    u_, w_, b_, gates_ = (t.detach().clone().requires_grad_() if t is not None else None
                          for t in (u, w, b, gates))
    x = activated(u_.detach(), kwargs["activation"], kwargs["keep"], kwargs["keep_scale"])[0]
    y = fn(x, w_, b_, routing, gates=gates_, pre=u_, **kwargs)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
    return [y.detach()] + [t.grad if t is not None else None for t in (u_, w_, b_, gates_)]


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("with_keep", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("routing_name", ["ragged", "multi_tile", "all_halted"])
def test_input_activation_matches_reference(routing_name, with_keep, activation):
    """MoE-FFD's down projection on x = act(u) ⊙ keep / (1 - p) with the pre-activations u
    (sorted rows): the output, u's gradient (act'(u) ⊙ keep / (1 - p) applied by the input
    gradient's epilogue), W's, b's and the gates' equal the reference's; a dropped element
    of u gets no gradient."""
    x, w, b, routing, kwargs, gates, g = _problem(routing_name, "ffd_down")
    keep = torch.rand(x.shape, generator=g) >= 0.3 if with_keep else None
    kwargs = dict(kwargs, activation=activation, keep=keep, keep_scale=1 / 0.7 if with_keep else 1.0)
    got = _run_activated(_triton, x, w, b, routing, kwargs, gates)
    want = _run_activated(reference_routed_linear, x, w, b, routing, kwargs, gates)
    assert_match(got, want, 2e-5)
    if with_keep:
        assert not got[1][~keep].any()
    if routing_name == "ragged":
        assert got[1].abs().sum() > 0 and got[4].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_input_activation_half_matches_reference(dtype):
    x, w, b, routing, kwargs, gates, g = _problem("multi_tile", "ffd_down", dtype=dtype)
    kwargs = dict(kwargs, activation="gelu", keep=torch.rand(x.shape, generator=g) >= 0.2,
                  keep_scale=1.25)
    got = _run_activated(_triton, x, w, b, routing, kwargs, gates)
    want = _run_activated(reference_routed_linear, x, w, b, routing, kwargs, gates)
    assert got[0].dtype == dtype
    assert_match(got, want, 4e-3 if dtype == torch.float16 else 3e-2)


@pytest.mark.parametrize("mode", ["per-step", "deferred"])
def test_weight_gradients_of_three_steps_with_the_input_activation(mode, monkeypatch):
    """Three steps, each with its own dropout mask, per step and deferred: each step returns
    u's gradient, and the weight gradient reads every step's act(u) ⊙ keep · s, as
    autograd's sum of the reference's does."""
    monkeypatch.setenv("SUT_WEIGHT_GRADS", mode)
    want = three_steps(reference_routed_linear, "ffd_down", activation="gelu", in_recurrence=False)
    launches = _wgrad_launches(monkeypatch)
    got = three_steps(_triton, "ffd_down", activation="gelu")
    assert launches == ([False] if mode == "deferred" else [False, True, True])
    assert_match(got[:3] + [None, None], want[:3] + [None, None], 2e-5)
    for g, w in zip(got[3] + got[4], want[3] + want[4]):
        assert_match([None, g, None, None, None], [None, w, None, None, None], 2e-5)


def _run_output_activation(backend, x, w, b, routing, kwargs, keep, scale, activation):
    """``routed_linear_activated`` forward and backward through u: [u, x', dx, dw, db]."""
    from sut_fairseq.ops.routed_linear import routed_linear_activated

    x_, w_, b_ = (t.detach().clone().requires_grad_() for t in (x, w, b))
    u, act = routed_linear_activated(x_, w_, b_, routing, kwargs["fan_out"], activation, keep,
                                     scale, backend=backend)
    assert not act.requires_grad
    u.backward(torch.randn(u.shape, generator=torch.Generator().manual_seed(1)).to(u.dtype))
    return [u.detach(), act, x_.grad, w_.grad, b_.grad]


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("with_keep", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("routing_name", ["ragged", "multi_tile", "all_halted", "single_row"])
def test_output_activation_matches_reference(routing_name, with_keep, activation):
    """MoE-FFD's up projection with x' = act(u) ⊙ keep / (1 - p) formed by the forward's
    epilogue: u, x' (zero on the no-op rows, and where dropped) and the gradients of x, W
    and b through u equal the reference's (which forms x' after u); one forward launch."""
    from sut_fairseq.kernels import aot

    x, w, b, routing, kwargs, _, g = _problem(routing_name, "ffd_up")
    M, D = routing.num_slots, w.size(2)
    keep = torch.rand(M, D, generator=g) >= 0.3 if with_keep else None
    scale = 1 / 0.7 if with_keep else 1.0
    got = _run_output_activation("triton", x, w, b, routing, kwargs, keep, scale, activation)
    want = _run_output_activation("reference", x, w, b, routing, kwargs, keep, scale, activation)
    for name, a, e in zip(("u", "act", "dx", "dw", "db"), got, want):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5, msg=name)
    active = routing.expert_offsets[-1]
    assert not got[1][active:].any()
    if with_keep:
        assert not got[1][~keep].any()
    if routing_name == "ragged":
        assert got[1].abs().sum() > 0
        with aot.record_launches() as launches:
            _run_output_activation("triton", x, w, b, routing, kwargs, keep, scale, activation)
        fwd = [args for _, args in launches][0]
        assert (fwd["OUT_ACT"], fwd["HAS_OUT_KEEP"]) == ({"gelu": 1, "relu": 2}[activation], with_keep)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_output_activation_half_matches_reference(dtype):
    """In half precision x' is formed from u as stored (rounded), as the reference forms it."""
    x, w, b, routing, kwargs, _, g = _problem("multi_tile", "ffd_up", dtype=dtype)
    keep = torch.rand(routing.num_slots, w.size(2), generator=g) >= 0.2
    got = _run_output_activation("triton", x, w, b, routing, kwargs, keep, 1.25, "gelu")
    want = _run_output_activation("reference", x, w, b, routing, kwargs, keep, 1.25, "gelu")
    assert got[1].dtype == dtype
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    for name, a, e in zip(("u", "act", "dx", "dw", "db"), got, want):
        scale = max(1.0, e.abs().max().item())
        assert (a.float() - e.float()).abs().max().item() <= tol * scale, name


@pytest.mark.parametrize("use", sorted(GATED))
def test_gate_rows_take_the_partial_sums_as_their_gradient(use):
    """Gated maps given gate rows (R, N, k), R >= the input gradient's column tiles (equal
    rows; the router's gates with ``gate_rows``): the output and the gradients of x, W and
    b equal the (N, k) gates' run; the rows' gradient sums to its gates' gradient (each row
    a column tile's partial sum, the rows past the tiles zero); fewer rows are refused."""
    from sut_fairseq.kernels.routed_linear_triton import max_column_tiles

    x, w, b, routing, kwargs, gates, _ = _problem("multi_tile", use)
    tiles = max_column_tiles(w.size(1), x.dtype, x.device)
    assert tiles > 1
    want = _run(_triton, x, w, b, routing, kwargs, gates)
    rows = gates.expand(tiles + 1, -1, -1).clone()
    got = _run(_triton, x, w, b, routing, kwargs, rows)
    assert_match(got[:4] + [None], want[:4] + [None], 1e-6)
    assert got[4].shape == rows.shape
    torch.testing.assert_close(got[4].sum(0), want[4], rtol=1e-5, atol=1e-6)
    assert got[4][0].abs().sum() > 0 and not got[4][tiles:].any()
    with pytest.raises(ValueError, match=rf"need R >= {tiles}"):
        _run(_triton, x, w, b, routing, kwargs, rows[: tiles - 1])
    with pytest.raises(ValueError, match="gate rows .* are for the Triton kernels"):
        _run(reference_routed_linear, x, w, b, routing, kwargs, rows)


def test_rejects_bad_shapes():
    from sut_fairseq.kernels import triton_routed_linear

    x, w, b, routing, kwargs, gates, _ = _problem("ragged", "momha_q")
    with pytest.raises(ValueError):
        triton_routed_linear(x[:3], w, b, routing, **kwargs)
    with pytest.raises(ValueError):
        triton_routed_linear(x, w[:2], b, routing, **kwargs)
    with pytest.raises(ValueError):
        triton_routed_linear(x, w, b, routing, grouped_out=True, gates=routing.gates, fan_out=routing.k)
    x, w, b, routing, kwargs, gates, _ = _problem("ragged", "ffd_down")
    with pytest.raises(ValueError, match="an input activation is 'gelu' or 'relu'"):
        triton_routed_linear(x, w, b, routing, activation="swish", pre=x, **kwargs)
    with pytest.raises(ValueError, match=r"needs its pre-activations \(pre\) of x's shape"):
        triton_routed_linear(x, w, b, routing, activation="gelu", **kwargs)
    with pytest.raises(ValueError, match=r"keep must be a bool mask of x's shape"):
        triton_routed_linear(x, w, b, routing, activation="gelu", pre=x,
                             keep=torch.ones(x.size(0), 3, dtype=torch.bool), **kwargs)


if not IN_PROCESS:
    delegate_module(globals(), {"TRITON_INTERPRET": "1"})
