"""Configuration checks at model build time, once the preset has filled every option: each
error names the option, the bad value and what is allowed (``--att-topk=5 is invalid: must
satisfy 1 <= k <= --att-experts (4)``), also for combinations that would silently mean
something else. Each exit rule accepts the other's option (``--exit-patience`` /
``--exit-entropy``): the exit sweep switches a checkpoint's rule with ``--model-overrides``.
``--tlb-memory-reset`` in training is refused at the first forward (chunked_recurrence.py).
"""
import numbers

from .config import BASE_DEFAULTS, CHUNK_POSITIONS, REL_POS, SIDES, TLB_ENCODER_OUT
from ..modules.exits import EXIT_RULES
from ..modules.halting import HALTING_RULES
from ..modules.hyper_module import HYPER_COMPONENTS, parse_components
from ..modules.recurrence import HALTING_KV
from ..modules.step_embedding import STEP_EMBEDDINGS

POSITIVE_INTEGERS = ("encoder_embed_dim", "decoder_embed_dim", "encoder_layers", "decoder_layers",
                     "att_experts", "att_heads", "att_head_dim", "ffd_experts", "ffd_hidden_dim",
                     "max_source_positions", "max_target_positions")
PROBABILITIES = ("dropout", "attention_dropout", "activation_dropout", "gating_dropout",
                 "halting_dropout")
TRANSITION_RULES = ("stick-breaking", "global-mean", "none")
POSITIVE = "must be a positive integer"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(ok: bool, option: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{option}={value!r} is invalid: {allowed}")


def _check(args, name: str, ok, allowed: str) -> None:
    """``_require`` on option ``name``'s value, tested by the predicate ``ok``."""
    value = getattr(args, name)
    _require(ok(value), _flag(name), value, allowed)


def _choose(args, name: str, choices: tuple, note: str = "") -> None:
    _check(args, name, lambda value: value in choices, f"choose from {choices}{note}")


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int_in(low: int, high=float("inf")):
    """An integer (not a bool) in [low, high]."""
    return lambda value: (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                          and low <= value <= high)


def _equal(expected):
    return lambda value: value == expected


def validate_args(args) -> None:
    """Raise ``ValueError("--option=value is invalid: what is allowed")`` on the first bad
    option."""
    for name in POSITIVE_INTEGERS:
        _check(args, name, _int_in(1), POSITIVE)
    for kind in ("att", "ffd"):
        experts = getattr(args, f"{kind}_experts")
        _check(args, f"{kind}_topk", _int_in(1, experts),
               f"must satisfy 1 <= k <= --{kind}-experts ({experts})")
    top_k = min(args.att_topk, args.ffd_topk)
    _check(args, "sample_topk", _int_in(0, top_k),
           f"must be between 0 and the smaller top-k ({top_k})")
    _choose(args, "rel_pos", REL_POS)
    _check(args, "rel_window", _int_in(0), "must be an integer >= 0")
    _check(args, "router_hidden_dim", _int_in(0), "must be an integer >= 0 (0 = model width)")
    # `0 < x <= 1` rather than `not (x <= 0 or x > 1)`: also rejects NaN
    _check(args, "halting_threshold", lambda x: _is_real(x) and 0.0 < x <= 1.0,
           "must be in (0, 1]")
    _choose(args, "encoder_halting", HALTING_RULES,
            f" (the exit rules {EXIT_RULES} are for the decoder)")
    _choose(args, "decoder_halting", HALTING_RULES + EXIT_RULES)
    for side in SIDES:
        _choose(args, f"{side}_halting_kv", HALTING_KV)
    _check(args, "exit_patience", _int_in(0), "must be an integer >= 0 (0 = never exit)")
    _check(args, "exit_entropy", lambda x: _is_real(x) and 0.0 <= x < float("inf"),
           "must be a finite number >= 0 (nats; 0 = never exit)")
    _validate_exits(args)
    for side in SIDES:
        _choose(args, f"{side}_step_embedding", STEP_EMBEDDINGS)
    if args.halting_transition:
        for side in SIDES:
            _check(args, f"{side}_halting", lambda rule: rule in TRANSITION_RULES,
                   "--halting-transition needs 'stick-breaking' or 'global-mean' (or 'none')")
    for name in PROBABILITIES:
        _check(args, name, lambda p: _is_real(p) and 0.0 <= p < 1.0, "must be in [0, 1)")
    _validate_hyper(args)
    _validate_chunks(args)
    if args.flex_attention:
        _check(args, "attention_dropout", _equal(0.0),
               "--flex-attention needs 0 (FlexAttention has no dropout)")
        _check(args, "hyper_modules", _equal(0), "--flex-attention needs 0 (the hyper-modules' "
               "self-attention has no FlexAttention form)")
    if args.share_all_embeddings:
        _check(args, "decoder_embed_dim", _equal(args.encoder_embed_dim), "--share-all-embeddings "
               f"needs it equal to --encoder-embed-dim ({args.encoder_embed_dim})")


def _validate_exits(args) -> None:
    """Early exits need a second decoder step; only the exit rules read the exit options."""
    rule = args.decoder_halting
    if rule in EXIT_RULES:
        _require(args.decoder_layers >= 2, "--decoder-halting", rule,
                 f"the exit rules need --decoder-layers >= 2 (got --decoder-layers "
                 f"{args.decoder_layers}: one step leaves nothing to exit before)")
        return
    for name in ("exit_patience", "exit_entropy"):
        default = BASE_DEFAULTS[name]
        _check(args, name, _equal(default),
               f"it is read only by --decoder-halting pabee|entropy, and --decoder-halting "
               f"is {rule!r} (leave {_flag(name)} at its default {default!r})")


def _validate_hyper(args) -> None:
    """The hyper-module options (docs/hyper_ut.md); with ``--hyper-modules M > 0`` the
    block must be dense (E = k = 1) with no relative positions or step embeddings."""
    _check(args, "hyper_modules", _int_in(0), "must be an integer >= 0 (0 = off)")
    _check(args, "hyper_embed_dim", _int_in(1), POSITIVE)
    _check(args, "hyper_key_dim", _int_in(0), "must be an integer >= 0 (0 = the model width)")
    _check(args, "hyper_router_temp", lambda t: _is_real(t) and 0.0 < t < float("inf"),
           "must be a finite number > 0")
    raw = args.hyper_components
    components = parse_components(raw)
    bad = [c for c in components if c not in HYPER_COMPONENTS]
    _require(not bad, "--hyper-components", raw,
             f"unknown component(s) {', '.join(bad)}; choose a comma list from {HYPER_COMPONENTS}")
    m = args.hyper_modules
    if m == 0:
        return
    _require(len(components) > 0, "--hyper-components", raw,
             f"--hyper-modules {m} needs at least one of {HYPER_COMPONENTS}")
    for name in ("att_experts", "att_topk", "ffd_experts", "ffd_topk"):
        _check(args, name, _equal(1), f"--hyper-modules {m} needs dense experts: E = k = 1 "
               "(hyper-modules replace expert routing)")
    _check(args, "rel_pos", _equal("none"), f"--hyper-modules {m} supports only 'none' (the "
           "hyper self-attention has no relative position term)")
    for side in SIDES:
        _check(args, f"{side}_step_embedding", _equal("none"),
               f"--hyper-modules {m} supports only 'none'")


def _validate_chunks(args) -> None:
    """The chunk-wise recurrence options (docs/chunked.md), per side."""
    chunked = []
    for side in SIDES:
        _check(args, f"{side}_chunk_size", _int_in(0), "must be an integer >= 0 (0 = off)")
        _check(args, f"{side}_memory_slots", _int_in(0),
               "must be an integer >= 0 (0 = no memory: the chunks are independent)")
        _check(args, f"{side}_memory_update_layers", _int_in(1), POSITIVE)
        _choose(args, f"{side}_chunk_positions", CHUNK_POSITIONS)
        g = getattr(args, f"{side}_chunk_size")
        if g == 0:
            continue
        chunked.append(side)
        needs = f"--{side}-chunk-size {g} supports"
        _check(args, f"{side}_step_embedding", _equal("none"), f"{needs} only 'none'")
        _check(args, "hyper_modules", _equal(0), f"{needs} only 0 (no hyper-modules)")
        _check(args, f"{side}_halting", lambda rule: rule in HALTING_RULES,
               f"{needs} {HALTING_RULES} (no early exits)")
    out = args.tlb_encoder_out
    _choose(args, "tlb_encoder_out", TLB_ENCODER_OUT)
    if out == "memory":
        _require(args.encoder_chunk_size > 0, "--tlb-encoder-out", out,
                 "'memory' needs --encoder-chunk-size > 0 (without chunks there is no memory)")
        _require(args.encoder_memory_slots > 0, "--tlb-encoder-out", out,
                 "'memory' needs --encoder-memory-slots > 0")
    if out == "both" and args.encoder_chunk_size > 0:
        _require(args.encoder_memory_slots > 0, "--tlb-encoder-out", out,
                 f"'both' needs --encoder-memory-slots > 0 (--encoder-chunk-size "
                 f"{args.encoder_chunk_size} with --encoder-memory-slots 0 has no memory: the "
                 "decoder would read the tokens only; say --tlb-encoder-out tokens)")
    if args.tlb_unshared:
        _require(args.encoder_chunk_size > 0, "--tlb-unshared", True,
                 "needs --encoder-chunk-size > 0: it gives each step of the chunked encoder "
                 "its own block (TLB); without chunks the encoder is a Universal Transformer, "
                 "one block shared by its steps")
    if args.tlb_memory_reset:
        _require(any(getattr(args, f"{side}_memory_slots") > 0 for side in chunked),
                 "--tlb-memory-reset", True,
                 "needs a side with a memory (--encoder-chunk-size or --decoder-chunk-size > 0 "
                 "and memory slots > 0)")
