"""``--compile-step``: each side's recurrence step as one ``torch.compile`` graph.

* compiled == eager for the outputs and every parameter's gradient (fp32, relative 1e-4)
  for every halting rule (but the early exits), transition-aware halting with GUT's
  gate, step embeddings, pre-LN with T5 relative positions and a dense UT (E = k = 1):
  with the ``aot_eager`` backend (dynamo's full-graph trace, AOTAutograd and the custom
  op's fake and autograd implementations, no code generation, so every variant is quick)
  and, for ``sut_tiny``, with inductor's C++ code as ``fairseq-train`` runs it;
* ``torch._dynamo.explain`` finds no graph break in the step;
* halted positions still cost nothing in the compiled step: the expert op computes the
  same rows as in the eager step;
* at most 8 compilations (4 of the steps, 4 of the input embeddings) over 50 batches whose
  B and T change (logic-like and WMT-shaped);
* the sides the option does not cover keep the eager step, with a message naming why.
"""
import copy
import importlib
import logging
import subprocess
import sys

import pytest
import torch

from conftest import make_model, randomise_halting, translation_batch
from sut_fairseq.criterions.losses import record_routing
from sut_fairseq import compiler
from sut_fairseq.compiler import CompiledStep, count_graph_breaks
from sut_fairseq.modules import recurrence
from sut_fairseq.modules.recurrence import KeyValueCarry, TensorLoop, build_compiled

VARIANTS = {
    "sut_tiny": {},
    "dense-ut": dict(att_experts=1, att_topk=1, ffd_experts=1, ffd_topk=1),
    "gut": dict(encoder_halting="global-mean", decoder_halting="global-mean",
                halting_transition=True, gated_ffn=True),
    "act": dict(encoder_halting="act", decoder_halting="act"),
    "none": dict(encoder_halting="none", decoder_halting="none"),
    "step-embeddings": dict(encoder_step_embedding="timestep", decoder_step_embedding="coordinate"),
    "pre-ln-t5": dict(encoder_normalize_before=True, decoder_normalize_before=True,
                      encoder_step_embedding="coordinate", rel_pos="t5"),
    # pre-LN with the keys/values of S carried from step to step (no step embedding)
    "pre-ln": dict(encoder_normalize_before=True, decoder_normalize_before=True),
}


def _models(overrides, loop=False, compile=True, inputs=True):
    """(eager model, the same weights with --compile-step, or with ``loop`` --compile-loop),
    halting units randomised so that positions halt at different steps. ``compile=False``:
    the compiled path's modules (``TensorStep`` / ``TensorLoop`` under ``CompiledCall``)
    run as they are, without torch.compile. ``inputs=False``: the input embeddings stay
    eager (tests that count the steps' graphs)."""
    eager = make_model(**overrides)
    randomise_halting(eager)
    compiled = copy.deepcopy(eager)
    for side, name in ((compiled.encoder.side, "encoder"), (compiled.decoder.side, "decoder")):
        side.compiled_step = build_compiled(side.recurrence.step, name,
                                            max_steps=side.num_steps if loop else None)
        # the side's input embedding, compiled as --compile-step builds it
        side.compiled_input = compiler.CompiledFunction(side.input_states, f"{name}'s input embedding",
                                                        follows=side.compiled_step)
        if not compile:  # what they call once compiled: here the module and function themselves
            side.compiled_step.compiled = side.compiled_step.step
            side.compiled_input.compiled = side.input_states
        if not inputs:
            side.compiled_input = None
    return eager, compiled


def _loss_and_grads(model, batch):
    src, lengths, prev = batch
    out, extra = model(src, lengths, prev)
    loss = (out.float().pow(2).mean() + extra["halting_encoder"].act_loss()
            + extra["halting_decoder"].act_loss())
    model.zero_grad()
    loss.backward()
    return out.detach(), extra, {n: p.grad.clone() for n, p in model.named_parameters()
                                 if p.grad is not None}


def _assert_same(eager, compiled, batch):
    expected, got = _loss_and_grads(eager, batch), _loss_and_grads(compiled, batch)
    for side in (compiled.encoder.side, compiled.decoder.side):
        assert side.compiled_step.compiled is not None and not side.compiled_step.failed
        assert side.compiled_input is None or (side.compiled_input.compiled is not None
                                               and not side.compiled_input.failed)
    _assert_same_results(expected, got)


def _assert_same_results(expected, got):
    """``_loss_and_grads``'s results of two models: outputs, steps, halting weights and
    every parameter's gradient."""
    (out_e, extra_e, grads_e), (out_c, extra_c, grads_c) = expected, got
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    for key in ("halting_encoder", "halting_decoder"):
        assert torch.equal(extra_c[key].steps, extra_e[key].steps)
        torch.testing.assert_close(extra_c[key].weights, extra_e[key].weights, rtol=1e-4, atol=1e-6)
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        # relative to the tensor's largest gradient: the key biases' true gradient is 0
        # (softmax ignores a shift of every logit) and both give rounding noise there
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-4 * g.abs().max().item() + 1e-8,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("loop", [False, True], ids=["step", "loop"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_compiled_paths_modules_uncompiled_equal_the_eager_recurrence(variant, loop):
    """The math of the compiled path apart from the compiler: the step's tensor form
    (``TensorStep``, called once per step through ``CompiledCall``, or ``TensorLoop``, all
    L steps in one call), run without torch.compile, against the eager recurrence (the
    same ``RecurrenceStep`` called directly), for every variant. The compiled tests below
    then check what the compiler does to them. (Also
    the eager calls through which ``make mutation`` maps these tests to the modules.)"""
    eager, uncompiled = _models(VARIANTS[variant], loop, compile=False)
    eager.train(), uncompiled.train()
    _assert_same(eager, uncompiled, translation_batch())


def _run_beside_eager(caplog, loop=False):
    """One forward of a --compile-step (``loop``: --compile-loop) model and of its eager
    twin (warnings captured); their outputs must be equal. Returns the compiled model and
    the batch."""
    eager, compiled = _models({}, loop=loop)
    batch = translation_batch()
    with caplog.at_level(logging.WARNING), torch.no_grad():
        torch.testing.assert_close(compiled(*batch)[0], eager(*batch)[0])
    return compiled, batch


def _first_step_inputs(side, seed):
    """A side's step-1 inputs for a direct call of its step: h_0 (B, T, d) random, the
    real positions (B, T) of ``translation_batch``'s source, the halting state begun on them and a
    (B, T, H·D) zero tensor for carried keys/values."""
    src, _, _ = translation_batch()
    h0 = torch.randn(*src.shape, side.embed_tokens.embedding_dim,
                     generator=torch.Generator().manual_seed(seed))
    real = src.ne(1)
    attn = side.block.self_attn
    rows = h0.new_zeros(*h0.shape[:2], attn.num_heads * attn.head_dim)
    return h0, real, side.halting.begin(h0, real), rows


@pytest.mark.parametrize("loop", [False, True], ids=["step", "loop"])
@pytest.mark.parametrize("rule", ["stick-breaking", "act"])
def test_the_step_decides_with_its_threshold_input(rule, loop):
    """α_thresh reaches the step (or the loop of all steps) as a tensor input, so that
    changing it compiles nothing again: the decision for the next step follows that
    input, not the halting unit's attribute. The loop runs 2 steps: a position runs the
    second step exactly when the decision after the first let it (c_1 < α_thresh)."""
    _, model = _models(dict(encoder_halting=rule, encoder_layers=2), loop, compile=False)
    side = model.encoder.side
    step = side.compiled_step.step
    decisions = {}
    for given in (0.3, 0.999):
        side.halting.threshold = 1.3 - given  # the attribute says otherwise
        h0, real, state, rows = _first_step_inputs(side, seed=2)
        with torch.no_grad():
            if loop:  # the loop begins the halting state and the carried keys itself
                out = step(h0, h0.clone(), real, real, ~real, threshold=torch.tensor(given))
            else:
                out = step(h0, h0.clone(), real, real, state.c, state.log_remain,
                           state.weighted_sum, state.steps, ~real, threshold=torch.tensor(given),
                           changed=real, k_rows=rows, v_rows=rows.clone())
        if loop:  # (S, steps, c, ...): c after the first step's decision, steps 1 or 2
            running_next, c = out[1].eq(2), out[2]
            assert torch.equal(out[1], real.long() + running_next.long())
        else:  # (h, S, steps, running_next, c, ...)
            running_next, c = out[3], out[4]
        assert torch.equal(running_next, real & (c < given)), (given, c)
        decisions[given] = running_next
    assert not torch.equal(decisions[0.3], decisions[0.999])  # the case this test is about


def test_the_step_projects_keys_and_values_only_for_the_rows_whose_state_changed():
    """Without a step embedding the keys/values of S are carried between steps
    (``KeyValueCarry``): a row whose S changed is projected again (whatever
    was carried for it), a row whose S did not keeps what was carried. Garbage carried
    for the changed rows leaves the step's output as it is; garbage carried for the
    others reaches it."""
    _, model = _models({}, compile=False)
    side = model.encoder.side
    step = side.compiled_step.step
    assert step.step.carries_kv
    h0, real, state, zeros = _first_step_inputs(side, seed=3)
    changed = torch.zeros_like(real)
    changed[:, ::2] = True
    everything = torch.ones_like(real)
    garbage = torch.full_like(zeros, 7.0)

    def run(k_rows, v_rows, rows):
        with torch.no_grad():
            return step(h0, h0.clone(), real, real, state.c, state.log_remain, state.weighted_sum,
                        state.steps, ~real, changed=rows, k_rows=k_rows, v_rows=v_rows)[0]

    with torch.no_grad():
        carry = KeyValueCarry(everything, zeros, zeros)
        carry(side.block, h0, real)
        k_true, v_true = carry.k_rows, carry.v_rows
    expected = run(k_true, v_true, everything)
    mask = changed.unsqueeze(-1)
    torch.testing.assert_close(run(torch.where(mask, garbage, k_true),
                                   torch.where(mask, garbage, v_true), changed), expected)
    assert not torch.allclose(run(torch.where(mask, k_true, garbage),
                                  torch.where(mask, v_true, garbage), changed), expected)


def _record_projected_rows(model) -> dict:
    """Per side, a list the side's self-attention key/value projections append to: the
    rows each call projects, (B, T) bool (every row for the block's plain ``self_kv``, or
    for the masked projection given no row mask)."""
    rows = {"encoder": [], "decoder": []}
    for name, side in (("encoder", model.encoder.side), ("decoder", model.decoder.side)):
        block, self_kv = side.block, side.block.self_kv

        def masked(module, args, seen=rows[name]):  # MaskedAffine(x, weight, bias, rows)
            x, changed = args[0], args[3]
            seen.append(torch.ones(x.shape[:2], dtype=torch.bool) if changed is None else changed.clone())

        def every(S, *rest, seen=rows[name], self_kv=self_kv):
            seen.append(torch.ones(S.shape[:2], dtype=torch.bool))
            return self_kv(S, *rest)

        block.kv_rows.register_forward_pre_hook(masked)
        block.self_kv = every
    return rows


@pytest.mark.parametrize("loop", [False, True], ids=["step", "loop"])
def test_the_compiled_paths_project_the_rows_the_eager_recurrence_projects(loop):
    """Halted rows are not projected again in the compiled path either: its step (or
    loop), run without torch.compile, projects at each step exactly the rows the eager
    recurrence projects (every row at step 1, then the rows that ran the step before).
    The loop runs on after every position halted; its extra steps are not compared."""
    eager, uncompiled = _models({}, loop, compile=False)
    batch = translation_batch()
    expected, got = _record_projected_rows(eager), _record_projected_rows(uncompiled)
    with torch.no_grad():
        eager(*batch), uncompiled(*batch)
    for side in ("encoder", "decoder"):
        want, have = expected[side], got[side]
        assert len(want) > 2 and not all(rows.all() for rows in want[1:]), "no row skipped"
        assert len(have) == len(want) or (loop and len(have) > len(want))
        for l, (a, b) in enumerate(zip(want, have), 1):
            assert torch.equal(a, b), (side, l)


def test_the_threshold_input_is_made_once_on_the_states_device():
    """α_thresh becomes a 0-d tensor on the step's device at the first call and stays
    that tensor (an input of the graph, never rebuilt)."""
    _, model = _models({}, compile=False)
    side = model.encoder.side
    h0, real, state, _ = _first_step_inputs(side, seed=0)
    inputs = recurrence.StepInputs(self_padding_mask=~real, real=real)
    call = recurrence.CompiledCall(side.compiled_step, side.halting)
    first = call.tensors(h0, h0, real, state, None, inputs)["threshold"]
    assert first.dim() == 0 and first.item() == pytest.approx(side.halting.threshold)
    assert call.tensors(h0, h0, real, state, None, inputs)["threshold"] is first
    meta = recurrence.CompiledCall(side.compiled_step, side.halting)
    h_meta = h0.to("meta")
    assert meta.tensors(h_meta, h_meta, real, state, None, inputs)["threshold"].device == h_meta.device


def test_a_compiler_failing_at_a_later_step_hands_the_eager_step_the_compiled_steps_state(caplog):
    """Compiling fails at step 2 (a recompilation, say): the eager step takes over from
    the state the compiled step 1 left (h_1 for the transition-aware halting input, the
    carried keys, the halting sums), so the forward and every gradient equal the eager
    model's; one message per side, and the side stays eager."""
    eager, compiled = _models(VARIANTS["gut"], compile=False)

    class FailsAtTheSecondCall:
        def __init__(self, step):
            self.step, self.calls = step, 0

        def __call__(self, **inputs):
            self.calls += 1
            if self.calls == 2:
                raise torch._dynamo.exc.Unsupported("recompiling step 2 failed")
            return self.step(**inputs)

    sides = (compiled.encoder.side, compiled.decoder.side)
    for side in sides:
        side.compiled_step.compiled = FailsAtTheSecondCall(side.compiled_step.step)
    batch = translation_batch()
    with caplog.at_level(logging.WARNING):
        got = _loss_and_grads(compiled, batch)
    expected = _loss_and_grads(eager, batch)
    assert all(side.compiled_step.failed and side.compiled_step.compiled.calls == 2 for side in sides)
    assert len([r for r in caplog.records if r.name == compiler.__name__]) == 2
    for key in ("halting_encoder", "halting_decoder"):  # steps after the failing one ran eagerly
        assert int(expected[1][key].steps.max()) > 2
    _assert_same_results(expected, got)


def test_a_missing_cpp_compiler_keeps_the_eager_step_and_says_so(monkeypatch, caplog):
    """Inductor's CPU backend needs a C++ compiler (``CXX``, default g++): without one the
    step is not compiled at all, one warning names the missing compiler, and the eager
    step's result comes back. A GPU needs none here."""
    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "inductor")
    message = "inductor's CPU backend needs a C++ compiler and 'no-such-c++' is not on PATH (set CXX)"
    assert compiler.compiler_missing(torch.device("cpu")) == message
    assert compiler.compiler_missing(torch.device("cuda")) is None
    compiled, batch = _run_beside_eager(caplog)
    src, lengths, prev = batch
    for side in (compiled.encoder.side, compiled.decoder.side):
        assert side.compiled_step.failed and side.compiled_step.compiled is None
        assert side.compiled_input.compiled is None and not side.compiled_input.failed  # eager, unsaid
    assert [r.getMessage() for r in caplog.records if r.name == compiler.__name__] == [
        f"--compile-step: compiling the {side} step failed (RuntimeError: {message}); running the "
        "eager step from now on" for side in ("encoder", "decoder")]
    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.no_grad():  # said once, not at every forward
        compiled(src, lengths, prev)
    assert not caplog.records


#: the default suite traces one variant with the most options (the rest: ``make test-all``)
QUICK = {"gut"}


@pytest.mark.parametrize("variant", [v if v in QUICK else pytest.param(v, marks=pytest.mark.slow)
                                     for v in sorted(VARIANTS)])
def test_compiled_step_equals_eager(variant, monkeypatch):
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    eager, compiled = _models(VARIANTS[variant])
    eager.train(), compiled.train()  # dropout is 0: training mode, deterministic
    _assert_same(eager, compiled, translation_batch())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gut", "act", "none", "step-embeddings"])
def test_compiled_loop_equals_eager(variant, monkeypatch):
    """--compile-loop: every step of a side in one graph, against the eager loop (the
    default suite: ``test_compiled_loop_runs_on_after_every_position_halted``)."""
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    eager, compiled = _models(VARIANTS[variant], loop=True)
    assert isinstance(compiled.encoder.side.compiled_step.step, TensorLoop)
    eager.train(), compiled.train()
    _assert_same(eager, compiled, translation_batch())


@pytest.mark.parametrize("compile, loop", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["compiled", "uncompiled", "compiled-step", "uncompiled-step"])
def test_compiled_loop_runs_on_after_every_position_halted(compile, loop, monkeypatch):
    """Where the eager loop stops early because every position halted, the loop's steps
    after that change nothing: the outputs, the halting weights and every gradient equal
    the eager model's (threshold 0.3: every position halts before the last of 3 steps);
    and where positions run to the last step (0.999) they equal them too. Compiled, and
    the loop module run as it is; and the per-step path (``compiled-step``,
    ``uncompiled-step``), which stops at the first step with no running position.

    One graph per side, whichever form: every step of the per-step path shares it (step
    1's carried inputs are marked as requiring a gradient, as the later steps' are), and
    α_thresh is an input, so changing it compiles nothing again."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compiler, "compile_backend", lambda: counter)
    torch._dynamo.reset()
    overrides = dict(halting_threshold=0.999, encoder_layers=3, decoder_layers=3)
    eager, compiled = _models(overrides, loop=loop, compile=compile, inputs=False)
    eager.train(), compiled.train()
    batch = translation_batch()
    with torch.no_grad():
        _, extra = eager(*batch)
    assert all(extra[key].steps.max().item() == 3 for key in ("halting_encoder", "halting_decoder"))
    _assert_same(eager, compiled, batch)  # every step runs: every graph compiled here
    compilations = counter.frame_count
    assert compilations == (2 if compile else 0)  # one per side
    for model in (eager, compiled):
        for side in (model.encoder.side, model.decoder.side):
            side.halting.threshold = 0.3
    with torch.no_grad():
        _, extra = eager(*batch)
    for key in ("halting_encoder", "halting_decoder"):  # the case this test is about
        assert extra[key].steps.max().item() < 3, (key, extra[key].steps)
    _assert_same(eager, compiled, batch)
    assert counter.frame_count == compilations


@pytest.mark.parametrize("rule", ["none", "act"])
def test_every_step_of_a_training_forward_runs_one_graph(rule, monkeypatch):
    """Whatever the halting rule, the per-step path compiles one graph per side for
    training: under ``none`` S_l is h_l itself, which as two aliased inputs of step 2
    made a second graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compiler, "compile_backend", lambda: counter)
    torch._dynamo.reset()
    _, model = _models(dict(encoder_halting=rule, decoder_halting=rule, encoder_layers=3,
                            decoder_layers=3), inputs=False)
    model.train()
    for _ in range(2):
        out, _ = model(*translation_batch())
        out.float().mean().backward()
    assert counter.frame_count == 2


def test_the_default_backend_is_inductor(monkeypatch):
    monkeypatch.delenv("SUT_COMPILE_BACKEND", raising=False)
    assert compiler.compile_backend() == "inductor"
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")
    assert compiler.compile_backend() == "aot_eager"


def test_the_step_compiles_once_whole_with_the_backend_and_mode_it_was_given(monkeypatch):
    """``torch.compile`` is called at the first call only, with ``fullgraph=True``, the
    backend ``SUT_COMPILE_BACKEND`` names and the step's ``mode`` (default: torch's own;
    ``"reduce-overhead"``: CUDA graphs on a GPU, set by ``train_step.py``'s ``+graphs``)."""
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return lambda **inputs: fn(**inputs)

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")

    class Double(torch.nn.Module):
        def forward(self, x):
            return 2 * x

    default, graphs = CompiledStep(Double(), "encoder"), CompiledStep(Double(), "decoder")
    graphs.mode = "reduce-overhead"
    for step in (default, graphs, default, graphs):
        assert torch.equal(step(x=torch.ones(2)), torch.full((2,), 2.0))
    assert calls == [dict(fullgraph=True, backend="aot_eager", mode=None),
                     dict(fullgraph=True, backend="aot_eager", mode="reduce-overhead")]


def test_the_compiled_step_is_the_eager_step_in_tensor_form():
    """One step: the compiled step and the compiled loop wrap the side's own
    ``RecurrenceStep`` (``step_module`` finds it in either form)."""
    for option in ("compile_step", "compile_loop"):
        model = make_model(**{option: True})
        for side in (model.encoder.side, model.decoder.side):
            assert recurrence.step_module(side.compiled_step) is side.recurrence.step


def test_the_loop_runs_the_steps_it_was_built_for():
    model = make_model(compile_loop=True)
    for side in (model.encoder.side, model.decoder.side):
        assert isinstance(side.compiled_step.step, TensorLoop)
        assert side.compiled_step.step.max_steps == side.num_steps
    side = model.encoder.side
    real = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=f"runs {side.num_steps} steps, not 2"):
        recurrence.SideRecurrence(side.recurrence.step, 2).run(
            torch.zeros(1, 3, 64), recurrence.StepInputs(self_padding_mask=~real, real=real),
            compiled=side.compiled_step)


def test_inductor_compiled_step_equals_eager(monkeypatch):
    """sut_tiny through inductor's generated C++, as --compile-step runs on a CPU."""
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "inductor")
    if compiler.compiler_missing(torch.device("cpu")):
        pytest.skip("no C++ compiler for inductor")
    torch._dynamo.reset()
    eager, compiled = _models({})
    eager.train(), compiled.train()
    _assert_same(eager, compiled, translation_batch())


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"sut_tiny"}))
def test_inductor_variants_equal_eager(variant, monkeypatch):
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "inductor")
    torch._dynamo.reset()
    eager, compiled = _models(VARIANTS[variant])
    eager.train(), compiled.train()
    _assert_same(eager, compiled, translation_batch())


@pytest.mark.parametrize("variant, loop", [("sut_tiny", False), ("sut_tiny", True),
                                           pytest.param("gut", False, marks=pytest.mark.slow),
                                           pytest.param("step-embeddings", False, marks=pytest.mark.slow)])
def test_no_graph_break_in_the_step(variant, loop):
    _, compiled = _models(VARIANTS[variant], loop)
    src, lengths, prev = translation_batch()
    net_input = {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}
    assert count_graph_breaks(compiled.train(), net_input) == 0


def test_halted_rows_cost_nothing_in_the_compiled_step(monkeypatch):
    """The expert op computes exactly the routed rows of the running positions, compiled
    as eagerly."""
    rl = importlib.import_module("sut_fairseq.ops.routed_linear")
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    computed = []
    forward = rl.reference_forward

    def counting(x, weight, bias, row_gates, src, dst, ends, out_rows):
        computed.append(ends[-1])
        return forward(x, weight, bias, row_gates, src, dst, ends, out_rows)

    monkeypatch.setattr(rl, "reference_forward", counting)
    eager, compiled = _models(dict(halting_threshold=0.6, encoder_layers=4, decoder_layers=4))
    batch = translation_batch()
    with torch.no_grad():
        computed.clear()
        res = eager.encoder(batch[0])["halting"][0]
        rows_eager = sum(computed)
        computed.clear()
        compiled.encoder(batch[0])
        rows_compiled = sum(computed)
    executed = res.steps.sum().item()
    assert executed < res.real.sum().item() * 4, "some positions must halt early"
    # per executed (position, step): self-attention q and o, FFD up and down, k = 2 slots each
    assert rows_eager == rows_compiled == 4 * 2 * executed


def test_masked_linear_computes_the_selected_rows_only(monkeypatch):
    """sut::masked_linear against a per-row loop, its gradients against autograd through
    the dense product, and the rows it computes (CPU: the selected ones)."""
    from sut_fairseq.ops.masked_linear_op import masked_linear

    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(5, 3).double()
    x = torch.randn(4, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 6, generator=g) < 0.5
    y = masked_linear(x, linear, mask)
    for i in range(4):
        for j in range(6):
            want = linear(x[i, j]) if mask[i, j] else torch.zeros(3, dtype=torch.float64)
            torch.testing.assert_close(y[i, j], want)
    torch.autograd.gradcheck(lambda x, w, b: torch.ops.sut.masked_linear(x, w, b, mask.reshape(-1)),
                             (x.detach().reshape(-1, 5).requires_grad_(), linear.weight.detach().clone().requires_grad_(),
                              linear.bias.detach().clone().requires_grad_()))
    seen = []
    forward = torch.nn.functional.linear

    def counting(inp, weight, bias=None):
        seen.append(inp.size(0))
        return forward(inp, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    masked_linear(x.detach(), linear, mask)
    assert seen == [int(mask.sum())]


def _logic_like_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        S = int(torch.randint(8, 40, (), generator=g))
        B = max(2, 2048 // S // 8)
        src = torch.randint(4, 40, (B, S), generator=g)
        src[0, : S // 3] = 1
        prev = torch.randint(4, 40, (B, 2), generator=g)
        yield src, src.ne(1).sum(1), prev


def _wmt_shaped_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        S, T = (int(v) for v in torch.randint(5, 60, (2,), generator=g))
        B = max(2, 1024 // max(S, T) // 4)
        src = torch.randint(4, 40, (B, S), generator=g)
        prev = torch.randint(4, 40, (B, T), generator=g)
        yield src, src.ne(1).sum(1), prev


@pytest.mark.slow
@pytest.mark.parametrize("one_op", [False, True], ids=["pytorch-router", "route-op"])
def test_compiled_loop_carries_the_routers_statistics_gradient(one_op, monkeypatch):
    """The MI loss over the routers' statistics (recorded as the criterion records them)
    through --compile-loop: the loss and every router parameter's gradient equal the eager
    loop's, for the routers' PyTorch path (the CPU's) and ``sut::route_top_k`` with the
    hidden layer formed in the op (CUDA's branch, the op's PyTorch backend here). The
    other compiled tests' loss leaves the statistics out."""
    from sut_fairseq.criterions.losses import mim_loss
    from sut_fairseq.modules.router import Router

    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(Router, "_one_op", lambda self, x: one_op)
    torch._dynamo.reset()
    eager, compiled = _models({}, loop=True)
    results = []
    for model in (eager, compiled):
        model.train()
        model.zero_grad()
        with record_routing(model) as stats:
            model(*translation_batch())
            loss = sum(mim_loss(s) for s in stats)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                        if "router" in n and p.grad is not None}))
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_e and grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-4 * g.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("batches", [_logic_like_batches,
                                     pytest.param(_wmt_shaped_batches, marks=pytest.mark.slow)])
def test_at_most_eight_compilations_over_fifty_batches(batches, monkeypatch):
    """50 training batches whose B and T change, with a validation forward (no
    gradient, eval mode) after every tenth, as fairseq-train runs them, the routers'
    statistics recorded as the criterion records them: one graph per side for training
    and one for validation, and as many of each side's input embedding."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    monkeypatch.setattr(compiler, "compile_backend", lambda: counter)
    torch._dynamo.reset()
    _, model = _models({})
    for i, (src, lengths, prev) in enumerate(batches(50)):
        model.train()
        with record_routing(model) as stats:
            out, _ = model(src, lengths, prev)
        (out.float().mean() + sum(s.sum_neg_entropy for s in stats)).backward()
        if i % 10 == 9:
            model.eval()
            with torch.no_grad(), record_routing(model):
                model(src, lengths, prev)
    for side in (model.encoder.side, model.decoder.side):
        assert not side.compiled_step.failed
    assert 1 <= counter.frame_count <= 8, f"{counter.frame_count} compilations"


HYPER = dict(hyper_modules=2, att_experts=1, att_topk=1, ffd_experts=1, ffd_topk=1, rel_pos="none")


@pytest.mark.parametrize("overrides, reasons", [
    (dict(encoder_chunk_size=4, encoder_memory_slots=2),
     {"encoder": ["--encoder-chunk-size (chunk-wise recurrence)"]}),
    (dict(decoder_chunk_size=4, decoder_memory_slots=2),
     {"decoder": ["--decoder-chunk-size (chunk-wise recurrence)"]}),
    (HYPER, {"encoder": ["--hyper-modules"], "decoder": ["--hyper-modules"]}),
    (dict(decoder_halting="pabee"), {"decoder": ["--decoder-halting pabee (early exits)"]}),
    (dict(decoder_halting="entropy"), {"decoder": ["--decoder-halting entropy (early exits)"]}),
    (dict(HYPER, decoder_halting="entropy"),
     {"encoder": ["--hyper-modules"],
      "decoder": ["--hyper-modules", "--decoder-halting entropy (early exits)"]}),
])
def test_uncovered_sides_keep_the_eager_step_and_say_why(overrides, reasons, caplog, monkeypatch):
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "eager")  # the covered side: dynamo's trace only
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING):
        model = make_model(compile_step=True, **overrides)
    assert [r.getMessage() for r in caplog.records if "--compile-step" in r.getMessage()] == [
        f"--compile-step: the {side} keeps the eager step (not covered: {', '.join(reasons[side])})"
        for side in ("encoder", "decoder") if side in reasons]
    for side in ("encoder", "decoder"):
        assert (getattr(model, side).side.compiled_step is None) == (side in reasons)
    src, lengths, prev = translation_batch()
    with torch.no_grad():
        model(src, lengths, prev)  # the eager step runs


def test_counting_graph_breaks_needs_a_compiled_step():
    src, lengths, prev = translation_batch()
    net_input = {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}
    with pytest.raises(ValueError, match=r"^count_graph_breaks: the model has no compiled step "
                                         r"\(--compile-step\)$"):
        count_graph_breaks(make_model(), net_input)


def test_option_builds_compiled_steps_and_compiles_lazily():
    model = make_model(compile_step=True)
    for side in (model.encoder.side, model.decoder.side):
        assert isinstance(side.compiled_step, CompiledStep)
        assert side.compiled_step.compiled is None  # nothing compiled before the first forward
    assert make_model().encoder.side.compiled_step is None


def test_an_error_of_the_model_is_not_taken_for_a_compiler_failure(monkeypatch):
    """Only torch.compile's own errors switch a side to the eager step; any other error
    in the compiled path reaches the caller."""
    def wrong(*args, **kwargs):
        raise ValueError("a shape is wrong")

    monkeypatch.setattr(recurrence.CompiledCall, "__call__", wrong)
    _, compiled = _models({})
    src, lengths, prev = translation_batch()
    with pytest.raises(ValueError, match="a shape is wrong"), torch.no_grad():
        compiled(src, lengths, prev)
    assert not compiled.encoder.side.compiled_step.failed


def test_importing_the_plugin_leaves_the_compiler_unloaded():
    """torch._dynamo costs about a second at every process start (fairseq-train, every
    recipe script): the plugin imports it only when a step is compiled."""
    code = "import sys, sut_fairseq; print('torch._dynamo' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr


@pytest.mark.parametrize("loop", [False, True], ids=["step", "loop"])
def test_a_failing_compiler_falls_back_with_one_message(monkeypatch, caplog, loop):
    """A compiler that fails gives a one-line warning and the eager step's result, for the
    compiled step as for the compiled loop."""
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiler, "compile_backend", lambda: broken)
    torch._dynamo.reset()
    compiled, batch = _run_beside_eager(caplog, loop)
    src, lengths, prev = batch
    for side in (compiled.encoder.side, compiled.decoder.side):
        assert side.compiled_step.failed and side.compiled_input.failed
    # one line per side and compiled function, naming the compiler's own error (not
    # dynamo's wrapper around it)
    assert [r.getMessage() for r in caplog.records if r.name == compiler.__name__] == [
        line for side in ("encoder", "decoder") for line in (
            f"--compile-step: compiling the {side}'s input embedding failed (RuntimeError: no "
            "compiler here); running it eagerly from now on",
            f"--compile-step: compiling the {side} step failed (RuntimeError: no compiler here); "
            "running the eager step from now on")]
    with caplog.at_level(logging.WARNING), torch.no_grad():  # and not again
        caplog.clear()
        compiled(src, lengths, prev)
    assert not caplog.records


def test_a_graph_break_in_the_step_is_a_compiler_failure(monkeypatch):
    """The step compiles whole or not at all (``fullgraph=True``): a graph break raises
    the compiler's error, which sends the side to the eager step, rather than a step
    silently split into several graphs with host work between them."""
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "eager")
    torch._dynamo.reset()

    class Breaking(torch.nn.Module):
        def forward(self, x):
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2

    step = CompiledStep(Breaking(), "encoder")
    with pytest.raises(Exception) as raised:
        step(x=torch.ones(3))
    assert compiler.is_compiler_error(raised.value), raised.value


def test_the_failure_message_is_the_errors_first_line_cut_to_300_characters(caplog):
    step = make_model(compile_step=True).encoder.side.compiled_step
    with caplog.at_level(logging.WARNING):
        step.disable(ValueError("x" * 400 + "\nsecond line"))
        step.disable(ValueError("  \n"))
    assert [r.getMessage() for r in caplog.records] == [
        f"--compile-step: compiling the encoder step failed (ValueError: {'x' * 300}); "
        "running the eager step from now on",
        "--compile-step: compiling the encoder step failed (ValueError: ); "
        "running the eager step from now on"]
    assert step.failed


def test_graph_breaks_are_not_counted_for_a_step_that_could_not_be_traced(monkeypatch):
    """When ``explain`` cannot trace a side's step, the forward falls back to the eager
    step; the count then means nothing and is refused (not reported as 0)."""
    def untraceable(fn):
        def explain(*args, **kwargs):
            raise torch._dynamo.exc.InternalTorchDynamoError("cannot trace this step")
        return explain

    model = make_model(compile_step=True)
    src, lengths, prev = translation_batch()
    net_input = {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}
    monkeypatch.setattr(torch._dynamo, "explain", untraceable)
    with pytest.raises(RuntimeError, match="the encoder and decoder step could not be traced"):
        count_graph_breaks(model, net_input)
    assert all(side.compiled_step.compiled is None and not side.compiled_step.failed
               for side in (model.encoder.side, model.decoder.side))  # the model's own steps untouched


def test_fused_compiles_once_eagerly_and_not_inside_a_traced_region(monkeypatch):
    """``compiler.fused`` (FlexAttention's kernel on CUDA): the compiled function, made once
    and reused, for eager callers; the function itself while a region is traced."""
    def double(x):
        return 2 * x

    monkeypatch.setattr(compiler, "_FUSED", {})
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn: compiled.append(fn) or ("compiled", fn))
    first = compiler.fused(double)
    assert first == ("compiled", double) and compiler.fused(double) is first
    assert compiled == [double]  # once
    monkeypatch.setattr(compiler, "tracing", lambda: True)
    assert compiler.fused(double) is double


def test_prepare_inputs_clones_only_repeats_and_marks_only_carried_zeros():
    """``compiler.prepare_inputs``: the second name of one tensor (S_0 = h_0) gets a clone
    of equal values, the first keeps the object; under autograd the carried zeros (``c``,
    ``k_rows``, ...) become leaves that require a gradient, and nothing else does (the
    state ``h`` without one, the 0-d α_thresh); under ``no_grad`` nothing is marked, and an
    integer carried input (a step count) never is."""
    h = torch.randn(2, 3, 4)
    c, steps, threshold = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), torch.tensor(0.9)
    inputs = {"h": h, "S": h, "c": c, "k_rows": steps, "threshold": threshold, "cross_k": None}
    out = compiler.prepare_inputs(inputs)
    assert list(out) == list(inputs) and out["cross_k"] is None
    assert out["h"] is h and out["S"] is not h and torch.equal(out["S"], h)
    assert out["c"] is c and c.requires_grad and c.is_leaf
    assert not out["h"].requires_grad and not out["S"].requires_grad
    assert not out["k_rows"].requires_grad and not out["threshold"].requires_grad
    fresh = torch.zeros(2, 3)
    with torch.no_grad():
        again = compiler.prepare_inputs({"h": torch.randn(2, 3, 4), "c": fresh, "log_remain": torch.zeros(2, 3)})
    assert not again["c"].requires_grad and not again["log_remain"].requires_grad
