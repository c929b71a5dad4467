"""One step of a side's universal recurrence as the eager loop runs it (``recurrence.py``).

Step l of either side, whatever its options (``SideStep.__call__``)::

    z    = mixture(h_{l-1})                 Hyper-UT's example embedding of step l, or None
    X    = S_{l-1} (mixture) or h_{l-1} (state)          ``--{encoder,decoder}-halting-kv``
    K, V = source(X, z)                     keys/values of X (+ E_l)
    K, V = [K, V of the earlier positions; K, V]          incremental decoding only
    q    = query(h_{l-1})                   h_{l-1} (+ E_l)
    h_l  = Block(q, K, V, z | padding masks, cross-attention K/V, chunk memory)

Each part is an object chosen once, when the model is built (``build_side_step``):

* source: ``StateKV`` (keys/values of S), ``step_embedding.SteppedKV`` /
  ``SteppedPreNormKV`` (of S + E_l, post-/pre-LN), ``HyperKV`` (the step's mixture);
* query: ``PlainQuery`` (h) or ``step_embedding.SteppedQuery`` (h + E_l);
* mixture: ``NoMixture``, ``ExampleMixture`` (encoder) or ``PrefixMixture`` (decoder).

With ``--tlb-unshared`` the chunked encoder's step is ``UnsharedSideStep``: step l runs
its own block l.

What changes from forward to forward is a ``StepContext``: the masks, the coordinates, the
cross-attention keys/values, the chunk memory's keys/values, the carried key/value rows
(``HaltedStateKV``: a full forward projects only the rows whose S changed; ``EveryRowKV``:
incremental decoding projects its new positions) and the cache (in incremental decoding
``decoder_cache.BufferedKeyCache``, or ``StepKeyCache`` for the chunked decoder's
right-aligned chunk cache; ``NO_CACHE`` otherwise). The compiled step (``compiled_step.py``)
builds its queries with the same query objects.
"""
import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .hyper_module import example_embedding, prefix_embedding
from .recurrence import BlockStep
from .step_embedding import StepEmbedding, SteppedQuery, stepped_kv
from .sut_block import EveryRowKV, HaltedStateKV, SUTBlock

Prefix = Dict[int, Tuple[torch.Tensor, torch.Tensor]]  # step l -> (Σ h (B, d), count (B,))

#: ``--encoder-halting-kv`` / ``--decoder-halting-kv``: the self-attention keys and values
#: of step l are those of the halted mixture S_{l-1} (``mixture``, the default) or of the
#: un-halted states h_{l-1} (``state``, GUT's Algorithm 3), docs/model.md#keys-and-values
HALTING_KV = ("mixture", "state")


class StepKeyCache:
    """The chunked decoder's incremental decoding (``chunk_cache.py``; the unchunked decoder
    writes into a preallocated buffer instead, ``decoder_cache.BufferedKeyCache``), one
    forward over the new positions: at step l the keys and
    values are those of the earlier positions, ``past_k[l-1]`` (B, H, t, D), followed by the
    new positions' (B, H, 1, D), which are recorded (``new_k``, ``new_v``) for the cache.

    ``prefix_in``: the causal prefix sums of global-mean halting over the earlier positions
    (or None); ``frozen_prefix``: their continuation when every new position halted early
    (``SideStep.freeze``)."""

    def __init__(self, num_steps: int, past_k: Optional[torch.Tensor] = None,
                 past_v: Optional[torch.Tensor] = None, prefix_in: Optional[Prefix] = None):
        self.num_steps, self.past_k, self.past_v = num_steps, past_k, past_v
        self.new_k: List[Optional[torch.Tensor]] = [None] * num_steps
        self.new_v: List[Optional[torch.Tensor]] = [None] * num_steps
        self.prefix_in, self.frozen_prefix = prefix_in, {}

    def record(self, step: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.new_k[step - 1], self.new_v[step - 1] = k, v

    def extend(self, step: int, k: torch.Tensor, v: torch.Tensor):
        """Record the new keys/values of ``step``; return [past; new] (B, H, t + 1, D)."""
        self.record(step, k, v)
        if self.past_k is None:  # the first position
            return k, v
        return torch.cat([self.past_k[step - 1], k], 2), torch.cat([self.past_v[step - 1], v], 2)


class NoKeyCache:
    """A full forward: every key is a position of this forward."""

    @staticmethod
    def extend(step: int, k: torch.Tensor, v: torch.Tensor):
        return k, v


NO_CACHE = NoKeyCache()


@dataclass
class StepContext:
    """What the steps of one recurrence read besides (h, S, running, l). Shapes: B batch,
    T query positions, T_k key positions (T, or the prefix in incremental decoding), S_src
    the encoder output, H heads of D, k memory slots.

    rows: the keys/values of S (``HaltedStateKV`` or ``EveryRowKV``); cache:
    ``StepKeyCache`` or ``NO_CACHE``; self_padding_mask (B, T_k) bool; real (B, T) bool,
    the query rows that are tokens; q_start: the first query's position among the keys;
    coords: PE (B, T, d) of the coordinate embedding, or None; cross_k / cross_v
    (B, H, S_src, D) and cross_padding_mask (B, S_src): the decoder's; memory_kv: keys and
    values (B, H, k, D) of the chunk's memory; hyper_prefix_in / hyper_prefix_out: the
    decoder's Hyper-UT prefix sums before / through the new positions (``PrefixMixture``).
    """

    rows: object
    self_padding_mask: torch.Tensor
    real: torch.Tensor
    cache: object = NO_CACHE
    q_start: int = 0
    coords: Optional[torch.Tensor] = None
    cross_k: Optional[torch.Tensor] = None
    cross_v: Optional[torch.Tensor] = None
    cross_padding_mask: Optional[torch.Tensor] = None
    memory_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    hyper_prefix_in: Optional[Prefix] = None
    hyper_prefix_out: Prefix = field(default_factory=dict)


# ---- key/value sources: (S (B, T, d), running, step l, z, ctx) -> K, V (B, H, T, D) each;
# running (B, T) bool: the rows that run step l, whose S changes for the next step (None
# where nothing is carried: incremental decoding's frozen rows); z: the step's mixture


class StateKV:
    """``K = W_k S + b`` (V alike; ``W_k LN(S) + b`` pre-LN) through ``ctx.rows``: in a
    full forward the rows whose S did not change keep their keys (``HaltedStateKV``)."""

    step_invariant = True  # the same S has the same keys at every step

    def __call__(self, S, running, step, z, ctx):
        return ctx.rows(S, running)


class HyperKV:
    """Hyper-UT key/value projections: ``K = W_k(z_l) S + b(z_l)``, every row at every step
    (the step's mixture z_l changes the weights)."""

    step_invariant = False

    def __init__(self, block: SUTBlock):
        self.block = block

    def __call__(self, S, running, step, z, ctx):
        return self.block.self_kv(S, z)


# ---- queries: (h (B, T, d), step l, ctx) -> the block's queries (B, T, d)


class PlainQuery:
    """The queries are h_{l-1} itself."""

    def __call__(self, h: torch.Tensor, step: int, ctx) -> torch.Tensor:
        return h

    @staticmethod
    def apply(x: torch.Tensor, te, coords) -> torch.Tensor:
        """x unchanged (the compiled step's form; ``te`` and ``coords`` are None)."""
        return x


def step_query(emb: Optional[StepEmbedding]):
    """``PlainQuery`` without a step embedding, else ``SteppedQuery`` (h + E_l)."""
    return PlainQuery() if emb is None else SteppedQuery(emb)


# ---- Hyper-UT mixtures: (h_{l-1} (B, T, d), step l, ctx) -> z_l, or None


class NoMixture:
    def __call__(self, h, step, ctx):
        return None


class ExampleMixture:
    """Encoder: z_l = masked mean of h_{l-1} over the real positions, (B, d)."""

    def __call__(self, h, step, ctx):
        return example_embedding(h, ctx.real)


class PrefixMixture:
    """Decoder: z_{t,l} = causal prefix mean of h_{l-1} over the real positions <= t,
    (B, T, d), continuing the earlier positions' sums (incremental decoding); the sums
    through the new positions go to ``ctx.hyper_prefix_out[l]``."""

    def __call__(self, h, step, ctx):
        prev = ctx.hyper_prefix_in.get(step) if ctx.hyper_prefix_in else None
        z, ctx.hyper_prefix_out[step] = prefix_embedding(h, ctx.real, prev)
        return z


class SideStep:
    """The eager step of one side (module docstring), built once with the model.

    ``kv_from_state``: the keys and values are those of h_{l-1} rather than S_{l-1}
    (``--*-halting-kv state``). Both change exactly on the rows that ran the previous step
    (a halted row keeps its h and its S), so the carried rows (``HaltedStateKV``), the
    incremental caches and the frozen rows (``freeze``) work alike for either."""

    def __init__(self, block: SUTBlock, query, source, mixture, kv_from_state: bool = False):
        self.block, self.query, self.source, self.mixture = block, query, source, mixture
        self.kv_from_state = kv_from_state

    def context(self, cache: Optional[StepKeyCache] = None, **inputs) -> StepContext:
        """A ``StepContext`` for one recurrence: a full forward (no ``cache``) carries the
        keys/values of the rows whose S did not change, incremental decoding projects the
        new positions' rows."""
        if cache is None:
            return StepContext(rows=HaltedStateKV(self.block), **inputs)
        return StepContext(rows=EveryRowKV(self.block), cache=cache, **inputs)

    def bind(self, ctx: StepContext) -> BlockStep:
        """``(h, S, running, l) -> h_l`` for ``universal_recurrence``."""
        return functools.partial(self, ctx=ctx)

    def memory_kv(self, M: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, k, D) of the chunk's memory M^c (B, k, d), projected
        once per chunk by the block's memory attention (``ctx.memory_kv``)."""
        return self.block.memory_attn.project_kv(M)

    def __call__(self, h: torch.Tensor, S: torch.Tensor, running: torch.Tensor, step: int,
                 ctx: StepContext) -> torch.Tensor:
        """h = h_{l-1} (B, T, d) queries, S = S_{l-1} (B, T, d) keys/values (h_{l-1} with
        ``kv_from_state``), running (B, T) bool, step l. Returns the block's output
        (B, T, d) (the recurrence keeps h_{l-1} on the rows that do not run)."""
        z = self.mixture(h, step, ctx)
        kv_in = h if self.kv_from_state else S
        k, v = ctx.cache.extend(step, *self.source(kv_in, running, step, z, ctx))
        return self.block(self.query(h, step, ctx), k, v, running,
                          self_padding_mask=ctx.self_padding_mask, q_start=ctx.q_start,
                          cross_k=ctx.cross_k, cross_v=ctx.cross_v,
                          cross_padding_mask=ctx.cross_padding_mask, hyper_z=z,
                          memory_kv=ctx.memory_kv)

    def freeze(self, S: torch.Tensor, h: torch.Tensor, first_skipped_step: int,
               ctx: StepContext) -> None:
        """Incremental decoding's ``on_early_exit``: every new position halted before step
        l = ``first_skipped_step``, so steps l..L cache the keys/values of its frozen S
        (B, 1, d) (of its frozen h with ``kv_from_state``; with the step's E_l, or the
        step-l mixture of its frozen h), and the causal prefix sums (of global-mean
        halting, and of the mixture) continue with the frozen h (B, 1, d)."""
        cache = ctx.cache
        kv_in = h if self.kv_from_state else S
        k = v = None
        for l in range(first_skipped_step, cache.num_steps + 1):
            z = self.mixture(h, l, ctx)
            if k is None or not self.source.step_invariant:
                k, v = self.source(kv_in, None, l, z, ctx)
            cache.record(l, k, v)
        cache.frozen_prefix.update(frozen_prefix_sums(cache.prefix_in, h, ctx.real,
                                                      first_skipped_step, cache.num_steps))


class UnsharedSideStep:
    """``--tlb-unshared``: the chunked encoder's step l runs its own block l
    (``blocks[l-1]``), as the TLB paper's Algorithm 2 stacks L unshared layers per chunk,
    instead of one block shared by the L steps. Chunks exclude step embeddings and
    hyper-modules, and the option is the encoder's (no incremental decoding), so the step
    is the plain one: queries h_{l-1}, keys and values of S_{l-1} (of h_{l-1} with
    ``kv_from_state``) projected by block l for every row at every step (the projection
    changes with the step, so nothing is carried from the previous one), and the memory
    keys and values of M^c projected once per chunk by each block (``memory_kv``: a list,
    entry l - 1 for step l)."""

    def __init__(self, blocks: List[SUTBlock], kv_from_state: bool = False):
        self.blocks, self.kv_from_state = list(blocks), kv_from_state

    def context(self, **inputs) -> StepContext:
        """A full forward's ``StepContext`` (the keys come from the step's block, not
        from ``rows``)."""
        return StepContext(rows=None, **inputs)

    def bind(self, ctx: StepContext) -> BlockStep:
        return functools.partial(self, ctx=ctx)

    def memory_kv(self, M: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per step l, block l's keys and values (B, H, k, D) of M^c (B, k, d)."""
        return [block.memory_attn.project_kv(M) for block in self.blocks]

    def __call__(self, h: torch.Tensor, S: torch.Tensor, running: torch.Tensor, step: int,
                 ctx: StepContext) -> torch.Tensor:
        """As ``SideStep.__call__``, with block l = ``blocks[step - 1]``."""
        block = self.blocks[step - 1]
        k, v = block.self_kv(h if self.kv_from_state else S)
        memory_kv = None if ctx.memory_kv is None else ctx.memory_kv[step - 1]
        return block(h, k, v, running, self_padding_mask=ctx.self_padding_mask,
                     q_start=ctx.q_start, cross_k=ctx.cross_k, cross_v=ctx.cross_v,
                     cross_padding_mask=ctx.cross_padding_mask, memory_kv=memory_kv)


def build_side_step(block: SUTBlock, emb: Optional[StepEmbedding], decoder: bool,
                    kv_from_state: bool = False) -> SideStep:
    """The side's step: its key/value source, queries and Hyper-UT mixture (step
    embeddings, chunks and hyper-modules exclude one another, ``models/validation.py``);
    ``kv_from_state``: keys and values of h_{l-1} instead of S_{l-1}."""
    if block.hyper_kv:
        source = HyperKV(block)
    elif emb is not None:
        source = stepped_kv(block, emb)
    else:
        source = StateKV()
    if not block.hyper:
        mixture = NoMixture()
    else:
        mixture = PrefixMixture() if decoder else ExampleMixture()
    return SideStep(block, step_query(emb), source, mixture, kv_from_state)


def frozen_prefix_sums(prefix_in: Optional[Prefix], h: torch.Tensor, real: torch.Tensor,
                       first_skipped_step: int, num_steps: int) -> Prefix:
    """Incremental decoding when every new position halted before ``first_skipped_step``:
    the causal prefix sums (Σ h, count) that the decisions of steps l + 1 (l >= that step)
    read, continued with the new position's frozen h (B, 1, d) where ``real`` (B, 1); {}
    without prefix sums (rules other than global-mean)."""
    if prefix_in is None:
        return {}
    r = real[:, -1]  # (B,) bool: the counts stay exact integers, as the halting's own sums
    return {l + 1: (prefix_in[l + 1][0] + h[:, -1] * r.unsqueeze(1), prefix_in[l + 1][1] + r)
            for l in range(first_skipped_step, num_steps + 1) if l + 1 in prefix_in}
