"""Configuration checks at model build time: each error names the option, the bad value
and what is allowed (instead of a shape error deep inside torch)."""
from ..modules.halting import HALTING_RULES


def _require(ok: bool, option: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{option}={value!r} is invalid: {allowed}")


def validate_args(args) -> None:
    for opt in ("encoder_embed_dim", "decoder_embed_dim", "encoder_layers", "decoder_layers",
                "att_experts", "att_heads", "att_head_dim", "ffd_experts", "ffd_hidden_dim"):
        value = getattr(args, opt)
        _require(isinstance(value, int) and value >= 1, "--" + opt.replace("_", "-"), value,
                 "must be a positive integer")
    _require(1 <= args.att_topk <= args.att_experts, "--att-topk", args.att_topk,
             f"must satisfy 1 <= k <= --att-experts ({args.att_experts})")
    _require(1 <= args.ffd_topk <= args.ffd_experts, "--ffd-topk", args.ffd_topk,
             f"must satisfy 1 <= k <= --ffd-experts ({args.ffd_experts})")
    _require(0 <= args.sample_topk <= min(args.att_topk, args.ffd_topk), "--sample-topk",
             args.sample_topk, "must be between 0 and the smaller top-k")
    _require(args.rel_window >= 0, "--rel-window", args.rel_window, "must be >= 0")
    _require(args.router_hidden_dim >= 0, "--router-hidden-dim", args.router_hidden_dim,
             "must be >= 0 (0 = model width)")
    _require(0.0 < args.halting_threshold <= 1.0, "--halting-threshold",
             args.halting_threshold, "must be in (0, 1]")
    for side in ("encoder_halting", "decoder_halting"):
        _require(getattr(args, side) in HALTING_RULES, "--" + side.replace("_", "-"),
                 getattr(args, side), f"choose from {HALTING_RULES}")
    if args.halting_transition:
        for side in ("encoder_halting", "decoder_halting"):
            _require(getattr(args, side) in ("stick-breaking", "global-mean", "none"),
                     "--" + side.replace("_", "-"), getattr(args, side),
                     "--halting-transition needs 'stick-breaking' or 'global-mean' (or 'none')")
    for opt in ("dropout", "attention_dropout", "activation_dropout", "gating_dropout",
                "halting_dropout"):
        value = getattr(args, opt)
        _require(0.0 <= value < 1.0, "--" + opt.replace("_", "-"), value, "must be in [0, 1)")
    if args.share_all_embeddings:
        _require(args.encoder_embed_dim == args.decoder_embed_dim, "--decoder-embed-dim",
                 args.decoder_embed_dim,
                 f"--share-all-embeddings needs it equal to --encoder-embed-dim ({args.encoder_embed_dim})")
