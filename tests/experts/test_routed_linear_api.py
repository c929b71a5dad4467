"""``routed_linear``'s own contract (``ops/routed_linear.py``), apart from the arithmetic of
its backends: the refusals and their messages, the operands the Triton backend checks
before its kernels index without bounds checks, the compute dtype the custom op receives
(as ``nn.Linear`` under autocast), and the CPU oracle ``reference_routed_linear`` (which the
CUDA tests compare the kernels with) against a per-slot loop in every layout."""
import importlib
import re

import pytest
import torch

from sut_fairseq.ops import make_routing, routed_linear
from sut_fairseq.ops.routed_linear import reference_routed_linear

routed_linear_module = importlib.import_module("sut_fairseq.ops.routed_linear")

N, K, E, DIN, DOUT = 5, 2, 3, 4, 6


def _routing(dtype=torch.float64):
    idx = torch.tensor([[0, 2], [1, 0], [E, E], [2, 1], [0, 1]])  # token 2 halted
    gates = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.0, 0.0], [0.5, 0.5], [0.2, 0.8]], dtype=dtype)
    return make_routing(idx, gates, E)


def _operands(seed=0, dtype=torch.float64, rows=N):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, DIN, generator=g, dtype=dtype),
            torch.randn(E, DIN, DOUT, generator=g, dtype=dtype),
            torch.randn(E, DOUT, generator=g, dtype=dtype))


def test_gates_with_sorted_output_are_refused_with_the_reason():
    r = _routing()
    x, W, b = _operands()
    message = "gates combine a token's slots and need grouped_out=False"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        routed_linear(x, W, b, r, fan_out=K, grouped_out=True, gates=r.gates)


@pytest.mark.parametrize("shape", [(DIN, DOUT), (E + 1, DIN, DOUT)])
def test_a_weight_that_is_not_one_matrix_per_expert_is_refused(shape):
    r = _routing()
    x, _, b = _operands()
    with pytest.raises(ValueError, match=f"^{re.escape(f'weight must be (E={E}, in, out); got {shape}')}$"):
        routed_linear(x, torch.zeros(shape, dtype=torch.float64), b, r, fan_out=K)


class _Checked(Exception):
    pass


@pytest.mark.parametrize("layout", [dict(fan_out=K, gates=True), dict(fan_out=1, grouped_in=True, grouped_out=True)])
def test_the_triton_backend_checks_every_operand_before_its_kernels(layout, monkeypatch):
    """``SUT_KERNELS=triton``: ``check_operands`` sees exactly the caller's operands, in
    order, before anything runs (the kernels index without bounds checks)."""
    kernels = pytest.importorskip("sut_fairseq.kernels.routed_linear_triton")
    seen = []

    def record(*args):
        seen.append(args)
        raise _Checked

    monkeypatch.setattr(kernels, "check_operands", record)
    monkeypatch.setenv("SUT_KERNELS", "triton")
    r = _routing(torch.float32)
    x, W, b = _operands(dtype=torch.float32, rows=N * K if layout.get("grouped_in") else N)
    gates = r.gates if layout.get("gates") else None
    grouped_in, grouped_out = layout.get("grouped_in", False), layout.get("grouped_out", False)
    with pytest.raises(_Checked):
        routed_linear(x, W, b, r, fan_out=layout["fan_out"], grouped_in=grouped_in,
                      grouped_out=grouped_out, gates=gates)
    (args,) = seen
    expected = (x, W, b, r, layout["fan_out"], grouped_in, grouped_out, gates)
    assert len(args) == len(expected)
    for got, want in zip(args, expected):
        assert got is want, (got, want)


@pytest.mark.parametrize("x_dtype, w_dtype, b_dtype, autocast, expect", [
    (torch.bfloat16, torch.float32, torch.bfloat16, False, torch.float32),   # promoted
    (torch.float32, torch.bfloat16, torch.float32, False, torch.float32),
    (torch.float32, torch.float32, torch.float32, True, torch.bfloat16),     # autocast's dtype
])
def test_the_op_receives_its_operands_in_the_compute_dtype(x_dtype, w_dtype, b_dtype, autocast,
                                                           expect, monkeypatch):
    seen = {}
    call = routed_linear_module.reference_forward  # the backend, as the op calls it

    def spy(x, weight, bias, *rest):
        seen.update(x=x.dtype, weight=weight.dtype, bias=bias.dtype)
        return call(x, weight, bias, *rest)

    monkeypatch.setattr(routed_linear_module, "reference_forward", spy)
    r = _routing(torch.float32)
    x, W, b = _operands(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = routed_linear(x.to(x_dtype), W.to(w_dtype), b.to(b_dtype), r, fan_out=K, gates=r.gates)
    assert seen == dict(x=expect, weight=expect, bias=expect)
    assert y.dtype == expect


def _slot_loop(x, W, b, r, rows_are_slots):
    """(M, out) per slot: x[row] @ W[e] + b[e], zero for the halted slots."""
    out = torch.zeros(N * K, DOUT, dtype=x.dtype)
    for n in range(N):
        for j in range(K):
            e = int(r.expert_idxs[n, j])
            if e < E:
                row = n * K + j if rows_are_slots else n
                out[n * K + j] = x[row] @ W[e] + (0 if b is None else b[e])
    return out


@pytest.mark.parametrize("with_bias", [True, False])
def test_the_reference_equals_a_per_slot_loop_in_every_layout(with_bias):
    r = _routing()
    x, W, b = _operands()
    b = b if with_bias else None
    slots = _slot_loop(x, W, b, r, rows_are_slots=False)
    # defaults: token rows in (fan_out k), slot rows out
    torch.testing.assert_close(reference_routed_linear(x, W, b, r, K), slots)
    # gated sum over each token's slots
    gated = (r.gates.reshape(-1, 1) * slots).view(N, K, DOUT).sum(1)
    torch.testing.assert_close(reference_routed_linear(x, W, b, r, K, gates=r.gates), gated)
    # sorted rows out (the no-op rows last, zero)
    sorted_out = reference_routed_linear(x, W, b, r, K, grouped_out=True)
    torch.testing.assert_close(sorted_out, slots[r.sorted_scattered_idxs])
    # sorted rows in -> gated sum (the FFD's down projection)
    xs = torch.randn(N * K, DIN, dtype=torch.float64)
    per_slot = _slot_loop(xs, W, b, r, rows_are_slots=True)
    grouped_in = xs[r.sorted_scattered_idxs]
    expect = (r.gates.reshape(-1, 1) * per_slot).view(N, K, DOUT).sum(1)
    torch.testing.assert_close(reference_routed_linear(grouped_in, W, b, r, 1, grouped_in=True,
                                                       gates=r.gates), expect)


class _FakeCuda:
    """What ``kernel_backend`` reads of a tensor: whether it is on a CUDA device."""
    is_cuda = True


def test_kernel_backend_follows_sut_kernels_and_the_device(monkeypatch):
    from sut_fairseq.ops.reference_linear import kernel_backend

    monkeypatch.delenv("SUT_KERNELS", raising=False)
    assert kernel_backend(torch.empty(1)) == "reference"
    assert kernel_backend(_FakeCuda()) == "triton"
    monkeypatch.setenv("SUT_KERNELS", "auto")
    assert (kernel_backend(torch.empty(1)), kernel_backend(_FakeCuda())) == ("reference", "triton")
    for choice in ("reference", "triton"):
        monkeypatch.setenv("SUT_KERNELS", choice)
        assert kernel_backend(torch.empty(1)) == choice and kernel_backend(_FakeCuda()) == choice
    monkeypatch.setenv("SUT_KERNELS", "Triton")
    message = "SUT_KERNELS='Triton' is not one of ('auto', 'reference', 'triton')"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        kernel_backend(torch.empty(1))


def test_the_autocast_dtype_of_a_device_type():
    from sut_fairseq.ops.reference_linear import _autocast_dtype

    assert _autocast_dtype("cpu") is None and _autocast_dtype("meta") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _autocast_dtype("cpu") == torch.bfloat16
        assert _autocast_dtype("meta") is None and _autocast_dtype("cuda") is None
    # CUDA's autocast state can be set without a GPU: the dtype is read for "cuda" too
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.float16)
        assert _autocast_dtype("cuda") == torch.float16 and _autocast_dtype("cpu") is None
    finally:
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


@pytest.mark.parametrize("dtype, din, dout, max_rows, grouped", [
    (torch.float32, 8, 12, 64, True),    # rows 16-byte aligned, few per expert: one grouped_mm
    (torch.float32, 8, 12, 2, False),    # more rows per expert than the limit: expert by expert
    (torch.float32, 6, 12, 64, False),   # x's rows 24 bytes
    (torch.float64, 8, 12, 64, False),   # grouped_mm takes no float64
])
def test_both_forwards_of_the_reference_equal_a_per_slot_loop(dtype, din, dout, max_rows, grouped,
                                                              monkeypatch):
    """The grouped forward and the expert-by-expert one, each against the per-slot loop, in
    the four layouts, with an expert no row chose and a halted token (no-op slots)."""
    from sut_fairseq.ops import reference_linear
    from sut_fairseq.ops.reference_linear import _grouped_gemm_takes

    monkeypatch.setattr(reference_linear, "GROUPED_MAX_ROWS_PER_EXPERT", max_rows)

    g = torch.Generator().manual_seed(1)
    n, k, e = 7, 2, 4
    idx = torch.tensor([[0, 2], [2, 0], [e, e], [2, 0], [0, 2], [3, 0], [2, 3]])  # expert 1: none
    gates = torch.rand(n, k, generator=g, dtype=dtype) * (idx < e)
    r = make_routing(idx, gates, e)
    x = torch.randn(n, din, generator=g, dtype=dtype)
    xs = torch.randn(n * k, din, generator=g, dtype=dtype)
    W = torch.randn(e, din, dout, generator=g, dtype=dtype)
    b = torch.randn(e, dout, generator=g, dtype=dtype)
    assert _grouped_gemm_takes(x, W, int(r.expert_offsets[-1])) == grouped

    def per_slot(rows, rows_are_slots):
        out = torch.zeros(n * k, dout, dtype=dtype)
        for s in range(n * k):
            ex = int(idx.view(-1)[s])
            if ex < e:
                out[s] = rows[s if rows_are_slots else s // k] @ W[ex] + b[ex]
        return out

    tol = dict(rtol=1e-5, atol=1e-5)
    slots = per_slot(x, False)
    torch.testing.assert_close(reference_routed_linear(x, W, b, r, k), slots, **tol)
    gated = (gates.reshape(-1, 1) * slots).view(n, k, dout).sum(1)
    torch.testing.assert_close(reference_routed_linear(x, W, b, r, k, gates=gates), gated, **tol)
    torch.testing.assert_close(reference_routed_linear(x, W, b, r, k, grouped_out=True),
                               slots[r.sorted_scattered_idxs], **tol)
    expect = (gates.reshape(-1, 1) * per_slot(xs, True)).view(n, k, dout).sum(1)
    torch.testing.assert_close(reference_routed_linear(xs[r.sorted_scattered_idxs], W, b, r, 1,
                                                       grouped_in=True, gates=gates), expect, **tol)
    # every token halted: zero rows, no GEMM
    halted = make_routing(torch.full((n, k), e), torch.zeros(n, k, dtype=dtype), e)
    assert torch.equal(reference_routed_linear(x, W, b, halted, k, gates=halted.gates),
                       torch.zeros(n, dout, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["grouped", "looped"])
def test_one_active_row_is_computed_and_the_rest_are_zero(dtype):
    """A batch with exactly one routed row (one token of two decoding with k = 1, the other
    halted): its row is x W[e] + b[e], the no-op row zero, in both forwards (grouped_mm
    takes no float64)."""
    from sut_fairseq.ops.reference_linear import _grouped_gemm_takes

    g = torch.Generator().manual_seed(2)
    e = 3
    r = make_routing(torch.tensor([[1], [e]]), torch.tensor([[1.0], [0.0]], dtype=dtype), e)
    x, W, b = (torch.randn(2, 8, generator=g, dtype=dtype), torch.randn(e, 8, 12, generator=g, dtype=dtype),
               torch.randn(e, 12, generator=g, dtype=dtype))
    assert _grouped_gemm_takes(x, W, 1) == (dtype == torch.float32)
    y = reference_routed_linear(x, W, b, r, 1)
    torch.testing.assert_close(y[0], x[0] @ W[1] + b[1], rtol=1e-5, atol=1e-5)
    assert not y[1].any()


def test_one_expert_with_sorted_rows_in_has_the_gradients_of_a_dense_layer():
    """E = 1 (a dense UT's layers through the routed op), rows already sorted (``grouped_in``),
    one halted slot: the output is x W + b on the active rows and 0 on the halted one, and
    every gradient is the dense layer's on the active rows (0 for the halted row's input)."""
    g = torch.Generator().manual_seed(3)
    r = make_routing(torch.tensor([[0], [1], [0]]), torch.tensor([[1.0], [0.0], [1.0]], dtype=torch.float64), 1)
    x = torch.randn(3, DIN, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(1, DIN, DOUT, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, DOUT, generator=g, dtype=torch.float64, requires_grad=True)
    y = reference_routed_linear(x, W, b, r, 1, grouped_in=True)   # slot order out
    active = r.sorted_scattered_idxs[:2]                             # the slots of sorted rows 0, 1
    want = torch.zeros(3, DOUT, dtype=torch.float64).index_copy(0, active, x[:2] @ W[0] + b[0])
    dy = torch.randn(3, DOUT, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, W, b), dy)
    expect = torch.autograd.grad(want, (x, W, b), dy)
    torch.testing.assert_close(y, want)
    for a, e in zip(got, expect):
        torch.testing.assert_close(a, e)
    assert not got[0][2].any()


def test_the_grouped_forward_takes_up_to_its_row_limit_per_expert_and_aligned_operands(monkeypatch):
    """``_grouped_gemm_takes``: at most GROUPED_MAX_ROWS_PER_EXPERT active rows per expert on
    average (E × the limit in all, the limit itself included), float32 / bf16 / fp16, a
    contiguous weight, 16-byte rows of x and of each expert's output."""
    from sut_fairseq.ops import reference_linear
    from sut_fairseq.ops.reference_linear import _grouped_gemm_takes

    monkeypatch.setattr(reference_linear, "GROUPED_MAX_ROWS_PER_EXPERT", 2)
    x, W = torch.zeros(9, 8), torch.zeros(4, 8, 16)
    assert _grouped_gemm_takes(x, W, 8)  # 4 experts × 2 rows: the limit itself
    assert not _grouped_gemm_takes(x, W, 9)
    assert _grouped_gemm_takes(x.half(), W.half(), 8) and _grouped_gemm_takes(x.bfloat16(), W.bfloat16(), 8)
    assert not _grouped_gemm_takes(x.double(), W.double(), 8)
    assert not _grouped_gemm_takes(x, W.transpose(1, 2).contiguous().transpose(1, 2), 8)  # not contiguous
    assert not _grouped_gemm_takes(x, torch.zeros(4, 8, 6), 8)  # output rows of 24 bytes
    assert not _grouped_gemm_takes(torch.zeros(9, 6), torch.zeros(4, 6, 16), 8)  # input rows of 24 bytes


@pytest.mark.parametrize("max_rows", [64, 1], ids=["grouped", "looped"])
def test_the_reference_forward_rounds_the_gates_to_the_operands_dtype_first(max_rows, monkeypatch):
    """Row gates in fp32 with bf16 operands (the routers' fp32 softmax under autocast): each
    gate is rounded to bf16 before it scales its row, exactly as gates given in bf16, in the
    grouped forward and the expert-by-expert one."""
    from sut_fairseq.ops import reference_linear
    from sut_fairseq.ops.reference_linear import _grouped_gemm_takes, reference_forward

    monkeypatch.setattr(reference_linear, "GROUPED_MAX_ROWS_PER_EXPERT", max_rows)
    g = torch.Generator().manual_seed(3)
    e, n = 2, 8
    x = torch.randn(n, 16, generator=g).bfloat16()
    W, b = torch.randn(e, 16, 16, generator=g).bfloat16(), torch.randn(e, 16, generator=g).bfloat16()
    gates = torch.rand(n, generator=g) * 0.9 + 0.05  # fp32, most not bf16 values
    assert not torch.equal(gates.bfloat16().float(), gates)
    ends = [3, n]
    assert _grouped_gemm_takes(x, W, n) == (max_rows == 64)
    got = reference_forward(x, W, b, gates, None, None, ends, n)
    want = reference_forward(x, W, b, gates.bfloat16(), None, None, ends, n)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
