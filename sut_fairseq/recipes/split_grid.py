"""A grid recipe over generated data with named test splits and a one-token target (the
flip-flop and ListOps recipes in ``scripts/flipflop/`` and ``scripts/listops/``).

A :class:`SplitTask` names the task's configs (``configs/TASK/``), its models and its
generator (``data-prep/TASK/generate.py``, whose files :mod:`.generated` describes), and
supplies the four stages:

1. *data*: the generator with ``--binarize`` into ``--data-dir`` unless it is complete;
2. *train*: fairseq-train for every (model, seed) without a ``train.json``;
3. *evaluate*: for every trained run without a ``result.json``, greedy fairseq-generate on
   every test split, scored by exact match of the target token (every line of the split
   scored once, ``recipes/scoring.py``), with the mean executed encoder steps per position
   read from fairseq-generate's closing ``steps executed`` line; a task may add fields
   per split (:meth:`SplitTask.evaluate`'s ``extra``);
4. *report*: the task's summariser, usually over :func:`collect` and :func:`metric_table`.

Runs go into ``WORK/MODEL/seedN/`` (``recipes/runs.py``): ``train.log``, ``checkpoints/``,
``train.json``, ``generate-SPLIT.txt``, ``score-SPLIT.json``, ``result.json``.
"""
import argparse
import os
import shlex
import sys
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence

from ..eval.generate_output import read_executed_steps
from .classify import (classify_grid, read_validate_output, refuse_options, score_validate_output,
                       validate_command)
from .commands import RecipeError, flag_value, run, show
from .files import load_json, load_results, write_json_atomic
from .generated import data_stage
from .grid import ModelGrid
from .runs import RunDir, add_budget_arguments, parse_grid_args, train_grid_run
from .scoring import exact_match
from .stages import recipe_parser, run_grid
from .summary import format_mean_std, markdown_table, mean_std
from .train_log import best_valid, training_hours

#: Greedy decoding of the one target token (at most 2 tokens before the forced </s>: a
#: second token makes the answer wrong) over every example of a split.
GENERATE_FLAGS = ["--beam", "1", "--required-batch-size-multiple", "1",
                  "--max-len-a", "0", "--max-len-b", "2", "--num-workers", "0"]
DEFAULT_GENERATE_BATCH = 256


class SplitTask:
    """One task: ``configs/TASK`` (``models``: the MODEL.json files in the order they run),
    its generator, its data configurations and the test splits each one writes."""

    def __init__(self, name: str, config_dir: str, models: Sequence[str], data_prep: str,
                 data_configs: Dict[str, str], planned_tests: Callable[[str], List[str]]):
        """``data_configs``: the generator's configuration for each training configuration
        (``{"cpu": "small", "full": "paper"}``), the default of ``--data-config``."""
        self.name, self.data_prep = name, data_prep
        self.grid = ModelGrid(config_dir, models)
        self.data_configs, self.planned_tests = dict(data_configs), planned_tests

    # ------------------------------------------------------------------ data
    def generate_data_command(self, out: str, data_config: str, overwrite: bool = False,
                              extra: Sequence[str] = ()) -> List[str]:
        return [sys.executable, self.data_prep, "--config", data_config, "--out", out,
                "--binarize", "--no-progress", *(["--overwrite"] if overwrite else []), *extra]

    @staticmethod
    def data_complete(data_dir: str) -> bool:
        """Whether the generator finished here with ``--binarize``."""
        return all(os.path.exists(os.path.join(data_dir, name))
                   for name in ("stats.json", os.path.join("bin", "dict.src.txt")))

    @staticmethod
    def test_splits(data_dir: str) -> "OrderedDict[str, str]":
        """``{test split: binarized split name}`` from ``DATA/stats.json``."""
        splits = load_json(os.path.join(data_dir, "stats.json")).get("binarized_test_splits")
        if not splits:
            raise RecipeError(f"{data_dir}/stats.json has no binarized_test_splits: was the data "
                              "generated with --binarize?")
        return OrderedDict(splits)

    def splits_to_score(self, args) -> "OrderedDict[str, str]":
        """The test splits of the data (``--splits`` picks some), binarized names as the
        generator will give them on a dry run before the data exists."""
        if args.dry_run and not self.data_complete(args.data_dir):
            names = self.planned_tests(args.data_config)
            available = OrderedDict((n, "test" if k == 0 else f"test{k}") for k, n in enumerate(names))
        else:
            available = self.test_splits(args.data_dir)
        missing = [s for s in (args.splits or []) if s not in available]
        if missing:
            raise RecipeError(f"{args.data_dir} has no test split {missing[0]!r}; it has "
                              f"{', '.join(available)}")
        return OrderedDict((n, b) for n, b in available.items() if not args.splits or n in args.splits)

    def prepare_data(self, args) -> None:
        """Stage 1: generate and binarize the data unless it is complete."""
        data_stage(args, self.data_complete(args.data_dir),
                   self.generate_data_command(args.data_dir, args.data_config,
                                              overwrite=os.path.isdir(args.data_dir)))

    # ------------------------------------------------------------------ runs
    def work_root(self, args) -> str:
        """Where the runs and the report go (``WORK``)."""
        return args.work_dir

    def check(self, args) -> None:
        """Refuse what this task cannot run (RecipeError); nothing here."""

    def runs(self, args) -> list:
        """Every (model, seed, RunDir) of the grid."""
        return [(model, seed, RunDir(os.path.join(self.work_root(args), model, f"seed{seed}"),
                                     f"== {self.grid.label(model)} | seed {seed} | {args.config}"))
                for model in args.models for seed in args.seeds]

    def train_flags(self, args, model: str, config: Optional[str] = None) -> List[str]:
        return self.grid.train_flags(model, config or args.config, extra=shlex.split(args.train_args))

    def train(self, args, model: str, seed: int, run_dir: RunDir) -> None:
        """Stage 2 for one run: fairseq-train (resumed when interrupted) -> train.json."""
        train_grid_run(self.grid, args, model, seed, run_dir)

    # ------------------------------------------------------------------ scoring
    def generate(self, args, run_dir: RunDir, binarized: str, output: str,
                 extra: Sequence[str] = ()) -> None:
        """Greedy fairseq-generate over one whole binarized split into ``output``."""
        run(self.grid.generate_command(os.path.join(args.data_dir, "bin"), run_dir.checkpoint,
                                       binarized, args.batch_size, GENERATE_FLAGS, args.cpu,
                                       [*shlex.split(args.generate_args), *extra],
                                       required=not args.dry_run),
            output, dry_run=args.dry_run)

    def score(self, args, split: str, output: str, max_steps: Optional[int]) -> Dict:
        """Exact match of ``output`` against ``DATA/SPLIT.tgt`` (``accuracy`` in %), the mean
        executed encoder steps per position and, for a chunked encoder, per chunk (None
        without the accounting line)."""
        result = exact_match(output, os.path.join(args.data_dir, f"{split}.tgt"))
        result["accuracy"] = result["exact_match"]
        executed = read_executed_steps(output).get("encoder")
        result["encoder_steps_executed"] = ([executed["executed"], executed["possible"]]
                                            if executed else None)
        result["mean_encoder_steps"] = (max_steps * executed["executed"] / executed["possible"]
                                        if executed and executed["possible"] and max_steps else None)
        result["mean_encoder_steps_per_chunk"] = executed["per_chunk"] if executed else None
        return result

    def trained_command(self, args, model: str, run_dir: RunDir):
        """``(configuration, fairseq-train options)`` of a run as it was trained (from
        ``train.json``); on a dry run, as it would be."""
        if args.dry_run:
            return args.config, self.train_flags(args, model)
        trained = run_dir.trained()
        config = trained.get("config", args.config)
        return config, trained.get("command") or self.train_flags(args, model, config)

    def evaluate(self, args, model: str, seed: int, run_dir: RunDir,
                 extra: Optional[Callable[[str, RunDir, str, str, Dict], Dict]] = None) -> None:
        """Stage 3 for one trained run: every test split -> ``score-SPLIT.json`` and
        ``result.json``. ``extra(model, run_dir, split, generate_output, score)`` returns
        more fields for the split (its own generate runs included; on a dry run it is
        called with an empty score and only prints its commands)."""
        if not run_dir.needs_evaluation(args.force, args.dry_run):
            return
        splits = self.splits_to_score(args)
        config, command = self.trained_command(args, model, run_dir)
        layers = flag_value(command, "--encoder-layers")
        max_steps = int(layers) if layers else None
        scores = OrderedDict()
        for split, binarized in splits.items():
            output = os.path.join(run_dir.dir, f"generate-{split}.txt")
            self.generate(args, run_dir, binarized, output)
            if args.dry_run:
                if extra is not None:
                    extra(model, run_dir, split, output, {})
                continue
            score = self.score(args, split, output, max_steps)
            if extra is not None:
                score.update(extra(model, run_dir, split, output, score))
            write_json_atomic(os.path.join(run_dir.dir, f"score-{split}.json"), score)
            scores[split] = score
            steps = score["mean_encoder_steps"]
            print(f"   {split}: accuracy {score['accuracy']:.2f}% ({score['correct']} / {score['total']})"
                  + ("" if steps is None else f", {steps:.2f} of {max_steps} encoder steps"), flush=True)
        if args.dry_run:
            return
        run_dir.write_result({
            "model": model, "label": self.grid.label(model), "seed": seed, "config": config,
            "accuracy": {s: v["accuracy"] for s, v in scores.items()},
            "mean_encoder_steps": {s: v["mean_encoder_steps"] for s, v in scores.items()},
            "max_steps": max_steps,
            "splits": {s: {k: v for k, v in score.items() if k not in ("generate_output", "reference")}
                       for s, score in scores.items()}}, args.cleanup)

    # ------------------------------------------------------------------ the command line
    def parser(self, doc: str) -> argparse.ArgumentParser:
        """A recipe's parser with the options every split-grid recipe takes."""
        parser = recipe_parser(doc)
        parser.add_argument("--data-dir", default=os.path.join("data", self.name))
        parser.add_argument("--work-dir", default=os.path.join("runs", self.name))
        defaults = ", ".join(f"{d} for --config {c}" for c, d in self.data_configs.items())
        parser.add_argument("--data-config", default=None,
                            choices=sorted(set(self.data_configs.values())),
                            help=f"the generator's --config (default: {defaults})")
        parser.add_argument("--config", default="cpu",
                            help="training configuration of common.json (default: cpu)")
        parser.add_argument("--models", nargs="+", default=list(self.grid.models),
                            choices=self.grid.models)
        parser.add_argument("--seeds", nargs="+", type=int, default=[1])
        parser.add_argument("--splits", nargs="+", default=None, metavar="SPLIT",
                            help="test splits to evaluate (default: every test split of the data)")
        parser.add_argument("--batch-size", type=int, default=DEFAULT_GENERATE_BATCH,
                            help="fairseq-generate --batch-size")
        add_budget_arguments(parser)
        return parser

    def main(self, parser: argparse.ArgumentParser, argv, summarize: Callable[[str, str], str],
             summarize_script: str, evaluate: Optional[Callable] = None) -> int:
        """Parse ``argv`` and run the selected stages. ``evaluate(args, model, seed, run)``
        replaces :meth:`evaluate` when given; the report stage prints
        ``summarize(WORK, DATA)`` (on a dry run: the command line of ``summarize_script``)."""
        args = parse_grid_args(parser, argv)
        if args.config not in self.grid.configs():
            parser.error(f"unknown --config {args.config!r}: choose from {', '.join(self.grid.configs())}")
        if args.data_config is None:
            args.data_config = self.data_configs.get(args.config, next(iter(self.data_configs.values())))
        try:
            self.check(args)
        except RecipeError as err:
            parser.error(str(err))
        work = self.work_root(args)

        def report():
            if args.dry_run:
                show([sys.executable, summarize_script, work, "--data-dir", args.data_dir])
            else:
                print("\n" + summarize(work, args.data_dir))

        evaluate = evaluate or (lambda args, *run: self.evaluate(args, *run))
        return run_grid(args, lambda: self.prepare_data(args), lambda: self.runs(args),
                        lambda *r: self.train(args, *r), lambda *r: evaluate(args, *r), report)


class ClassifySplitTask(SplitTask):
    """A :class:`SplitTask` in the classify setup (:mod:`.classify`): the models of
    ``CONFIG_DIR/classify/``, the data also in the classification layout (``classify_prep``
    over the generator's files: ``DATA/classify/{input0,label,splits.json}``), runs in
    ``WORK/classify/MODEL/seedN/``, the test splits scored by one fairseq-validate
    (``validate.txt``), each against ``DATA/SPLIT.tgt``."""

    def __init__(self, name: str, config_dir: str, models: Sequence[str], data_prep: str,
                 classify_prep: str, data_configs: Dict[str, str],
                 planned_tests: Callable[[str], List[str]]):
        super().__init__(name, config_dir, models, data_prep, data_configs, planned_tests)
        self.grid = classify_grid(config_dir, models)
        self.classify_prep = classify_prep

    @staticmethod
    def classify_dir(data_dir: str) -> str:
        return os.path.join(data_dir, "classify")

    def data_complete(self, data_dir: str) -> bool:
        """The generator's data and its classification layout are both there."""
        return (SplitTask.data_complete(data_dir)
                and os.path.isfile(os.path.join(self.classify_dir(data_dir), "splits.json")))

    def test_splits(self, data_dir: str) -> "OrderedDict[str, str]":
        """``{test split: binarized split name}`` from ``DATA/classify/splits.json``."""
        return OrderedDict(load_json(os.path.join(self.classify_dir(data_dir), "splits.json"))
                           ["binarized_test_splits"])

    def prepare_data(self, args) -> None:
        """Stage 1: the generator (unless its data is complete), then the classification
        layout (unless there)."""
        data_stage(args, SplitTask.data_complete(args.data_dir),
                   self.generate_data_command(args.data_dir, args.data_config,
                                              overwrite=os.path.isdir(args.data_dir)))
        out = self.classify_dir(args.data_dir)
        if os.path.isfile(os.path.join(out, "splits.json")):
            return
        print(f"== data: classification layout -> {out}", flush=True)
        run([sys.executable, self.classify_prep, "--data", args.data_dir, "--out", out,
             *(["--overwrite"] if os.path.isdir(out) else [])], dry_run=args.dry_run)

    def work_root(self, args) -> str:
        return os.path.join(args.work_dir, "classify")

    def check(self, args) -> None:
        refuse_options(args, "classify", {
            "generate_args": "the classify setup scores with fairseq-validate, not fairseq-generate"})

    def train(self, args, model: str, seed: int, run_dir: RunDir) -> None:
        train_grid_run(self.grid, args, model, seed, run_dir, data_bin=self.classify_dir(args.data_dir))

    def evaluate(self, args, model: str, seed: int, run_dir: RunDir, extra=None) -> None:
        """Stage 3 for one trained run: one fairseq-validate over every test split
        (``validate.txt``) -> ``score-SPLIT.json`` and ``result.json`` (as :meth:`SplitTask.evaluate`'s)."""
        if not run_dir.needs_evaluation(args.force, args.dry_run):
            return
        config, command = self.trained_command(args, model, run_dir)
        layers = flag_value(command, "--encoder-layers")
        scores = OrderedDict()
        splits = self.splits_to_score(args)
        output = os.path.join(run_dir.dir, "validate.txt")
        run(validate_command(self.grid, self.classify_dir(args.data_dir), run_dir.checkpoint,
                             list(splits.values()), args.batch_size, args.cpu, required=not args.dry_run),
            output, dry_run=args.dry_run)
        if args.dry_run:
            return
        for split, binarized in splits.items():
            score = score_validate_output(output, binarized, os.path.join(args.data_dir, f"{split}.tgt"))
            score["mean_encoder_steps_per_chunk"] = read_validate_output(output, binarized).get("chunk_steps_enc")
            write_json_atomic(os.path.join(run_dir.dir, f"score-{split}.json"), score)
            scores[split] = score
            print(f"   {split}: accuracy {score['accuracy']:.2f}% ({score['correct']} / {score['total']})",
                  flush=True)
        run_dir.write_result({
            "model": model, "label": self.grid.label(model), "seed": seed, "config": config,
            "setup": "classify", "accuracy": {s: v["accuracy"] for s, v in scores.items()},
            "mean_encoder_steps": {s: v["mean_encoder_steps"] for s, v in scores.items()},
            "max_steps": int(layers) if layers else None, "splits": scores}, args.cleanup)


# --------------------------------------------------------------------------- summaries

def collect(work_dir: str, grid: ModelGrid, metrics: Sequence[str]) -> "OrderedDict[str, Dict]":
    """Per model (in the grid's order): label, seeds, params, updates, max steps and, for
    every per-split ``metric`` of the results (``result["splits"][split][metric]``), the
    seed mean, std and count per split (None where no seed has a value)."""
    results = load_results(work_dir, ["model", "splits"], pattern=os.path.join("*", "seed*", "result.json"))
    models: "OrderedDict[str, Dict]" = OrderedDict()
    for name in grid.models:
        runs = [r for r in results if r["model"] == name]
        if not runs:
            continue
        splits = list(OrderedDict.fromkeys(s for r in runs for s in r["splits"]))
        models[name] = {"label": runs[0]["label"], "seeds": [r["seed"] for r in runs],
                        "params": runs[0].get("params"), "updates": [r.get("updates") for r in runs],
                        "max_steps": runs[0].get("max_steps"), "splits": splits}
        for metric in metrics:
            models[name][metric] = {s: mean_std([r["splits"][s][metric] for r in runs
                                                 if r["splits"].get(s, {}).get(metric) is not None])
                                    for s in splits}
        logs = [os.path.join(os.path.dirname(r["_path"]), "train.log") for r in runs]
        logs = [log for log in logs if os.path.exists(log)]
        hours = [h for h in map(training_hours, logs) if h is not None]
        models[name]["training"] = {
            "valid": mean_std([v for v in (best_valid(log, "accuracy") for log in logs) if v is not None]),
            "hours": mean_std(hours)}
        models[name]["hours_all_runs"] = sum(hours) if hours else None
    return models


def training_text(models: Dict[str, Dict]) -> str:
    """What each model's runs cost and reached (:func:`collect`'s ``training``): the
    updates of each seed, the best validation accuracy and the hours of one core per run
    (mean ± sd over the seeds; ``train_log.training_hours``) and for all its runs."""
    seeds = max((len(m["seeds"]) for m in models.values()), default=1)
    rows = [[m["label"], "/".join(f"{u:,}" for u in m["updates"] if u is not None) or "–",
             format_mean_std(m["training"]["valid"], seeds),
             "–" if m["training"]["hours"] is None else f"{m['training']['hours'][0]:.2f}",
             "–" if m["hours_all_runs"] is None else f"{m['hours_all_runs']:.2f}"]
            for m in models.values()]
    return ("Training per run: the updates of each seed, the best validation accuracy (%, mean "
            "± sd over the seeds), and the hours of one core per run (fairseq's update rates) and "
            "for all the runs of the model:\n\n"
            + markdown_table(["model", "updates", "valid", "core-h per run", "core-h, all runs"], rows) + "\n")


def metric_table(models: Dict[str, Dict], splits: Sequence[str], metric: str,
                 headers: Optional[Dict[str, str]] = None, digits: int = 1,
                 info: bool = True) -> str:
    """A markdown table: one row per model, one column per split, the seed mean of
    ``metric`` and, where a model has more than one seed, its sample standard deviation
    (``mean ± sd``; "–" where there is no value); with ``info`` also parameters and the
    updates of each seed."""
    headers = headers or {}
    header = ["model"] + (["params", "updates"] if info else []) + [headers.get(s, s) for s in splits]
    rows = []
    for m in models.values():
        cells = [m["label"]]
        if info:
            cells += [f"{m['params']:,}" if m["params"] else "–",
                      "/".join(f"{u:,}" for u in m["updates"] if u is not None) or "–"]
        for s in splits:
            value = m[metric].get(s)
            if value is None:
                cells.append("–")
            else:
                mean, std, n = value
                cells.append(f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if n > 1 else ""))
        rows.append(cells)
    return markdown_table(header, rows)


def reference_row(label: str, values: Dict[str, Optional[float]], splits: Sequence[str],
                  info: bool = True, scale: float = 1.0) -> List[str]:
    """A table row in italics for a baseline or a paper's number (``values`` per split,
    times ``scale``; "–" where missing), shaped like :func:`metric_table`'s rows."""
    cells = [f"*{label}*"] + (["–", "–"] if info else [])
    for s in splits:
        value = values.get(s)
        cells.append("–" if value is None else f"*{scale * value:.1f}*")
    return cells


def add_rows(table: str, rows: Sequence[Sequence[str]]) -> str:
    """``table`` with more markdown rows appended."""
    return "\n".join([table] + ["| " + " | ".join(r) + " |" for r in rows])


def accuracy_plot(path: str, models: Dict[str, Dict], splits: Sequence[str], title: str,
                  metric: str = "accuracy", ylabel: str = "accuracy (%)") -> None:
    """One line per model over the test splits (named on the x axis), as a PNG; the seed
    mean, with error bars of ± one standard deviation where a model has several seeds."""
    from .summary import line_plot

    series, errors = OrderedDict(), {}
    for m in models.values():
        points = [(k, *m[metric][s]) for k, s in enumerate(splits) if m[metric].get(s)]
        series[m["label"]] = ([p[0] for p in points], [p[1] for p in points])
        if any(p[3] > 1 for p in points):  # the seeds' sample standard deviation
            errors[m["label"]] = [p[2] for p in points]
    line_plot(path, series, "test split", ylabel, title, xticks=list(range(len(splits))),
              xticklabels=list(splits), errors=errors)


def json_ready(models: Dict[str, Dict]) -> Dict[str, Dict]:
    """``collect``'s output with its (mean, std, n) tuples as lists."""
    return {name: {k: ({s: (list(v) if v else None) for s, v in val.items()}
                       if isinstance(val, dict) else val) for k, val in m.items()}
            for name, m in models.items()}


#: The per-split step metrics of a result (``collect`` them for :func:`steps_text`).
STEP_METRICS = ("mean_encoder_steps", "mean_encoder_steps_per_chunk")


def steps_text(models: Dict[str, Dict], splits: Sequence[str]) -> str:
    """The mean executed encoder steps per position (of each model's L) and, for the
    models with chunks, per chunk, as markdown with a line of explanation each; a model
    that counts no steps (fairseq's transformer encoder) is left out of both."""
    def counting(metric):
        return {name: m for name, m in models.items() if any(v is not None for v in m[metric].values())}

    text = ("Mean executed encoder steps per position (of each model's L):\n\n"
            + metric_table(counting("mean_encoder_steps"), splits, "mean_encoder_steps", digits=2,
                           info=False) + "\n")
    chunked = counting("mean_encoder_steps_per_chunk")
    if chunked:
        text += ("\nMean executed encoder steps per chunk (the chunk-wise models; a chunk's steps "
                 "are the most one of its tokens executed):\n\n"
                 + metric_table(chunked, splits, "mean_encoder_steps_per_chunk", digits=2, info=False) + "\n")
    return text


def ordered_splits(models: Dict[str, Dict], order: Sequence[str]) -> List[str]:
    """The test splits of the results: those of ``order`` first, in that order, then any
    others sorted."""
    present = {s for m in models.values() for s in m["splits"]}
    return [s for s in order if s in present] + sorted(present - set(order))


def write_report(work_dir: str, stem: str, text: str, models: Dict[str, Dict],
                 splits: Sequence[str], title: str, extra: Optional[Dict] = None) -> str:
    """Write ``WORK/STEM.md`` (``text``), ``WORK/STEM.json`` (the splits, the models of
    :func:`collect` and ``extra``) and ``WORK/accuracy.png`` (:func:`accuracy_plot`, with
    ``title``), atomically; return ``text``."""
    from .files import write_text_atomic

    write_text_atomic(os.path.join(work_dir, f"{stem}.md"), text)
    write_json_atomic(os.path.join(work_dir, f"{stem}.json"),
                      {"splits": list(splits), "models": json_ready(models), **(extra or {})})
    accuracy_plot(os.path.join(work_dir, "accuracy.png"), models, splits, title)
    return text


def report_main(doc: str, task: str, summarize: Callable[[str, str], str], stem: str,
                argv=None) -> None:
    """The command line of a split-grid task's summariser (``summary_main`` with its
    files: ``STEM.md``, ``STEM.json``, ``accuracy.png``; data in ``data/TASK``)."""
    from .summary import summary_main

    summary_main(doc, os.path.join("data", task), summarize,
                 [f"{stem}.md", f"{stem}.json", "accuracy.png"], argv,
                 compare=lambda work_dir, a, b: compare_models(os.path.join(work_dir, f"{stem}.json"), a, b))


def compare_models(report_json: str, a: str, b: str) -> str:
    """Model ``a`` against model ``b`` on every test split of a written report
    (``WORK/STEM.json``): ``summary.compare_text`` of their accuracies; a model without
    runs is refused, naming those with runs."""
    from .summary import compare_text

    report = load_json(report_json)
    models = {name: (m["label"], m["seeds"], {s: (tuple(v) if v else None) for s, v in m["accuracy"].items()})
              for name, m in report["models"].items()}
    return compare_text(models, a, b, report["splits"], "test split", "no runs of that model in the report")
