"""Everything ``torch.compile`` needs from this package, in one place.

The model's maths never asks whether it is being compiled. Three kinds of code do, and
they live here or call ``tracing()`` from here:

* implementation choices with equal results (a counting sort instead of ``torch.sort``,
  an argmax top-k, the dropout mask as an op, a down projection that reads every row):
  ``tracing()``, called by the ops that choose (``ops/routing.py``, ``modules/router.py``,
  ``modules/dropout.py``, ``modules/moe_ffd.py``);
* a function that is only fast compiled (FlexAttention): ``fused(fn)``, compiled once
  when called eagerly, ``fn`` itself inside a region being compiled;
* the workarounds a compiled step needs from its caller (``CompiledStep``): inputs that
  alias each other are cloned (aliased inputs would compile a graph of their own), the
  carried tensors that start as zeros without a gradient are marked as requiring one (a
  graph is specialised on ``requires_grad``), and batch and length are marked dynamic
  (fairseq's batches change both at every update);
* where compilation cannot run (no C++ compiler for inductor's CPU backend) and what its
  failure looks like, after which the eager step takes over (``is_compiler_error``;
  ``CompiledFunction``, which the criteria use for their auxiliary terms as well).
"""
import logging
import os
import shutil
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)


def tracing() -> bool:
    """Whether the code runs under ``torch.compile`` (dynamo tracing it) rather than eagerly."""
    return torch.compiler.is_compiling()


_FUSED = {}


def fused(fn: Callable) -> Callable:
    """``fn`` as ``torch.compile`` makes it, compiled once per process (eager callers), or
    ``fn`` itself while a region that calls it is being traced (it is compiled with it)."""
    if tracing():
        return fn
    if fn not in _FUSED:
        _FUSED[fn] = torch.compile(fn)
    return _FUSED[fn]


def compile_backend() -> str:
    """``torch.compile``'s backend: ``SUT_COMPILE_BACKEND`` (default ``inductor``; e.g.
    ``aot_eager`` traces and differentiates the same graph without generating code, which
    the tests use to check many model variants quickly)."""
    return os.environ.get("SUT_COMPILE_BACKEND", "inductor")


def compiler_missing(device: torch.device) -> Optional[str]:
    """Why inductor cannot compile for ``device`` here, or None."""
    if device.type == "cpu":
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            return f"inductor's CPU backend needs a C++ compiler and {cxx!r} is not on PATH (set CXX)"
    return None


def is_compiler_error(error: BaseException) -> bool:
    """Whether ``error`` is torch.compile's own failure (the backend's, an unsupported
    construct, dynamo's internal error), after which the eager step takes over. torch._dynamo
    is imported here, not with the package: it adds about a second to every process start."""
    import torch._dynamo.exc as exc

    return isinstance(error, (exc.BackendCompilerFailed, exc.Unsupported, exc.InternalTorchDynamoError))


#: inputs that one step hands the next and that start as zeros without a gradient
CARRIED = ("c", "log_remain", "weighted_sum", "k_rows", "v_rows")

#: the dimensions of a step's inputs that change from batch to batch (B, T, S_src); the
#: others' dimensions 0 and 1 are (B, T)
_DYNAMIC_DIMS = {"cross_k": (0, 2), "cross_v": (0, 2), "te": (), "te_table": (), "threshold": ()}


def mark_dynamic(tensor: torch.Tensor, dims=(0, 1)) -> torch.Tensor:
    """``tensor`` with ``dims`` (default batch and length) dynamic in the graphs compiled
    for it from the first call on (``maybe_mark_dynamic``: sizes 0 and 1 stay special)."""
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


def prepare_inputs(inputs: dict) -> dict:
    """The compiled step's keyword inputs made such that every call runs the same graph:
    a tensor that is the same object as an earlier input is cloned (S_0 = h_0, running =
    real at step 1; S_l = h_l under the rule ``none``), the carried zeros are marked as
    requiring a gradient when autograd records (leaves whose gradient is computed and
    dropped), and batch and length are dynamic from the first call on
    (``maybe_mark_dynamic``: sizes 0 and 1 stay special)."""
    seen, out = set(), {}
    for name, tensor in inputs.items():
        if tensor is not None:
            if id(tensor) in seen:
                tensor = tensor.clone()
            seen.add(id(tensor))
            if (name in CARRIED and torch.is_grad_enabled() and tensor.is_floating_point()
                    and not tensor.requires_grad):
                tensor.requires_grad_()
            mark_dynamic(tensor, _DYNAMIC_DIMS.get(name, (0, 1)))
        out[name] = tensor
    return out


class CompiledFunction:
    """``fn`` compiled on first use with ``torch.compile(fullgraph=True)``; ``what`` names it
    in the one-line warning of a failure, after which callers run ``fn`` eagerly for the
    rest of the process (``failed``). ``mode``, set before the first call, is
    ``torch.compile``'s (None: its default). ``follows``: a compiled step whose failure to
    compile keeps ``fn`` eager too (``run``)."""

    #: what runs after a failure, as the warning says it
    fallback = "it eagerly"

    def __init__(self, fn: Callable, what: str, follows: Optional["CompiledFunction"] = None):
        self.fn, self.what, self.follows = fn, what, follows
        self.mode: Optional[str] = None
        self.compiled: Optional[Callable] = None
        self.failed = False

    def usable(self, device: torch.device) -> bool:
        """Whether ``fn`` runs compiled on ``device``: not failed before, and inductor has
        what it needs there (checked at the first call; a one-line warning, then eager,
        where it has not)."""
        if self.compiled is None and not self.failed and compile_backend() == "inductor":
            missing = compiler_missing(device)
            if missing is not None:
                self.disable(RuntimeError(missing))
        return not self.failed

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, fullgraph=True, backend=compile_backend(),
                                          mode=self.mode)
        return self.compiled(*args, **kwargs)

    def run(self, device: torch.device, *args):
        """``fn(*args)``, compiled where ``usable(device)`` (and ``follows``, the compiled
        step it belongs to, is: where that one cannot compile, it alone says so); eager
        after the compiler's own failure (reported once by ``disable``)."""
        if (self.follows is None or self.follows.usable(device)) and self.usable(device):
            try:
                return self(*args)
            except Exception as error:  # noqa: BLE001  (the compiler's own errors only)
                if not is_compiler_error(error):
                    raise
                self.disable(error)
        return self.fn(*args)

    def disable(self, error: BaseException) -> None:
        # the compiler's own error, not dynamo's wrapper around it
        error = getattr(error, "inner_exception", None) or error
        first = str(error).strip().splitlines()
        logger.warning("--compile-step: compiling the %s failed (%s: %s); running %s from "
                       "now on", self.what, type(error).__name__, first[0][:300] if first else "",
                       self.fallback)
        self.failed = True


class CompiledStep(CompiledFunction):
    """A step module (``modules/recurrence.py``'s ``TensorStep`` or ``TensorLoop``: tensors
    in, tensors out) compiled on first use, its inputs made by ``prepare_inputs``.
    ``"reduce-overhead"`` as ``mode`` replays the compiled graphs as CUDA graphs on a GPU
    (``benchmarks/train_step.py``'s ``+graphs`` models, over the compiled loop)."""

    fallback = "the eager step"

    def __init__(self, step: torch.nn.Module, side: str):
        super().__init__(step, f"{side} step")
        self.side = side

    @property
    def step(self) -> torch.nn.Module:
        """The step module compiled (``fn``)."""
        return self.fn

    def __call__(self, **inputs):
        return super().__call__(**prepare_inputs(inputs))


def compiles_steps(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a SUT/UT of this plugin) runs a side's recurrence compiled
    (``--compile-step`` / ``--compile-loop``, and compiling it has not failed)."""
    steps = [getattr(getattr(getattr(model, part, None), "side", None), "compiled_step", None)
             for part in ("encoder", "decoder")]
    return any(step is not None and not step.failed for step in steps)


def count_graph_breaks(model: torch.nn.Module, net_input: dict) -> int:
    """Graph breaks ``torch._dynamo.explain`` finds in the compiled steps of one forward of
    ``model`` (built with ``--compile-step``) on ``net_input``: every call of each side's
    step is traced by ``explain`` instead of being compiled; the forward runs eagerly.

    Raises RuntimeError when a side's step could not be traced at all (the forward then
    fell back to the eager step, and no count would mean anything)."""
    sides = [side for side in (model.encoder.side, model.decoder.side) if side.compiled_step is not None]
    if not sides:
        raise ValueError("count_graph_breaks: the model has no compiled step (--compile-step)")
    breaks = []

    class Explained(CompiledStep):
        def __call__(self, **inputs):
            inputs = prepare_inputs(inputs)
            breaks.append(torch._dynamo.explain(self.step)(**inputs).graph_break_count)
            return self.step(**inputs)

    saved = [side.compiled_step for side in sides]
    explained = [Explained(step.step, step.side) for step in saved]
    try:
        for side, step in zip(sides, explained):
            side.compiled_step = step
        with torch.no_grad():
            model(**net_input)
    finally:
        for side, step in zip(sides, saved):
            side.compiled_step = step
    failed = [step.side for step in explained if step.failed]
    if failed:
        raise RuntimeError(f"count_graph_breaks: the {' and '.join(failed)} step could not be "
                           "traced (the warning above says why)")
    return sum(breaks)
