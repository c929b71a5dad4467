"""One weight gradient per shared expert parameter per backward (``ops/weight_grads.py``,
``SUT_WEIGHT_GRADS``). Per step (the default) each step's weight-gradient product adds the
running sum of the later steps, which the parameter's bucket holds between the steps'
backwards, and step 1's returns the sum; deferred, the steps leave their rows to step 1's
backward, which makes dW and db over every step's rows in one
``sut::routed_linear_backward``. The oracle of both: each call its own gradient, summed
by autograd (outside a recurrence).

* three steps of each of the four uses of the op (ragged loads, no-op slots, a step with
  every slot halted): per step and deferred == autograd's sums (weights, biases, inputs,
  gates), per step with the running sum handed from step 3 to 2 to 1;
* whole models (stick-breaking, ACT, GUT's global halting, unshared TLB blocks in chunks):
  per step and deferred == autograd's sums, eagerly and as a compiled loop (AOTAutograd
  traces the buckets into the backward graph), deferred with one weight-gradient product
  per parameter where per step there is one per step;
* the buckets hand back what they held; a layer outside a recurrence keeps its own
  gradient; ``SUT_WEIGHT_GRADS`` is checked by name, ``per-step`` by default.
(The Triton kernels' running sums and deferred gradients: ``kernels/test_kernels_interpret.py``.)
"""
import copy
import importlib

import pytest
import torch

from conftest import make_model, randomise_halting, translation_batch
from kernel_cases import USES, three_steps
from sut_fairseq import compiler
from sut_fairseq.modules.expert_linear import ExpertLinear
from sut_fairseq.modules.recurrence import build_compiled
from sut_fairseq.ops import weight_grads
from sut_fairseq.ops.routed_linear import reference_routed_linear

routed_linear_module = importlib.import_module("sut_fairseq.ops.routed_linear")


def _close(got, want, what):
    if want is None:
        assert got is None, what
        return
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def _chain(monkeypatch):
    """(whether the bucket held a running sum, whether the step returned it) per call of
    ``weight_grads.running_sum`` (a list, appended to)."""
    calls = []
    inner = weight_grads.running_sum

    def recording(bucket, dw, db, flushes):
        calls.append((bucket.running is not None, flushes))
        return inner(bucket, dw, db, flushes)

    monkeypatch.setattr(weight_grads, "running_sum", recording)
    return calls


@pytest.mark.parametrize("mode", ["per-step", "deferred"])
@pytest.mark.parametrize("use", list(USES))
def test_three_steps_equal_autograds_sums(use, mode, monkeypatch):
    want = three_steps(reference_routed_linear, use, in_recurrence=False)
    monkeypatch.setenv("SUT_WEIGHT_GRADS", mode)
    weight_grads.Stats.reset()
    chain = _chain(monkeypatch)
    got = three_steps(reference_routed_linear, use)
    if mode == "deferred":
        assert weight_grads.Stats.peak > 0 and weight_grads.Stats.held == 0 and not chain
    else:  # step 3 starts the sum, step 2 adds to it, step 1 adds and returns it
        assert chain == [(False, False), (True, False), (True, True)]
    for what, g, w in zip(("loss", "dW", "db"), got[:3], want[:3]):
        _close(g, w, what)
    for l, (g, w) in enumerate(zip(got[3] + got[4], want[3] + want[4])):
        _close(g, w, f"dx / dgates of step {l % 3 + 1}")


def test_the_merged_routing_is_the_routing_of_the_steps_tokens_concatenated():
    """Step l's slot s is slot l·M + s of the merged routing, no-op slots last; two maps on
    one routing merge it once; steps of different token counts are refused."""
    g = torch.Generator().manual_seed(0)
    E, N, k, entries = 5, 7, 2, []
    for step in range(3):
        idx = torch.randint(0, E, (N, k), generator=g)
        idx[idx == 3] = E  # expert 3 never chosen: no-op slots instead
        entries.append(weight_grads.Entry(None, None, None, idx, None, k, False, False))
    got = weight_grads.merged_routing(entries, E)
    flat = torch.cat([e.expert_idxs for e in entries]).flatten()
    slots = got.sorted_scattered_idxs
    assert torch.equal(flat[slots], got.sorted_expert_idxs)
    assert torch.equal(got.sorted_expert_idxs, flat.sort(stable=True).values)  # by expert ...
    for e in range(E + 1):  # ... then by step and slot
        rows = slots[got.sorted_expert_idxs == e]
        assert torch.equal(rows, rows.sort().values)
    assert got.expert_offsets.tolist() == [int((flat <= e).sum()) for e in range(E)]
    assert weight_grads.merged_routing(entries, E) is got  # merged once for the layer's two maps
    with pytest.raises(RuntimeError, match="different token counts"):
        weight_grads.merged_routing(entries[:2] + [weight_grads.Entry(
            None, None, None, entries[2].expert_idxs[:4], None, 2, False, False)], E)


def _count_weight_products(monkeypatch):
    """Calls of the reference backward asked for a weight gradient (a list, appended to)."""
    calls = []
    inner = routed_linear_module.reference_backward

    def counting(grad, x, weight, bias, row_gates, src, dst, ends, needs):
        if needs[1]:
            calls.append(tuple(weight.shape))
        return inner(grad, x, weight, bias, row_gates, src, dst, ends, needs)

    monkeypatch.setattr(routed_linear_module, "reference_backward", counting)
    return calls


def _grads(model, batch):
    src, lengths, prev = batch
    out, extra = model(src, lengths, prev)
    loss = out.float().pow(2).mean() + extra["halting_encoder"].act_loss()
    model.zero_grad()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    (out_g, grads_g), (out_w, grads_w) = got, want
    torch.testing.assert_close(out_g, out_w, rtol=1e-5, atol=1e-6)
    assert grads_g.keys() == grads_w.keys()
    for name, w in grads_w.items():
        torch.testing.assert_close(grads_g[name], w, rtol=1e-4, atol=1e-5 * w.abs().max().item() + 1e-8,
                                   msg=lambda m: f"{name}: {m}")


def _routed_modules(model) -> int:
    return sum(1 for m in model.modules() if isinstance(m, ExpertLinear) and m.weight.size(0) > 1)


MODELS = {
    "stick-breaking": dict(encoder_halting="stick-breaking", decoder_halting="stick-breaking"),
    "act": dict(encoder_halting="act", decoder_halting="act"),
    "gut": dict(encoder_halting="global-mean", decoder_halting="global-mean",
                halting_transition=True, gated_ffn=True),
    "tlb-unshared": dict(encoder_chunk_size=3, encoder_memory_slots=2, tlb_unshared=True,
                         encoder_halting="none"),
}


def _autograds_sums(monkeypatch):
    """Every call its own weight gradient (as outside a recurrence), summed by autograd."""
    monkeypatch.setattr(weight_grads, "defer_code", lambda tag, weight: -1)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_model_per_step_and_deferred_equal_autograds_sums(name, monkeypatch):
    model = make_model(halting_threshold=0.8, encoder_layers=3, decoder_layers=3, **MODELS[name])
    randomise_halting(model, seed=3)
    model.train()  # dropout 0: deterministic
    calls = _count_weight_products(monkeypatch)
    with monkeypatch.context() as m:
        _autograds_sums(m)
        want = _grads(model, translation_batch())
    own = len(calls)
    monkeypatch.setenv("SUT_WEIGHT_GRADS", "per-step")
    del calls[:]
    chain = _chain(monkeypatch)
    _assert_same(_grads(model, translation_batch()), want)
    assert len(calls) == own  # one product per executed step, as autograd's ...
    assert sum(held for held, _ in chain) == own - sum(returned for _, returned in chain) > 0
    monkeypatch.setenv("SUT_WEIGHT_GRADS", "deferred")  # ... and deferred: one per parameter
    weight_grads.Stats.reset()
    del calls[:]
    _assert_same(_grads(model, translation_batch()), want)
    assert weight_grads.Stats.held == 0
    if name == "tlb-unshared":  # the encoder's blocks each flush per chunk, the decoder once
        assert _routed_modules(model.decoder) < len(calls) < own
    else:  # one product per routed parameter, where per step each executed step makes one
        assert len(calls) == _routed_modules(model) < own


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_compiled_loop_traces_the_buckets(backend, monkeypatch):
    """--compile-loop: AOTAutograd runs the buckets while tracing the backward: per step,
    a chain of products each adding the running sum (no other sum of the steps' terms);
    deferred, one product per routed parameter; both equal autograd's sums, eagerly."""
    if backend == "inductor" and compiler.compiler_missing(torch.device("cpu")):
        pytest.skip("no C++ compiler for inductor")
    monkeypatch.setenv("SUT_COMPILE_BACKEND", backend)
    eager = make_model(halting_threshold=0.8, encoder_layers=3, decoder_layers=3)
    randomise_halting(eager, seed=3)
    eager.train()
    with monkeypatch.context() as m:
        _autograds_sums(m)
        want = _grads(eager, translation_batch())
    for mode in ("per-step", "deferred"):
        torch._dynamo.reset()
        monkeypatch.setenv("SUT_WEIGHT_GRADS", mode)
        compiled = copy.deepcopy(eager)
        for side, name in ((compiled.encoder.side, "encoder"), (compiled.decoder.side, "decoder")):
            side.compiled_step = build_compiled(side.recurrence.step, name, max_steps=side.num_steps)
        with monkeypatch.context() as m:
            chain = _chain(m)
            _grads(compiled, translation_batch())  # compiles: the buckets run while tracing
        with monkeypatch.context() as m:  # the compiled backward's products
            calls = _count_weight_products(m)
            got = _grads(compiled, translation_batch())
        for side in (compiled.encoder.side, compiled.decoder.side):
            assert side.compiled_step.compiled is not None and not side.compiled_step.failed
        _assert_same(got, want)
        if mode == "per-step":  # 3 steps: each parameter's sum begun once, added to twice
            modules = _routed_modules(compiled)
            assert chain.count((False, False)) == modules and chain.count((True, True)) == modules
            assert len(calls) == 3 * modules
        else:
            assert not chain and len(calls) == _routed_modules(compiled)


def test_a_layer_outside_a_recurrence_keeps_its_own_gradient(monkeypatch):
    monkeypatch.setenv("SUT_WEIGHT_GRADS", "deferred")
    layer = ExpertLinear(3, 4, 5)
    assert weight_grads.ROLE.step is None
    assert weight_grads.defer_code(layer.tag, layer.weight) == -1
    weight_grads.ROLE.step = 2
    try:
        assert weight_grads.defer_code(layer.tag, layer.weight) == 2 * layer.tag
        with torch.no_grad():  # no gradient: nothing to defer
            assert weight_grads.defer_code(layer.tag, layer.weight) == -1
    finally:
        weight_grads.ROLE.step = None


@pytest.mark.parametrize("choice, deferred", [(None, False), ("per-step", False), ("deferred", True)])
def test_per_step_is_the_default(choice, deferred, monkeypatch):
    if choice is None:
        monkeypatch.delenv("SUT_WEIGHT_GRADS", raising=False)
    else:
        monkeypatch.setenv("SUT_WEIGHT_GRADS", choice)
    w = torch.zeros(2, 3, 4, requires_grad=True)
    weight_grads.ROLE.step = 1
    try:
        code = weight_grads.defer_code(7, w)
    finally:
        weight_grads.ROLE.step = None
    bucket, flushes = weight_grads.attach(code)
    assert code == 15 and flushes and bucket.deferred == deferred and bucket.running is None


def test_a_bad_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("SUT_WEIGHT_GRADS", "later")
    with pytest.raises(ValueError, match=r"SUT_WEIGHT_GRADS='later'.*'per-step'"):
        weight_grads.mode()


@pytest.mark.parametrize("mode", ["per-step", "deferred"])
def test_step_1s_backward_closes_the_bucket(mode, monkeypatch):
    """Steps 2..L join the bucket of their forward's step 1 until step 1's backward
    closes it; a later call of step 2 without a step 1 (a new forward) then makes its own
    gradient instead of adding to a sum that was already returned."""
    monkeypatch.setenv("SUT_WEIGHT_GRADS", mode)
    tag = weight_grads.new_tag()
    bucket, flushes = weight_grads.attach(2 * tag + 1)
    assert flushes and bucket.deferred == (mode == "deferred")
    assert weight_grads.attach(2 * tag) == (bucket, False)  # step 2 joins
    if mode == "deferred":
        w = torch.randn(2, 3, 4)
        x, grad = torch.randn(5, 3), torch.randn(5, 4)
        weight_grads.add(bucket, weight_grads.Entry(grad, x, None, torch.tensor([[0], [1], [0], [2], [1]]),
                                                    None, 1, False, False))
        dw, _ = weight_grads.flush(bucket, w, None, "reference", False)
        torch.testing.assert_close(dw[0], x[[0, 2]].t() @ grad[[0, 2]])
    else:
        dw = torch.ones(2, 3, 4)
        assert weight_grads.running_sum(bucket, dw, None, False) == (None, None)
        assert bucket.running[0] is dw
        assert weight_grads.running_sum(bucket, dw + 1, None, True)[0].eq(2).all()
    assert weight_grads.attach(2 * tag) == (None, False)  # closed: its own gradient
