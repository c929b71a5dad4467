#!/usr/bin/env python3
"""Train and evaluate the paper's Table 4 grid on CFQ: UT w/o halting and UT with halting
on MCD1/2/3 and the random split, 5 seeds each, then print the table -- the four stages
of the shared recipe template (``sut_fairseq.recipes``): 1 data, 2 train, 3 evaluate,
4 report.

    python scripts/cfq/table4.py --data data/cfq --work-dir runs/cfq
        [--cfq-dir DIR | --archive FILE] [--stage S] [--stop-stage S]
        [--splits mcd1 mcd2 mcd3 random_split] [--variants no-halting halting]
        [--seeds 1 2 3 4 5] [--smoke] [--dry-run] [--force] [--cleanup]
        [--train-args "--fp16"] [--generate-args "..."]

Stages (``--stage``/``--stop-stage``, by name or number):

* *data*: ``data-prep/cfq/prepare.py --binarize`` for the splits whose ``DATA/SPLIT/bin``
  is missing, from ``--cfq-dir`` (the extracted archive), ``--archive`` (cfq1.1.tar.gz)
  or, with neither, a download into ``DATA/download``;
* *train*: fairseq-train every run without a ``train.json`` (dev exact match picks
  ``checkpoint_best.pt``; an interrupted run resumes from its ``checkpoint_last.pt``);
* *evaluate*: fairseq-generate on ``DATA/SPLIT/test`` and ``exact_match.py`` against
  ``DATA/SPLIT/test.tgt`` for every trained run without a ``result.json``;
* *report*: ``summarize.py``'s table, printed and written to ``WORK/table4.md``.

Runs go one after another (never two trainings at once) into ``WORK/VARIANT/SPLIT/seedN/``::

    train.log             fairseq-train's output (dev exact match every validation)
    train.json            written when training has finished: seconds, best dev exact match
    checkpoints/          checkpoint_best.pt = best dev exact match (deleted with --cleanup)
    generate-test.txt     fairseq-generate on the test split with checkpoint_best.pt
    result.json           test exact match, counts, best dev exact match, commands, times

``--force`` redoes the selected stages of every run (the train stage deletes the run).
Every command is printed before it runs; ``--dry-run`` only prints them. ``--smoke``
swaps in a tiny ut_cfq and a few updates (CPU, e.g. on the test fixture).
"""
import os
import shlex
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cfq_recipe as recipe  # noqa: E402
import exact_match  # noqa: E402
import summarize  # noqa: E402
from sut_fairseq.recipes import (RecipeError, recipe_parser, run as run_command,  # noqa: E402
                                 run_grid, show, write_json_atomic, write_text_atomic)
from sut_fairseq.recipes.runs import RunDir, parse_grid_args  # noqa: E402
from sut_fairseq.recipes.train_log import best_valid  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def prepare_data(args):
    """Stage 1: prepare and binarize the splits that are not yet."""
    missing = [s for s in args.splits
               if not os.path.isfile(os.path.join(args.data, s, "bin", "dict.src.txt"))]
    if not missing:
        print(f"   every split is prepared in {args.data}")
        return
    source = (["--cfq-dir", args.cfq_dir] if args.cfq_dir else
              ["--archive", args.archive] if args.archive else [])
    run_command(recipe.prepare_command(args.data, missing, source), dry_run=args.dry_run)


def grid(args):
    """Every (variant, split, seed) run of the grid: (variant, split, seed, RunDir)."""
    return [(variant, split, seed, RunDir(
        os.path.join(args.work_dir, variant, split, f"seed{seed}"),
        f"== {recipe.VARIANTS[variant]['label']} | {split} | seed {seed}"))
        for split in args.splits for variant in args.variants for seed in args.seeds]


def train(args, variant, split, seed, run):
    """Stage 2 for one run -> train.json."""
    data_bin = os.path.join(args.data, split, "bin")
    if not (args.dry_run or os.path.exists(data_bin)):
        raise RecipeError(f"{data_bin} not found: run the data stage first")
    command = recipe.train_command(data_bin, run.save_dir, variant, seed, args.smoke,
                                   shlex.split(args.train_args), required=not args.dry_run)
    seconds = run.train(command, args.force, args.dry_run)
    if seconds is not None:
        write_json_atomic(run.train_json, {
            "seconds_this_call": round(seconds, 1), "command": command,
            "best_dev_exact_match": best_valid(run.train_log, "exact_match")})


def evaluate(args, variant, split, seed, run):
    """Stage 3 for one trained run: generate, score -> result.json."""
    if not run.needs_evaluation(args.force, args.dry_run):
        return
    generate = recipe.generate_command(os.path.join(args.data, split, "bin"), run.checkpoint,
                                       "test", args.smoke, shlex.split(args.generate_args),
                                       required=not args.dry_run)
    gen_out = os.path.join(run.dir, "generate-test.txt")
    score = [sys.executable, os.path.join(HERE, "exact_match.py"), gen_out,
             "--reference", os.path.join(args.data, split, "test.tgt"),
             "--json", os.path.join(run.dir, "score.json")]
    if args.dry_run:
        show(generate, gen_out)
        show(score)
        return
    trained = run.trained()
    start = time.time()
    run_command(generate, gen_out)
    generate_seconds = time.time() - start
    show(score)  # run in this process; refuses unless every test line was scored
    try:
        result = exact_match.main(score[2:])
    except SystemExit as err:
        raise RecipeError(f"scoring {gen_out} failed: {err}")
    result.update({
        "variant": variant, "label": recipe.VARIANTS[variant]["label"], "split": split,
        "seed": seed, "smoke": args.smoke, "checkpoint": os.path.abspath(run.checkpoint),
        "best_dev_exact_match": trained["best_dev_exact_match"],
        "train_seconds": trained["seconds_this_call"], "generate_seconds": round(generate_seconds, 1),
        "train_command": trained["command"], "generate_command": generate,
    })
    write_json_atomic(run.result, result)
    if args.cleanup:
        run.cleanup()
    print(f"   test exact match {result['exact_match']:.2f}% ({result['correct']}/{result['total']}); "
          f"best dev {result['best_dev_exact_match']} -> {run.result}", flush=True)


def report(args):
    """Stage 4: the table from every result.json of WORK."""
    table = os.path.join(args.work_dir, "table4.md")
    command = [sys.executable, os.path.join(HERE, "summarize.py"), args.work_dir, "--markdown", table]
    if args.dry_run:
        show(command)
        return
    text = summarize.summarize(args.work_dir)
    print("\n" + text)
    write_text_atomic(table, text + "\n")
    print(f"\ntable written to {table}")


def main(argv=None):
    parser = recipe_parser(__doc__)
    parser.add_argument("--data", required=True, help="prepare.py's --out (DATA/SPLIT/bin, DATA/SPLIT/test.tgt)")
    parser.add_argument("--work-dir", required=True, help="where runs and results go")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--cfq-dir", default=None, help="data stage: the extracted CFQ archive")
    source.add_argument("--archive", default=None, help="data stage: cfq1.1.tar.gz you already have")
    parser.add_argument("--splits", nargs="+", default=list(recipe.SPLITS), choices=recipe.SPLITS)
    parser.add_argument("--variants", nargs="+", default=list(recipe.VARIANTS),
                        choices=list(recipe.VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(recipe.SEEDS))
    parser.add_argument("--smoke", action="store_true",
                        help="reduced CPU configuration: tiny ut_cfq, 6 updates, short decodes")
    args = parse_grid_args(parser, argv)

    return run_grid(args, lambda: prepare_data(args), lambda: grid(args), partial(train, args),
                    partial(evaluate, args), lambda: report(args))


if __name__ == "__main__":
    sys.exit(main())
