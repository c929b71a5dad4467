#!/usr/bin/env python3
"""Reproduce paper Table 5 and Figure 4 (logical inference) end to end: generate the data
if missing, prepare and binarize each protocol, train every model, evaluate, print the
table and draw the figure.

    python scripts/logic/table5.py [--data-dir data/logic] [--work-dir runs/logic]
        [--original DIR] [--pairs 500000] [--reduced]
        [--models sut ut-halting ut-no-halting transformer] [--protocols standard A B C]
        [--seeds 1] [--stop-time-hours H] [--max-update N] [--buckets 7..12]
        [--threshold A] [--cpu] [--train-args "..."] [--generate-args "..."]
        [--dry-run] [--force] [--cleanup]

Data (``--data-dir``): ``DATA/original/`` holds ``train0..12``/``test0..12`` in the original
format -- ``data-prep/logic/generate.py --pairs 500000 --seed 1`` writes them when missing,
or ``--original DIR`` uses files you have (the downloaded originals); ``DATA/PROTOCOL/``
is ``data-prep/logic/prepare.py --protocol PROTOCOL --binarize``'s output (skipped when its
``bin/`` is complete).

Runs go one after another (never two trainings at once) into
``WORK/MODEL/PROTOCOL/seedN/``::

    train.log              fairseq-train's output
    checkpoints/           checkpoint_best.pt = best validation accuracy (--cleanup deletes it)
    train.json             written when training has finished: seconds, updates, parameters
    generate-SPLIT.txt     fairseq-generate's output on each test split
    halting.json           average halting depth per bucket (standard protocol, SUT/UT)
    eval.json              evaluate.py's result
    result.json            everything above in one file (atomically); the run is done

A run with a result.json is skipped (``--force`` redoes it from scratch); one with a
train.json is only evaluated again; an interrupted training resumes from its
checkpoint_last.pt, the time already spent counting against ``--stop-time-hours``.
Every command is printed before it runs; ``--dry-run`` only prints them. At the end
``summarize.py`` prints Table 5 beside the paper's SUT, LSTM and Transformer rows and writes
``WORK/table5.md``, ``WORK/table5.json`` and ``WORK/figure4.png``.
"""
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import evaluate as evaluation  # noqa: E402
import logic_recipe as recipe  # noqa: E402
import summarize  # noqa: E402

ORIGINAL_FILES = [f"{p}{k}" for p in ("train", "test") for k in recipe.ALL_BUCKETS]


def run_checked(command):
    recipe.show(command)
    returncode = subprocess.run(command).returncode
    if returncode != 0:
        raise SystemExit(f"error: {os.path.basename(command[1])} failed (exit {returncode})")


def binarized_complete(protocol_dir, protocol):
    """Whether prepare.py --binarize finished for this protocol (the dictionary and the
    last test split it binarizes are there)."""
    last = "test12" if protocol == "standard" else "test"
    bin_dir = os.path.join(protocol_dir, "bin")
    return all(os.path.exists(os.path.join(bin_dir, name)) for name in
               ("dict.src.txt", f"{last}.src-tgt.src.bin", f"{last}.src-tgt.tgt.bin"))


def prepare_data(args):
    """Generate (if needed) and prepare every requested protocol."""
    original = args.original or os.path.join(args.data_dir, "original")
    missing = [f for f in ORIGINAL_FILES if not os.path.isfile(os.path.join(original, f))]
    if missing:
        if args.original:
            raise SystemExit(f"error: --original {original} lacks {', '.join(missing[:4])}...")
        print(f"== data: generating {original} ({args.pairs:,} pairs, seed {args.gen_seed})", flush=True)
        # an incomplete DATA/original (left by an older version) is not trusted: replaced
        command = recipe.generate_data_command(original, args.pairs, args.gen_seed,
                                               overwrite=os.path.isdir(original))
        if args.dry_run:
            recipe.show(command)
        else:
            run_checked(command)
    for protocol in args.protocols:
        out = os.path.join(args.data_dir, protocol)
        if binarized_complete(out, protocol):
            continue
        # prepare.py writes OUT whole or not at all; an OUT without a complete bin/ (left by
        # an older version, or text only) is not trusted and is replaced (--overwrite)
        print(f"== data: protocol {protocol} -> {out}", flush=True)
        command = recipe.prepare_command(original, out, protocol, overwrite=os.path.isdir(out))
        if args.dry_run:
            recipe.show(command)
        else:
            run_checked(command)


_PARAMS = re.compile(r"num\. (shared|expert) model params: ([\d,]+)")
_UPDATES = re.compile(r"num_updates[ =](\d+)")


def parse_train_log(path):
    """Parameter count (shared + expert, as fairseq-train logs them), the last update
    number and why training stopped."""
    params, updates, stop = {}, None, None
    with open(path, errors="replace") as log:
        for line in log:
            for kind, value in _PARAMS.findall(line):
                params[kind] = int(value.replace(",", ""))
            for value in _UPDATES.findall(line):
                updates = int(value)
            if "Stopping training due to" in line:
                stop = line.split("Stopping training due to", 1)[1].strip()
    return {"params": sum(params.values()) if params else None, "updates": updates,
            "stop_reason": stop}


def one_run(args, config, model, protocol, seed):
    data = os.path.join(args.data_dir, protocol)
    data_bin = os.path.join(data, "bin")
    run_dir = os.path.join(args.work_dir, model, protocol, f"seed{seed}")
    save_dir = os.path.join(run_dir, "checkpoints")
    train_log = os.path.join(run_dir, "train.log")
    train_json = os.path.join(run_dir, "train.json")
    result_path = os.path.join(run_dir, "result.json")
    checkpoint = os.path.join(save_dir, "checkpoint_best.pt")
    train = recipe.train_command(model, data_bin, config, seed, save_dir, args.stop_time_hours,
                                 args.max_update, args.cpu, shlex.split(args.train_args),
                                 required=not args.dry_run)
    print(f"== {recipe.label(model)} | {protocol} | seed {seed} | {config}", flush=True)
    eval_kwargs = dict(buckets=args.buckets, batch_size=args.batch_size, threshold=args.threshold,
                       cpu=args.cpu, generate_extra=shlex.split(args.generate_args))
    if args.dry_run:
        recipe.show(train, train_log)
        evaluation.evaluate(model, protocol, data, checkpoint, run_dir, dry_run=True, **eval_kwargs)
        return
    if os.path.exists(result_path) and not args.force:
        print(f"   done before: {result_path} (--force to redo)")
        return
    if args.force and os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    os.makedirs(run_dir, exist_ok=True)

    if os.path.exists(train_json):
        print(f"   trained before: {train_json}; evaluating")
        trained = recipe.load_json(os.path.basename(train_json), run_dir)
    else:
        if os.path.exists(os.path.join(save_dir, "checkpoint_last.pt")):
            print("   resuming from checkpoints/checkpoint_last.pt", flush=True)
        start = time.time()
        evaluation.run_logged(train, train_log, append=True)  # a resumed run appends
        trained = parse_train_log(train_log)
        trained.update({"seconds_this_call": round(time.time() - start, 1), "command": train,
                        "config": config,
                        "stop_time_hours": float(recipe.flag_value(train, "--stop-time-hours") or 0),
                        "max_update": int(recipe.flag_value(train, "--max-update") or 0)})
        recipe.write_json_atomic(train_json, trained)
        print(f"   trained: {trained['updates']} updates, {trained['params']:,} parameters "
              f"({trained['stop_reason']})" if trained["params"] else "   trained", flush=True)

    evaluated = evaluation.evaluate(model, protocol, data, checkpoint, run_dir, **eval_kwargs)
    result = dict(evaluated)
    result.update({"seed": seed, "config": config, "params": trained.get("params"),
                   "updates": trained.get("updates"), "stop_reason": trained.get("stop_reason"),
                   "train": trained, "run_dir": os.path.abspath(run_dir)})
    recipe.write_json_atomic(result_path, result)
    if args.cleanup:
        shutil.rmtree(save_dir, ignore_errors=True)
    scores = ", ".join(f"{k}: {v['accuracy']:.1f}" for k, v in result["accuracy"].items())
    print(f"   accuracy (%) {scores} -> {result_path}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--data-dir", default=os.path.join("data", "logic"))
    parser.add_argument("--work-dir", default=os.path.join("runs", "logic"))
    parser.add_argument("--original", default=None,
                        help="directory with train0..12/test0..12 to use instead of generating")
    parser.add_argument("--pairs", type=int, default=500_000, help="pairs to generate (default 500000)")
    parser.add_argument("--gen-seed", type=int, default=1, help="generator seed (default 1)")
    parser.add_argument("--reduced", action="store_true",
                        help="the 2-CPU-core configuration (default: full, for a GPU)")
    parser.add_argument("--models", nargs="+", default=list(recipe.MODELS), choices=recipe.MODELS)
    parser.add_argument("--protocols", nargs="+", default=list(recipe.PROTOCOLS), choices=recipe.PROTOCOLS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--stop-time-hours", type=float, default=None,
                        help="wall-clock cap of every model (default: the configuration's)")
    parser.add_argument("--max-update", type=int, default=None, help="update budget of every model (default: the configuration's)")
    parser.add_argument("--buckets", default="7..12",
                        help="standard-protocol buckets to evaluate: 7..12 (default), all, 0..12")
    parser.add_argument("--batch-size", type=int, default=recipe.DEFAULT_GENERATE_BATCH,
                        help="fairseq-generate --batch-size")
    parser.add_argument("--threshold", type=float, default=None,
                        help="alpha_thresh at evaluation (default: the checkpoint's, 0.999)")
    parser.add_argument("--cpu", action="store_true", help="pass --cpu to fairseq-train/-generate")
    parser.add_argument("--train-args", default="", help="extra fairseq-train options (one string)")
    parser.add_argument("--generate-args", default="", help="extra fairseq-generate options (one string)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--force", action="store_true", help="redo runs that have a result.json")
    parser.add_argument("--cleanup", action="store_true", help="delete each run's checkpoints once evaluated")
    args = parser.parse_args(argv)
    try:
        args.buckets = recipe.parse_buckets(args.buckets)
    except (recipe.RecipeError, ValueError) as err:
        parser.error(str(err))
    config = "reduced" if args.reduced else "full"

    start = time.time()
    prepare_data(args)
    for protocol in args.protocols:
        for model in args.models:
            for seed in args.seeds:
                one_run(args, config, model, protocol, seed)
    if args.dry_run:
        recipe.show([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "summarize.py"), args.work_dir])
        return 0
    text = summarize.summarize(args.work_dir)
    print("\n" + text)
    print(f"\n{time.time() - start:.0f} s; written {os.path.join(args.work_dir, 'table5.md')}, "
          f"table5.json, figure4.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
