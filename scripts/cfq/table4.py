#!/usr/bin/env python3
"""Train and evaluate the paper's Table 4 grid on CFQ: UT w/o halting and UT with halting
on MCD1/2/3 and the random split, 5 seeds each, then print the table.

    python scripts/cfq/table4.py --data data/cfq --work-dir runs/cfq
        [--splits mcd1 mcd2 mcd3 random_split] [--variants no-halting halting]
        [--seeds 1 2 3 4 5] [--smoke] [--dry-run] [--force] [--cleanup]
        [--train-args "--fp16"] [--generate-args "..."]

``--data`` is ``data-prep/cfq/prepare.py --binarize``'s ``--out``: ``DATA/SPLIT/bin`` is
trained on and ``DATA/SPLIT/test.tgt`` is the reference. Runs go one after another
(never two trainings at once) into ``WORK/VARIANT/SPLIT/seedN/``::

    train.log             fairseq-train's output (dev exact match every validation)
    checkpoints/          checkpoint_best.pt = best dev exact match (deleted with --cleanup)
    generate-test.txt     fairseq-generate on the test split with checkpoint_best.pt
    result.json           test exact match, counts, best dev exact match, commands, times

A run whose result.json exists is skipped (``--force`` redoes it from scratch); an
interrupted run resumes from its checkpoint_last.pt. Every command is printed before it
runs. ``--smoke`` swaps in a tiny ut_cfq and a few updates (CPU, e.g. on the test
fixture); ``--dry-run`` only prints the commands. The table (``summarize.py``) is
printed at the end and written to ``WORK/table4.md``.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cfq_recipe as recipe  # noqa: E402
import summarize  # noqa: E402


def show(command, stdout=None):
    redirect = f" > {shlex.quote(stdout)} 2>&1" if stdout else ""
    print("+ " + " ".join(shlex.quote(c) for c in command) + redirect, flush=True)


def run_logged(command, log_path):
    show(command, log_path)
    with open(log_path, "w") as log:
        returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        with open(log_path, errors="replace") as log:
            sys.stdout.write(log.read()[-3000:])
        raise SystemExit(f"error: {os.path.basename(command[0])} failed (exit {returncode}); "
                         f"log: {log_path}")


def best_dev_exact_match(train_log):
    """The best dev-set ``exact_match`` over the validations in a fairseq-train log (the
    one checkpoint_best.pt was saved at), or None when there was none."""
    best = None
    with open(train_log, errors="replace") as log:
        for line in log:
            if "valid on 'valid' subset" in line:
                m = re.search(r"\| exact_match ([\d.]+)", line)
                if m and (best is None or float(m.group(1)) > best):
                    best = float(m.group(1))
    return best


def one_run(args, variant, split, seed):
    data_bin = os.path.join(args.data, split, "bin")
    reference = os.path.join(args.data, split, "test.tgt")
    run_dir = os.path.join(args.work_dir, variant, split, f"seed{seed}")
    save_dir = os.path.join(run_dir, "checkpoints")
    result_path = os.path.join(run_dir, "result.json")
    train = recipe.train_command(data_bin, save_dir, variant, seed, args.smoke,
                                 shlex.split(args.train_args))
    checkpoint = os.path.join(save_dir, "checkpoint_best.pt")
    generate = recipe.generate_command(data_bin, checkpoint, "test", args.smoke,
                                       shlex.split(args.generate_args))
    gen_out = os.path.join(run_dir, "generate-test.txt")
    score_json = os.path.join(run_dir, "score.json")
    score = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "exact_match.py"),
             gen_out, "--reference", reference, "--json", score_json]
    print(f"== {recipe.VARIANTS[variant]['label']} | {split} | seed {seed}", flush=True)
    if args.dry_run:
        show(train, os.path.join(run_dir, "train.log"))
        show(generate, gen_out)
        show(score)
        return
    if os.path.exists(result_path) and not args.force:
        print(f"   done before: {result_path} (--force to redo)")
        return
    for path in (data_bin, reference):
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} not found; run data-prep/cfq/prepare.py "
                             f"--out {args.data} --split {split} --binarize first")
    if args.force and os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    os.makedirs(run_dir, exist_ok=True)

    start = time.time()
    run_logged(train, os.path.join(run_dir, "train.log"))
    train_seconds = time.time() - start
    start = time.time()
    run_logged(generate, gen_out)
    generate_seconds = time.time() - start
    show(score)
    if subprocess.run(score).returncode != 0:
        raise SystemExit(f"error: scoring failed for {run_dir}")
    with open(score_json) as handle:
        result = json.load(handle)
    result.update({
        "variant": variant, "label": recipe.VARIANTS[variant]["label"], "split": split,
        "seed": seed, "smoke": args.smoke, "checkpoint": os.path.abspath(checkpoint),
        "best_dev_exact_match": best_dev_exact_match(os.path.join(run_dir, "train.log")),
        "train_seconds": round(train_seconds, 1), "generate_seconds": round(generate_seconds, 1),
        "train_command": train, "generate_command": generate,
    })
    tmp = result_path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle, indent=2)
    os.replace(tmp, result_path)
    if args.cleanup:
        shutil.rmtree(save_dir, ignore_errors=True)
    print(f"   test exact match {result['exact_match']:.2f}% ({result['correct']}/{result['total']}); "
          f"best dev {result['best_dev_exact_match']}; train {train_seconds:.0f} s -> {result_path}",
          flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="prepare.py's --out (DATA/SPLIT/bin, DATA/SPLIT/test.tgt)")
    parser.add_argument("--work-dir", required=True, help="where runs and results go")
    parser.add_argument("--splits", nargs="+", default=list(recipe.SPLITS))
    parser.add_argument("--variants", nargs="+", default=list(recipe.VARIANTS),
                        choices=list(recipe.VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(recipe.SEEDS))
    parser.add_argument("--smoke", action="store_true",
                        help="reduced CPU configuration: tiny ut_cfq, 6 updates, short decodes")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--force", action="store_true", help="redo runs that have a result.json")
    parser.add_argument("--cleanup", action="store_true", help="delete each run's checkpoints once scored")
    parser.add_argument("--train-args", default="", help="extra fairseq-train arguments (one string)")
    parser.add_argument("--generate-args", default="", help="extra fairseq-generate arguments (one string)")
    args = parser.parse_args(argv)

    start = time.time()
    for split in args.splits:
        for variant in args.variants:
            for seed in args.seeds:
                one_run(args, variant, split, seed)
    if args.dry_run:
        return 0
    text = summarize.summarize(args.work_dir)
    print("\n" + text)
    with open(os.path.join(args.work_dir, "table4.md"), "w") as handle:
        handle.write(text + "\n")
    print(f"\n{time.time() - start:.0f} s; table written to {os.path.join(args.work_dir, 'table4.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
