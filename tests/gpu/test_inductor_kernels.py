"""benchmarks/inductor_kernels.py: inductor's GPU kernels generated on the CPU."""
import contextlib
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import inductor_kernels  # noqa: E402
from inductor_kernels import RegionCall  # noqa: E402


def _block(x, w, b):
    """LayerNorm, a linear layer, softmax: one GEMM and, around it, what inductor fuses."""
    y = F.layer_norm(x, (x.size(-1),))
    return torch.softmax(F.linear(y, w, b), -1) * 2.0


def _generated(fn, *args):
    calls = [RegionCall(0, ("fn",), tuple(a.to("meta") for a in args), {})]
    compiled = {}

    def region(*inputs):
        from sut_fairseq import compiler
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(fn, backend=compiler.compile_backend(), fullgraph=True)
        return compiled["fn"](*inputs)

    return inductor_kernels.generated_kernels(calls, {("fn",): region})


def test_a_small_graph_forward_and_backward():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    kernels, mismatches = _generated(_block, x, w, b)
    assert mismatches == []  # the scheduler's kernels are the wrapper's launches
    fwd, bwd = kernels[(0, "fwd")], kernels[(0, "bwd")]
    gemms = [k for k in fwd if k.kind == "gemm"]
    assert [(k.name, k.gemm) for k in gemms] == [("addmm", (1, 64, 48, 32))]
    assert gemms[0].flops == 2 * 64 * 48 * 32
    assert all(k.kind in ("gemm", "inductor") for k in fwd + bwd)
    # the LayerNorm before the GEMM and the softmax after it: at most one kernel each
    assert 1 <= sum(k.kind == "inductor" for k in fwd) <= 2
    # backward: dX and dW products (the bias gradient a reduction kernel)
    assert sorted(k.gemm for k in bwd if k.kind == "gemm") == [(1, 48, 32, 64), (1, 64, 32, 48)]
    assert all(k.bytes > 0 for k in fwd + bwd if k.kind == "inductor")


def test_each_call_of_a_region_adds_its_kernels_again():
    x = torch.randn(64, 32)
    w, b = torch.randn(48, 32), torch.randn(48)
    calls = [RegionCall(r, ("fn",), (x.to("meta"), w.to("meta"), b.to("meta")), {}) for r in (0, 1)]
    compiled = {}

    def region(*inputs):
        from sut_fairseq import compiler
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(_block, backend=compiler.compile_backend(), fullgraph=True)
        return compiled["fn"](*inputs)

    kernels, _ = inductor_kernels.generated_kernels(calls, {("fn",): region})
    # compiled once, called twice; no gradient: forward only
    assert sorted(kernels) == [(0, "fwd"), (1, "fwd")]
    assert [k.name for k in kernels[(0, "fwd")]] == [k.name for k in kernels[(1, "fwd")]]


def test_a_float_scatter_add_is_generated_as_on_cuda_whatever_the_cpu_threads():
    """The halting rule's scatter-add of the remainders (``weights.scatter_add(2, last, r)``):
    CUDA's lowering makes it inductor's own kernel; inductor's CPU rule would leave it to an
    aten ``scatter_reduce_`` when more than one thread is visible (the model's launches
    then moved with the machine's cores: 1,030 on one, 1,044 on two)."""
    def remainders(w, last, r):
        return w.scatter_add(2, last, r).sum(-1)

    w = torch.randn(4, 5, 6, requires_grad=True)
    last = torch.randint(0, 6, (4, 5, 1))
    r = torch.randn(4, 5, 1, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kernels, mismatches = _generated(remainders, w, last, r)
    finally:
        torch.set_num_threads(threads)
    assert mismatches == []
    assert [k.kind for k in kernels[(0, "fwd")]] == ["inductor"] * len(kernels[(0, "fwd")])


def test_an_op_that_only_mutates_its_input_is_sized_by_that_input():
    """A scatter-add of int64 counts is an aten ``scatter_reduce_`` on CUDA too: an extern
    op that writes into its first input and has no output of its own (inductor's
    ``NoneLayout``): one aten launch, with that input's dtype and size."""
    def counts(c, idx, ones):
        return c.scatter_add(0, idx, ones) * 2

    c = torch.zeros(8, dtype=torch.long)
    idx = torch.randint(0, 8, (20,))
    kernels, mismatches = _generated(counts, c, idx, torch.ones(20, dtype=torch.long))
    assert mismatches == []
    scatters = [k for k in kernels[(0, "fwd")] if k.kind == "aten"]
    assert [(k.name, k.numel, k.dtype) for k in scatters] == [("scatter_reduce_", 8, torch.int64)]


def test_attention_is_one_opaque_op_forward_and_backward():
    """The math a CPU would compile (two bmm and a softmax) is not generated: attention is
    the caller's fused kernel; the op itself computes SDPA and its gradients exactly."""
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    out = torch.ops.gpu_model.attention(q, k, v, mask, 0.0, False, None)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(
        lambda *t: torch.ops.gpu_model.attention(*t, 0.0, False, None), (q, k, v, mask))
    # causal, with its own scale, no mask: against SDPA too
    torch.testing.assert_close(torch.ops.gpu_model.attention(q, k, v, None, 0.0, True, 0.3),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))
    assert torch.autograd.gradcheck(
        lambda *t: torch.ops.gpu_model.attention(*t, None, 0.0, True, 0.3), (q, k, v))
    # grouped-query: 3 query heads over one key/value head
    k1, v1 = k[:, :1].detach(), v[:, :1].detach()
    torch.testing.assert_close(inductor_kernels._opaque_sdpa(q, k1, v1, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k1, v1, enable_gqa=True))

    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    kernels, _ = _generated(attend, q.float(), k.float(), v.float(), mask.float())
    generated = kernels.get((0, "fwd"), []) + kernels.get((0, "bwd"), [])
    assert not [g for g in generated if g.kind == "gemm"]


def test_the_cuda_branches_are_traced():
    """Code that asks ``x.is_cuda`` takes its CUDA branch while a region is generated."""
    def branchy(x):
        return x * 2 if x.is_cuda else x @ x.t()

    x = torch.randn(16, 16)
    kernels, _ = _generated(branchy, x)
    assert [k.kind for k in kernels[(0, "fwd")]] == ["inductor"]


@pytest.mark.parametrize("argv, message", [
    (["--arch", "sut_tiny", "--inductor"], "add --compile-step or --compile-loop"),
    (["--arch", "sut_tiny+flex", "--compile-loop", "--inductor"], "does not model FlexAttention"),
])
def test_inductor_option_refuses_what_it_does_not_model(capsys, argv, message):
    import gpu_model

    with pytest.raises(SystemExit):
        gpu_model.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_sut_tiny_compiled_loop_with_inductors_kernels(capsys):
    import gpu_model

    gpu_model.main(["--arch", "sut_tiny", "--compile-loop", "--inductor", "--top", "3"])
    out = capsys.readouterr().out
    assert "compiled (inductor's kernels)" in out
    assert "--inductor:" not in out  # no scheduler / wrapper disagreement
    launches = int(re.search(r"gpu model: sut_tiny launches (\d+)", out).group(1))
    kinds = dict(re.findall(r"^  (attention|accum)\s+(\d+)", out, re.M))
    assert kinds["attention"] == "27"  # 3 + 6 forward, twice that backward (the recorder's)
    assert int(kinds["accum"]) <= 2  # the sums over the loop's steps are in its graph
    assert 300 < launches < 1000


def _zero_filled_statistics_gradients(form):
    import gpu_model

    kernels = gpu_model.record_step(form, True, 4, 8, 200, torch.bfloat16, True)
    assert any(k.name == "_route_backward" for k in kernels)
    return [k for k in kernels if "route_top_k" in k.name and "zeros" in k.name]


@pytest.mark.slow  # 15-30 s each: a step recorded and its regions generated
@pytest.mark.parametrize("form", ["sut_tiny+loop", "sut_tiny"])
def test_the_regions_carry_the_routers_statistics_as_in_training(form):
    """The regions are traced with the routers' statistics recorded (the MI loss's), so a
    router's backward takes their gradient as an input, as in training: no zero-filled
    gradient of them. A compiled step records them afresh per call (each call's backward
    runs before the next: a chain over calls would backward through a freed graph)."""
    assert not _zero_filled_statistics_gradients(form)


@pytest.mark.slow
def test_traced_without_the_statistics_every_router_backward_gets_a_zero_fill(monkeypatch):
    """What the test above guards against: a kernel per router call that training does
    not run."""
    import gpu_model

    monkeypatch.setattr(gpu_model, "record_routing", lambda model: contextlib.nullcontext())
    assert _zero_filled_statistics_gradients("sut_tiny+loop")
