"""The universal recurrence of one side: one shared block applied up to L times under a
halting rule, as one step that runs eagerly or compiled.

    h_0 = S_0 = embeddings,  running = real
    for l = 1..L:
        stop when no position runs        (incremental decoding caches steps l..L first)
        z    = mixture(h_{l-1})            Hyper-UT's example embedding of step l, or None
        X    = S_{l-1}, or h_{l-1}         ``--{encoder,decoder}-halting-kv mixture|state``
        K, V = keys/values of X (+ E_l)    E_l: the step embedding, if any
        K, V = [cached positions; K, V]    incremental decoding only
        h_l  = Block(h_{l-1} (+ E_l), K, V, z)   on running positions, h_{l-1} elsewhere
        S_l  = halting.mix(h_l, S_{l-1})                                  (Eq. 3)
        running = halting.decide(h_l)      who computes step l + 1 (l < L)
    output S_L

A halted position keeps its h and S, so its keys and values are carried from the step before
(``KeyValueCarry``). Positions that do not run reach the block as ``running = False``, and
every data-dependent saving happens inside the custom ops (``sut::routed_linear``,
``sut::masked_linear``): the step's shapes never depend on the data, so
``torch.compile(fullgraph=True)`` traces it whole (``--compile-step``, ``TensorStep``) and
the eager loop runs the very same step, reading a ``StepInputs``.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .. import compiler
from ..ops import weight_grads
from .halting import HaltingResult, HaltingState
from .hyper_module import example_embedding, prefix_embedding
from .step_embedding import add_embedding, step_kv_bias

Prefix = Dict[int, Tuple[torch.Tensor, torch.Tensor]]  # step l -> (Σ h (B, d), count (B,))

#: ``--{encoder,decoder}-halting-kv``: the keys and values of step l are S_{l-1}'s (``mixture``,
#: the default) or h_{l-1}'s (``state``, GUT's Algorithm 3); docs/model.md#keys-and-values
HALTING_KV = ("mixture", "state")


class NoKeyCache:
    """A full forward: every key is a position of this forward."""

    @staticmethod
    def extend(step: int, k: torch.Tensor, v: torch.Tensor):
        return k, v


NO_CACHE = NoKeyCache()


@dataclass
class StepInputs:
    """What the steps of one recurrence read besides (h, S, running): self_padding_mask
    (B, T_k) bool over the T_k keys (T, or the prefix in incremental decoding); real (B, T)
    bool, the query rows that are tokens; q_start: the first query's position among the keys;
    coords: PE (B, T, d) or None; te_table (L, d): TE(1..L) or None; cross_k / cross_v
    (B, H, S_src, D), cross_padding_mask (B, S_src): the decoder's; memory_kv: the chunk's
    memory keys and values (B, H, k, D) (a list by step under ``--tlb-unshared``); cache:
    ``NO_CACHE`` or an incremental-decoding key cache; hyper_prefix_in / _out: the decoder's
    Hyper-UT prefix sums before / through the new positions."""

    self_padding_mask: torch.Tensor
    real: torch.Tensor
    q_start: int = 0
    coords: Optional[torch.Tensor] = None
    te_table: Optional[torch.Tensor] = None
    cross_k: Optional[torch.Tensor] = None
    cross_v: Optional[torch.Tensor] = None
    cross_padding_mask: Optional[torch.Tensor] = None
    memory_kv: object = None
    cache: object = NO_CACHE
    hyper_prefix_in: Optional[Prefix] = None
    hyper_prefix_out: Prefix = field(default_factory=dict)


def joint_kv(attn: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """The key and value projections of ``attn`` as one map d -> 2·H·D (one GEMM, not two):
    [K | V] = x [W_k; W_v]ᵀ + [b_k; b_v]; returns (weight (2·H·D, d), bias (2·H·D,))."""
    return (torch.cat([attn.k_proj.weight, attn.v_proj.weight], 0),
            torch.cat([attn.k_proj.bias, attn.v_proj.bias], 0))


class KeyValueCarry:
    """Self-attention keys and values (B, T, H·D) of X carried from step to step: only the
    rows whose X changed (``changed`` (B, T) bool, the rows that ran the previous step; None
    at step 1: every row) are projected, ``sut::masked_linear`` skipping the others."""

    def __init__(self, changed=None, k_rows=None, v_rows=None):
        self.changed, self.k_rows, self.v_rows = changed, k_rows, v_rows

    def __call__(self, block: nn.Module, x: torch.Tensor, running: torch.Tensor):
        """K, V (B, H, T, D) of x (B, T, d) (LayerNormed in a pre-LN block); ``running``
        (B, T): the rows whose x changes in this step."""
        x = block.self_attn_norm(x) if block.normalize_before else x
        k, v = block.kv_rows(x, *joint_kv(block.self_attn), self.changed).chunk(2, -1)
        if self.changed is not None:
            keep = self.changed.unsqueeze(-1)
            k, v = torch.where(keep, k, self.k_rows), torch.where(keep, v, self.v_rows)
        self.changed, self.k_rows, self.v_rows = running, k, v
        heads = (*x.shape[:2], block.self_attn.num_heads, block.self_attn.head_dim)
        return k.view(heads).transpose(1, 2), v.view(heads).transpose(1, 2)


# ---- key/value sources: (block, X (B, T, d), z, te (d,) or None, inputs, carry, running)
# -> K, V (B, H, T, D); carry None: every row is projected (incremental decoding)

def carried_kv(block, x, z, te, inputs, carry, running):
    """``K = W_k X' + b`` (+ ``W_k TE(l)`` with a post-LN step embedding, which is affine in
    X so the carried keys stay exact), ``X' = X`` or ``X + PE`` (coordinate); V alike."""
    base = x if inputs.coords is None else x + inputs.coords
    k, v = block.self_kv(base) if carry is None else carry(block, base, running)
    if te is not None:
        bk, bv = step_kv_bias(block, te)
        k, v = k + bk, v + bv
    return k, v


def prenorm_stepped_kv(block, x, z, te, inputs, carry, running):
    """Pre-LN with a step embedding: ``K = W_k LN(X + E_l) + b`` for every row at every step
    (LayerNorm is not affine: no per-step vector corrects carried keys)."""
    return block.self_kv(add_embedding(x, te, inputs.coords))


def hyper_kv(block, x, z, te, inputs, carry, running):
    """Hyper-UT key/value projections ``K = W_k(z_l) X + b(z_l)``: every row at every step."""
    return block.self_kv(x, z)


def every_row_kv(block, x, z, te, inputs, carry, running):
    """Block l's own projections of every row (``--tlb-unshared``)."""
    return block.self_kv(x)


# ---- Hyper-UT mixtures: (h_{l-1} (B, T, d), step l, inputs) -> z_l

def example_mixture(h, step, inputs):
    """Encoder: z_l = masked mean of h_{l-1} over the real positions, (B, d)."""
    return example_embedding(h, inputs.real)


def prefix_mixture(h, step, inputs):
    """Decoder: z_{t,l} = causal prefix mean of h_{l-1} over the real positions <= t,
    (B, T, d), continuing the earlier positions' sums (incremental decoding); the sums
    through the new positions go to ``inputs.hyper_prefix_out[l]``."""
    prev = inputs.hyper_prefix_in.get(step) if inputs.hyper_prefix_in else None
    z, inputs.hyper_prefix_out[step] = prefix_embedding(h, inputs.real, prev)
    return z


def no_mixture(h, step, inputs):
    return None


class RecurrenceStep(nn.Module):
    """Step l of one side (module docstring), with no parameters of its own: ``blocks``, the
    shared block or the L blocks of ``--tlb-unshared``; ``step_embedding`` chooses the
    key/value source (TE(l) comes with each call); ``kv_from_state``: keys and values of
    h_{l-1}, not S_{l-1}."""

    def __init__(self, blocks: List[nn.Module], halting: nn.Module, step_embedding: Optional[nn.Module],
                 kv_from_state: bool, decoder: bool):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.halting, self.kv_from_state = halting, kv_from_state
        block = blocks[0]
        if len(blocks) > 1:
            self.source = every_row_kv
        elif block.hyper_kv:
            self.source = hyper_kv
        elif step_embedding is not None and block.normalize_before:
            self.source = prenorm_stepped_kv
        else:
            self.source = carried_kv
        self.mixture = no_mixture if not block.hyper else prefix_mixture if decoder else example_mixture
        #: the keys of a frozen X are the same at every step (no TE(l), no mixture)
        self.step_invariant = self.source is carried_kv and step_embedding is None and not block.hyper

    @property
    def carries_kv(self) -> bool:
        """Whether the keys/values of halted rows are carried (``KeyValueCarry``)."""
        return self.source is carried_kv

    def forward(self, h: torch.Tensor, S: torch.Tensor, running: torch.Tensor, step: int,
                state: HaltingState, rule, carry: Optional[KeyValueCarry], inputs: StepInputs,
                te: Optional[torch.Tensor], decide_next: bool, threshold: Optional[torch.Tensor] = None):
        """h = h_{l-1}, S = S_{l-1} (B, T, d), running (B, T) bool; ``rule`` updates the
        halting ``state``; te: TE(l) (d,) or None; threshold: α_thresh as a 0-d tensor (a
        compiled step's input) or None (the rule's own). Returns h_l, S_l and who runs step
        l + 1 (``running`` itself when not ``decide_next``)."""
        block = self.blocks[step - 1] if len(self.blocks) > 1 else self.blocks[0]
        z = self.mixture(h, step, inputs)
        x = h if self.kv_from_state else S
        k, v = inputs.cache.extend(step, *self.source(block, x, z, te, inputs, carry, running))
        memory_kv = inputs.memory_kv
        memory_kv = memory_kv[step - 1] if isinstance(memory_kv, list) else memory_kv
        query = h if te is None else add_embedding(h, te, inputs.coords)
        rows = None if block.training else running_rows(running, query, inputs, z, memory_kv)
        # step 1's backward makes the shared weights' gradients (unshared blocks: each its own)
        weight_grads.ROLE.step = step if len(self.blocks) == 1 else 1
        try:
            if rows is None:
                h_new = block(query, k, v, running, self_padding_mask=inputs.self_padding_mask,
                              q_start=inputs.q_start, cross_k=inputs.cross_k, cross_v=inputs.cross_v,
                              cross_padding_mask=inputs.cross_padding_mask, hyper_z=z,
                              memory_kv=memory_kv)
            else:  # the block on the running rows alone; the halted rows keep h (advance)
                h_new = h.index_copy(0, rows, block_on_rows(block, rows, query, k, v, running, inputs))
        finally:
            weight_grads.ROLE.step = None
        return advance(h, h_new, S, running, step, state, rule, decide_next, threshold)

    def memory_kv(self, M: torch.Tensor):
        """Keys and values (B, H, k, D) of the chunk's memory M^c (B, k, d), once per chunk
        (a list by step under ``--tlb-unshared``)."""
        kv = [block.memory_attn.project_kv(M) for block in self.blocks]
        return kv if len(kv) > 1 else kv[0]

    def freeze(self, S: torch.Tensor, h: torch.Tensor, first_skipped_step: int, inputs: StepInputs):
        """Every new position halted before step l = ``first_skipped_step`` (incremental
        decoding): steps l..L cache the keys/values of its frozen X (B, 1, d) (with E_l or the
        mixture), and the causal prefix sums continue with its frozen h (B, 1, d)."""
        cache = inputs.cache
        x = h if self.kv_from_state else S
        k = v = None
        for l in range(first_skipped_step, cache.num_steps + 1):
            z = self.mixture(h, l, inputs)
            te = None if inputs.te_table is None else inputs.te_table[l - 1]
            if k is None or not self.step_invariant:
                k, v = self.source(self.blocks[0], x, z, te, inputs, None, None)
            cache.record(l, k, v)
        cache.frozen_prefix.update(frozen_prefix_sums(cache.prefix_in, h, inputs.real,
                                                      first_skipped_step, cache.num_steps))


#: incremental decoding runs a step's block on the running rows alone once at least this
#: share of the rows halted (below it, gathering their keys and values costs more than the
#: halted rows' attention, LayerNorms and projections save)
COMPACT_HALTED_SHARE = 0.25


#: a step on the running rows alone keeps the cross-attention's keys whole (the rows
#: attending from their places in the beam grid) while at least this share of the rows
#: runs; below it, gathering each row's sentence's keys costs less than attending from
#: the whole grid (one captured Multi30k decoder call: the two break even near 0.4)
GRID_CROSS_SHARE = 0.5


def running_rows(running: torch.Tensor, query: torch.Tensor, inputs: StepInputs, z,
                 memory_kv) -> Optional[torch.Tensor]:
    """The running rows (R,) of one incremental decoding call, for the block to run on them
    alone: one new position per row (B, 1), on a CPU (the count is read on the host), no
    Hyper-UT mixture z, chunk memory or coordinate embedding, and at least
    COMPACT_HALTED_SHARE of the rows halted but not all; otherwise None."""
    if (inputs.cache is NO_CACHE or query.size(1) != 1 or query.is_cuda or z is not None
            or memory_kv is not None or inputs.coords is not None):
        return None
    rows = running[:, 0].nonzero().squeeze(1)  # the one host read
    count, total = rows.numel(), running.size(0)
    return rows if 0 < count < total and count <= (1.0 - COMPACT_HALTED_SHARE) * total else None


def block_on_rows(block: nn.Module, rows: torch.Tensor, query: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, running: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
    """``block`` on the decoder rows ``rows`` (R,) of query (B, 1, d), their keys/values
    (B, H, S, D) and prefix padding. Cross-attention inputs (one row per sentence under beam
    search, B / G rows): with at least GRID_CROSS_SHARE of the B rows running they stay
    whole and the R rows attend from their places among the B (``cross_rows``: one grouped
    attention, as at full depth); with fewer, each row's sentence's row is gathered."""
    def pick(t, index=rows):  # every input is a tensor in incremental decoding
        return t.index_select(0, index)

    cross = dict(cross_k=inputs.cross_k, cross_v=inputs.cross_v,
                 cross_padding_mask=inputs.cross_padding_mask)
    if rows.numel() >= GRID_CROSS_SHARE * query.size(0):
        cross["cross_rows"] = (rows, query.size(0))
    else:
        sentences = rows // (query.size(0) // inputs.cross_k.size(0))
        cross = {name: pick(t, sentences) for name, t in cross.items()}
    return block(pick(query), pick(k), pick(v), pick(running),
                 self_padding_mask=pick(inputs.self_padding_mask), q_start=inputs.q_start, **cross)


def advance(h: torch.Tensor, h_new: torch.Tensor, S: torch.Tensor, running: torch.Tensor,
            step: int, state: HaltingState, rule, decide_next: bool,
            threshold: Optional[torch.Tensor] = None):
    """The halting half of step l, after the block gave h_new (B, T, d); returns h_l, S_l, running:

        h_l = h_new on running positions, h_{l-1} elsewhere;  steps += running
        S_l = rule.mix(h_l, S_{l-1})                                     (Eq. 3)
        running = rule.decide(h_l)        who computes step l + 1 (if ``decide_next``)
    """
    h = torch.where(running.unsqueeze(-1), h_new, h)
    state.steps = state.steps + running.long()
    S = rule.mix(h, S, running, state)
    if decide_next:
        running = rule.decide(h, running, state, step + 1, threshold)
    return h, S, running


def frozen_prefix_sums(prefix_in: Optional[Prefix], h: torch.Tensor, real: torch.Tensor,
                       first_skipped_step: int, num_steps: int) -> Prefix:
    """``RecurrenceStep.freeze``'s causal prefix sums (Σ h, count) for the decisions of steps
    l + 1 (l >= ``first_skipped_step``), continued with the frozen h (B, 1, d) where ``real``
    (B, 1); {} without prefix sums (rules other than global-mean)."""
    if prefix_in is None:
        return {}
    r = real[:, -1]  # (B,) bool: the counts stay exact integers, as the halting's own sums
    return {l + 1: (prefix_in[l + 1][0] + h[:, -1] * r.unsqueeze(1), prefix_in[l + 1][1] + r)
            for l in range(first_skipped_step, num_steps + 1) if l + 1 in prefix_in}


class TensorStep(nn.Module):
    """``RecurrenceStep`` with tensor inputs and outputs only (``--compile-step``): a full
    forward of a side without chunks, hyper-modules or early exits (``unsupported``).

    Inputs: h = h_{l-1}, S (B, T, d); running, real, self_padding_mask (B, T) bool; c,
    log_remain, weighted_sum, steps: the ``HaltingState``'s; threshold: α_thresh, 0-d fp32
    (None for the rule ``none``); changed (B, T) bool, the rows whose X changed in the
    previous step, and k_rows / v_rows (B, T, H·D), the carried keys and values (None unless
    ``carries_kv``); te: TE(l) (d,); coords, cross_*: as in ``StepInputs``; step: l inside
    ``TensorLoop`` (step 1 makes the shared expert weights' gradients, ``weight_grads``),
    else 1 (a graph of its own, the same for every step). Returns h_l, S_l, steps, the
    decision for step l + 1 (running, c, log_remain, weighted_sum, α_l or None) and
    k_rows / v_rows; the caller discards the decision after the last step."""

    def __init__(self, step: RecurrenceStep):
        super().__init__()
        self.step = step
        self.cache = NO_CACHE  # an attribute: dynamo wraps objects it can name, not defaults

    def forward(self, h, S, running, real, c, log_remain, weighted_sum, steps, self_padding_mask,
                threshold=None, changed=None, k_rows=None, v_rows=None, te=None, coords=None,
                cross_k=None, cross_v=None, cross_padding_mask=None, step: int = 1):
        state = HaltingState.from_tensors(real, c, log_remain, weighted_sum, h, steps)
        carry = KeyValueCarry(changed, k_rows, v_rows) if changed is not None else None
        inputs = StepInputs(self_padding_mask=self_padding_mask, real=real, coords=coords,
                            cross_k=cross_k, cross_v=cross_v, cross_padding_mask=cross_padding_mask,
                            cache=self.cache)
        h, S, running_next = self.step(h, S, running, step, state, self.step.halting, carry, inputs,
                                       te, True, threshold)
        alpha = state.alphas[-1] if state.alphas else None
        return (h, S, state.steps, running_next, state.c, state.log_remain, state.weighted_sum, alpha,
                None if carry is None else carry.k_rows, None if carry is None else carry.v_rows)


class TensorLoop(nn.Module):
    """All L steps of a side as one function (``--compile-loop``), with no host read between
    steps: ``TensorStep`` L times. Exact: once no position runs a step changes nothing (every
    state keeps its value where ``running`` is false, α = 0 there), so it returns what the
    early-exiting loop returns. Inputs: ``TensorStep``'s for step 1 but the halting state
    and the carried keys/values, which the loop begins itself (in its graph: no zero-fill
    launches of their own), with ``te_table`` (L, d) for ``te``. Returns S_L, steps, c,
    log_remain, weighted_sum, the α of steps 2..L and the rule's ``finish`` in the same
    graph: the halting weights (B, T, L) and expected depth (B, T)."""

    def __init__(self, step: TensorStep, max_steps: int):
        super().__init__()
        self.step, self.max_steps = step, max_steps

    def forward(self, h, S, running, real, self_padding_mask, threshold=None, te_table=None,
                **block_inputs):
        step = self.step.step
        state = step.halting.begin(h, real)
        c, log_remain, weighted_sum, steps = state.c, state.log_remain, state.weighted_sum, state.steps
        changed = k_rows = v_rows = None
        if step.carries_kv:  # step 1 projects every row
            attn = step.blocks[0].self_attn
            k_rows = v_rows = h.new_zeros(*h.shape[:2], attn.num_heads * attn.head_dim)
            changed = torch.ones_like(real)
        alphas = []
        for l in range(1, self.max_steps + 1):
            te = None if te_table is None else te_table[l - 1]
            h, S, steps, running_next, *decision, alpha, k_rows, v_rows = self.step(
                h, S, running, real, c, log_remain, weighted_sum, steps, self_padding_mask,
                threshold, changed, k_rows, v_rows, te, **block_inputs, step=l)
            changed = running if changed is not None else None  # the rows whose X changed
            if l < self.max_steps:  # the decision for step l + 1
                running, (c, log_remain, weighted_sum) = running_next, decision
                if alpha is not None:
                    alphas.append(alpha)
        state = HaltingState.from_tensors(real, c, log_remain, weighted_sum, h, steps)
        state.alphas = alphas
        result = step.halting.finish(state, self.max_steps)
        return S, steps, c, log_remain, weighted_sum, tuple(alphas), result.weights, result.expected_depth


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


def step_module(compiled: compiler.CompiledStep) -> RecurrenceStep:
    """The ``RecurrenceStep`` inside a compiled ``TensorStep`` or ``TensorLoop``."""
    body = compiled.step
    return (body.step if isinstance(body, TensorLoop) else body).step


class SideRecurrence:
    """A side's recurrence: its ``RecurrenceStep`` (``step``) and the loop over it, eager or
    through the side's compiled step. A plain object, so that the step's modules stay
    registered under the side's own names only."""

    def __init__(self, step: RecurrenceStep, num_steps: int):
        self.step, self.num_steps = step, num_steps

    def run(self, h0: torch.Tensor, inputs: StepInputs, rule=None,
            compiled: Optional[compiler.CompiledStep] = None,
            on_early_exit: Optional[Callable] = None,
            prefix_in: Optional[Prefix] = None) -> Tuple[torch.Tensor, HaltingResult, HaltingState]:
        """The recurrence over h_0 = h0 (B, T, d), queries ``inputs.real`` (B, T). rule: the
        step's own by default (or exits bound to the output projection, a chunk's step cap);
        compiled: the side's compiled step, used in a full forward until compiling fails;
        on_early_exit(S, h, l): called when every position halted before step l (``freeze``);
        prefix_in: earlier positions' causal prefix sums (incremental decoding, global-mean
        halting). Returns S_L (B, T, d), the HaltingResult and the final HaltingState."""
        rule = self.step.halting if rule is None else rule
        max_steps = self.num_steps
        full = inputs.cache is NO_CACHE
        compiles = (full and rule is self.step.halting and compiled is not None
                    and compiled.usable(h0.device))
        loop = compiles and isinstance(compiled.step, TensorLoop)
        if loop:
            try:
                return self._run_loop(compiled, h0, inputs, rule, max_steps)
            except Exception as error:  # noqa: BLE001  (the compiler's own errors only)
                if not compiler.is_compiler_error(error):
                    raise
                compiled.disable(error)
        state = rule.begin(h0, inputs.real, prefix_in)
        carry = KeyValueCarry() if full and self.step.carries_kv else None
        call = self.step
        if compiles and not loop:
            call = CompiledCall(compiled, rule)
        h, S, running = h0, h0, inputs.real
        for l in range(1, max_steps + 1):
            if l > 1 and not bool(running.any()):  # the one host read of a step
                if on_early_exit is not None:
                    on_early_exit(S, h, l)
                break
            te = None if inputs.te_table is None else inputs.te_table[l - 1]
            args = (h, S, running, l, state, rule, carry, inputs, te, l < max_steps)
            try:
                h, S, running = call(*args)
            except Exception as error:  # noqa: BLE001  (the compiler's own errors only)
                if call is self.step or not compiler.is_compiler_error(error):
                    raise
                compiled.disable(error)
                call = self.step
                h, S, running = call(*args)
        return S, rule.finish(state, max_steps), state

    def _run_loop(self, compiled, h0, inputs, rule, max_steps):
        """``--compile-loop``: all steps in one call, no host read."""
        if compiled.step.max_steps != max_steps:
            raise ValueError(f"the compiled loop runs {compiled.step.max_steps} steps, not {max_steps}")
        S, steps, c, log_remain, weighted_sum, alphas, weights, depth = compiled(
            h=h0, S=h0, running=inputs.real, real=inputs.real,
            self_padding_mask=inputs.self_padding_mask,
            threshold=threshold_tensor(rule.threshold, h0), te_table=inputs.te_table,
            coords=inputs.coords, cross_k=inputs.cross_k, cross_v=inputs.cross_v,
            cross_padding_mask=inputs.cross_padding_mask)
        state = HaltingState.from_tensors(inputs.real, c, log_remain, weighted_sum, S, steps)
        state.alphas = list(alphas)
        return S, HaltingResult(weights, depth, steps, inputs.real, max_steps), state


def threshold_tensor(threshold, like: torch.Tensor) -> Optional[torch.Tensor]:
    """α_thresh as a 0-d tensor on ``like``'s device, an input of a compiled graph rather than
    a constant of it (None, for the rule ``none``, and a tensor stay as they are)."""
    if threshold is None or torch.is_tensor(threshold):
        return threshold
    return torch.tensor(float(threshold), device=like.device)


class CompiledCall:
    """``RecurrenceStep``'s call over a compiled ``TensorStep``: the halting state, carried
    keys/values and inputs as tensors in, the results written back (but for the decision
    after the last step, which the eager step does not make)."""

    def __init__(self, compiled: compiler.CompiledStep, rule):
        self.compiled = compiled
        # α_thresh: a 0-d tensor at the first call (an input of the graph, not a constant)
        self.threshold = rule.threshold

    def tensors(self, h, S, running, state, carry, inputs, te=None) -> dict:
        self.threshold = threshold_tensor(self.threshold, h)
        kv = {}
        if carry is not None:
            if carry.changed is None:  # step 1 projects every row
                attn = step_module(self.compiled).blocks[0].self_attn
                rows = h.new_zeros(*h.shape[:2], attn.num_heads * attn.head_dim)
                kv = dict(changed=torch.ones_like(inputs.real), k_rows=rows, v_rows=rows.clone())
            else:
                kv = dict(changed=carry.changed, k_rows=carry.k_rows, v_rows=carry.v_rows)
        return dict(h=h, S=S, running=running, real=state.real, c=state.c,
                    log_remain=state.log_remain, weighted_sum=state.weighted_sum, steps=state.steps,
                    self_padding_mask=inputs.self_padding_mask, threshold=self.threshold, **kv,
                    te=te, coords=inputs.coords, cross_k=inputs.cross_k, cross_v=inputs.cross_v,
                    cross_padding_mask=inputs.cross_padding_mask)

    def __call__(self, h, S, running, step, state, rule, carry, inputs, te, decide_next):
        (h_new, S, state.steps, running_next, c, log_remain, weighted_sum, alpha, k_rows,
         v_rows) = self.compiled(**self.tensors(h, S, running, state, carry, inputs, te))
        if carry is not None:
            carry.changed, carry.k_rows, carry.v_rows = running, k_rows, v_rows
        state.prev_h = h_new
        if not decide_next:
            return h_new, S, running
        state.c, state.log_remain, state.weighted_sum = c, log_remain, weighted_sum
        if alpha is not None:
            state.alphas.append(alpha)
        return h_new, S, running_next


def build_compiled(step: RecurrenceStep, side: str, max_steps: Optional[int] = None
                   ) -> compiler.CompiledStep:
    """A side's compiled step (``--compile-step``), or with ``max_steps`` its whole loop of
    that many steps (``--compile-loop``)."""
    body = TensorStep(step)
    return compiler.CompiledStep(body if max_steps is None else TensorLoop(body, max_steps), side)
