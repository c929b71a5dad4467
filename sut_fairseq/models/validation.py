"""Configuration checks at model build time: each error names the option, the bad value
and what is allowed (instead of a shape error deep inside torch).

``SUTTransformerModel.build_model`` calls ``validate_args`` after the preset has filled
every option, so the checks see the values the model would be built with: those from the
command line, from a preset, or from a checkpoint with ``--model-overrides``. Under
``fairseq-train`` the error ends fairseq's traceback as its last line, e.g.::

    ValueError: --att-topk=5 is invalid: must satisfy 1 <= k <= --att-experts (4)

Besides single values, combinations that would be accepted and silently mean something
else are refused (``_validate_exits``, ``_validate_chunks``): early exits with one decoder
step, an exit option changed from its default under a rule that never reads it, and a
chunked encoder that hands the decoder a memory it does not have. ``--exit-patience`` and
``--exit-entropy`` under the *other* exit rule are meant: both rules share the off-ramps,
and the exit sweep switches a checkpoint from one rule to the other with
``--model-overrides`` while the first rule's value stays in its arguments.
``--tlb-memory-reset`` is refused in training mode, at the first forward
(``modules/chunked_recurrence.py``): a model cannot tell at build time whether it will be
trained or evaluated.
"""
import numbers

from .config import BASE_DEFAULTS, CHUNK_POSITIONS, REL_POS, TLB_ENCODER_OUT
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(ok: bool, option: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{option}={value!r} is invalid: {allowed}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def validate_args(args) -> None:
    """Raise ``ValueError("--option=value is invalid: what is allowed")`` on the first bad
    option."""
    for opt in POSITIVE_INTEGERS:
        value = getattr(args, opt)
        _require(_is_int(value) and value >= 1, _flag(opt), value, "must be a positive integer")
    _require(_is_int(args.att_topk) and 1 <= args.att_topk <= args.att_experts, "--att-topk",
             args.att_topk, f"must satisfy 1 <= k <= --att-experts ({args.att_experts})")
    _require(_is_int(args.ffd_topk) and 1 <= args.ffd_topk <= args.ffd_experts, "--ffd-topk",
             args.ffd_topk, f"must satisfy 1 <= k <= --ffd-experts ({args.ffd_experts})")
    _require(_is_int(args.sample_topk) and 0 <= args.sample_topk <= min(args.att_topk, args.ffd_topk),
             "--sample-topk", args.sample_topk,
             f"must be between 0 and the smaller top-k ({min(args.att_topk, args.ffd_topk)})")
    _require(args.rel_pos in REL_POS, "--rel-pos", args.rel_pos, f"choose from {REL_POS}")
    _require(_is_int(args.rel_window) and args.rel_window >= 0, "--rel-window", args.rel_window,
             "must be an integer >= 0")
    _require(_is_int(args.router_hidden_dim) and args.router_hidden_dim >= 0, "--router-hidden-dim",
             args.router_hidden_dim, "must be an integer >= 0 (0 = model width)")
    # `not (0 < x <= 1)` rather than `x <= 0 or x > 1`: also rejects NaN
    _require(_is_real(args.halting_threshold)
             and 0.0 < args.halting_threshold <= 1.0, "--halting-threshold",
             args.halting_threshold, "must be in (0, 1]")
    _require(args.encoder_halting in HALTING_RULES, "--encoder-halting", args.encoder_halting,
             f"choose from {HALTING_RULES} (the exit rules {EXIT_RULES} are for the decoder)")
    _require(args.decoder_halting in HALTING_RULES + EXIT_RULES, "--decoder-halting",
             args.decoder_halting, f"choose from {HALTING_RULES + EXIT_RULES}")
    for side in ("encoder_halting_kv", "decoder_halting_kv"):
        _require(getattr(args, side) in HALTING_KV, _flag(side), getattr(args, side),
                 f"choose from {HALTING_KV}")
    _require(_is_int(args.exit_patience) and args.exit_patience >= 0, "--exit-patience",
             args.exit_patience, "must be an integer >= 0 (0 = never exit)")
    _require(_is_real(args.exit_entropy) and 0.0 <= args.exit_entropy < float("inf"),
             "--exit-entropy", args.exit_entropy, "must be a finite number >= 0 (nats; 0 = never exit)")
    _validate_exits(args)
    for side in ("encoder_step_embedding", "decoder_step_embedding"):
        _require(getattr(args, side) in STEP_EMBEDDINGS, _flag(side), getattr(args, side),
                 f"choose from {STEP_EMBEDDINGS}")
    if args.halting_transition:
        for side in ("encoder_halting", "decoder_halting"):
            _require(getattr(args, side) in TRANSITION_RULES, _flag(side), getattr(args, side),
                     "--halting-transition needs 'stick-breaking' or 'global-mean' (or 'none')")
    for opt in PROBABILITIES:
        value = getattr(args, opt)
        _require(_is_real(value) and 0.0 <= value < 1.0, _flag(opt), value,
                 "must be in [0, 1)")
    _validate_hyper(args)
    _validate_chunks(args)
    if args.flex_attention:
        _require(args.attention_dropout == 0.0, "--attention-dropout", args.attention_dropout,
                 "--flex-attention needs 0 (FlexAttention has no dropout)")
        _require(args.hyper_modules == 0, "--hyper-modules", args.hyper_modules,
                 "--flex-attention needs 0 (the hyper-modules' self-attention has no FlexAttention form)")
    if args.share_all_embeddings:
        _require(args.encoder_embed_dim == args.decoder_embed_dim, "--decoder-embed-dim",
                 args.decoder_embed_dim,
                 f"--share-all-embeddings needs it equal to --encoder-embed-dim ({args.encoder_embed_dim})")


def _validate_exits(args) -> None:
    """Early exits need a second decoder step to exit before; the exit options are read
    only by the exit rules."""
    rule = args.decoder_halting
    if rule in EXIT_RULES:
        _require(args.decoder_layers >= 2, "--decoder-halting", rule,
                 f"the exit rules need --decoder-layers >= 2 (got --decoder-layers "
                 f"{args.decoder_layers}: one step leaves nothing to exit before)")
        return
    for opt in ("exit_patience", "exit_entropy"):
        value = getattr(args, opt)
        _require(value == BASE_DEFAULTS[opt], _flag(opt), value,
                 f"it is read only by --decoder-halting pabee|entropy, and --decoder-halting "
                 f"is {rule!r} (leave {_flag(opt)} at its default {BASE_DEFAULTS[opt]!r})")


def _validate_hyper(args) -> None:
    """The hyper-module options (docs/hyper_ut.md); with ``--hyper-modules M > 0`` the
    block must be dense (E = k = 1) with no relative positions or step embeddings."""
    m = args.hyper_modules
    _require(_is_int(m) and m >= 0, "--hyper-modules", m, "must be an integer >= 0 (0 = off)")
    d_e = args.hyper_embed_dim
    _require(_is_int(d_e) and d_e >= 1, "--hyper-embed-dim", d_e, "must be a positive integer")
    d_k = args.hyper_key_dim
    _require(_is_int(d_k) and d_k >= 0, "--hyper-key-dim", d_k,
             "must be an integer >= 0 (0 = the model width)")
    tau = args.hyper_router_temp
    _require(_is_real(tau) and 0.0 < tau < float("inf"), "--hyper-router-temp", tau,
             "must be a finite number > 0")
    raw = args.hyper_components
    components = parse_components(raw)
    bad = [c for c in components if c not in HYPER_COMPONENTS]
    _require(not bad, "--hyper-components", raw,
             f"unknown component(s) {', '.join(bad)}; choose a comma list from {HYPER_COMPONENTS}")
    if m == 0:
        return
    _require(len(components) > 0, "--hyper-components", raw,
             f"--hyper-modules {m} needs at least one of {HYPER_COMPONENTS}")
    for opt in ("att_experts", "att_topk", "ffd_experts", "ffd_topk"):
        _require(getattr(args, opt) == 1, _flag(opt), getattr(args, opt),
                 f"--hyper-modules {m} needs dense experts: E = k = 1 (hyper-modules replace "
                 "expert routing)")
    _require(args.rel_pos == "none", "--rel-pos", args.rel_pos,
             f"--hyper-modules {m} supports only 'none' (the hyper self-attention has no "
             "relative position term)")
    for side in ("encoder_step_embedding", "decoder_step_embedding"):
        _require(getattr(args, side) == "none", _flag(side), getattr(args, side),
                 f"--hyper-modules {m} supports only 'none'")


def _validate_chunks(args) -> None:
    """The chunk-wise recurrence options (docs/chunked.md), per side."""
    chunked = []
    for side in ("encoder", "decoder"):
        g = getattr(args, f"{side}_chunk_size")
        _require(_is_int(g) and g >= 0, f"--{side}-chunk-size", g, "must be an integer >= 0 (0 = off)")
        k = getattr(args, f"{side}_memory_slots")
        _require(_is_int(k) and k >= 0, f"--{side}-memory-slots", k,
                 "must be an integer >= 0 (0 = no memory: the chunks are independent)")
        u = getattr(args, f"{side}_memory_update_layers")
        _require(_is_int(u) and u >= 1, f"--{side}-memory-update-layers", u, "must be a positive integer")
        positions = getattr(args, f"{side}_chunk_positions")
        _require(positions in CHUNK_POSITIONS, f"--{side}-chunk-positions", positions,
                 f"choose from {CHUNK_POSITIONS}")
        if g == 0:
            continue
        chunked.append(side)
        step_embedding = getattr(args, f"{side}_step_embedding")
        _require(step_embedding == "none", f"--{side}-step-embedding", step_embedding,
                 f"--{side}-chunk-size {g} supports only 'none'")
        _require(args.hyper_modules == 0, "--hyper-modules", args.hyper_modules,
                 f"--{side}-chunk-size {g} supports only 0 (no hyper-modules)")
        halting = getattr(args, f"{side}_halting")
        _require(halting in HALTING_RULES, f"--{side}-halting", halting,
                 f"--{side}-chunk-size {g} supports {HALTING_RULES} (no early exits)")
    out = args.tlb_encoder_out
    _require(out in TLB_ENCODER_OUT, "--tlb-encoder-out", out, f"choose from {TLB_ENCODER_OUT}")
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
