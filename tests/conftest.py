"""Shared fixtures: small models built exactly as ``fairseq-train --arch ...`` would.

Under pytest-xdist (``make test`` runs ``-n auto``) each of the N workers gets
cores / N threads (torch's intra-op pool and, through ``OMP_NUM_THREADS``, the
subprocesses the tests start), so that N workers do not oversubscribe the cores.
"""
import logging
import os

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # before torch is imported: its thread pool reads OMP_NUM_THREADS
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.ERROR)


def _mutmut_stats_outside_compiled_code():
    """Under ``make mutation``'s first pass (``MUTANT_UNDER_TEST=stats``: mutmut records
    which tests call which function) its trampolines keep a ``ContextVar`` call stack,
    which dynamo cannot trace: every ``fullgraph=True`` compile of a mutated function
    failed, so that pass failed and the module was never tested. While dynamo traces,
    the trampoline now takes its no-mutant path (the original function, nothing recorded);
    the calls recorded are the eager ones, which every compiled test also makes."""
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from mutmut.mutation import trampoline

    read = trampoline.get_mutant_under_test
    # the real test, held here: ``compiling_branch`` fakes the attribute, and under the
    # fake nothing a compiled-branch test called was recorded (so no mutant reached it)
    compiling = torch.compiler.is_compiling
    trampoline.get_mutant_under_test = lambda: "" if compiling() else read()


_mutmut_stats_outside_compiled_code()


def make_model(arch="sut_tiny", dict_size=40, seed=0, **overrides):
    """An eval-mode model with no dropout (deterministic), over a joined dictionary."""
    from sut_fairseq.models.standalone import build_model

    torch.manual_seed(seed)
    overrides.setdefault("dropout", 0.0)
    model = build_model(arch, dict_size=dict_size, share_all_embeddings=True, **overrides)
    return model.eval()


def translation_batch(seed=0, B=3, S=9, T=7):
    """(src_tokens (B, S) with row 0 left-padded, src_lengths (B,), prev_output_tokens
    (B, T) with row 1 right-padded) over ``make_model``'s 40-word dictionary."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    src[0, :3] = 1  # left padding
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[1, T - 2:] = 1  # right padding
    return src, src.ne(1).sum(1), prev


def randomise_parameters(module, seed=0):
    """Every parameter of ``module`` random (LayerNorm gains and biases, zero-initialised
    biases included), float64, so that a swapped norm or a dropped bias changes the
    result; eval mode. Returns the module."""
    g = torch.Generator().manual_seed(seed)
    module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return module.eval()


class ScriptedRng:
    """A stand-in for ``random.Random`` in generator tests: ``choice`` returns the item at
    each listed index in turn, ``random`` the listed numbers in turn."""

    def __init__(self, picks=(), numbers=()):
        self.picks, self.numbers = list(picks), list(numbers)

    def choice(self, items):
        return items[self.picks.pop(0)]

    def random(self):
        return self.numbers.pop(0)


class LooksCuda(torch.Tensor):
    """A CPU tensor that reports ``is_cuda`` (``t.as_subclass(LooksCuda)``): runs a branch
    taken for CUDA tensors, where that branch computes nothing CUDA-only."""

    @property
    def is_cuda(self):
        return True


def randomise_halting(model, std=2.0, seed=1):
    """Give the halting units a non-zero last layer so positions halt at different steps."""
    g = torch.Generator().manual_seed(seed)
    for side in (model.encoder.side, model.decoder.side):
        unit = getattr(side.halting, "unit", None)
        if unit is not None:
            with torch.no_grad():
                unit.fc2.weight.copy_(torch.randn(unit.fc2.weight.shape, generator=g) * std / unit.fc2.weight.size(1) ** 0.5)
                unit.fc2.bias.fill_(-0.5)


@pytest.fixture
def compiling_branch(monkeypatch):
    """Run the branch a compiled step takes, eagerly: ``torch.compiler.is_compiling()``
    answers True for the test. ``torch._dynamo`` is imported first: a module imported
    while the answer is patched keeps the fake for the rest of the process
    (``torch._dynamo.decorators`` binds ``is_compiling`` at import), and every later
    compilation in that process then took the eager branches while tracing."""
    import torch._dynamo  # noqa: F401

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


@pytest.fixture
def tiny_model():
    return make_model


def decoder_case(threshold, seed=0, **overrides):
    """A sut_tiny of 4 decoder steps with randomised halting units at ``threshold``, and
    sources (3, 6) with padding and targets (3, 7) starting with eos."""
    model = make_model(halting_threshold=threshold, decoder_layers=4, seed=seed, **overrides)
    randomise_halting(model, seed=seed + 5)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (3, 6), generator=g)
    src[1, :2] = 1
    prev = torch.randint(4, 40, (3, 7), generator=g)
    prev[:, 0] = 2  # eos starts every target
    return model, src, prev


def run_incremental(model, enc, prev, reorder=None):
    """Decode ``prev`` (B, T) one position at a time through fairseq's incremental API;
    with ``reorder`` (B,) the cache, the encoder output and the prefix are reordered before
    every step after the first, as beam search does. Returns the logits (B, T, V), the
    decoder's executed steps (B, T) and the final (reordered) prefix."""
    state, outs, steps = {}, [], []
    for t in range(prev.size(1)):
        if reorder is not None and t > 0:
            model.decoder.reorder_incremental_state_scripting(state, reorder)
            enc = model.encoder.reorder_encoder_out(enc, reorder)
            prev = prev.index_select(0, reorder)
            outs = [o.index_select(0, reorder) for o in outs]
            steps = [s.index_select(0, reorder) for s in steps]
        out, extra = model.decoder(prev[:, : t + 1], enc, incremental_state=state)
        outs.append(out)
        steps.append(extra["halting_decoder"].steps)
    return torch.cat(outs, 1), torch.cat(steps, 1), prev


# Files whose tests train models or run whole recipes in subprocesses (a minute or more
# each, most of it in module fixtures). Under ``--dist loadfile`` a file runs on one worker
# from start to end, so these go first, the longest first (their last measured times), and
# the short files fill the workers at the end.
HEAVY_FIRST = ("test_gpu_validate.py", "test_compiled_step.py", "test_benchmarks_smoke.py",
               "test_end_to_end.py", "test_hydra_train.py", "test_cpvr_recipe.py", "test_logic_recipe.py",
               "test_multi30k_recipe.py",
               "test_readme_commands.py", "test_flipflop_recipe.py", "test_listops_recipe.py",
               "test_listops_classify.py", "test_logic_classify.py",
               "test_wmt14_spm.py", "test_exit_sweep.py", "test_wmt14_recipe.py",
               "test_kernels_interpret.py", "test_analysis.py", "test_cfq_pipeline.py",
               "test_odd_data.py", "test_exact_resume.py", "test_chunked.py",
               "test_distributed.py", "test_kernels_model.py", "test_prep_outputs.py",
               "test_learning_curves.py", "test_logic_data.py", "test_cpvr_data.py")


def pytest_collection_modifyitems(session, config, items):
    """The HEAVY_FIRST files first, in that order; every other file after them in its
    collection order (a stable sort: the tests of a file keep their order). Under mutmut
    (``make mutation``: it runs a mutant's tests with ``-x``) the other way round: the light
    files, such as a module's own unit tests, first, so that a mutant they kill costs no
    model test."""
    if "MUTANT_UNDER_TEST" in os.environ:
        items.sort(key=lambda item: item.path.name in HEAVY_FIRST)
        return
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))


def pytest_runtest_logreport(report):
    """With SUT_TEST_FAILURES_AT_ONCE=1, print each failure's traceback as soon as the test
    fails, not in the summary at the end: a run killed at a time limit (the GPU node's
    10-minute commands) still shows why the tests before the kill failed."""
    if report.failed and os.environ.get("SUT_TEST_FAILURES_AT_ONCE") == "1":
        lines = report.longreprtext.splitlines()
        print(f"\nFAILED {report.nodeid} ({report.when}):\n" + "\n".join(lines[-40:]), flush=True)
