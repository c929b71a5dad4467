#!/usr/bin/env python3
"""Train one logical-inference model of paper Table 5 (docs/logic.md).

    python scripts/logic/train.py MODEL --data DATA_BIN [--reduced] [--save-dir DIR]
        [--stop-time-hours H] [--max-update N] [--seed 1] [--cpu] [--dry-run]
        [-- extra fairseq-train options]

MODEL: sut, ut-halting, ut-no-halting, transformer (configs/logic/MODEL.json over
configs/logic/common.json). The ``full`` configuration (default) is the paper-scale GPU
run; ``--reduced`` the 2-CPU-core one (10,000 updates; about an hour for the transformer on one core, several for the SUT). Every
model of a configuration gets the same budget: ``--max-update`` updates over the same
batches, ``--stop-time-hours`` only capping the wall-clock time. Options after ``--`` go to fairseq-train and replace the recipe's value
of the same option (e.g. ``-- --encoder-layers 2`` for a smoke test).

fairseq-train's output goes to the terminal and to ``SAVE_DIR/train.log``; it logs the
parameter count (``num. shared model params``; ``params.py`` prints every model's
before training). The command is printed before it runs; ``--dry-run`` only prints it.
Re-running the same command resumes from ``SAVE_DIR/checkpoint_last.pt`` (the time
already spent counts against the budget).
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logic_recipe as recipe  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("model", choices=recipe.ALL_MODELS)
    parser.add_argument("--data", required=True, help="binarized data (prepare.py's OUT/bin)")
    parser.add_argument("--reduced", action="store_true",
                        help="the 2-CPU-core configuration (default: full, for a GPU)")
    parser.add_argument("--save-dir", default=None, help="default checkpoints/logic/MODEL")
    parser.add_argument("--stop-time-hours", type=float, default=None,
                        help="wall-clock cap (default: the configuration's)")
    parser.add_argument("--max-update", type=int, default=None,
                        help="update budget (default: the configuration's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cpu", action="store_true", help="pass --cpu to fairseq-train")
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    args.extra = extra
    return args


def main(argv=None):
    args = parse_args(argv)
    config = "reduced" if args.reduced else "full"
    save_dir = args.save_dir or os.path.join("checkpoints", "logic", args.model)
    try:
        command = recipe.train_command(args.model, args.data, config, args.seed, save_dir,
                                       args.stop_time_hours, args.max_update, args.cpu, args.extra,
                                       required=not args.dry_run)
    except recipe.RecipeError as err:
        sys.exit(f"error: {err}")
    command += ["--log-file", os.path.join(save_dir, "train.log")]
    print(f"# {recipe.label(args.model)}, {config} configuration: "
          f"--stop-time-hours {recipe.flag_value(command, '--stop-time-hours')}, "
          f"--max-update {recipe.flag_value(command, '--max-update')}", flush=True)
    recipe.show(command)
    if args.dry_run:
        return 0
    os.makedirs(save_dir, exist_ok=True)
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
