#!/usr/bin/env python3
"""Multi30k English->German: the transformer, the SUT and the UT at matched compute, with
BLEU, the halting trade-off and decoding speed (docs/multi30k.md) -- the four stages of
the recipe template (``sut_fairseq.recipes``).

    python scripts/multi30k/table.py --local-dir DIR [--data-dir data/multi30k]
        [--work-dir runs/multi30k] [--config cpu] [--models transformer sut ut]
        [--seeds 1 2 3] [--core N] [--threads 1] [--thresholds 0.1,0.3,...]
        [--stage S] [--stop-stage S] [--dry-run] [--force]

Stages (``--stage`` / ``--stop-stage``, by name or number):

1 data      ``data-prep/multi30k/prepare.py --local-dir DIR --workdir DATA`` (resumes by
            itself; every Multi30k test set found in DIR is prepared);
2 train     fairseq-train for every (model, seed) of ``configs/multi30k/`` into
            ``WORK/MODEL/seedN/`` (resumed from ``checkpoint_last.pt``), each run on
            ``--threads`` threads, pinned to ``--core`` with taskset when given, under GNU
            time (peak memory in train.log); ``train.json`` when it has finished;
3 evaluate  per run: the ``--average`` best checkpoints by validation NLL averaged, then
            fairseq-generate with beam 5 on every test set (``--bpe sentencepiece``: the
            ``D-`` lines are detokenised text) on one thread, timed (and its peak memory),
            scored with SacreBLEU
            (signature printed) and lowercased Moses-tokenised BLEU against
            ``DATA/raw/TEST.de`` (every line scored once) -> ``result.json``; for the
            halting models' first seed also the analyses into ``WORK/analysis/MODEL-seedN/``:
            the alpha_thresh sweep on test 2016 (SacreBLEU, steps executed, decoding time per
            threshold, ``tradeoff.png``), halting heat maps of ``--heatmap-ids`` test
            sentences and the expert-token associations (SUT);
4 report    ``scripts/multi30k/report.py``: ``WORK/table.md`` / ``table.json`` (mean +- sd
            over seeds, one row per model, one column pair per test set, the published
            range), ``learning_curves.png`` and the trade-off summary (the knee).

Every model of a configuration gets the same batches and number of updates. Every command
is printed before it runs; ``--dry-run`` prints them all; running the same command again
resumes.
"""
import os
import re
import shlex
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from sut_fairseq.recipes import RecipeError, load_json, run, show  # noqa: E402
from sut_fairseq.recipes.grid import ModelGrid  # noqa: E402
from sut_fairseq.recipes.runs import RunDir, add_budget_arguments, parse_grid_args, train_grid_run  # noqa: E402
from sut_fairseq.recipes.stages import recipe_parser, run_grid  # noqa: E402
from sut_fairseq.recipes.train_log import best_valid  # noqa: E402

MODELS = ("transformer", "sut", "ut")
GRID = ModelGrid(os.path.join(REPO, "configs", "multi30k"), MODELS)
SRC, TGT = "en", "de"
BEAM = 5
GENERATE_BATCH = 64
DEFAULT_THRESHOLDS = "0.1,0.3,0.5,0.7,0.9,0.99,0.999"
DEFAULT_TESTS = {"test": "test_2016_flickr"}  # what a dry run shows before the data exists


# --------------------------------------------------------------------------- paths

def data_bin(args) -> str:
    return os.path.join(args.data_dir, "data-bin")


def run_dir(args, model: str, seed: int) -> RunDir:
    return RunDir(os.path.join(args.work_dir, model, f"seed{seed}"), f"== {model} seed {seed}")


def test_sets(args) -> dict:
    """``{fairseq subset: test set name}`` of the prepared data (data-bin/subsets.json)."""
    path = os.path.join(data_bin(args), "subsets.json")
    if not os.path.isfile(path):
        if args.dry_run:
            return dict(DEFAULT_TESTS)
        raise RecipeError(f"missing {path}: run the data stage first")
    return load_json(path)["test_subsets"]


def pinned(command, args, time_it: bool = False) -> list:
    """``command`` on ``--threads`` threads, pinned to ``--core`` (taskset) when given,
    under GNU time -v (its report, with the peak memory, ends the log) with ``time_it``."""
    prefix = ["env", f"OMP_NUM_THREADS={args.threads}", f"MKL_NUM_THREADS={args.threads}"]
    if args.core is not None:
        prefix += ["taskset", "-c", str(args.core)]
    if time_it and os.access("/usr/bin/time", os.X_OK):
        prefix += ["/usr/bin/time", "-v"]
    return prefix + list(command)


# --------------------------------------------------------------------------- stages

def data(args) -> None:
    """Stage 1."""
    run([sys.executable, os.path.join(REPO, "data-prep", "multi30k", "prepare.py"),
         "--local-dir", args.local_dir, "--workdir", args.data_dir, *shlex.split(args.prep_args)],
        dry_run=args.dry_run)


def runs(args):
    return [(model, seed) for model in args.models for seed in args.seeds]


_WALL = re.compile(r"\bwall[ =]([\d.]+)")


def peak_rss_gb(log: str):
    """The largest ``Maximum resident set size`` GNU time wrote into ``log`` (GB), or None."""
    peak = None
    with open(log, errors="replace") as handle:
        for line in handle:
            if "Maximum resident set size (kbytes):" in line:
                kb = int(line.rsplit(":", 1)[1])
                peak = max(peak or 0, kb / 1e6)
    return peak


def train_details(args, rd: RunDir) -> dict:
    """What train.json holds beside the shared fields: fairseq's wall clock of the run,
    GNU time's peak memory, the threads and the best validation NLL."""
    walls = [float(w) for w in _WALL.findall(open(rd.train_log, errors="replace").read())]
    return {"train_wall_seconds": walls[-1] if walls else None, "peak_rss_gb": peak_rss_gb(rd.train_log),
            "threads": args.threads, "best_valid_nll_loss": best_valid(rd.train_log, "nll_loss", maximize=False)}


def train(args, model: str, seed: int) -> None:
    """Stage 2 for one run: the grid's training, pinned and timed."""
    train_grid_run(GRID, args, model, seed, run_dir(args, model, seed), data_bin=data_bin(args),
                   wrap=lambda command: pinned(command, args, time_it=True),
                   details=lambda rd: train_details(args, rd))


def average(args, rd: RunDir) -> str:
    """Average the ``--average`` best checkpoints by validation NLL (fewer when the run
    kept fewer) into ``RUN/averaged.pt``; returns its path."""
    from sut_fairseq.eval.average_checkpoints import BEST_PATTERN

    output = os.path.join(rd.dir, "averaged.pt")
    found = ([f for f in os.listdir(rd.save_dir) if BEST_PATTERN.match(f)]
             if os.path.isdir(rd.save_dir) else [])
    n = min(args.average, len(found)) if found else args.average
    if not args.dry_run and not found:
        raise RecipeError(f"{rd.save_dir} holds no checkpoint.best_nll_loss_*.pt to average")
    command = [sys.executable, "-m", "sut_fairseq.eval.average_checkpoints", "--inputs", rd.save_dir,
               "--num-best", str(n), "--metric", "nll_loss", "--output", output, "--drop-optimizer-state"]
    run(command, dry_run=args.dry_run)
    return output


def generate(args, checkpoint: str, subset: str, out: str) -> float:
    """Beam-5 fairseq-generate of one test subset, one thread, under GNU time (its peak
    memory ends ``out``); returns its wall seconds."""
    flags = ["--beam", str(BEAM), "--required-batch-size-multiple", "1", "--num-workers", "0",
             "--bpe", "sentencepiece", "--sentencepiece-model", os.path.join(data_bin(args), "spm.model")]
    command = GRID.generate_command(data_bin(args), checkpoint, subset, GENERATE_BATCH, flags, args.cpu,
                                    shlex.split(args.generate_args), required=not args.dry_run)
    start = time.time()
    run(pinned(command, args, time_it=True), out, dry_run=args.dry_run)
    return time.time() - start


def evaluate(args, model: str, seed: int) -> None:
    """Stage 3 for one run (and, for the first seed of a halting model, the analyses)."""
    from sut_fairseq.eval.generate_output import read_executed_steps
    from sut_fairseq.recipes.scoring import detok_bleu

    rd = run_dir(args, model, seed)
    if rd.needs_evaluation(args.force, args.dry_run):
        checkpoint = average(args, rd)
        tests = {}
        for subset, name in test_sets(args).items():
            out = os.path.join(rd.dir, f"generate-{name}.txt")
            seconds = generate(args, checkpoint, subset, out)
            if args.dry_run:
                continue
            reference = os.path.join(args.data_dir, "raw", f"{name}.{TGT}")
            hyps, sacre, tok = detok_bleu(out, reference, TGT)
            steps = read_executed_steps(out)
            tests[name] = {"subset": subset, "sentences": len(hyps), "sacrebleu": sacre.score,
                           "sacrebleu_signature": sacre.signature, "sacrebleu_detail": sacre.detail,
                           "tok_lc_bleu": tok.score, "tok_lc_bleu_signature": tok.signature,
                           "decode_seconds": round(seconds, 2), "decode_peak_rss_gb": peak_rss_gb(out),
                           "sentences_per_second": len(hyps) / seconds,
                           "steps_executed": {side: s["executed"] / s["possible"] for side, s in steps.items()}}
            print(f"   {name}: SacreBLEU {sacre.score:.2f} ({sacre.signature}), tokenised lowercased "
                  f"BLEU {tok.score:.2f}; {len(hyps)} sentences in {seconds:.1f} s "
                  f"({len(hyps) / seconds:.1f}/s)", flush=True)
        if not args.dry_run:
            rd.write_result({"model": model, "seed": seed, "checkpoint": checkpoint, "beam": BEAM,
                             "tests": tests})
    if GRID.has_halting(model) and seed == args.seeds[0] and not args.no_analysis:
        analyse(args, model, seed, rd)


def analyse(args, model: str, seed: int, rd: RunDir) -> None:
    """The paper's analyses of one trained halting model on test 2016 (fairseq's ``test``)."""
    out = os.path.join(args.work_dir, "analysis", f"{model}-seed{seed}")
    checkpoint = os.path.join(rd.dir, "averaged.pt")
    done = os.path.join(out, "sweep", "sweep.json")
    if os.path.exists(done) and not args.force and not args.dry_run:
        print(f"   analysed before: {out} (--force to redo)")
        return
    gen_args = f"--post-process sentencepiece {args.generate_args}".strip()
    sweep = [sys.executable, "-m", "sut_fairseq.analysis.sweep", "--path", checkpoint,
             "--data", data_bin(args), "--gen-subset", "test", "--metric", "sacrebleu",
             "--thresholds", args.thresholds, "--beam", str(BEAM), "--batch-size", str(GENERATE_BATCH),
             "--generate-args", gen_args, "--output-dir", os.path.join(out, "sweep")]
    heatmaps = [sys.executable, os.path.join(HERE, "heatmaps.py"), "--path", checkpoint,
                "--data", data_bin(args), "--ids", *[str(i) for i in args.heatmap_ids],
                "--output", os.path.join(out, "heatmaps.png")]
    commands = [sweep, heatmaps]
    experts = GRID.model(model)["arch"].startswith("sut")  # a dense UT routes nothing
    if experts:
        commands.append([sys.executable, "-m", "sut_fairseq.analysis.expert_report", "--path", checkpoint,
                         "--data", data_bin(args), "--gen-subset", "test",
                         "--json", os.path.join(out, "experts.json")])
    logs = [None, None, os.path.join(out, "experts.log")]
    if args.dry_run:
        for command, log in zip(commands, logs):
            show(pinned(command, args), log)
        return
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    for command, log in zip(commands, logs):
        run(pinned(command, args), log)
    if experts:
        experts_markdown(os.path.join(out, "experts.json"), os.path.join(out, "experts.md"))


def experts_markdown(json_path: str, md_path: str) -> None:
    """The expert-token tables of ``experts.json`` as markdown (the report's own format)."""
    from sut_fairseq.analysis.expert_report import format_markdown
    from sut_fairseq.recipes import write_text_atomic

    report = load_json(json_path)
    head = (f"{report['checkpoint']}: {report['sentences']} sentence pairs of {report['subset']}, "
            "teacher-forced\n\n")
    write_text_atomic(md_path, head + format_markdown(report["routers"], report["score"], report["min_count"]) + "\n")


def report(args) -> None:
    """Stage 4."""
    command = [sys.executable, os.path.join(HERE, "report.py"), args.work_dir]
    run(command, dry_run=args.dry_run)


# --------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    parser = recipe_parser(__doc__)
    parser.add_argument("--local-dir", default=None, metavar="DIR",
                        help="the Multi30k raw files (data stage; required unless --stage is later)")
    parser.add_argument("--data-dir", default="data/multi30k", help="prepare.py's --workdir")
    parser.add_argument("--work-dir", default="runs/multi30k", help="where the runs go")
    parser.add_argument("--config", default="cpu", help="configuration of configs/multi30k/common.json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--core", type=int, default=None, help="pin every run to this core (taskset)")
    parser.add_argument("--average", type=int, default=5, help="best checkpoints averaged (default 5)")
    parser.add_argument("--thresholds", default=DEFAULT_THRESHOLDS, help="alpha_thresh values of the sweep")
    parser.add_argument("--heatmap-ids", nargs="+", type=int, default=[0, 1, 2],
                        help="test 2016 sentences (ids) drawn as halting heat maps")
    parser.add_argument("--no-analysis", action="store_true", help="evaluate stage: BLEU only")
    parser.add_argument("--prep-args", default="", help="data stage: extra prepare.py options (one string)")
    add_budget_arguments(parser)
    args = parse_grid_args(parser, argv)
    if args.stage == "data" and args.local_dir is None:
        parser.error("the data stage needs --local-dir DIR (the Multi30k raw files); "
                     "or start later with --stage train")
    if args.config not in GRID.configs():
        parser.error(f"--config {args.config!r}: choose from {', '.join(GRID.configs())}")
    return run_grid(args, lambda: data(args), lambda: runs(args),
                    lambda model, seed: train(args, model, seed),
                    lambda model, seed: evaluate(args, model, seed), lambda: report(args))


if __name__ == "__main__":
    sys.exit(main())
