"""One step of a side's universal recurrence as one compiled graph (``--compile-step``).

The eager recurrence (``recurrence.py``) calls the side's ``SideStep`` (``side_step.py``)
per step, which skips halted rows by reading masks on the host (the router's and the
halting unit's active rows, the changed rows of the key/value cache). Here one step is a module with tensor inputs and
outputs whose shapes never depend on the data, so ``torch.compile(fullgraph=True)``
traces it whole: what depends on the data (which rows each expert gets, skipping the
rows of halted positions) happens inside the custom op ``sut::routed_linear``, which
still gives halted rows no expert work. Step l (l = 1 .. L) of the body::

    x_q = h_{l-1} (+ E_l),  x_kv = S_{l-1} (+ E_l)          E_l: the step embedding, if any
                                                 (the eager step's query object, ``apply``;
                                                 x_kv = h_{l-1} (+ E_l) under
                                                 ``--*-halting-kv state``)
    h_l = Block(x_q, keys/values of x_kv)   on running rows, h_{l-1} elsewhere
    S_l = halting.mix(h_l, S_{l-1})                           (Eq. 3)
    running_{l+1}, α_l = halting.decide(h_l)                  (the next step's decision)

so the Python loop (``run_compiled``) reads one value on the host per step: whether any
position still runs. The decision made after the last step is discarded (the eager loop
never makes it), so both loops return the same S_L and halting statistics.

Covered: both sides' full (teacher-forced) forward with every halting rule but the early
exits, transition-aware halting, GUT's gate, step embeddings, relative positions and
any number of experts. Not covered (the eager step runs; ``unsupported`` says why):
chunk-wise recurrence, hyper-modules, early exits, and incremental decoding.
"""
import logging
import os
import shutil
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn

from ..ops.masked_linear_op import masked_affine
from .halting import HaltingResult, HaltingState
from .side_step import step_query

logger = logging.getLogger(__name__)


def unsupported(args, prefix: str) -> List[str]:
    """Why ``--compile-step`` cannot compile this side's step (empty: it can)."""
    reasons = []
    if getattr(args, f"{prefix}_chunk_size"):
        reasons.append(f"--{prefix}-chunk-size (chunk-wise recurrence)")
    if args.hyper_modules:
        reasons.append("--hyper-modules")
    if prefix == "decoder" and args.decoder_halting in ("pabee", "entropy"):
        reasons.append(f"--decoder-halting {args.decoder_halting} (early exits)")
    return reasons


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


def compile_backend() -> str:
    """``torch.compile``'s backend: ``SUT_COMPILE_BACKEND`` (default ``inductor``; e.g.
    ``aot_eager`` traces and differentiates the same graph without generating code, which
    the tests use to check many model variants quickly)."""
    return os.environ.get("SUT_COMPILE_BACKEND", "inductor")


def joint_kv(attn: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """The key and value projections of ``attn`` as one linear map d -> 2·H·D, the weights
    stacked: [K | V] = x [W_k; W_v]ᵀ + [b_k; b_v] (one GEMM forward, one per gradient,
    instead of two each). Returns (weight (2·H·D, d), bias (2·H·D,)), built from the
    parameters at each call (their names and shapes, hence checkpoints, are unchanged)."""
    return (torch.cat([attn.k_proj.weight, attn.v_proj.weight], 0),
            torch.cat([attn.k_proj.bias, attn.v_proj.bias], 0))


class RecurrenceStep(nn.Module):
    """Step l of one side (docstring above). Holds no parameters of its own: the side's
    block, halting rule and step embedding are chosen when the model is built.

    Shapes: B batch, T positions, d width, H heads of D; S_src the cross-attention source.
    """

    def __init__(self, block: nn.Module, halting: nn.Module, step_embedding: Optional[nn.Module],
                 kv_from_state: bool = False):
        super().__init__()
        self.block, self.halting = block, halting
        #: keys/values of h_{l-1} instead of S_{l-1} (``--*-halting-kv state``); h, like S,
        #: changes exactly on the rows that ran the previous step, so the carry is the same
        self.kv_from_state = kv_from_state
        #: h_{l-1} (+ E_l): the eager step's query object (``side_step.step_query``)
        self.query = step_query(step_embedding)
        #: without a step embedding the keys/values of S are carried from step to step and
        #: only the rows whose S changed are projected again (HaltedStateKV's saving)
        self.carries_kv = step_embedding is None

    def changed_kv(self, S: torch.Tensor, changed: torch.Tensor, k_rows: torch.Tensor,
                   v_rows: torch.Tensor):
        """Keys and values (B, T, H·D) of S (B, T, d): projected for the ``changed`` rows
        (B, T) (inside ``sut::masked_linear``, which skips the others), carried over from
        ``k_rows`` / ``v_rows`` for the rest."""
        x = self.block.self_attn_norm(S) if self.block.normalize_before else S
        keep = changed.unsqueeze(-1)
        k, v = masked_affine(x, *joint_kv(self.block.self_attn), changed).chunk(2, -1)
        return torch.where(keep, k, k_rows), torch.where(keep, v, v_rows)

    def forward(self, h: torch.Tensor, S: torch.Tensor, running: torch.Tensor,
                real: torch.Tensor, c: torch.Tensor, log_remain: torch.Tensor,
                weighted_sum: torch.Tensor, steps: torch.Tensor,
                self_padding_mask: torch.Tensor, threshold: Optional[torch.Tensor] = None,
                changed: Optional[torch.Tensor] = None, k_rows: Optional[torch.Tensor] = None,
                v_rows: Optional[torch.Tensor] = None, te: Optional[torch.Tensor] = None,
                coords: Optional[torch.Tensor] = None, cross_k: Optional[torch.Tensor] = None,
                cross_v: Optional[torch.Tensor] = None,
                cross_padding_mask: Optional[torch.Tensor] = None):
        """h = h_{l-1}, S, weighted_sum: (B, T, d); running, real, self_padding_mask: (B, T)
        bool; c, log_remain: (B, T) fp32; steps (B, T) long; threshold: α_thresh, a 0-d
        fp32 tensor (None for the rule ``none``); changed (B, T) bool, the rows whose S
        changed in the previous step, and k_rows/v_rows (B, T, H·D) the keys and values of
        the others (``carries_kv``; else None); te: TE(l) (d,) and coords
        PE (B, T, d) of the step embedding; cross_k/cross_v (B, H, S_src, D) and
        cross_padding_mask (B, S_src) on the decoder.

        Returns h_l, S_l, steps, the decision for step l + 1: running (B, T), c,
        log_remain, weighted_sum and α_l (None for the rule ``none``), and the keys and
        values of S_{l-1} (of h_{l-1} with ``kv_from_state``) (B, T, H·D) each, or None.
        (A transition-aware decision reads [h_{l-1}; h_l]: h_{l-1} is this step's input h.)"""
        kv_in = h if self.kv_from_state else S
        if self.carries_kv:
            k_rows, v_rows = self.changed_kv(kv_in, changed, k_rows, v_rows)
            heads = (*S.shape[:2], self.block.self_attn.num_heads, self.block.self_attn.head_dim)
            k, v = k_rows.view(heads).transpose(1, 2), v_rows.view(heads).transpose(1, 2)
        else:  # keys/values of S_{l-1} + E_l, which changes on every row: every row projected
            k, v = self.block.self_kv(self.query.apply(kv_in, te, coords))
        # step l reads h_{l-1} (+ E_l)
        h_new = self.block(self.query.apply(h, te, coords), k, v, running,
                           self_padding_mask=self_padding_mask,
                           cross_k=cross_k, cross_v=cross_v, cross_padding_mask=cross_padding_mask)
        h_prev, h = h, torch.where(running.unsqueeze(-1), h_new, h)
        steps = steps + running.long()
        state = HaltingState.from_tensors(real, c, log_remain, weighted_sum, h_prev, steps)
        S = self.halting.mix(h, S, running, state)
        running_next = self.halting.decide(h, running, state, 0, threshold)
        alpha = state.alphas[-1] if state.alphas else None
        return (h, S, steps, running_next, state.c, state.log_remain, state.weighted_sum, alpha,
                k_rows, v_rows)


class RecurrenceLoop(nn.Module):
    """All L steps of a side as one function (``--compile-loop``): ``RecurrenceStep`` L
    times, unrolled into one graph when compiled, with no host read between steps. For a
    GPU, where one graph for the whole recurrence fuses across steps (the shared weights'
    gradients summed inside the backward graph rather than one addition per step).

    Exact: once no position runs, a step changes nothing (h_l, S_l, the step counts, c,
    the weighted sum and the carried keys/values keep their values where ``running`` is
    false, and α_l = 0 there), so the L steps return what the early-exiting loop of
    ``run_compiled`` returns; the α of the steps after the exit are zeros, which add
    nothing to the halting weights. What it gives up is the early exit's saving, a
    forward that stops when every position has halted."""

    def __init__(self, step: RecurrenceStep, max_steps: int):
        super().__init__()
        self.step, self.max_steps = step, max_steps

    def forward(self, h: torch.Tensor, S: torch.Tensor, running: torch.Tensor,
                real: torch.Tensor, c: torch.Tensor, log_remain: torch.Tensor,
                weighted_sum: torch.Tensor, steps: torch.Tensor,
                self_padding_mask: torch.Tensor, threshold: Optional[torch.Tensor] = None,
                changed: Optional[torch.Tensor] = None, k_rows: Optional[torch.Tensor] = None,
                v_rows: Optional[torch.Tensor] = None, te_table: Optional[torch.Tensor] = None,
                **block_inputs):
        """The inputs of ``RecurrenceStep.forward`` for step 1, with ``te_table`` (L, d)
        TE(1..L) in place of ``te``. Returns S_L (B, T, d), steps (B, T), c, log_remain
        (B, T), weighted_sum (B, T, d) and the α of the decisions for steps 2..L, a tuple
        of (B, T) (empty for the rule ``none``): the halting state ``run_compiled``
        finishes."""
        alphas = []
        for l in range(1, self.max_steps + 1):
            te = None if te_table is None else te_table[l - 1]
            (h, S, steps, running_next, c_next, log_remain_next, weighted_sum_next, alpha,
             k_rows, v_rows) = self.step(h, S, running, real, c, log_remain, weighted_sum, steps,
                                         self_padding_mask, threshold, changed, k_rows, v_rows,
                                         te, **block_inputs)
            changed = running if self.step.carries_kv else None  # the rows whose S changed
            if l < self.max_steps:  # the decision for step l + 1
                running, c, log_remain, weighted_sum = (running_next, c_next, log_remain_next,
                                                        weighted_sum_next)
                if alpha is not None:
                    alphas.append(alpha)
        return S, steps, c, log_remain, weighted_sum, tuple(alphas)


class CompiledStep:
    """``RecurrenceStep`` (or ``RecurrenceLoop``) compiled on first use
    (``torch.compile(fullgraph=True)``).

    A failure to compile is reported once, in one line, and the side falls back to the
    eager step for the rest of the process (``failed``). ``mode``, set before the first
    call, is ``torch.compile``'s (None: its default); ``"reduce-overhead"`` replays the
    compiled graphs as CUDA graphs on a GPU (``benchmarks/train_step.py``'s ``+graphs``
    models, over the compiled loop)."""

    def __init__(self, step: RecurrenceStep, side: str):
        self.step, self.side = step, side
        self.mode: Optional[str] = None
        self.compiled: Optional[Callable] = None
        self.failed = False

    def usable(self, device: torch.device) -> bool:
        """Whether this step runs compiled on ``device``: not failed before, and inductor
        has what it needs there (checked at the first call; a one-line warning, then the
        eager step, where it has not)."""
        if self.compiled is None and not self.failed and compile_backend() == "inductor":
            missing = compiler_missing(device)
            if missing is not None:
                self.disable(RuntimeError(missing))
        return not self.failed

    def __call__(self, **inputs):
        if self.compiled is None:
            self.compiled = torch.compile(self.step, fullgraph=True, backend=compile_backend(),
                                          mode=self.mode)
        return self.compiled(**inputs)

    def disable(self, error: BaseException) -> None:
        # the compiler's own error, not dynamo's wrapper around it
        error = getattr(error, "inner_exception", None) or error
        first = str(error).strip().splitlines()
        logger.warning("--compile-step: compiling the %s step failed (%s: %s); running the "
                       "eager step from now on", self.side, type(error).__name__,
                       first[0][:300] if first else "")
        self.failed = True


#: the dimensions of a step's inputs that change from batch to batch (B, T, S_src)
_DYNAMIC_DIMS = {"cross_k": (0, 2), "cross_v": (0, 2), "te": (), "te_table": (), "threshold": ()}


def mark_batch_dims(inputs: dict) -> None:
    """Compile for any batch size and length from the first batch on: fairseq's batches
    change B and T every update, and a graph specialised to the first shapes would be
    compiled again at the second (``maybe_mark_dynamic``: sizes 0 and 1 stay special)."""
    for name, tensor in inputs.items():
        if tensor is not None:
            for dim in _DYNAMIC_DIMS.get(name, (0, 1)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)


def step_module(step: Callable) -> RecurrenceStep:
    """The ``RecurrenceStep`` of a step, of a ``RecurrenceLoop`` or of their ``CompiledStep``."""
    body = step.step if isinstance(step, CompiledStep) else step
    return body.step if isinstance(body, RecurrenceLoop) else body


def build_compiled(block: nn.Module, halting: nn.Module, step_embedding: Optional[nn.Module],
                   side: str, max_steps: Optional[int] = None,
                   kv_from_state: bool = False) -> CompiledStep:
    """A side's compiled step (``--compile-step``), or with ``max_steps`` its whole loop of
    that many steps (``--compile-loop``); ``kv_from_state``: ``--*-halting-kv state``."""
    body = RecurrenceStep(block, halting, step_embedding, kv_from_state)
    return CompiledStep(body if max_steps is None else RecurrenceLoop(body, max_steps), side)


def run_compiled(step: Callable, h0: torch.Tensor, real: torch.Tensor, halting: nn.Module,
                 max_steps: int, self_padding_mask: torch.Tensor,
                 te_table: Optional[torch.Tensor] = None, **block_inputs):
    """The universal recurrence (``recurrence.universal_recurrence``) over a compiled step.

    Args:
        step: a ``RecurrenceStep`` or a ``RecurrenceLoop`` (one call for all steps), or
            its compiled form; h0: (B, T, d); real: (B, T) bool.
        te_table: (L, d) the step embedding's TE(1..L), or None.
        block_inputs: ``coords`` and the decoder's ``cross_k``, ``cross_v``,
            ``cross_padding_mask``.
    Returns:
        S_L (B, T, d), the HaltingResult and the final HaltingState, as the eager loop.
    """
    state = halting.begin(h0, real)
    # S_0 = h_0 and running = real, as tensors of their own: inputs that alias each other
    # would make a graph for step 1 apart from the later steps'
    h, S, running = h0, h0.clone(), real.clone()
    threshold = getattr(halting, "threshold", None)
    if threshold is not None:  # an input, not a constant of the graph
        threshold = torch.tensor(float(threshold), device=h0.device)
    kv = {}
    if step_module(step).carries_kv:  # step 1 projects every row (keys of S_0 = h_0)
        attn = step_module(step).block.self_attn
        rows = h0.new_zeros(*h0.shape[:2], attn.num_heads * attn.head_dim)
        kv = dict(changed=torch.ones_like(real), k_rows=rows, v_rows=rows.clone())
    body = step.step if isinstance(step, CompiledStep) else step
    if isinstance(body, RecurrenceLoop):  # all steps in one call, no host read
        if body.max_steps != max_steps:
            raise ValueError(f"run_compiled: the loop runs {body.max_steps} steps, not {max_steps}")
        inputs = dict(h=h, S=S, running=running, real=real, c=state.c, log_remain=state.log_remain,
                      weighted_sum=state.weighted_sum, steps=state.steps,
                      self_padding_mask=self_padding_mask, threshold=threshold, te_table=te_table,
                      **kv, **block_inputs)
        mark_batch_dims(inputs)
        S, state.steps, state.c, state.log_remain, state.weighted_sum, alphas = step(**inputs)
        state.alphas.extend(alphas)
        return S, halting.finish(state, max_steps), state
    if torch.is_grad_enabled():
        # dynamo specialises a graph on each input's requires_grad: the inputs one step
        # hands the next are zeros without a gradient at step 1 and carry one after it,
        # so step 1 would compile a graph of its own. Marked as requiring one (leaves
        # whose gradient is computed and dropped), every step runs the same graph.
        carried = [state.c, state.log_remain, state.weighted_sum]
        for tensor in carried + ([kv["k_rows"], kv["v_rows"]] if kv else []):
            tensor.requires_grad_()
    for l in range(1, max_steps + 1):
        if l > 1 and not bool(running.any()):  # the one host read of a step
            break
        te = None if te_table is None else te_table[l - 1]
        inputs = dict(h=h, S=S, running=running, real=real, c=state.c, log_remain=state.log_remain,
                      weighted_sum=state.weighted_sum, steps=state.steps,
                      self_padding_mask=self_padding_mask, threshold=threshold, te=te,
                      **kv, **block_inputs)
        mark_batch_dims(inputs)
        (h, S, state.steps, running_next, c, log_remain, weighted_sum, alpha,
         k_rows, v_rows) = step(**inputs)
        if S is h:  # the rule none's S_l = h_l: as aliased inputs, another graph
            S = h.clone()
        if kv:  # the rows that ran this step changed their S
            kv = dict(changed=running.clone(), k_rows=k_rows, v_rows=v_rows)  # (no aliased inputs)
        if l < max_steps:  # the decision for step l + 1
            running = running_next
            state.c, state.log_remain, state.weighted_sum = c, log_remain, weighted_sum
            if alpha is not None:
                state.alphas.append(alpha)
    result: HaltingResult = halting.finish(state, max_steps)
    return S, result, state


def count_graph_breaks(model: nn.Module, net_input: dict) -> int:
    """Graph breaks ``torch._dynamo.explain`` finds in the compiled steps of one forward of
    ``model`` (built with ``--compile-step``) on ``net_input``: every call of each side's
    step is traced by ``explain`` instead of being compiled; the forward runs eagerly.

    Raises RuntimeError when a side's step could not be traced at all (the forward then
    fell back to the eager step, and no count would mean anything)."""
    sides = [side for side in (model.encoder, model.decoder) if side.compiled_step is not None]
    if not sides:
        raise ValueError("count_graph_breaks: the model has no compiled step (--compile-step)")
    breaks = []

    class Explained(CompiledStep):
        def __call__(self, **inputs):
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
