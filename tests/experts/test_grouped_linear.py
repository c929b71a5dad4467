"""The routed linear map on PyTorch's grouped GEMM (``ops/grouped_linear.py``,
``SUT_EXPERT_GEMM=grouped_mm``) against the reference backend's expert-by-expert loop: every
row layout, with no-op slots and an expert no row chose, outputs and every gradient in fp32;
a whole model's logits and parameter gradients; the rows the product leaves undefined; the
selection and its refusals."""
import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model, randomise_halting
from old_code import assert_same_as_old
from sut_fairseq.ops import grouped_linear
from sut_fairseq.ops.reference_linear import expert_gemm
from sut_fairseq.ops.routed_linear import (grouped_mm_routed_linear, reference_routed_linear,
                                           routed_linear)
from sut_fairseq.ops.routing import make_routing

# the module (``sut_fairseq.ops`` exports its function under the same name)
routed_linear_module = importlib.import_module("sut_fairseq.ops.routed_linear")

N, K, E, IN, OUT = 7, 2, 4, 8, 16
_GROUPED_MM = F.grouped_mm

# (fan_out, grouped_in, grouped_out, gates): the layouts MoE-FFD and MoMHA use
LAYOUTS = [(K, False, False, True), (K, False, True, False), (K, False, False, False),
           (1, False, False, True), (1, True, False, True), (1, True, True, False)]


def _routing(seed=0):
    """N tokens over E experts, top-K: token 2 halted (both slots no-op), token 5's second
    slot no-op, expert 1 chosen by no slot."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (N, K), generator=g)
    idx[idx == 1] = 0
    idx[2] = E
    idx[5, 1] = E
    gates = torch.rand(N, K, generator=g)
    gates[idx == E] = 0
    return make_routing(idx, gates, E), gates


def _outputs_and_grads(f, layout, bias, seed=1):
    fan_out, grouped_in, grouped_out, with_gates = layout
    routing, gates = _routing()
    g = torch.Generator().manual_seed(seed)
    rows = N if fan_out == K else N * K
    x = torch.randn(rows, IN, generator=g, requires_grad=True)
    w = torch.randn(E, IN, OUT, generator=g, requires_grad=True)
    b = torch.randn(E, OUT, generator=g, requires_grad=True) if bias else None
    gt = gates.clone().requires_grad_(True) if with_gates else None
    y = f(x, w, b, routing, fan_out, grouped_in, grouped_out, gt)
    R = torch.randn(y.shape, generator=g)
    inputs = [t for t in (x, w, b, gt) if t is not None]
    return (y, *torch.autograd.grad((y * R).sum(), inputs))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_equals_the_reference_loop(layout, bias):
    """Output and the gradients of x, W, b and the gates == the reference backend's."""
    got = _outputs_and_grads(grouped_mm_routed_linear, layout, bias)
    want = _outputs_and_grads(reference_routed_linear, layout, bias)
    for name, a, b in zip(("y", "dx", "dW", "db|dg", "dg"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


class _PoisonedGroupedMM(torch.autograd.Function):
    """``grouped_mm`` (2-d x 3-d) that writes NaN into the rows past the last offset, in its
    output and in its input gradient: what PyTorch leaves there is undefined memory."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        y = _GROUPED_MM(a, b, offs=offs)
        y[int(offs[-1]):] = float("nan")
        return y

    @staticmethod
    def backward(ctx, dy):
        a, b, offs = ctx.saved_tensors
        with torch.enable_grad():
            a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
            da, db = torch.autograd.grad(_GROUPED_MM(a_, b_, offs=offs), (a_, b_), dy)
        da = da.clone()
        da[int(offs[-1]):] = float("nan")
        return da, db, None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_rows_grouped_mm_leaves_undefined_reach_nothing(monkeypatch, layout):
    """With the no-op rows of the product's output and input gradient NaN, the map's output
    and gradients are still the reference's (the two masks hold them back)."""
    monkeypatch.setattr(grouped_linear.F, "grouped_mm",
                        lambda a, b, offs: _PoisonedGroupedMM.apply(a, b, offs))
    got = _outputs_and_grads(grouped_mm_routed_linear, layout, True)
    want = _outputs_and_grads(reference_routed_linear, layout, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sorted_input_rows_may_stop_after_the_active_ones():
    """``grouped_in`` x of only the A active sorted rows (the reference backend's MoE-FFD
    hands over that many) == the same rows with the no-op ones after them."""
    routing, gates = _routing()
    A = int(routing.expert_offsets[-1])
    x = torch.randn(N * K, IN)
    w = torch.randn(E, IN, OUT)
    full = grouped_mm_routed_linear(x, w, None, routing, 1, True, False, gates)
    torch.testing.assert_close(grouped_mm_routed_linear(x[:A], w, None, routing, 1, True, False, gates), full)
    torch.testing.assert_close(full, reference_routed_linear(x, w, None, routing, 1, True, False, gates))


def test_every_row_no_op():
    """A call whose slots are all no-op (every token halted): zeros, zero gradients."""
    idx = torch.full((N, K), E)
    routing = make_routing(idx, torch.zeros(N, K), E)
    x = torch.randn(N, IN, requires_grad=True)
    w = torch.randn(E, IN, OUT, requires_grad=True)
    b = torch.randn(E, OUT, requires_grad=True)
    y = grouped_mm_routed_linear(x, w, b, routing, K)
    assert torch.equal(y, torch.zeros(N * K, OUT))
    y.sum().backward()
    for t in (x, w, b):
        assert torch.equal(t.grad, torch.zeros_like(t))


@contextlib.contextmanager
def _backend(name):
    """Every routed product on ``name``; MoE-FFD hands the down projection all M sorted
    rows where the products are not the reference's (as on CUDA)."""
    from sut_fairseq.modules import moe_ffd

    before = routed_linear_module.kernel_backend, moe_ffd.kernel_backend
    routed_linear_module.kernel_backend = moe_ffd.kernel_backend = lambda x: name
    try:
        yield
    finally:
        routed_linear_module.kernel_backend, moe_ffd.kernel_backend = before


@pytest.mark.parametrize("rule", ["stick-breaking", "act"])
def test_a_model_on_grouped_mm_equals_the_reference(rule):
    """sut_tiny (MoMHA and MoE-FFD on routed rows, halted positions as no-op slots), every
    routed product on ``grouped_mm`` against the reference loop: logits and every
    parameter's gradient within 1e-4."""
    model = make_model(encoder_halting=rule, decoder_halting=rule, halting_threshold=0.8,
                       encoder_layers=4, decoder_layers=4)
    randomise_halting(model, seed=3)
    g = torch.Generator().manual_seed(0)
    src, prev = torch.randint(4, 40, (3, 7), generator=g), torch.randint(4, 40, (3, 6), generator=g)
    with _backend("grouped"):
        assert_same_as_old(model, src, prev, lambda: _backend("reference"))


def test_the_triton_backend_multiplies_on_grouped_mm_when_asked(monkeypatch):
    """``SUT_EXPERT_GEMM=grouped_mm`` turns the ``triton`` backend's products into
    ``grouped_routed_linear`` (no custom op, no kernel); ``kernels`` (the default) and the
    reference backend keep theirs."""
    calls = []
    real = routed_linear_module.grouped_routed_linear
    monkeypatch.setattr(routed_linear_module, "grouped_routed_linear",
                        lambda *a: calls.append(1) or real(*a))
    routing, gates = _routing()
    x, w = torch.randn(N, IN), torch.randn(E, IN, OUT)
    monkeypatch.setattr(routed_linear_module, "kernel_backend", lambda x: "triton")
    monkeypatch.setenv("SUT_EXPERT_GEMM", "grouped_mm")
    y = routed_linear(x, w, None, routing, K, gates=gates)
    assert calls == [1]
    torch.testing.assert_close(y, reference_routed_linear(x, w, None, routing, K, gates=gates))
    monkeypatch.setattr(routed_linear_module, "kernel_backend", lambda x: "reference")
    routed_linear(x, w, None, routing, K, gates=gates)
    assert calls == [1]
    monkeypatch.delenv("SUT_EXPERT_GEMM")
    assert expert_gemm() == "kernels"


def test_bad_choices_and_operands_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("SUT_EXPERT_GEMM", "cublas")
    with pytest.raises(ValueError, match=r"SUT_EXPERT_GEMM='cublas' is not one of \('kernels', 'grouped_mm'\)"):
        expert_gemm()
    routing, _ = _routing()
    with pytest.raises(ValueError, match="float64"):
        grouped_mm_routed_linear(torch.randn(N, IN, dtype=torch.float64),
                                 torch.randn(E, IN, OUT, dtype=torch.float64), None, routing, K)
    with pytest.raises(ValueError, match=r"out=6 in torch.float32 is 24 bytes; use a multiple of 4"):
        grouped_mm_routed_linear(torch.randn(N, IN), torch.randn(E, IN, 6), None, routing, K)
    with pytest.raises(ValueError, match=r"in=12 in torch.bfloat16 is 24 bytes; use a multiple of 8"):
        grouped_mm_routed_linear(torch.randn(N, 12, dtype=torch.bfloat16),
                                 torch.randn(E, 12, 8, dtype=torch.bfloat16), None, routing, K)


def test_the_map_compiles_whole_and_equals_eager():
    """``torch.compile(fullgraph=True)`` of the map with its backward (no graph break: no
    host read, no custom op), in bfloat16 (what grouped_mm takes in a traced graph), equal
    to eager."""
    torch._dynamo.reset()
    routing, gates = _routing()
    g = torch.Generator().manual_seed(2)
    bf16 = dict(dtype=torch.bfloat16)
    x = torch.randn(N, IN, generator=g).to(**bf16).requires_grad_()
    w = torch.randn(E, IN, OUT, generator=g).to(**bf16).requires_grad_()
    b = torch.randn(E, OUT, generator=g).to(**bf16).requires_grad_()

    def f(x, w, b, gates):
        return grouped_mm_routed_linear(x, w, b, routing, K, gates=gates).sin().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    want = torch.autograd.grad(f(x, w, b, gates), (x, w, b))
    got = torch.autograd.grad(compiled(x, w, b, gates), (x, w, b))
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, atol=1e-2, rtol=1e-2)


def test_a_traced_graph_takes_bfloat16_only(monkeypatch):
    """grouped_mm's traced form (and CUDA's) multiplies bfloat16 only: float32 operands are
    refused there by name, before the tracer's own error."""
    monkeypatch.setattr(grouped_linear, "tracing", lambda: True)
    routing, _ = _routing()
    with pytest.raises(ValueError, match=r"bfloat16,\) operands on CUDA and in a compiled step, not torch.float32"):
        grouped_mm_routed_linear(torch.randn(N, IN), torch.randn(E, IN, OUT), None, routing, K)
