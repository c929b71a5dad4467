"""One weight gradient per shared expert parameter per backward (``SUT_WEIGHT_GRADS``).

A side's L recurrence steps apply the same expert weights W (E, in, out) and biases b
(E, out), so their gradients sum over the steps:

    dW_e = Σ_l Σ_{s ∈ S_l(e)} x_s^T (g_s dy_s),    db_e = Σ_l Σ_{s ∈ S_l(e)} g_s dy_s

(S_l(e): the slots routed to expert e in step l; g_s: the slot's gate where the op weighs
and sums a token's slots, else 1). Autograd runs step 1's backward after the others' (every
later step reads step 1's output), so each parameter's ``Bucket``, opened by its step-1
forward and joined by steps 2..L, gathers the steps' terms, and step 1's backward returns
the whole gradient; steps L..2 return none.

* ``per-step`` (the default): each step's ``sut::routed_linear`` backward makes its own
  term, one weight-gradient launch over the rows of that step, and the launch adds the
  running sum of the steps whose backward ran before it as it stores its tiles (``acc_w``
  / ``acc_b`` of ``sut::routed_linear_backward``, cuBLAS's beta = 1): the bucket holds the
  sum (``running_sum``). Without it autograd would add the L terms itself, in a compiled
  loop a fused kernel per parameter that reads L gradients of the weight's size.
* ``deferred``: one launch per parameter over the rows of every step. The backwards of
  steps L..2 compute the input and gate gradients only and leave their operands (the
  output's gradient, x, the gates, the expert choice) in the bucket; step 1's backward
  adds its own and makes dW and db in one ``sut::routed_linear_backward`` over all of
  them, with one routing of the L·N tokens (``merged_routing``: the steps' expert choices
  concatenated; grouped rows are put back in slot order first). The bucket holds every
  step's output gradient until then (``Stats`` counts its bytes); the sums run in another
  order than per step (fp32 rounding only).

The same Python runs eagerly and while AOTAutograd traces a compiled loop's backward
(``--compile-loop``): the bucket exists at trace time only, and the compiled backward holds
the chain of launches (per step) or one launch per parameter (deferred). Each compiled step
(``--compile-step``) is its own graph and backward: every step is step 1 of its graph
there and makes its own gradient. Outside a recurrence (``StepRole.step`` None) or
without a gradient a call makes its own weight gradient, and autograd sums them.

``SUT_WEIGHT_GRADS``: ``per-step`` (the default) or ``deferred``, on either backend. What
deferring buys is the weight-gradient kernel's efficiency over L times the rows per launch;
what it costs is gathering the steps' operands (copies of their rows and the merged
routing). The model of the GPU step prices the cost but not the efficiency, and puts the
break-even at about 2.4 times today's fitted efficiency of that kernel
(docs/gpu-step.md); ``benchmarks/moe_gpu.py`` measures both forms on a GPU.
"""
import itertools
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .routing import Routing, make_routing, slot_order

MODES = ("per-step", "deferred")

#: a tag per ``ExpertLinear``: its bucket's key (``Bucket.current``)
_tags = itertools.count()


def new_tag() -> int:
    return next(_tags)


class StepRole:
    """The recurrence step whose block is running (1..L), set by ``RecurrenceStep`` around
    its block call (1 for every step of ``--tlb-unshared``, whose blocks run once each);
    None outside a recurrence (a layer called on its own: per step)."""

    step: Optional[int] = None


ROLE = StepRole()


def mode() -> str:
    choice = os.environ.get("SUT_WEIGHT_GRADS", "per-step")
    if choice not in MODES:
        raise ValueError(f"SUT_WEIGHT_GRADS={choice!r} is not one of {MODES}")
    return choice


def defer_code(tag: int, weight: Tensor) -> int:
    """The ``defer`` argument of ``sut::routed_linear`` for the parameter ``tag`` at the
    running step: -1 (its own weight gradient, summed by autograd), else 2·tag + (1 at
    step 1, which returns the bucket's gradient)."""
    if tag < 0 or ROLE.step is None or not (weight.requires_grad and torch.is_grad_enabled()):
        return -1
    return 2 * tag + int(ROLE.step == 1)


@dataclass
class Entry:
    """One step's operands of the weight gradient, in ``routed_linear``'s layouts: grad,
    the output's gradient (sorted rows with ``grouped_out``, slot rows (M, out), or token
    rows (N, out) read by the k slots); x (token rows read by ``fan_out`` slots, slot rows,
    or sorted rows with ``grouped_in``); gates (N, k) or None; the step's expert choice
    (N, k) and sorted_scattered_idxs (M,) (its ``Routing``'s)."""

    grad: Tensor
    x: Tensor
    gates: Optional[Tensor]
    expert_idxs: Tensor
    sorted_scattered_idxs: Tensor
    fan_out: int
    grouped_in: bool
    grouped_out: bool

    def nbytes(self) -> int:
        """The output gradient's bytes; 0 while a graph is traced (symbolic sizes)."""
        n = self.grad.numel()
        return n * self.grad.element_size() if isinstance(n, int) else 0


class Bucket(list):
    """One parameter's gradient across its steps since its step-1 forward: ``deferred``,
    the steps' entries (a list of ``Entry``); per step, ``running``, the sum (dW, db or
    None) of the steps whose backward ran, None before the first."""

    #: the open bucket of each tag: step 1's forward opens one, steps 2..L join it, step 1's
    #: backward closes it (a later forward's step l > 1 then makes its own gradient)
    current: Dict[int, "Bucket"] = {}

    def __init__(self, tag: int, deferred: bool):
        super().__init__()
        self.tag, self.deferred = tag, deferred
        self.running: Optional[Tuple[Tensor, Optional[Tensor]]] = None

    def close(self) -> None:
        """Step 1's backward: no later call joins this bucket."""
        if Bucket.current.get(self.tag) is self:
            del Bucket.current[self.tag]


class Stats:
    """Bytes of output gradients held by buckets at once, at most (``reset`` to start)."""

    held = peak = 0

    @classmethod
    def reset(cls) -> None:
        cls.held = cls.peak = 0


def attach(defer: int) -> Tuple[Optional[Bucket], bool]:
    """At a forward's ``setup_context``: (the bucket this call's backward adds to, whether it
    flushes it) for ``defer`` (``defer_code``); (None, False) for -1, and for a later step
    with no open bucket (its own weight gradient, as per step)."""
    if defer < 0:
        return None, False
    tag, first = divmod(defer, 2)
    if first:
        Bucket.current[tag] = Bucket(tag, mode() == "deferred")
    bucket = Bucket.current.get(tag)
    return bucket, bool(first) and bucket is not None


def running_sum(bucket: Bucket, dw: Tensor, db: Optional[Tensor], flushes: bool
                ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Per step: a step's (dW, db), which include the bucket's running sum, become the
    running sum; step 1 (``flushes``) returns them as the parameter's gradient and empties
    the bucket, the other steps return (None, None)."""
    bucket.running = None if flushes else (dw, db)
    if flushes:
        bucket.close()
    return (dw, db) if flushes else (None, None)


def add(bucket: Bucket, entry: Entry) -> None:
    bucket.append(entry)
    Stats.held += entry.nbytes()
    Stats.peak = max(Stats.peak, Stats.held)


class MergedRouting:
    """The last merged routing and the step tensors it was merged from: two parameters that
    share a routing (MoE-FFD's up and down, MoMHA's query and output) flush one after the
    other and merge it once. The cached tensors stay alive, so an id cannot be reused."""

    last: Tuple[tuple, List[Tensor], Optional[Routing]] = ((), [], None)


def merged_routing(entries: List[Entry], num_experts: int) -> Routing:
    """The routing of the steps' tokens concatenated: step l's slot s is slot l·M + s (its
    token l·N + s // k), expert e's rows step 1's, then step 2's, ... (``make_routing`` of
    the concatenated choices; gates None: they travel apart, ``combined``)."""
    key = tuple(id(e.expert_idxs) for e in entries)
    if MergedRouting.last[0] == key:
        return MergedRouting.last[2]
    shape = entries[0].expert_idxs.shape
    if any(e.expert_idxs.shape != shape for e in entries):
        raise RuntimeError(f"deferred weight gradient: the steps routed different token "
                           f"counts {[tuple(e.expert_idxs.shape) for e in entries]}; the steps "
                           "of a recurrence route the same")
    routing = make_routing(torch.cat([e.expert_idxs for e in entries]), None, num_experts)
    MergedRouting.last = (key, [e.expert_idxs for e in entries], routing)
    return routing


def combined(entries: List[Entry]):
    """The steps' operands as one call's: (grad, x, gates, fan_out) over the L·N tokens,
    step l's slot s the slot l·M + s; grouped rows in slot order."""
    first = entries[0]
    if any((e.fan_out, e.grouped_in, e.grouped_out) != (first.fan_out, first.grouped_in,
                                                        first.grouped_out) for e in entries):
        raise RuntimeError("deferred weight gradient: the steps of one parameter used "
                           "different row layouts")
    grad = torch.cat([slot_order(e.grad, e.sorted_scattered_idxs) if e.grouped_out else e.grad
                      for e in entries])
    x = torch.cat([slot_order(e.x, e.sorted_scattered_idxs) if e.grouped_in else e.x
                   for e in entries])
    gates = None if first.gates is None else torch.cat([e.gates for e in entries])
    return grad, x, gates, 1 if first.grouped_in else first.fan_out


def flush(bucket: Bucket, weight: Tensor, bias: Optional[Tensor], backend: str,
          need_b: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """dW (E, in, out) and db (E, out) or None over every entry of ``bucket``, in one
    ``sut::routed_linear_backward``; empties the bucket."""
    grad, x, gates, fan_out = combined(bucket)
    routing = merged_routing(bucket, weight.size(0))
    _, dw, db, _ = torch.ops.sut.routed_linear_backward(
        grad, x, weight, bias, gates, routing.expert_idxs, routing.sorted_expert_idxs,
        routing.sorted_scattered_idxs, routing.expert_offsets, fan_out, False, False, backend,
        False, True, need_b, False)
    Stats.held -= sum(e.nbytes() for e in bucket)
    bucket.clear()
    bucket.close()
    return dw, (db if need_b and bias is not None else None)
