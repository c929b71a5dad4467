#!/usr/bin/env python3
"""Logical inference end to end: generate the data if missing, prepare and binarize each
protocol, train every model, evaluate, print the table -- the four stages of the shared
recipe template (``sut_fairseq.recipes``): 1 data, 2 train, 3 evaluate, 4 report -- in
one of two setups (``--setup``; docs/logic.md#the-classify-setup):

* ``classify`` (default): the recurrent-transformers paper's Table 2 setup: Siamese
  encoder-only classifiers (``configs/logic/classify/``: ut, gut, tlb, gutlb and the sut
  and transformer baselines; ``--task sut_classification``) on ``prepare.py --format
  classify``'s data in ``DATA/classify/PROTOCOL/``, runs in
  ``WORK/classify/MODEL/PROTOCOL/seedN/``, the test splits scored by one fairseq-validate
  (``validate.txt``); the report is
  ``WORK/classify/table5.md``;
* ``seq2seq``: paper Table 5 and Figure 4 of the SUT paper as below (translation task,
  ``configs/logic/``), unchanged.

    python scripts/logic/table5.py [--setup classify|seq2seq] [--data-dir data/logic]
        [--work-dir runs/logic] [--stage S] [--stop-stage S]
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

Stages (``--stage``/``--stop-stage``, by name or number): *data* generates and prepares
what is missing; *train* trains every run without a ``train.json`` (an interrupted
training resumes from its checkpoint_last.pt, the time already spent counting against
``--stop-time-hours``); *evaluate* evaluates every trained run without a ``result.json``;
*report* (``summarize.py``) prints Table 5 beside the paper's SUT, LSTM and Transformer
rows and writes ``WORK/table5.md``, ``WORK/table5.json`` and ``WORK/figure4.png``.
``--force`` redoes the selected stages of every run from scratch (the train stage deletes
the run). Every command is printed before it runs; ``--dry-run`` only prints them.
"""
import os
import shlex
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import evaluate as evaluation  # noqa: E402
import logic_recipe as recipe  # noqa: E402
import summarize  # noqa: E402
from sut_fairseq.recipes import RecipeError, recipe_parser, run_grid  # noqa: E402
from sut_fairseq.recipes import classify  # noqa: E402
from sut_fairseq.recipes.runs import RunDir, add_budget_arguments, parse_grid_args  # noqa: E402
from sut_fairseq.recipes.train_log import parse_train_log  # noqa: E402

ORIGINAL_FILES = [f"{p}{k}" for p in ("train", "test") for k in recipe.ALL_BUCKETS]


def binarized_complete(protocol_dir, protocol, setup="seq2seq"):
    """Whether prepare.py --binarize finished for this protocol (the dictionary and the
    last test split it binarizes are there; for classify, those of label/ and input1/)."""
    last = "test12" if protocol == "standard" else "test"
    bin_dir = os.path.join(protocol_dir, "bin")
    if setup == "classify":
        names = [os.path.join("label", "dict.txt"), os.path.join("label", f"{last}.bin"),
                 os.path.join("input1", f"{last}.bin")]
    else:
        names = ["dict.src.txt", f"{last}.src-tgt.src.bin", f"{last}.src-tgt.tgt.bin"]
    return all(os.path.exists(os.path.join(bin_dir, name)) for name in names)


def prepare_data(args):
    """Stage 1: generate (if needed) and prepare every requested protocol."""
    original = args.original or os.path.join(args.data_dir, "original")
    missing = [f for f in ORIGINAL_FILES if not os.path.isfile(os.path.join(original, f))]
    if missing:
        if args.original:
            raise SystemExit(f"error: --original {original} lacks {', '.join(missing[:4])}...")
        print(f"== data: generating {original} ({args.pairs:,} pairs, seed {args.gen_seed})", flush=True)
        # an incomplete DATA/original (left by an older version) is not trusted: replaced
        recipe.run(recipe.generate_data_command(original, args.pairs, args.gen_seed,
                                                overwrite=os.path.isdir(original)),
                   dry_run=args.dry_run)
    for protocol in args.protocols:
        out = recipe.protocol_dir(args.data_dir, protocol, args.setup)
        if binarized_complete(out, protocol, args.setup):
            continue
        # prepare.py writes OUT whole or not at all; an OUT without a complete bin/ (left by
        # an older version, or text only) is not trusted and is replaced (--overwrite)
        print(f"== data: protocol {protocol} ({args.setup}) -> {out}", flush=True)
        recipe.run(recipe.prepare_command(original, out, protocol, overwrite=os.path.isdir(out),
                                          setup=args.setup),
                   dry_run=args.dry_run)


def work_root(args):
    """The setup's runs: ``WORK`` (seq2seq) or ``WORK/classify``."""
    return os.path.join(args.work_dir, "classify") if args.setup == "classify" else args.work_dir


def grid(args, config):
    """Every (model, protocol, seed) run of the grid: (model, protocol, seed, RunDir)."""
    label = recipe.grid_for(args.setup).label
    return [(model, protocol, seed, RunDir(
        os.path.join(work_root(args), model, protocol, f"seed{seed}"),
        f"== {label(model)} | {protocol} | seed {seed} | {config} | {args.setup}"))
        for protocol in args.protocols for model in args.models for seed in args.seeds]


def train(args, config, model, protocol, seed, run):
    """Stage 2 for one run: fairseq-train (resumed when interrupted) -> train.json."""
    command = recipe.grid_for(args.setup).train_command(
        model, os.path.join(recipe.protocol_dir(args.data_dir, protocol, args.setup), "bin"), config,
        seed, run.save_dir, args.stop_time_hours, args.max_update, args.cpu,
        shlex.split(args.train_args), required=not args.dry_run)
    seconds = run.train(command, args.force, args.dry_run)
    if seconds is None:
        return
    trained = parse_train_log(run.train_log)
    trained.update({"seconds_this_call": round(seconds, 1), "command": command, "config": config,
                    "setup": args.setup, "stop_time_hours": float(recipe.flag_value(command, "--stop-time-hours") or 0),
                    "max_update": int(recipe.flag_value(command, "--max-update") or 0)})
    recipe.write_json_atomic(run.train_json, trained)
    print(f"   trained: {trained['updates']} updates, {trained['params']:,} parameters "
          f"({trained['stop_reason']})" if trained["params"] else "   trained", flush=True)


def evaluate(args, config, model, protocol, seed, run):
    """Stage 3 for one trained run: every test split scored -> result.json."""
    if not run.needs_evaluation(args.force, args.dry_run):
        return
    if args.setup == "classify":
        evaluated = evaluate_classify(args, protocol, run)
    else:
        evaluated = evaluation.evaluate(
            model, protocol, os.path.join(args.data_dir, protocol), run.checkpoint, run.dir,
            buckets=args.buckets, batch_size=args.batch_size, threshold=args.threshold, cpu=args.cpu,
            generate_extra=shlex.split(args.generate_args), dry_run=args.dry_run)
    if args.dry_run:
        return
    trained = run.trained()
    result = dict(evaluated)
    result.update({"model": model, "protocol": protocol, "setup": args.setup, "seed": seed,
                   "config": trained.get("config", config),
                   "params": trained.get("params"), "updates": trained.get("updates"),
                   "stop_reason": trained.get("stop_reason"), "train": trained,
                   "run_dir": os.path.abspath(run.dir)})
    recipe.write_json_atomic(run.result, result)
    if args.cleanup:
        run.cleanup()
    scores = ", ".join(f"{k}: {v['accuracy']:.1f}" for k, v in result["accuracy"].items())
    print(f"   accuracy (%) {scores} -> {run.result}", flush=True)


def evaluate_classify(args, protocol, run):
    """Stage 3 of the classify setup for one run: one fairseq-validate over every test
    split of the protocol (``validate.txt``), each split scored against its ``.label``
    file. Returns ``{"accuracy": {key: score}, "halting_depth": None}`` (None on a dry
    run)."""
    data = recipe.protocol_dir(args.data_dir, protocol, "classify")
    splits = recipe.eval_splits(protocol, args.buckets)
    output = os.path.join(run.dir, "validate.txt")
    recipe.run(recipe.validate_command(os.path.join(data, "bin"), run.checkpoint,
                                       [split["subset"] for split in splits], args.batch_size,
                                       args.cpu, classify.overrides(args.threshold),
                                       required=not args.dry_run),
               output, dry_run=args.dry_run)
    if args.dry_run:
        return None
    accuracy = {split["key"]: classify.score_validate_output(
        output, split["subset"], os.path.join(data, f"{split['text']}.label")) for split in splits}
    return {"accuracy": accuracy, "halting_depth": None}


def report(args):
    """Stage 4: the setup's table (table5.md, table5.json, the figures) from every
    result.json of its runs."""
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "summarize.py"), work_root(args), "--setup", args.setup]
    if args.dry_run:
        recipe.show(command)
        return
    print("\n" + summarize.summarize(work_root(args), setup=args.setup))
    figures = "figure4.png, accuracy.png" if args.setup == "seq2seq" else "accuracy.png"
    print(f"\nwritten {os.path.join(work_root(args), 'table5.md')}, table5.json, {figures}")


def check_setup(args):
    """The setup's default models; models and options the setup cannot run are refused
    (RecipeError naming them)."""
    args.models = args.models or list(recipe.CLASSIFY_MODELS if args.setup == "classify" else recipe.MODELS)
    recipe.check_models(args.models, args.setup)
    if args.setup == "classify":
        classify.refuse_options(args, "classify", {
            "generate_args": "the classify setup scores with fairseq-validate, not fairseq-generate"})


def main(argv=None):
    parser = recipe_parser(__doc__)
    parser.add_argument("--data-dir", default=os.path.join("data", "logic"))
    parser.add_argument("--work-dir", default=os.path.join("runs", "logic"))
    parser.add_argument("--original", default=None,
                        help="directory with train0..12/test0..12 to use instead of generating")
    parser.add_argument("--pairs", type=int, default=500_000, help="pairs to generate (default 500000)")
    parser.add_argument("--gen-seed", type=int, default=1, help="generator seed (default 1)")
    parser.add_argument("--reduced", action="store_true",
                        help="the 2-CPU-core configuration (default: full, for a GPU)")
    classify.add_setup_argument(parser)
    parser.add_argument("--models", nargs="+", default=None,
                        choices=list(dict.fromkeys(recipe.ALL_MODELS + recipe.CLASSIFY_MODELS)),
                        help="default: the setup's models (classify: "
                             f"{' '.join(recipe.CLASSIFY_MODELS)}; seq2seq: {' '.join(recipe.MODELS)})")
    parser.add_argument("--protocols", nargs="+", default=list(recipe.PROTOCOLS), choices=recipe.PROTOCOLS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--buckets", default="7..12",
                        help="standard-protocol buckets to evaluate: 7..12 (default), all, 0..12")
    parser.add_argument("--batch-size", type=int, default=recipe.DEFAULT_GENERATE_BATCH,
                        help="fairseq-generate / fairseq-validate --batch-size")
    parser.add_argument("--threshold", type=float, default=None,
                        help="alpha_thresh at evaluation (default: the checkpoint's, 0.999)")
    add_budget_arguments(parser)
    args = parse_grid_args(parser, argv)
    try:
        args.buckets = recipe.parse_buckets(args.buckets)
        check_setup(args)
    except (RecipeError, ValueError) as err:
        parser.error(str(err))
    config = "reduced" if args.reduced else "full"

    return run_grid(args, lambda: prepare_data(args), lambda: grid(args, config),
                    partial(train, args, config), partial(evaluate, args, config), lambda: report(args))


if __name__ == "__main__":
    sys.exit(main())
