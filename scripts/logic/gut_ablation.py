#!/usr/bin/env python3
"""Which difference from the recurrent-transformers paper moves GUT on logical inference:
GUT trained with each difference of the old recipe undone alone (issue #52), one seed,
one budget, then one table.

    python scripts/logic/gut_ablation.py [--data-dir data/logic] [--work-dir runs/logic-ablation]
        [--variants as-before decoder-halting kv-state schedule setup paper] [--seed 1]
        [--max-update 2000] [--stage run|report] [--stop-stage run|report] [--dry-run]

The variants (``VARIANTS``), each one ``table5.py`` run of GUT (standard protocol, the
``reduced`` configuration, ``--max-update`` updates) into ``WORK/VARIANT/``:

| variant | setup | what differs from the paper | undone |
|---|---|---|---|
| ``as-before`` | seq2seq | all: decoder halting = the encoder's global-mean (the old trap), keys/values the mixture S_{l-1}, inverse-sqrt schedule, translation task | none |
| ``decoder-halting`` | seq2seq | the decoder halts by stick-breaking (``configs/logic/gut.json`` today) | (1) the decoder's halting |
| ``kv-state`` | seq2seq | ``--encoder-halting-kv state`` (Algorithm 3's keys/values H_{l-1}) | (2) keys and values |
| ``schedule`` | seq2seq | ``--lr-scheduler fixed``: warm-up then a constant rate | (4), its schedule half |
| ``setup`` | classify | the Siamese encoder-only classifier with the paper's schedule, keys/values the mixture | (4) the setup |
| ``paper`` | classify | none (``configs/logic/classify/gut.json``) | all |

Difference (3), TLB's shared block and read-out, is not a GUT option: the classify table's
TLB row is the unshared, memory-mean TLB. The seq2seq variants train on batches of 2,048
source tokens (about 73 pairs, the seq2seq ``reduced`` configuration), the classify ones on
``--batch-size 64`` pairs; ``--warmup`` updates of warm-up for every variant (the old
recipe's inverse-sqrt schedule keeps its shape). Each run is resumable as table5.py's are.

Stages: *run* trains and evaluates each variant with ``table5.py`` (its stages data,
train and evaluate; a variant with a ``result.json`` is not run again); *report* reads ``WORK/VARIANT/.../seedN/result.json`` and writes ``WORK/ablation.md`` and
``WORK/ablation.json`` (accuracy per operator count 7..12, the updates and the hours of one core of each run).
Every command is printed before it runs.
"""
import argparse
import json
import os
import shlex
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logic_recipe as recipe  # noqa: E402
import table5  # noqa: E402
from sut_fairseq.recipes.summary import markdown_table  # noqa: E402
from sut_fairseq.recipes.train_log import training_hours  # noqa: E402

#: variant -> (setup, the model's extra fairseq-train options, what it undoes)
VARIANTS = OrderedDict([
    ("as-before", ("seq2seq", ["--decoder-halting", "global-mean"], "none")),
    ("decoder-halting", ("seq2seq", [], "(1) the decoder's halting")),
    ("kv-state", ("seq2seq", ["--decoder-halting", "global-mean", "--encoder-halting-kv", "state"],
                  "(2) keys and values")),
    ("schedule", ("seq2seq", ["--decoder-halting", "global-mean", "--lr-scheduler", "fixed"],
                  "(4) the schedule")),
    ("setup", ("classify", ["--encoder-halting-kv", "mixture"], "(4) the setup")),
    ("paper", ("classify", [], "all")),
])
#: the batch of each setup (the seq2seq reduced configuration's tokens; the classify table's pairs)
BATCH = {"seq2seq": [], "classify": ["--batch-size", "64"]}


def table5_args(args, variant: str):
    """table5.py's arguments for one variant (GUT, standard protocol, one seed)."""
    setup, extra, _ = VARIANTS[variant]
    budget = ["--warmup-updates", str(args.warmup), "--validate-interval-updates", str(args.interval),
              "--save-interval-updates", str(args.interval)]
    train_args = " ".join(shlex.quote(a) for a in BATCH[setup] + budget + extra)
    return ["--setup", setup, "--reduced", "--protocols", "standard",
            "--models", "gut", "--seeds", str(args.seed), "--data-dir", args.data_dir,
            "--work-dir", os.path.join(args.work_dir, variant), "--max-update", str(args.max_update),
            "--train-args", train_args, "--stop-stage", "evaluate"] + (["--dry-run"] if args.dry_run else [])


def result_path(args, variant: str) -> str:
    setup = VARIANTS[variant][0]
    root = os.path.join(args.work_dir, variant, "classify" if setup == "classify" else "")
    return os.path.join(root, "gut", "standard", f"seed{args.seed}", "result.json")


def report(args) -> str:
    """The table of every variant with a result (accuracy per operator count 7..12, its
    updates and the hours of one core its training took, ``train_log.training_hours`` of
    the run's train.log; "–" without one)."""
    buckets = [str(k) for k in recipe.REPORT_BUCKETS]
    rows, numbers = [], OrderedDict()
    for variant in args.variants:
        path = result_path(args, variant)
        if not os.path.exists(path):
            rows.append([variant, VARIANTS[variant][2]] + ["–"] * len(buckets) + ["not run", "–"])
            continue
        with open(path) as handle:
            result = json.load(handle)
        accuracy = {k: result["accuracy"][k]["accuracy"] for k in buckets if k in result["accuracy"]}
        log = os.path.join(os.path.dirname(path), "train.log")
        hours = training_hours(log) if os.path.exists(log) else None
        numbers[variant] = {"undone": VARIANTS[variant][2], "accuracy": accuracy,
                            "updates": result.get("updates"), "core_hours": hours,
                            "result": os.path.abspath(path)}
        rows.append([variant, VARIANTS[variant][2]]
                    + [f"{accuracy[k]:.1f}" if k in accuracy else "–" for k in buckets]
                    + [result.get("updates"), "–" if hours is None else f"{hours:.2f}"])
    table = markdown_table(["variant", "difference undone", *buckets, "updates", "core-hours"], rows,
                           numeric_from=2)
    text = (f"GUT on logical inference (standard protocol, seed {args.seed}, {args.max_update} updates): "
            "accuracy (%) per number of operators\n\n" + table + "\n")
    recipe.write_text_atomic(os.path.join(args.work_dir, "ablation.md"), text)
    recipe.write_json_atomic(os.path.join(args.work_dir, "ablation.json"),
                             {"seed": args.seed, "max_update": args.max_update, "variants": numbers})
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--data-dir", default=os.path.join("data", "logic"))
    parser.add_argument("--work-dir", default=os.path.join("runs", "logic-ablation"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-update", type=int, default=2000, help="updates of every variant (default 2000)")
    parser.add_argument("--warmup", type=int, default=500, help="warm-up updates of every variant (default 500)")
    parser.add_argument("--interval", type=int, default=500,
                        help="validate and save every N updates (default 500)")
    parser.add_argument("--stage", choices=["run", "report"], default="run", help="first stage (default run)")
    parser.add_argument("--stop-stage", choices=["run", "report"], default="report",
                        help="last stage (default report)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    for name in ("max_update", "warmup", "interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: must be >= 1")
    for variant in args.variants if args.stage == "run" else ():
        argv = table5_args(args, variant)
        print(f"== {variant} (undone: {VARIANTS[variant][2]}): table5.py {shlex.join(argv)}", flush=True)
        status = table5.main(argv)
        if status:
            return status
    if args.stop_stage == "report" and not args.dry_run:
        print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
