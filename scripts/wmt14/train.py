#!/usr/bin/env python3
"""Train one WMT'14 En-De model of the paper's Table 1 or a Table 2 ablation (docs/wmt14.md).

    python scripts/wmt14/train.py MODEL --data DATA_BIN [--ablation NAME] [--ngpus N]
        [--max-tokens 8192] [--update-freq N] [--save-dir DIR] [--precision fp16]
        [--eager] [--dry-run] [-- extra fairseq-train options]

MODEL: transformer, ut_base, sut_base, ut_big, sut_big (configs/wmt14/MODEL.json, over
configs/wmt14/common.json). --ablation (sut_base only): no-mim, no-momha, no-act,
no-halting (configs/wmt14/ablations.json). Options after ``--`` are passed to fairseq-train
and replace the recipe's value of the same option.

With ``--precision bf16`` on a GPU the SUT/UT train with ``--compile-step`` (each side's
recurrence step one compiled graph: 1.49x the eager sut_base step on an H200,
docs/performance.md); ``--eager`` keeps the eager step. fp16 and the CPU keep it too (the
compiled step is not measured faster there).

The paper trained on 32 GPUs x 8192 tokens; with other hardware the gradient is
accumulated over --update-freq = ceil(32 * 8192 / (NGPUS * MAX_TOKENS)) batches, printed
before the command. The command is printed before it runs; --dry-run only prints it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wmt14_recipe as recipe  # noqa: E402


def compiles_step(args) -> bool:
    """Whether the recipe turns on ``--compile-step``: the plugin's models (not fairseq's
    transformer) in bf16 on a GPU, where the compiled step was measured faster, unless
    ``--eager``."""
    return args.model != "transformer" and not args.cpu and args.precision == "bf16" and not args.eager


def build_command(args) -> list:
    common = recipe.load_config("common.json")
    model = recipe.load_model(args.model)
    paper = common["paper_batch"]
    flags = [common["flags"], ["--arch", args.arch or model["arch"]], model["flags"]]
    if args.ablation:
        if not model.get("ablations"):
            raise recipe.RecipeError(f"--ablation applies to sut_base (Table 2), not {args.model}")
        ablations = recipe.load_ablations()
        if args.ablation not in ablations:
            raise recipe.RecipeError(f"unknown --ablation {args.ablation!r}: choose from "
                                     f"{', '.join(ablations)}")
        flags.append(ablations[args.ablation]["flags"])
    freq = args.update_freq or recipe.update_freq(args.ngpus, args.max_tokens,
                                                  paper["gpus"], paper["max_tokens"])
    run_name = args.model + (f"-{args.ablation}" if args.ablation else "")
    save_dir = args.save_dir or os.path.join("checkpoints", "wmt14", run_name)
    hardware = ["--max-tokens", str(args.max_tokens), "--update-freq", str(freq),
                "--save-dir", save_dir, "--log-file", os.path.join(save_dir, "train.log")]
    if args.cpu:
        hardware.append("--cpu")
    elif args.precision in ("fp16", "bf16"):
        hardware.append(f"--{args.precision}")
    if compiles_step(args):
        hardware.append("--compile-step")
    if args.ngpus > 1:
        hardware += ["--distributed-world-size", str(args.ngpus)]
    extra = list(args.extra)
    command = [recipe.tool("fairseq-train", required=not args.dry_run), args.data,
               "--user-dir", recipe.user_dir(), *common["task"],
               *recipe.merge_flags(*flags, hardware, extra)]
    note = recipe.batch_note(args.ngpus, args.max_tokens, freq, paper["gpus"], paper["max_tokens"],
                             explicit=bool(args.update_freq))
    return command, note, save_dir, run_name


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("model", choices=recipe.MODELS)
    parser.add_argument("--data", required=True, help="fairseq-preprocess output (WORKDIR/data-bin)")
    parser.add_argument("--ablation", default=None, help="Table 2 ablation of sut_base")
    parser.add_argument("--ngpus", type=int, default=1, help="GPUs in the job (all nodes)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens per GPU per batch")
    parser.add_argument("--update-freq", type=int, default=None,
                        help="override the computed gradient accumulation")
    parser.add_argument("--save-dir", default=None, help="default checkpoints/wmt14/RUN")
    parser.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16")
    parser.add_argument("--cpu", action="store_true", help="train on CPU (smoke tests; implies fp32)")
    parser.add_argument("--eager", action="store_true",
                        help="with --precision bf16 on a GPU: keep the eager recurrence step "
                        "(by default the SUT/UT there train with --compile-step)")
    parser.add_argument("--arch", default=None,
                        help="replace the model's --arch, keeping the rest of its recipe "
                        "(e.g. sut_tiny for a smoke test)")
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:  # everything after "--" goes to fairseq-train
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    args.extra = extra
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        command, note, save_dir, run_name = build_command(args)
    except recipe.RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"# {run_name}: {note}", flush=True)
    if not args.dry_run:
        os.makedirs(save_dir, exist_ok=True)
    try:
        recipe.run(command, dry_run=args.dry_run)
    except recipe.RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
