"""MACs of a model, counting only the work that ran: ptflops with custom hooks for the
expert layers (docs/model.md#counting-macs).

    python -m sut_fairseq.analysis.macs --arch sut_base [ARCH ...|all] [--src-len 32] [--tgt-len 32]
        [--dict-size 32768] [--mode static|dynamic|both] [--threshold 0.8]
    python -m sut_fairseq.analysis.macs --path CKPT --data DATA_BIN [--gen-subset test]
        [--threshold 0.8] [--max-sentences N]

**Convention.** The MACs of a (source length S, target length T) pair are those of one
encoder pass over the S source positions plus one teacher-forced decoder pass over the T
target positions (all T positions at once, as in training), batch of 1, including the
output projection to the vocabulary. Embedding look-ups and sinusoidal positions cost 0.

* ``static`` (paper Table 1): every real position runs every one of the L steps; the
  model's halting threshold is set to +inf for the count, so nothing halts.
* ``dynamic``: only what ran at the chosen threshold — the hooks read, per call, how many
  rows each module processed (``Routing.expert_offsets[-1]`` = the expert rows of the
  positions still running; halted and padding positions go to the no-op expert).

What is counted (ptflops' conventions: a linear map costs in·out + out (bias) per row, a
LayerNorm 1 per element, activations, dropout and residual adds 0):

* MoE-FFD: per routed row (k per running position) both expert projections with biases,
  plus d for the gate-weighted sum of the k outputs;
* MoMHA: per routed row the expert's query (with bias) and output projections, d for the
  gate-weighted sum, and per running position d for the shared output bias; per routed
  row and head the attention itself, S·D (logits) + S (softmax) + S·D (weighted sum) over
  all S keys (the causal mask does not shorten it), and the relative term (clipped:
  O·D for the O offsets the implementation materialises, O <= 2W+1; T5: S bias adds);
  the shared K/V projections for the rows actually projected (self-attention: every
  position at step 1, afterwards only the rows whose halted state S changed;
  cross-attention: the encoder output once per forward);
* routers: per running position the router MLP (d·h + h + h·E);
* halting unit: per position it reads (running positions only), d_in·d + d + d + 1;
* early-exit off-ramps (``--decoder-halting pabee|entropy``): V·d per running position per
  step l < L for o_l = W_out LN_l(h_l) (the tied projection, no bias), while exits are on;
  their LayerNorms as all LayerNorms below. A static count turns exits off, and a model
  whose rule never exits (P = 0 or S = 0) evaluates no off-ramp;
* hyper-modules (``--hyper-modules``, docs/hyper_ut.md), per call of a component
  d_in -> d_out with M modules, embeddings d_e, keys d_k, over rows of width d, in the
  basis of r = min(M, d_e) matrices the layer uses: with M < d_e the M module matrices,
  composed once per call, M·d_e·d_out·d_in (category ``hyper``), and coefficients s;
  otherwise the d_e generator matrices and coefficients e = s V. The router per example
  embedding z (LN d + W_r d·d_k + logits M·d_k, + mixture M·d_e for the generator basis,
  category ``router``); per example (encoder: one z per sentence and step) the composition
  r·d_out·d_in + d_out·d_in (``hyper``) and per token x Wᵀ + b, d_in·d_out + d_out (under
  the component's category: ``att_proj`` for q and out, ``kv`` for k and v, ``ffd`` for the
  FFN maps); per token (decoder: one z per token and step) the r-fold projection
  d_in·r·d_out and the contraction r·d_out (``hyper``), plus g x + b, d_in·d_out + d_out
  (component's category). Every row runs (halted and padding
  rows too, their outputs discarded), so dynamic counts count them all. The hyper
  self-attention's core as MoMHA's with k = 1 over all its query rows;
* chunk-wise recurrence (``--encoder-chunk-size`` / ``--decoder-chunk-size``,
  docs/chunked.md), category ``memory``: the chunk's self-attention is MoMHA's above over
  the w <= g keys of its chunk; the memory read (in every step, on every row of the chunk,
  halted and padding rows included, as it runs) LN_q and the query projection
  d·H·D + H·D per row, per head k·D + k + k·D over the k slots, the output projection
  H·D·d + d per row; its keys and values once per chunk, LN_m k·d and 2·k·(d·H·D + H·D);
  the memory update after a chunk, per write block, the same attention with the k slots as
  queries over the chunk's w rows (LN_s w·d, K/V 2·w·(d·H·D + H·D), per head w·D + w + w·D
  per slot) and its FFN (LN k·d, 2·k·(d·d + d)). LN_out of the memory the decoder reads
  is an ordinary LayerNorm (``other``);
* everything else (dense nn.Linear layers such as the vanilla Transformer's FFN and the
  output projection, LayerNorms) by ptflops' own hooks, on the rows they ran on.
* fairseq's ``MultiheadAttention`` (the vanilla Transformer) gets a hook with the same
  attention conventions: q, k, v and out projections plus S·Dh + S + S·Dh per query and head.

Dynamic counts exclude the attention logits of halted query rows although the current
``scaled_dot_product_attention`` call computes them (it runs over all rows of the batch;
their output is discarded); LayerNorms and the output projection are counted on all rows,
as they run.
"""
import argparse
import contextlib
import io
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
import torch.nn as nn

PRESETS = ["sut_base", "sut_big", "ut_base", "ut_big", "ut_cfq", "sut_logic", "sut_tiny",
           "ut_cpvr", "hyper_ut_cpvr", "tlb_logic", "gutlb_logic", "tlb_flipflop",
           "gutlb_flipflop", "transformer_wmt_en_de", "sut_multi30k", "ut_multi30k",
           "transformer_multi30k"]
BASELINE = "transformer_wmt_en_de"
# paper Table 1 (WMT'14 En-De), MACs in millions; the ratios are what we compare
PAPER_MACS = {"transformer_wmt_en_de": 604, "sut_base": 787, "sut_big": 787, "ut_base": 1998,
              "ut_big": 3707}
# the paper's model each smaller preset scales down (its ratio is the one to compare with)
PAPER_ANALOGUE = {"sut_multi30k": "sut_base", "ut_multi30k": "ut_base",
                  "transformer_multi30k": "transformer_wmt_en_de"}
CATEGORIES = ("ffd", "att_proj", "kv", "att_core", "router", "halting", "offramp")
# counted only for models with hyper-modules (their parts gain this key)
HYPER_CATEGORY = "hyper"
# counted only for models with a chunk memory (chunk-wise recurrence)
MEMORY_CATEGORY = "memory"
CATEGORY_NAMES = {"ffd": "FFD experts", "att_proj": "attention q/o projections",
                  "kv": "attention K/V", "att_core": "attention logits/softmax/sum + relative",
                  "router": "routers", "halting": "halting unit",
                  "offramp": "early-exit off-ramp projections",
                  "hyper": "hyper-module weight composition (generator / r-fold projection, r = min(M, d_e))",
                  "memory": "chunk memory: read attention, update blocks",
                  "other":
                  "other (dense linear layers, output projection, LayerNorm)"}


@dataclass
class MacsCount:
    """total: MACs of the counted call; parts: category -> MACs (``CATEGORIES``, plus
    ``hyper`` for models with hyper-modules; the remainder is ``other``); steps: side -> (executed (position, step) pairs, L × real
    positions) for SUT models."""

    total: int
    parts: Dict[str, int] = field(default_factory=dict)
    steps: Dict[str, Tuple[int, int]] = field(default_factory=dict)

    @property
    def other(self) -> int:
        return self.total - sum(self.parts.values())

    def __add__(self, other: "MacsCount") -> "MacsCount":
        parts = {c: self.parts.get(c, 0) + other.parts.get(c, 0) for c in set(self.parts) | set(other.parts)}
        steps = {s: tuple(a + b for a, b in zip(self.steps.get(s, (0, 0)), other.steps.get(s, (0, 0))))
                 for s in set(self.steps) | set(other.steps)}
        return MacsCount(self.total + other.total, parts, steps)


# ---------------------------------------------------------------------------------------
# hooks (ptflops custom_modules_hooks: ``hook(module, inputs, output)`` adds to
# ``module.__flops__``; a module with a hook is a leaf for ptflops' accumulation)

_TALLY: Optional[Dict[str, int]] = None  # per-category tallies of the count in progress


def _add(module: nn.Module, category: str, macs: int) -> None:
    module.__flops__ += int(macs)
    if _TALLY is not None:
        _TALLY[category] += int(macs)


def _fold(parent: nn.Module, child: Optional[nn.Module], category: Optional[str] = None) -> None:
    """Add what ptflops counted on ``child`` since the last fold to ``parent``.

    For sub-modules a hooked module owns but that run outside its ``forward`` (MoMHA's
    K/V projections, the halting unit's input LayerNorm) or whose count its hook reuses
    (the router): ptflops does not descend below a hooked module."""
    if child is None or not hasattr(child, "__flops__"):
        return
    delta = child.__flops__ - getattr(child, "_sut_macs_folded", 0)
    child._sut_macs_folded = child.__flops__
    if delta:
        parent.__flops__ += delta
        if category is not None and _TALLY is not None:
            _TALLY[category] += delta


def _linear_macs(rows: int, in_dim: int, out_dim: int, bias: bool) -> int:
    return rows * (in_dim * out_dim + (out_dim if bias else 0))


def router_hook(router, inputs, routing) -> None:
    """Router: its MLP on the running rows; keeps the Routing for the parent's hook."""
    router._sut_routing = routing
    if router.num_experts > 1:
        rows = int(routing.expert_offsets[-1]) // routing.k
        fc1, fc2 = router.fc1, router.fc2
        _add(router, "router", _linear_macs(rows, fc1.in_features, fc1.out_features, True)
             + _linear_macs(rows, fc2.in_features, fc2.out_features, fc2.bias is not None))


def _expert_slots(module, active: torch.Tensor) -> Tuple[int, int]:
    """(slots the experts processed, k) of a MoE-FFD or MoMHA call: its router's routing,
    or with one expert (no router call) its active rows."""
    if module.router.num_experts == 1:
        return int(active.sum()), 1
    routing = module.router._sut_routing
    return int(routing.expert_offsets[-1]), routing.k


def moe_ffd_hook(module, inputs, output) -> None:
    """MoE-FFD: only the k selected experts of each running position."""
    slots, _ = _expert_slots(module, inputs[1])  # rows the experts processed
    _, d, D = module.up.weight.shape
    _add(module, "ffd", slots * (d * D + D + D * d + d) + slots * d)
    _fold(module, module.router)


def _relative_offsets(window: int, T: int, q_start: int, S: int) -> int:
    """How many offsets ``ClippedRelativePosition`` materialises (its lo..hi range)."""
    lo = max(-window, min(window, 0 - (q_start + T - 1)))
    hi = max(-window, min(window, (S - 1) - q_start))
    return hi - lo + 1


def momha_hook(module, inputs, output) -> None:
    """MoMHA: the k selected query/output experts, the attention of their rows, the
    relative term, the shared K/V projections and the router."""
    from ..modules.relative_position import ClippedRelativePosition, T5RelativeBias

    query, key = inputs[0], inputs[1]
    q_start = int(inputs[5]) if len(inputs) > 5 else 0
    B, T, d = query.shape
    H, S, D = key.size(1), key.size(2), key.size(3)
    inner = H * D
    slots, k = _expert_slots(module, inputs[3])
    positions = slots // k
    _add(module, "att_proj", _linear_macs(slots, d, inner, True) + _linear_macs(slots, inner, d, False)
         + slots * d + positions * d)
    core = slots * H * (S * D + S + S * D)
    if isinstance(module.relative, ClippedRelativePosition):
        core += slots * H * _relative_offsets(module.relative.window, T, q_start, S) * D
    elif isinstance(module.relative, T5RelativeBias):
        core += slots * H * S
    _add(module, "att_core", core)
    _fold(module, module.router)
    _fold(module, module.k_proj, "kv")
    _fold(module, module.v_proj, "kv")


def halting_unit_hook(module, inputs, output) -> None:
    """Halting unit: its MLP on the rows it computed (the running positions, ``rows``)."""
    x = inputs[0]
    rows = int(inputs[1].sum()) if len(inputs) > 1 and inputs[1] is not None else x.numel() // x.size(-1)
    fc1, fc2 = module.fc1, module.fc2
    _add(module, "halting", _linear_macs(rows, fc1.in_features, fc1.out_features, True)
         + _linear_macs(rows, fc2.in_features, fc2.out_features, True))
    _fold(module, module.norm, "halting")


def masked_affine_hook(module, inputs, output) -> None:
    """The carried keys/values' projection (``MaskedAffine``): the rows it computed, all at
    step 1, then those whose state changed."""
    x, weight, bias = inputs[:3]
    mask = inputs[3] if len(inputs) > 3 else None
    rows = int(mask.sum()) if mask is not None else x.numel() // x.size(-1)
    out_dim, in_dim = weight.shape
    _add(module, "kv", _linear_macs(rows, in_dim, out_dim, bias is not None))


def offramp_hook(module, inputs, output) -> None:
    """Early-exit off-ramp projection o = x W_outᵀ: V·d per row it ran on (the running
    positions of one step)."""
    x, weight = inputs[0], inputs[1]
    _add(module, "offramp", (x.numel() // x.size(-1)) * weight.numel())


def hyper_router_macs(layer, rows: int, mixture: bool = True) -> int:
    """Router of a HyperLinear on ``rows`` example embeddings: LN + W_r + logits, and the
    mixture e = s V unless the layer contracts with s itself (``mixture=False``)."""
    router = layer.router
    ctx, d_k = router.query.in_features, router.query.out_features
    M, d_e = layer.num_modules, layer.embed_dim
    return rows * (ctx + ctx * d_k + M * d_k + (M * d_e if mixture else 0))


def hyper_linear_macs(layer, x_shape, z_shape) -> Dict[str, int]:
    """MACs of one HyperLinear call, by category (see the module docstring)."""
    d_in, d_out, d_e, M = layer.in_dim, layer.out_dim, layer.embed_dim, layer.num_modules
    rows = math.prod(x_shape[:-1])
    contexts = math.prod(z_shape[:-1])
    modules = layer.basis == "modules"  # W^(m) = G V_m composed once, coefficients s (no e)
    r = M if modules else d_e
    out = {"router": hyper_router_macs(layer, contexts, mixture=not modules),
           "hyper": M * d_e * d_out * d_in if modules else 0}
    if len(z_shape) == len(x_shape) - 1:  # per example: compose (B, d_out, d_in), then x Wᵀ + b
        out["hyper"] += contexts * (r * d_out * d_in + d_out * d_in)
    else:  # per token: x [B_1 .. B_r], contraction with the coefficients; then g x + b
        out["hyper"] += rows * (d_in * r * d_out + r * d_out)
    out[layer.category] = out.get(layer.category, 0) + rows * (d_in * d_out + d_out)
    return out


def hyper_linear_hook(module, inputs, output) -> None:
    """HyperLinear: router, weight composition and the projection itself."""
    for category, macs in hyper_linear_macs(module, inputs[0].shape, inputs[1].shape).items():
        _add(module, category, macs)


def hyper_attention_hook(module, inputs, output) -> None:
    """Hyper self-attention: the attention core over every query row (its projections
    are counted by their own hooks, HyperLinear's or ptflops' for dense ones)."""
    query, key = inputs[0], inputs[1]
    B, T, _ = query.shape
    H, S, D = key.size(1), key.size(2), key.size(3)
    _add(module, "att_core", B * T * H * (S * D + S + S * D))
    _fold_hyper_attention(module)


def _fold_hyper_attention(module) -> None:
    from ..modules.hyper_module import HyperLinear

    for child, category in ((module.q_proj, "att_proj"), (module.out_proj, "att_proj"),
                            (module.k_proj, "kv"), (module.v_proj, "kv")):
        _fold(module, child, None if isinstance(child, HyperLinear) else category)


def hyper_ffd_hook(module, inputs, output) -> None:
    """Hyper FFN: its two maps (counted by their own hooks)."""
    _fold_hyper_ffd(module)


def _fold_hyper_ffd(module) -> None:
    from ..modules.hyper_module import HyperLinear

    for child in (module.fc1, module.fc2):
        _fold(module, child, None if isinstance(child, HyperLinear) else "ffd")


_MEMORY_ATTENTION_CHILDREN = ("q_norm", "q_proj", "out_proj", "kv_norm", "k_proj", "v_proj")


def memory_attention_hook(module, inputs, output) -> None:
    """Chunk memory attention (read or write): per query row and head S·D + S + S·D over
    the S keys; its LayerNorms and projections (keys/values projected in ``project_kv``,
    outside forward) folded in."""
    query, key = inputs[0], inputs[1]
    rows = query.numel() // query.size(-1)
    H, S, D = key.size(1), key.size(2), key.size(3)
    _add(module, MEMORY_CATEGORY, rows * H * (S * D + S + S * D))
    _fold_children(module, _MEMORY_ATTENTION_CHILDREN, MEMORY_CATEGORY)


def memory_ffn_hook(module, inputs, output) -> None:
    """Memory update FFN: its LayerNorm and two d x d maps (counted by ptflops' hooks)."""
    _fold_children(module, ("norm", "fc1", "fc2"), MEMORY_CATEGORY)


def _fold_children(module, names, category) -> None:
    for name in names:
        _fold(module, getattr(module, name), category)


def _capture_call(module, args, kwargs) -> None:
    module._sut_call = (args, kwargs)


def fairseq_mha_hook(module, inputs, output) -> None:
    """fairseq's MultiheadAttention (time-first (T, B, C) inputs, called with keywords)."""
    args, kwargs = module._sut_call
    names = ("query", "key", "value")
    given = {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(names)}
    query, key = given["query"], given["key"]
    T, B = query.shape[0], query.shape[1]
    S = T if key is None else key.shape[0]
    proj = (_linear_macs(T, module.q_proj.in_features, module.q_proj.out_features, module.q_proj.bias is not None)
            + _linear_macs(S, module.k_proj.in_features, module.k_proj.out_features, module.k_proj.bias is not None)
            + _linear_macs(S, module.v_proj.in_features, module.v_proj.out_features, module.v_proj.bias is not None))
    out = _linear_macs(T, module.out_proj.in_features, module.out_proj.out_features,
                       module.out_proj.bias is not None)
    H, Dh = module.num_heads, module.head_dim
    _add(module, "kv", B * (proj - _linear_macs(T, module.q_proj.in_features, module.q_proj.out_features,
                                                 module.q_proj.bias is not None)))
    _add(module, "att_proj", B * (out + _linear_macs(T, module.q_proj.in_features,
                                                     module.q_proj.out_features, module.q_proj.bias is not None)))
    _add(module, "att_core", B * H * T * (S * Dh + S + S * Dh))


def rnn_hook(module, inputs, output) -> None:
    """nn.RNN/GRU/LSTM: ptflops' own hook, also for a PackedSequence input (fairseq's LSTM
    encoder), whose rows are the Σ lengths time steps actually run."""
    from ptflops.pytorch_ops import rnn_flops_counter_hook

    x = inputs[0]
    if isinstance(x, nn.utils.rnn.PackedSequence):
        x = x.data.unsqueeze(1)  # (Σ lengths, 1, features): batch × length = rows run
    rnn_flops_counter_hook(module, (x,) + tuple(inputs[1:]), output)


def custom_hooks(model: nn.Module) -> Dict[type, Callable]:
    """ptflops ``custom_modules_hooks`` for every hooked module type found in ``model``."""
    from fairseq.modules.multihead_attention import MultiheadAttention

    from ..modules.exits import OffRampProjection
    from ..modules.halting import HaltingUnit
    from ..modules.hyper_block import HyperFeedForward, HyperSelfAttention
    from ..modules.hyper_module import HyperLinear
    from ..modules.memory import MemoryAttention, MemoryFeedForward
    from ..modules.moe_ffd import MoEFeedForward
    from ..modules.momha import MixtureOfMultiHeadAttention
    from ..modules.router import Router
    from ..ops.masked_linear_op import MaskedAffine

    known = {Router: router_hook, MoEFeedForward: moe_ffd_hook,
             MixtureOfMultiHeadAttention: momha_hook, HaltingUnit: halting_unit_hook,
             OffRampProjection: offramp_hook, HyperLinear: hyper_linear_hook,
             HyperSelfAttention: hyper_attention_hook, HyperFeedForward: hyper_ffd_hook,
             MemoryAttention: memory_attention_hook, MemoryFeedForward: memory_ffn_hook,
             MaskedAffine: masked_affine_hook}
    hooks = {}
    for m in model.modules():
        for cls, hook in known.items():
            if isinstance(m, cls):
                hooks[type(m)] = hook
        if isinstance(m, MultiheadAttention):
            hooks[type(m)] = fairseq_mha_hook
        elif type(m) in (nn.RNN, nn.GRU, nn.LSTM):
            hooks[type(m)] = rnn_hook
    return hooks


# ---------------------------------------------------------------------------------------
# counting

CUSTOM_TYPES_IN_USE: Dict[type, Callable] = {}  # the hooks of the count in progress


class _Once(nn.Module):
    """ptflops' root: runs ``fn`` once (batch counter 1, so the total is not divided),
    then folds what ran outside the hooked modules' forwards."""

    def __init__(self, model: nn.Module, fn: Callable[[], object]):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, _batch):
        out = self.fn()
        hooks = CUSTOM_TYPES_IN_USE
        for m in self.model.modules():
            if type(m) in hooks and hooks[type(m)] is momha_hook:
                _fold(m, m.router)
                _fold(m, m.k_proj, "kv")
                _fold(m, m.v_proj, "kv")
            elif type(m) in hooks and hooks[type(m)] is moe_ffd_hook:
                _fold(m, m.router)
            elif type(m) in hooks and hooks[type(m)] is halting_unit_hook:
                _fold(m, m.norm, "halting")
            elif type(m) in hooks and hooks[type(m)] is hyper_attention_hook:
                _fold_hyper_attention(m)  # K/V projections run outside its forward
            elif type(m) in hooks and hooks[type(m)] is hyper_ffd_hook:
                _fold_hyper_ffd(m)
            elif type(m) in hooks and hooks[type(m)] is memory_attention_hook:
                _fold_children(m, _MEMORY_ATTENTION_CHILDREN, MEMORY_CATEGORY)
            elif type(m) in hooks and hooks[type(m)] is memory_ffn_hook:
                _fold_children(m, ("norm", "fc1", "fc2"), MEMORY_CATEGORY)
        return out


def count_call(model: nn.Module, fn: Callable[[], object]) -> MacsCount:
    """MACs of ``fn()`` (which runs ``model`` or a sub-module of it) with ptflops and the
    custom hooks. Returns the total and the per-category parts."""
    global _TALLY, CUSTOM_TYPES_IN_USE
    from fairseq.modules.multihead_attention import MultiheadAttention
    from ptflops import get_model_complexity_info

    hooks = custom_hooks(model)
    handles = [m.register_forward_pre_hook(_capture_call, with_kwargs=True)
               for m in model.modules() if isinstance(m, MultiheadAttention)]
    for m in model.modules():
        for attr in ("_sut_macs_folded", "_sut_routing", "_sut_call"):
            if attr in m.__dict__:
                delattr(m, attr)
    was_training = model.training
    _TALLY, CUSTOM_TYPES_IN_USE = defaultdict(int), hooks
    log = io.StringIO()
    try:
        with torch.no_grad(), contextlib.redirect_stdout(log):
            total, _ = get_model_complexity_info(
                _Once(model, fn), (1,), input_constructor=lambda _res: [None],
                print_per_layer_stat=False, as_strings=False, ost=log, verbose=False,
                custom_modules_hooks=hooks, backend="pytorch",
                backend_specific_config={"count_functional": False})
        parts = {c: _TALLY.get(c, 0) for c in CATEGORIES}
        if hyper_linear_hook in hooks.values():
            parts[HYPER_CATEGORY] = _TALLY.get(HYPER_CATEGORY, 0)
        if memory_attention_hook in hooks.values():
            parts[MEMORY_CATEGORY] = _TALLY.get(MEMORY_CATEGORY, 0)
    finally:
        _TALLY, CUSTOM_TYPES_IN_USE = None, {}
        for h in handles:
            h.remove()
        for m in model.modules():
            for attr in ("_sut_macs_folded", "_sut_routing", "_sut_call"):
                if attr in m.__dict__:
                    delattr(m, attr)
        model.train(was_training)
    if total is None:
        raise RuntimeError("ptflops could not count this model:\n" + log.getvalue()[-3000:])
    return MacsCount(int(total), parts)


def is_sut(model: nn.Module) -> bool:
    return hasattr(getattr(model, "encoder", None), "side")


@contextlib.contextmanager
def halting_threshold(model: nn.Module, threshold: Optional[float]):
    """Temporarily set α_thresh of both sides; ``math.inf`` = never halt (static count:
    early exits off too); None = leave it."""
    sides = [s.halting for s in (model.encoder.side, model.decoder.side)] if is_sut(model) else []
    saved = [getattr(h, "threshold", None) for h in sides]
    saved_exits = [getattr(h, "exits_enabled", None) for h in sides]
    try:
        for h in sides:
            if threshold is not None and getattr(h, "threshold", None) is not None:
                h.threshold = threshold
            if threshold == math.inf and getattr(h, "exits_enabled", None) is not None:
                h.exits_enabled = False
        yield
    finally:
        for h, t, e in zip(sides, saved, saved_exits):
            if t is not None:
                h.threshold = t
            if e is not None:
                h.exits_enabled = e


def count_forward(model: nn.Module, net_input: Dict[str, torch.Tensor], mode: str = "static",
                  threshold: Optional[float] = None) -> MacsCount:
    """MACs of one teacher-forced forward ``model(**net_input)`` (an encoder pass plus a
    decoder pass over all target positions).

    mode ``static``: no position halts (threshold +inf); ``dynamic``: at ``threshold``
    (None = the model's own). For SUT models ``steps`` holds the executed (position, step)
    pairs per side."""
    if mode not in ("static", "dynamic"):
        raise ValueError(f"mode must be 'static' or 'dynamic'; got {mode!r}")
    if mode == "dynamic" and threshold is not None:
        from ..modules.halting import check_threshold

        check_threshold(threshold)
    model.eval()
    halting = {}

    def run():
        out = model(**net_input)
        extra = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if isinstance(extra, dict):
            for side, key in (("encoder", "halting_encoder"), ("decoder", "halting_decoder")):
                if extra.get(key) is not None:
                    h = extra[key]
                    halting[side] = (int(h.steps.sum()), int(h.real.sum()) * h.max_steps)
        return out

    with halting_threshold(model, math.inf if mode == "static" else threshold):
        result = count_call(model, run)
    result.steps = halting
    return result


def random_net_input(model: nn.Module, src_len: int, tgt_len: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Batch of 1: ``src_len`` source tokens (random symbols + eos) and ``tgt_len`` decoder
    input tokens (eos + random symbols), from the model's dictionaries."""
    if src_len < 1 or tgt_len < 1:
        raise ValueError("source and target lengths must be >= 1")
    g = torch.Generator().manual_seed(seed)
    src_dict, tgt_dict = model.encoder.dictionary, model.decoder.dictionary

    def symbols(d, n):
        return torch.randint(d.nspecial, len(d), (n,), generator=g)

    device = next(model.parameters()).device
    src = torch.cat([symbols(src_dict, src_len - 1), torch.tensor([src_dict.eos()])]).unsqueeze(0)
    prev = torch.cat([torch.tensor([tgt_dict.eos()]), symbols(tgt_dict, tgt_len - 1)]).unsqueeze(0)
    return {"src_tokens": src.to(device), "src_lengths": torch.tensor([src_len], device=device),
            "prev_output_tokens": prev.to(device)}


def count_arch(arch: str, src_len: int = 32, tgt_len: int = 32, dict_size: int = 32768,
               modes: Iterable[str] = ("static",), threshold: Optional[float] = None,
               seed: int = 0, **overrides) -> Dict[str, MacsCount]:
    """MACs of a registered architecture (``models.standalone.build_model``, joined dictionary,
    all embeddings shared) for one random (src_len, tgt_len) pair; mode -> count."""
    from ..models.standalone import build_model, model_args

    torch.manual_seed(seed)
    share = {"share_all_embeddings": True}
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            model_args(arch, **share, **overrides)
    except SystemExit:  # an architecture without --share-all-embeddings (e.g. fconv)
        share = {}
    model = build_model(arch, dict_size=dict_size, **share, **overrides).eval()
    net_input = random_net_input(model, src_len, tgt_len, seed)
    return {mode: count_forward(model, net_input, mode, threshold) for mode in modes}


def count_dataset(model, task, subset: str, threshold: Optional[float] = None,
                  max_sentences: Optional[int] = None, static: bool = True) -> Dict[str, object]:
    """Dynamic (and static) MACs of every sentence pair of ``subset``, one pair at a time
    (batch of 1, so no padding is counted). Returns sums and the sentence count."""
    itr = task.get_batch_iterator(dataset=task.dataset(subset), max_sentences=1,
                                  required_batch_size_multiple=1, seed=1,
                                  ignore_invalid_inputs=False).next_epoch_itr(shuffle=False)
    sums = {"dynamic": MacsCount(0), "static": MacsCount(0)}
    n = 0
    for sample in itr:
        if not sample:
            continue
        net_input = sample["net_input"]
        net_input = {k: net_input[k] for k in ("src_tokens", "src_lengths", "prev_output_tokens")}
        sums["dynamic"] = sums["dynamic"] + count_forward(model, net_input, "dynamic", threshold)
        if static:
            sums["static"] = sums["static"] + count_forward(model, net_input, "static")
        n += 1
        if max_sentences is not None and n >= max_sentences:
            break
    return {"sentences": n, **sums}


# ---------------------------------------------------------------------------------------
# command line

def fmt(macs: float) -> str:
    """787.3M / 2.31M / 1.97G / 53.1K: three significant figures at least."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(macs) >= scale:
            value = macs / scale
            return f"{value:.{2 if abs(value) < 10 or unit == 'G' else 1}f}{unit}"
    return f"{macs:.0f}"


def paper_pair(arch: str, baseline: str) -> Optional[Tuple[int, int]]:
    """(paper MACs of ``arch``, of ``baseline``) in millions, through the paper model each
    scales down (:data:`PAPER_ANALOGUE`); None when the paper has no such pair."""
    a, b = PAPER_ANALOGUE.get(arch, arch), PAPER_ANALOGUE.get(baseline, baseline)
    return (PAPER_MACS[a], PAPER_MACS[b]) if a in PAPER_MACS and b in PAPER_MACS else None


def _arch_main(args) -> Dict:
    archs = PRESETS if args.arch == ["all"] else args.arch
    modes = {"static": ["static"], "dynamic": ["dynamic"], "both": ["static", "dynamic"]}[args.mode]
    results: Dict[str, Dict[str, MacsCount]] = {}
    todo = list(archs)
    if args.baseline != "none" and args.baseline not in todo:
        todo.append(args.baseline)
    for arch in todo:
        arch_modes = modes if arch in archs else ["static"]
        results[arch] = count_arch(arch, args.src_len, args.tgt_len, args.dict_size, arch_modes,
                                   args.threshold, args.seed)
        print(f"counted {arch}", file=sys.stderr, flush=True)
    base = results.get(args.baseline, {}).get("static") if args.baseline != "none" else None

    print(f"MACs per (source, target) pair of lengths ({args.src_len}, {args.tgt_len}): one encoder "
          f"pass + one teacher-forced decoder pass, batch 1, joined dictionary of {args.dict_size}")
    header = "| arch | static MACs | excl. routers | routers | halting unit |"
    rule = "|---|---|---|---|---|"
    if "dynamic" in modes:
        header += f" executed MACs (α_thresh {args.threshold or 'default'}) | steps executed enc / dec |"
        rule += "---|---|"
    if base is not None:
        header += f" × {args.baseline} (static) | paper × |"
        rule += "---|---|"
    print(header + "\n" + rule)
    for arch in archs:
        r = results[arch]
        row = f"| {arch} |"
        if "static" in r:
            s = r["static"]
            row += f" {fmt(s.total)} ({s.total:,}) | {s.total - s.parts['router']:,} | " \
                   f"{fmt(s.parts['router'])} | {fmt(s.parts['halting'])} |"
        else:
            row += " – | – | – | – |"
        if "dynamic" in modes:
            dyn = r["dynamic"]
            steps = " / ".join(f"{100 * e / m:.1f}%" for e, m in (dyn.steps.get(side, (0, 0)) for side in ("encoder", "decoder")) if m) or "–"
            row += f" {fmt(dyn.total)} ({dyn.total:,}) | {steps} |"
        if base is not None:
            ratio = f"{r['static'].total / base.total:.2f}" if "static" in r else "–"
            pair = paper_pair(arch, args.baseline)
            paper = f"{pair[0]}/{pair[1]} = {pair[0] / pair[1]:.2f}" if pair else "–"
            row += f" {ratio} | {paper} |"
        print(row)
    if base is not None:
        for arch in archs:
            if "static" not in results[arch] or arch == args.baseline:
                continue
            ratio = results[arch]["static"].total / base.total
            line = f"static MAC ratio {arch} / {args.baseline} = {ratio:.3f}"
            pair = paper_pair(arch, args.baseline)
            if pair:
                paper = pair[0] / pair[1]
                line += (f" (paper {pair[0]}/{pair[1]} = {paper:.3f}; "
                         f"{100 * (ratio / paper - 1):+.1f}%)")
            print(line)
    return {arch: {mode: {"total": c.total, "parts": c.parts, "other": c.other,
                          "steps": {k: list(v) for k, v in c.steps.items()}}
                   for mode, c in r.items()} for arch, r in results.items()}


def _checkpoint_main(args) -> Dict:
    from .halting_analysis import load

    model, task = load(args.data, args.path, args.threshold, args.gen_subset)
    threshold = args.threshold
    if threshold is None and is_sut(model):
        threshold = getattr(model.encoder.side.halting, "threshold", None)
    r = count_dataset(model, task, args.gen_subset, args.threshold, args.max_sentences)
    n = r["sentences"]
    if n == 0:
        raise SystemExit(f"error: no sentence pairs in subset {args.gen_subset!r}")
    dyn, sta = r["dynamic"], r["static"]
    print(f"| {args.path} | subset {args.gen_subset} | {n} sentence pairs (batch 1) | "
          f"α_thresh {threshold}")
    for side in ("encoder", "decoder"):
        if side in dyn.steps and dyn.steps[side][1]:
            e, m = dyn.steps[side]
            print(f"| {side} steps executed {100 * e / m:.1f}% ({e}/{m})")
    print(f"| static MACs per sentence pair (mean): {fmt(sta.total / n)}")
    print(f"| executed / static: {100 * dyn.total / max(1, sta.total):.1f}%")
    print(f"MACs per sentence pair (mean, executed at α_thresh {threshold}): {fmt(dyn.total / n)}")
    return {"checkpoint": args.path, "subset": args.gen_subset, "sentences": n, "threshold": threshold,
            "dynamic_total": dyn.total, "static_total": sta.total, "dynamic_parts": dyn.parts,
            "static_parts": sta.parts, "steps": {k: list(v) for k, v in dyn.steps.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", help="registered architecture(s), or 'all' for the presets")
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--tgt-len", type=int, default=32)
    parser.add_argument("--dict-size", type=int, default=32768, help="joined dictionary size")
    parser.add_argument("--mode", choices=["static", "dynamic", "both"], default="static",
                        help="--arch only: static (all L steps) and/or dynamic (halting at --threshold)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="α_thresh for dynamic counts (default: the model's)")
    parser.add_argument("--baseline", default=BASELINE, help="architecture for the ratios ('none': skip)")
    parser.add_argument("--seed", type=int, default=0, help="random tokens and weights")
    parser.add_argument("--path", help="checkpoint: count on real data (dynamic and static)")
    parser.add_argument("--data", help="fairseq data-bin directory (with --path)")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--max-sentences", type=int, default=None, help="with --path: first N pairs")
    parser.add_argument("--json", default=None, help="also write the counts as JSON")
    args = parser.parse_args(argv)
    if args.path:
        if not args.data:
            parser.error("--path needs --data")
        result = _checkpoint_main(args)
    elif args.arch:
        result = _arch_main(args)
    else:
        parser.error("give --arch ARCH [...] or --path CKPT --data DATA_BIN")
    if args.json:
        from ..data.atomic import write_json_atomic

        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
