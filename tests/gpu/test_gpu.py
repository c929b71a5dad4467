"""Checks that need a CUDA device: the Triton kernels, the expert layers, incremental
decoding, and the absence of host syncs in the expert path (fairseq-train on CUDA is in
``test_gpu_train.py``).

Every test here is marked ``gpu`` and skipped when no CUDA device is present, so
``make test`` on a CPU machine only reports them as skipped. On a GPU machine:

    pytest -m gpu tests/gpu/test_gpu.py

1. ``triton_routed_linear`` vs ``reference_routed_linear`` (forward; gradients of x,
   weight, bias, gates) for the four calls MoE-FFD and MoMHA make, on the routings of
   ``test_kernels_interpret.py`` (ragged loads, an empty expert, halted rows routed to
   the sentinel expert E, k = 1, k = E, one row) and a large ragged one that spans several
   tiles of the shipped GPU configurations; fp32, bf16 (against the fp32 reference of the
   same bf16 values) and bf16 autocast.
2. ``MoEFeedForward`` and ``MixtureOfMultiHeadAttention`` on the kernels vs the same module
   with ``SUT_KERNELS=reference``: outputs and every gradient.
3. Incremental decoding equals the full decoder on CUDA (as ``test_incremental.py``), and
   a whole model's training step runs through the Triton op.
4. No device-to-host synchronisation in the expert path of a training step
   (``torch.cuda.set_sync_debug_mode("error")``): the routed linear, and the expert layers
   after the router's forward (which does synchronise; recorded as an expected failure).

The compiled recurrence (``--compile-step``, ``--compile-loop``, CUDA graphs) on CUDA is in
``test_gpu_compiled.py``.
"""
import contextlib
import importlib

import pytest
import torch

from conftest import make_model
from sut_fairseq.ops.routed_linear import kernel_backend, reference_routed_linear
from sut_fairseq.ops.routing import make_routing
from kernel_cases import GATED, IN_DIM, OUT_DIM, ROUTINGS, USES, assert_match, routing_indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with pytest -m gpu on a GPU machine)"),
]

DEV = torch.device("cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    """Every test starts on the default backend choice (Triton for CUDA tensors) and with
    fp32 matmuls in full precision (no TF32), whatever the calling environment set."""
    monkeypatch.delenv("SUT_KERNELS", raising=False)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


# --------------------------------------------------------------------------------------
# 1. Triton routed linear vs the reference, every layout the modules use

LARGE = "large_ragged"
GPU_ROUTINGS = ROUTINGS + [LARGE]


def _indices(name: str, g: torch.Generator):
    """(expert_idxs (N, k), E) on the CPU; E marks a halted / padding slot."""
    if name == LARGE:  # many 64/128-row tiles, ragged loads, expert 4 empty, 37 halted tokens
        N, k = 900, 3
        weights = torch.tensor([5.0, 1.0, 3.0, 0.5, 0.0, 2.0, 8.0])
        idx = torch.multinomial(weights.expand(N, -1), k, generator=g)
        idx[torch.randperm(N, generator=g)[:37]] = weights.numel()
        return idx, weights.numel()
    return routing_indices(name, g)


def _problem(routing_name: str, use: str, seed: int = 0):
    """fp32 CPU operands [x, weight, bias, gates], the CUDA routing and the call's kwargs."""
    g = torch.Generator().manual_seed(seed)
    idx, E = _indices(routing_name, g)
    N, k = idx.shape
    gates = torch.rand(N, k, generator=g)
    gates = gates / gates.sum(1, keepdim=True) * (idx < E)
    rows, kwargs, has_bias = USES[use]
    in_dim, out_dim = (200, 136) if routing_name == LARGE else (IN_DIM, OUT_DIM)
    n_rows = N if rows == "token" else N * k
    x = torch.randn(n_rows, in_dim, generator=g)
    w = torch.randn(E, in_dim, out_dim, generator=g) / in_dim ** 0.5
    b = torch.randn(E, out_dim, generator=g) if has_bias else None
    operands = [x, w, b, gates if use in GATED else None]
    routing = make_routing(idx.to(DEV), gates.to(DEV), E)
    return operands, routing, dict(kwargs, fan_out=k if rows == "token" else 1)


def _device_randn(shape, seed: int) -> torch.Tensor:
    """Standard normal fp32 values drawn on the device from a seeded generator."""
    return torch.randn(tuple(shape), device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))


def _on_device(operands, dtype):
    return [t.to(DEV, dtype) if t is not None else None for t in operands]


def _fwd_bwd(fn, operands, routing, kwargs, dy_dtype=None, autocast=None, dy_seed=1):
    """Forward + backward of ``fn``; returns [y, dx, dw, db, dgates] (None where absent).

    The output gradient is drawn in fp32 and rounded to ``dy_dtype`` (default: y's
    dtype), so a bf16 run and its fp32 reference see the same values. It is drawn on the
    device (a copy from the host would be a synchronisation of its own)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in operands]
    x, w, b, gates = leaves
    ctx = torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with ctx:
        y = fn(x, w, b, routing, gates=gates, **kwargs)
    y.backward(_device_randn(y.shape, dy_seed).to(dy_dtype or y.dtype).to(y.dtype))
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def _triton(*args, **kwargs):
    from sut_fairseq.kernels import triton_routed_linear

    return triton_routed_linear(*args, **kwargs)


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("routing_name", GPU_ROUTINGS)
def test_triton_fp32_matches_reference(routing_name, use):
    operands, routing, kwargs = _problem(routing_name, use)
    operands = _on_device(operands, torch.float32)
    got = _fwd_bwd(_triton, operands, routing, kwargs)
    want = _fwd_bwd(reference_routed_linear, operands, routing, kwargs)
    assert_match(got, want, 1e-4)
    halted = routing.expert_idxs.eq(routing.num_experts)
    if not kwargs.get("grouped_out") and operands[3] is None:  # slot rows out
        assert not got[0][halted.reshape(-1)].any(), "halted slots must give zero rows"


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("routing_name", ["ragged", "multi_tile", "all_halted", "single_row", LARGE])
def test_triton_bf16_matches_fp32_reference(routing_name, use):
    """bf16 operands through the kernels vs the fp32 reference of the same (bf16) values:
    within a few bf16 roundings of each result (3e-2 of its largest entry; the results are
    rounded to bf16 once or twice, e.g. slot rows before the gated sum, and the interpreter
    run of these shapes stays below 1.1e-2)."""
    operands, routing, kwargs = _problem(routing_name, use)
    half = _on_device(operands, torch.bfloat16)
    got = _fwd_bwd(_triton, half, routing, kwargs)
    assert all(t is None or t.dtype == torch.bfloat16 for t in got)
    want = _fwd_bwd(reference_routed_linear, [t.float() if t is not None else None for t in half],
                    routing, kwargs, dy_dtype=torch.bfloat16)
    assert_match(got, want, 3e-2)


@pytest.mark.parametrize("use", list(USES))
def test_triton_autocast_bf16_matches_reference(use):
    """fp32 parameters under CUDA autocast (bf16), as ``--amp``-style training runs them:
    bf16 output, gradients in the parameters' fp32."""
    operands, routing, kwargs = _problem(LARGE, use)
    operands = _on_device(operands, torch.float32)
    got = _fwd_bwd(_triton, operands, routing, kwargs, autocast=torch.bfloat16)
    want = _fwd_bwd(reference_routed_linear, operands, routing, kwargs, autocast=torch.bfloat16)
    assert got[0].dtype == torch.bfloat16
    assert all(t is None or t.dtype == torch.float32 for t in got[1:])
    assert_match(got, want, 3e-2)


# --------------------------------------------------------------------------------------
# 2. The expert layers on the kernels vs the same layers on the reference


def _moe_ffd(dtype):
    from sut_fairseq.modules.moe_ffd import MoEFeedForward

    torch.manual_seed(0)
    return MoEFeedForward(64, 96, num_experts=6, top_k=2, router_hidden_dim=64,
                          activation_fn="gelu").to(DEV, dtype).train()


MOMHA_CASES = {  # name -> (relative, causal, cross-attention)
    "decoder_self_clipped": ("clipped", True, False),
    "encoder_self_t5": ("t5", False, False),
    "cross": (None, False, True),
}


def _momha(case, dtype):
    from sut_fairseq.modules.momha import MixtureOfMultiHeadAttention

    relative, causal, _ = MOMHA_CASES[case]
    torch.manual_seed(0)
    return MixtureOfMultiHeadAttention(64, 64, num_experts=6, top_k=2, num_heads=4, head_dim=16,
                                       router_hidden_dim=64, relative=relative, window=4,
                                       causal=causal).to(DEV, dtype).train()


def _layer_inputs(dtype, B=4, T=13, S=11, d=64, seed=0):
    """query (B, T, d), memory (B, S, d), active (B, T), memory padding mask (B, S)."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, T, d, generator=g).to(DEV, dtype)
    memory = torch.randn(B, S, d, generator=g).to(DEV, dtype)
    active = (torch.rand(B, T, generator=g) < 0.8).to(DEV)
    active[1, -3:] = False  # padding at the end of a row
    memory_pad = torch.zeros(B, S, dtype=torch.bool, device=DEV)
    memory_pad[2, -4:] = True
    return query, memory, active, memory_pad


def _layer_step(module, call, inputs, seed=3):
    """Forward + backward; returns {"output": y, "grad <name>": gradient} for the inputs
    and every parameter."""
    module.zero_grad(set_to_none=True)
    leaves = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    y = call(module, *leaves)
    y.backward(_device_randn(y.shape, seed).to(y.dtype))
    out = {"output": y.detach()}
    out.update({f"grad input {i}": t.grad for i, t in enumerate(leaves) if t.grad is not None})
    out.update({f"grad {n}": p.grad for n, p in module.named_parameters() if p.grad is not None})
    return out


def _call_moe(module, query, memory, active, memory_pad):
    return module(query, active)


def _call_momha(cross):
    def call(module, query, memory, active, memory_pad):
        if cross:
            key, value = module.project_kv(memory)
            return module(query, key, value, active, key_padding_mask=memory_pad)
        key, value = module.project_kv(query)
        self_pad = ~active  # the positions that are not running are the padding here
        self_pad[:, 0] = False
        return module(query, key, value, active, key_padding_mask=self_pad)

    return call


def _compare_backends(module, call, inputs, monkeypatch, tol):
    assert kernel_backend(inputs[0]) == "triton"
    got = _layer_step(module, call, inputs)
    monkeypatch.setenv("SUT_KERNELS", "reference")
    assert kernel_backend(inputs[0]) == "reference"
    want = _layer_step(module, call, inputs)
    monkeypatch.delenv("SUT_KERNELS")
    assert got.keys() == want.keys()
    for name in want:
        a, e = got[name].float(), want[name].float()
        assert torch.isfinite(a).all(), name
        scale = max(1.0, e.abs().max().item())
        err = (a - e).abs().max().item()
        assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"
    # the routers and the expert weights got gradients (through the gates)
    assert any(n.startswith("grad router.") for n in got)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_moe_ffd_kernels_match_reference(dtype, monkeypatch):
    dtype = DTYPES[dtype]
    module = _moe_ffd(dtype)
    _compare_backends(module, _call_moe, _layer_inputs(dtype), monkeypatch,
                      1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(MOMHA_CASES))
def test_momha_kernels_match_reference(case, dtype, monkeypatch):
    dtype = DTYPES[dtype]
    module = _momha(case, dtype)
    _compare_backends(module, _call_momha(MOMHA_CASES[case][2]), _layer_inputs(dtype), monkeypatch,
                      1e-4 if dtype == torch.float32 else 3e-2)


# --------------------------------------------------------------------------------------
# 3. Incremental decoding == full forward on CUDA


def _cuda_setup(threshold, seed=0):
    from conftest import decoder_case

    model, src, prev = decoder_case(threshold, seed=seed)
    return model.to(DEV), src.to(DEV), prev.to(DEV)


@pytest.mark.parametrize("threshold", [0.999, 0.6, 0.3])
def test_incremental_equals_full_forward_on_cuda(threshold):
    from conftest import run_incremental as _incremental

    model, src, prev = _cuda_setup(threshold)
    with torch.no_grad():
        enc = model.encoder(src)
        full, extra = model.decoder(prev, enc)
        inc, steps, _ = _incremental(model, enc, prev)
    assert inc.device.type == DEV.type
    torch.testing.assert_close(inc, full, atol=1e-4, rtol=1e-4)
    assert torch.equal(steps, extra["halting_decoder"].steps)
    if threshold < 0.999:
        assert (steps < 4).any(), "the test needs positions that halt early"


def test_incremental_equals_full_forward_after_beam_reordering_on_cuda():
    from conftest import run_incremental as _incremental

    model, src, prev = _cuda_setup(0.6, seed=1)
    reorder = torch.tensor([2, 0, 0], device=DEV)
    with torch.no_grad():
        enc = model.encoder(src)
        inc, _, final_prev = _incremental(model, enc, prev, reorder=reorder)
        order = torch.arange(3, device=DEV)
        for _ in range(prev.size(1) - 1):
            order = order.index_select(0, reorder)
        full, _ = model.decoder(final_prev, model.encoder.reorder_encoder_out(enc, order))
    torch.testing.assert_close(inc, full, atol=1e-4, rtol=1e-4)


def test_model_forward_on_cuda_runs_the_kernels(monkeypatch):
    """A whole sut_tiny training forward/backward on CUDA goes through the Triton op
    (not the reference) and gives finite gradients."""
    import sut_fairseq.kernels as kernels

    # the module (``sut_fairseq.ops.routed_linear`` the attribute is the function)
    rl = importlib.import_module("sut_fairseq.ops.routed_linear")

    calls = []
    triton_op = kernels.triton_routed_linear

    def counting(*args, **kwargs):
        calls.append(1)
        return triton_op(*args, **kwargs)

    monkeypatch.setattr(kernels, "triton_routed_linear", counting)
    monkeypatch.setattr(rl, "reference_routed_linear", None)  # must not be reached
    model = make_model(halting_threshold=0.9).to(DEV).train()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 40, (3, 6), generator=g).to(DEV)
    prev = torch.randint(4, 40, (3, 5), generator=g).to(DEV)
    out, _ = model(src, src.ne(1).sum(1), prev)
    out.float().logsumexp(-1).sum().backward()
    assert calls
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(t).all() for t in grads)


# --------------------------------------------------------------------------------------
# 4. No device-to-host synchronisation in the expert path


def _without_host_sync(fn):
    """Run ``fn`` with CUDA's sync debug mode raising on any device-to-host sync."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_routed_linear_makes_no_host_sync(dtype):
    """Forward and backward of the four routed-linear calls (routing built beforehand)."""
    dtype = DTYPES[dtype]
    problems = []
    for use in USES:
        operands, routing, kwargs = _problem(LARGE, use)
        problems.append((_on_device(operands, dtype), routing, kwargs))

    def step():
        for operands, routing, kwargs in problems:
            _fwd_bwd(_triton, operands, routing, kwargs)

    step()  # warm-up: compilation and autotuning synchronise
    _without_host_sync(step)


def test_expert_layers_make_no_host_sync():
    """A training step of MoE-FFD and MoMHA (self- and cross-attention), router included:
    routing, the routed projections, attention, the gate products and the whole backward
    run under ``set_sync_debug_mode("error")`` (on CUDA the router routes every row and
    masks the inactive ones; slot counts use scatter_add, not bincount).

    Limited to the expert layers: the model-level recurrence stops early on
    ``bool(running.any())`` and the halting unit compacts running rows with ``nonzero``,
    both host reads by design (one per step)."""
    cases = [(_moe_ffd(torch.float32), _call_moe)]
    cases += [(_momha(c, torch.float32), _call_momha(MOMHA_CASES[c][2])) for c in MOMHA_CASES]
    inputs = _layer_inputs(torch.float32)
    for module, call in cases:
        _layer_step(module, call, inputs)  # warm-up (autotuning)
        _without_host_sync(lambda: _layer_step(module, call, inputs))


def test_router_forward_makes_no_host_sync():
    module = _moe_ffd(torch.float32)
    query, _, active, _ = _layer_inputs(torch.float32)
    x = query.reshape(-1, query.size(-1))
    module.router(x, active.reshape(-1))  # warm-up
    _without_host_sync(lambda: module.router(x, active.reshape(-1)))


def test_dropout_on_cuda_drops_at_its_rate_and_rescales():
    """CUDA tensors take ``F.dropout`` (the CPU's 16-bit mask is a CPU path): a million
    ones at p = 0.3 keep 70 % ± 0.5 % of the entries, each scaled to 1 / 0.7."""
    from sut_fairseq.modules.dropout import dropout

    torch.manual_seed(0)
    y = dropout(torch.ones(1_000_000, device="cuda"), 0.3, True)
    kept = y[y != 0]
    assert abs(kept.numel() / 1_000_000 - 0.7) < 0.005
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.7))


@pytest.mark.parametrize("relative", [None, "clipped", "t5"])
@pytest.mark.parametrize("causal", [False, True])
def test_flex_attention_forward_and_gradients_match_the_default_path(relative, causal):
    """``--flex-attention`` (``modules/flex_attention.py``): MoMHA's self-attention through
    the compiled FlexAttention kernel equals the default path (SDPA with the relative term
    and masks as a bias) in fp32, output and every gradient (the relative embeddings' or
    the T5 table's through FlexAttention's gradient of a score_mod's captured tensor),
    with padding and k = 2 picks per position."""
    from sut_fairseq.modules.momha import MixtureOfMultiHeadAttention

    x = torch.randn(3, 9, 32, device="cuda", requires_grad=True)
    active = torch.ones(3, 9, dtype=torch.bool, device="cuda")
    pad = torch.zeros(3, 9, dtype=torch.bool, device="cuda")
    pad[1, -3:] = True
    results = []
    for flex in (False, True):
        torch.manual_seed(0)
        attn = MixtureOfMultiHeadAttention(32, 32, 4, 2, 2, 16, 32, relative=relative, window=3,
                                           causal=causal, flex=flex).cuda()
        if relative == "t5":
            torch.nn.init.normal_(attn.relative.bias.weight)
        x.grad = None
        k, v = attn.project_kv(x)
        out = attn(x, k, v, active, key_padding_mask=pad)
        out.square().sum().backward()
        results.append((out, x.grad.clone(), {n: p.grad for n, p in attn.named_parameters()
                                               if p.grad is not None}))
    (out0, dx0, g0), (out1, dx1, g1) = results
    torch.testing.assert_close(out1, out0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dx1, dx0, atol=1e-4, rtol=1e-4)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_kernels_match_the_pytorch_path(dtype, monkeypatch):
    """The label-smoothed loss on its Triton kernels (CUDA's default) against the op's
    PyTorch path (``SUT_KERNELS=reference``) on a 1,024 x 32,768 batch with padding rows:
    loss, nll and the logits' gradient (in the logits' dtype)."""
    from sut_fairseq.ops.label_smoothed_ce import label_smoothed_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(1024, 32768, device="cuda", generator=g)).to(dtype)
    target = torch.randint(0, 32768, (1024,), device="cuda", generator=g)
    target[::7] = 1
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("SUT_KERNELS", backend)
        x = logits.clone().requires_grad_()
        loss, nll = label_smoothed_cross_entropy(x, target, 0.1, 1)
        (0.5 * loss).backward()
        out[backend] = (loss.detach(), nll, x.grad)
    (l0, n0, g0), (l1, n1, g1) = out["reference"], out["triton"]
    assert g1.dtype == dtype
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-2)
    torch.testing.assert_close(n1, n0, rtol=1e-5, atol=1e-2)
    tol = dict(rtol=1e-4, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(g1.float(), g0.float(), **tol)


@pytest.mark.parametrize("E, k", [(24, 4), (48, 4), (5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_kernels_match_the_reference(E, k, dtype):
    """``sut::route_top_k``'s kernels on 4,100 rows (128 blocks and a ragged one), a third
    inactive: the layout exactly, gates and statistics within rounding, and the backward
    kernel against the reference formula."""
    from sut_fairseq.kernels.routing_triton import route_top_k, route_top_k_backward
    from sut_fairseq.ops.route_op import route_top_k_backward_reference, route_top_k_reference

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (2 * torch.randn(4100, E, device="cuda", generator=g)).to(dtype)
    active = torch.rand(4100, device="cuda", generator=g) > 0.33
    got, want = route_top_k(logits, None, active, k, dtype), route_top_k_reference(logits, None, active, k, dtype)
    for a, b in zip(got, want):
        if a.dtype == torch.bfloat16:  # the gates, in the logits' dtype
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3)
        elif a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(a, b)
    grad_gates = torch.randn(4100, k, device="cuda", generator=g)
    grad_sums = torch.randn(2 * E + 2, device="cuda", generator=g)
    torch.testing.assert_close(
        route_top_k_backward(logits, None, active, got[1], grad_gates, grad_sums)[0].float(),
        route_top_k_backward_reference(logits, None, active, got[1], grad_gates, grad_sums)[0].float(),
        rtol=1e-4 if dtype == torch.float32 else 1e-2, atol=1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("E", [24, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_kernels_with_the_last_layer_match_the_reference(E, dtype):
    """The routers' form: logits x W^T made in the kernels from the hidden layer x (4,100 ×
    512) and the last layer W (E × 512), fp32 with IEEE products: the picks of (nearly)
    every row as the reference's from ``F.linear`` (a product summed in another order can
    flip a near tie), the statistics within rounding, and the backward's dz and dx = dz W
    against the reference formula for the kernel's own picks."""
    from sut_fairseq.kernels.routing_triton import route_top_k, route_top_k_backward
    from sut_fairseq.ops.route_op import route_top_k_backward_reference, route_top_k_reference

    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.tanh(torch.randn(4100, 512, device="cuda", generator=g)).to(dtype)
    weight = (torch.randn(E, 512, device="cuda", generator=g) * 2 / 512 ** 0.5).to(dtype)
    active = torch.rand(4100, device="cuda", generator=g) > 0.33
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = route_top_k(x, weight, active, 4, dtype)
        want = route_top_k_reference(x, weight, active, 4, dtype)
        same = (got[1] == want[1]).all(1)
        assert same.float().mean() > 0.999, same.float().mean()
        torch.testing.assert_close(got[5], want[5], rtol=1e-2, atol=1e-1)  # sums over 4,100 rows
        grad_gates = torch.randn(4100, 4, device="cuda", generator=g)
        grad_sums = torch.randn(2 * E + 2, device="cuda", generator=g)
        dz, dx, _ = route_top_k_backward(x, weight, active, got[1], grad_gates, grad_sums)
        want_dz, want_dx, _ = route_top_k_backward_reference(x, weight, active, got[1], grad_gates, grad_sums)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(dz.float(), want_dz.float(), **tol)
    torch.testing.assert_close(dx.float(), want_dx.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_kernels_forming_the_hidden_layer_match_the_reference(dtype):
    """``pre_tanh``: the kernels form a · tanh(u) ⊙ keep / (1 - p) from the pre-activation
    u (4,100 × 512) and the gating dropout's mask as they load it: the picks of (nearly)
    every row as the reference's, the statistics within rounding, and the backward's dz, u's
    gradient and the hidden layer against the reference for the kernel's own picks."""
    from sut_fairseq.kernels.routing_triton import route_top_k, route_top_k_backward
    from sut_fairseq.ops.route_op import route_top_k_backward_reference, route_top_k_reference

    g = torch.Generator(device="cuda").manual_seed(3)
    u = (2 * torch.randn(4100, 512, device="cuda", generator=g)).to(dtype)
    weight = (torch.randn(24, 512, device="cuda", generator=g) * 2 / 512 ** 0.5).to(dtype)
    active = torch.rand(4100, device="cuda", generator=g) > 0.33
    keep = torch.rand(4100, 512, device="cuda", generator=g) >= 0.2
    hidden = (keep, 1.25, True)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = route_top_k(u, weight, active, 4, dtype, None, *hidden)
        want = route_top_k_reference(u, weight, active, 4, dtype, None, *hidden)
        same = (got[1] == want[1]).all(1)
        assert same.float().mean() > 0.999, same.float().mean()
        torch.testing.assert_close(got[5], want[5], rtol=1e-2, atol=1e-1)  # sums over 4,100 rows
        grad_gates = torch.randn(4100, 4, device="cuda", generator=g)
        grad_sums = torch.randn(2 * 24 + 2, device="cuda", generator=g)
        mine = route_top_k_backward(u, weight, active, got[1], grad_gates, grad_sums, *hidden)
        ref = route_top_k_backward_reference(u, weight, active, got[1], grad_gates, grad_sums, *hidden)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for name, a, e in zip(("dz", "du", "hidden"), mine, ref):
        torch.testing.assert_close(a.float(), e.float(), **tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_input_activation_kernels_match_the_reference(dtype):
    """MoE-FFD's down projection with its input activation (GELU, dropout mask) on the
    kernels against the reference backend on the device, ``sut_base``'s sizes (E 24, k 4,
    512 → 512, 4,096 tokens): output and the gradients of u, W, b and the gates."""
    from sut_fairseq.ops.routed_linear import (activated, reference_routed_linear,
                                               triton_routed_linear)
    from sut_fairseq.ops.routing import make_routing

    g = torch.Generator(device="cuda").manual_seed(4)
    N, k, E, D, d = 4096, 4, 24, 512, 512
    idx = torch.rand(N, E, device="cuda", generator=g).topk(k, 1).indices
    idx[torch.rand(N, device="cuda", generator=g) < 0.1] = E  # halted tokens
    gates = torch.rand(N, k, device="cuda", generator=g) * (idx < E)
    routing = make_routing(idx, gates, E)
    u0 = torch.randn(N * k, D, device="cuda", generator=g).to(dtype)
    keep = torch.rand(N * k, D, device="cuda", generator=g) >= 0.2
    w0 = (torch.randn(E, D, d, device="cuda", generator=g) / D ** 0.5).to(dtype)
    b0 = torch.randn(E, d, device="cuda", generator=g).to(dtype)
    dy = torch.randn(N, d, device="cuda", generator=g).to(dtype)
    outs = []
    for fn in (triton_routed_linear, reference_routed_linear):
        u, w, b, q = (t.clone().requires_grad_() for t in (u0, w0, b0, gates.to(dtype)))
        x = activated(u.detach(), "gelu", keep, 1.25)[0]
        y = fn(x, w, b, routing, 1, grouped_in=True, gates=q, activation="gelu", pre=u,
               keep=keep, keep_scale=1.25)
        y.backward(dy)
        outs.append((y, u.grad, w.grad, b.grad, q.grad))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, a, e in zip(("y", "du", "dW", "db", "dgates"), *outs):
        scale = max(1.0, e.float().abs().max().item())
        err = (a.float() - e.float()).abs().max().item()
        assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"
    assert not outs[0][1][~keep].any()


def test_router_on_its_kernels_makes_no_host_sync():
    """``sut::route_top_k`` forward and backward under ``set_sync_debug_mode("error")``."""
    logits = torch.randn(4096, 24, device="cuda", requires_grad=True)
    active = torch.rand(4096, device="cuda") > 0.2

    def step():
        gates, *_, sums = torch.ops.sut.route_top_k(logits, None, active, 4, torch.float32, None)
        (gates.sum() + sums[:24].pow(2).sum()).backward()

    step()  # warm-up: compilation
    _without_host_sync(step)
