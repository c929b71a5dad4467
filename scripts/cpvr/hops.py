#!/usr/bin/env python3
"""C-PVR accuracy and halting depth per hop (the Hyper-UT paper's Figs. 3, 5 and 7) for
the UT, the SUT and Hyper-UT, end to end: the four stages of the shared recipe template
(``sut_fairseq.recipes``): 1 data, 2 train, 3 evaluate, 4 report.

    python scripts/cpvr/hops.py [--data-dir data/cpvr] [--work-dir runs/cpvr]
        [--stage S] [--stop-stage S] [--models ut sut hyper-ut] [--seeds 1]
        [--config cpu] [--data-config small] [--max-update N] [--stop-time-hours H]
        [--hops 1..9] [--cpu] [--train-args "..."] [--generate-args "..."]
        [--dry-run] [--force] [--cleanup]

Stages (``--stage``/``--stop-stage``, by name or number): *data* runs
``data-prep/cpvr/generate.py --config DATA_CONFIG --binarize`` into ``--data-dir`` unless
it is complete; *train* trains every run without a ``train.json`` (an interrupted training
resumes from its checkpoint_last.pt); *evaluate* scores every trained run without a
``result.json``: greedy fairseq-generate on each test hop (exact match of the label, every
line of the split scored once) and the teacher-forced mean executed depth per hop
(``sut_fairseq.analysis.halting_depth``); *report* (``summarize.py``) writes
``WORK/hops.md``, ``WORK/hops.json``, ``WORK/accuracy.png`` and ``WORK/depth.png`` beside
the shortcut baselines of the data.

Runs go one after another into ``WORK/MODEL/seedN/`` (``train.log``, ``checkpoints/``,
``train.json``, ``generate-hopN.txt``, ``score-hopN.json``, ``halting.json``,
``result.json``). ``--force`` redoes the selected stages of every run; every command is
printed before it runs; ``--dry-run`` only prints them.
"""
import argparse
import os
import shlex
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpvr_recipe as recipe  # noqa: E402
import summarize  # noqa: E402
from sut_fairseq.data import cpvr  # noqa: E402
from sut_fairseq.recipes import (RecipeError, recipe_parser, run, run_grid,  # noqa: E402
                                 show, write_json_atomic)
from sut_fairseq.recipes.generated import data_stage  # noqa: E402
from sut_fairseq.recipes.numbers import parse_numbers  # noqa: E402
from sut_fairseq.recipes.runs import (RunDir, add_budget_arguments, parse_grid_args,  # noqa: E402
                                      train_grid_run)


def prepare_data(args):
    """Stage 1: generate and binarize the data unless it is complete."""
    data_stage(args, recipe.data_complete(args.data_dir),
               recipe.generate_data_command(args.data_dir, args.data_config,
                                            overwrite=os.path.isdir(args.data_dir)))


def grid(args):
    """Every (model, seed, RunDir) of the grid."""
    return [(model, seed, RunDir(os.path.join(args.work_dir, model, f"seed{seed}"),
                                 f"== {recipe.GRID.label(model)} | seed {seed} | {args.config}"))
            for model in args.models for seed in args.seeds]


def train(args, model, seed, run_dir):
    """Stage 2 for one run: fairseq-train (resumed when interrupted) -> train.json."""
    train_grid_run(recipe.GRID, args, model, seed, run_dir)


def evaluate(args, model, seed, run_dir):
    """Stage 3 for one trained run: accuracy and depth on every test hop -> result.json."""
    if not run_dir.needs_evaluation(args.force, args.dry_run):
        return
    data_bin = os.path.join(args.data_dir, "bin")
    if args.dry_run and not recipe.data_complete(args.data_dir):  # what the data stage writes
        splits = cpvr.binarized_test_splits(cpvr.make_config(args.data_config).test_hops)
    else:
        splits = recipe.test_splits(args.data_dir)
    missing = sorted(set(args.hops or []) - set(splits))
    if missing:
        raise RecipeError(f"{args.data_dir} has no test split for hops {missing}")
    hops = args.hops or sorted(splits)
    accuracy = {}
    for n in hops:
        output = os.path.join(run_dir.dir, f"generate-hop{n}.txt")
        run(recipe.GRID.generate_command(data_bin, run_dir.checkpoint, splits[n], args.batch_size,
                                         recipe.GENERATE_FLAGS, args.cpu,
                                         shlex.split(args.generate_args), required=not args.dry_run),
            output, dry_run=args.dry_run)
        if args.dry_run:
            continue
        score = recipe.score_split(output, os.path.join(args.data_dir, f"test{n}.tgt"))
        write_json_atomic(os.path.join(run_dir.dir, f"score-hop{n}.json"), score)
        accuracy[str(n)] = score["accuracy"]
        print(f"   hop {n}: accuracy {score['accuracy']:.2f}% ({score['correct']} / {score['total']})",
              flush=True)
    depth_json = os.path.join(run_dir.dir, "halting.json")
    run([sys.executable, "-m", "sut_fairseq.analysis.halting_depth", data_bin,
         "--path", run_dir.checkpoint, "--subsets", *[splits[n] for n in hops],
         "--keys", *[str(n) for n in hops], "--json", depth_json],
        os.path.join(run_dir.dir, "halting.log"), dry_run=args.dry_run)
    if args.dry_run:
        return
    depth = recipe.load_json(depth_json)["splits"]
    trained = run_dir.trained()
    result = {"model": model, "label": recipe.GRID.label(model), "seed": seed,
              "config": trained.get("config", args.config), "accuracy": accuracy,
              "encoder_depth": {k: v["encoder"]["mean_depth"] for k, v in depth.items()},
              "decoder_depth": {k: v["decoder"]["mean_depth"] for k, v in depth.items()},
              "max_steps": next(iter(depth.values()))["encoder"]["max_steps"]}
    run_dir.write_result(result, args.cleanup)


def report(args):
    """Stage 4: the table, its JSON and the two figures from every result.json of WORK."""
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "summarize.py"),
               args.work_dir, "--data-dir", args.data_dir]
    if args.dry_run:
        show(command)
        return
    print("\n" + summarize.summarize(args.work_dir, args.data_dir))


def parse_hops(text):
    """``"1..9"``, ``"1-4"`` or ``"1,3,5"`` -> sorted hop numbers (all >= 1)."""
    try:
        hops = parse_numbers(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if hops[0] < 1:
        raise argparse.ArgumentTypeError(f"hops must be >= 1, got {text!r}")
    return hops


def main(argv=None):
    parser = recipe_parser(__doc__)
    parser.add_argument("--data-dir", default=os.path.join("data", "cpvr"))
    parser.add_argument("--work-dir", default=os.path.join("runs", "cpvr"))
    parser.add_argument("--data-config", default="small", choices=sorted(cpvr.CONFIGS),
                        help="data-prep/cpvr/generate.py --config (default: small)")
    parser.add_argument("--config", default="cpu", help="training configuration of common.json (default: cpu)")
    parser.add_argument("--models", nargs="+", default=list(recipe.GRID.models), choices=recipe.GRID.models)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--hops", type=parse_hops, default=None,
                        help="test hops to evaluate (default: every test split of the data)")
    parser.add_argument("--batch-size", type=int, default=recipe.DEFAULT_GENERATE_BATCH,
                        help="fairseq-generate --batch-size")
    add_budget_arguments(parser)
    args = parse_grid_args(parser, argv)
    return run_grid(args, lambda: prepare_data(args), lambda: grid(args), partial(train, args),
                    partial(evaluate, args), lambda: report(args))


if __name__ == "__main__":
    sys.exit(main())
