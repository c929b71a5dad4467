#!/usr/bin/env python3
"""Paper Table 5 and Figure 4 from per-run results of ``table5.py``.

    python scripts/logic/summarize.py WORK_DIR [--out-dir DIR] [--setup seq2seq|classify]

``--setup classify`` (``table5.py --setup classify``'s ``WORK/classify``): the models'
labels from ``configs/logic/classify/`` and, beneath them, the recurrent-transformers
paper's Table 2 where the repository quotes it; there is no halting-depth analysis.

Reads every ``WORK_DIR/MODEL/PROTOCOL/seedN/result.json`` (``model``, ``protocol``,
``seed``, ``accuracy`` {bucket or A/B/C: {"accuracy": %, ...}}, ``halting_depth``).
A cell is the accuracy of one seed, or over K > 1 seeds their mean ± sample standard
deviation ``(n=K)``. Printed:

* Table 5: accuracy (%) per operator count 7..12 (standard protocol) and on the
  compositional splits A/B/C, one row per model, the paper's SUT, LSTM and Transformer rows beneath;
* the in-distribution buckets 0..6 when they were evaluated, and their pooled accuracy
  (``0-6``: correct over total pairs of the seven test files, the figure "in distribution"
  refers to);
* what each model's runs of the standard protocol cost and reached, from the train.log
  beside each result.json: updates, the best validation accuracy, the executed encoder
  steps at 7 and 12 operators, the hours of one core per run and for all its runs
  (``train_log.training_hours``);
* the average halting depth per operator count (teacher-forced, standard protocol) of the
  encoder and of the decoder: the executed steps, and the expected depth (the ACT loss's
  summand) where the results have it, each row with Spearman's rho against the operator
  count over 1..12 (bucket 0 holds a handful of pairs): whether the depth rises with the
  operators, the paper's Figure 4.

Written into ``--out-dir`` (default WORK_DIR), each atomically: ``table5.md`` (the printed
text), ``table5.json`` (the same numbers) and ``figure4.png`` (paper Figure 4: x = number
of operators, y = average halting depth: per model with halting, the executed steps of
the encoder and of the decoder, and the encoder's expected depth; matplotlib's Agg backend)
and ``accuracy.png`` (relation accuracy per number of operators, one line per model).
"""
import argparse
import os
import statistics
import sys
from collections import defaultdict
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logic_recipe as recipe  # noqa: E402
from sut_fairseq.recipes import load_results as load_all  # noqa: E402
from sut_fairseq.recipes.summary import compare_text, line_plot, markdown_table, mean_std, spearman  # noqa: E402
from sut_fairseq.recipes.train_log import best_valid, training_hours  # noqa: E402

TABLE_KEYS = [str(k) for k in recipe.REPORT_BUCKETS] + list(recipe.COMPOSITIONAL)
IN_DISTRIBUTION_KEYS = [str(k) for k in recipe.ALL_BUCKETS if k not in recipe.REPORT_BUCKETS]
#: the cell of the pooled in-distribution accuracy
POOLED = "0-6"
#: the depth quantities of Figure 4: (key in table5.json, the side, result.json's field, row name)
DEPTHS = (("encoder", "encoder", "mean_depth", "encoder, executed"),
          ("encoder_expected", "encoder", "mean_expected_depth", "encoder, expected"),
          ("decoder", "decoder", "mean_depth", "decoder, executed"),
          ("decoder_expected", "decoder", "mean_expected_depth", "decoder, expected"))
#: the operator counts Spearman's rho of the depth runs over (bucket 0: 6 test pairs)
RHO_FROM = 1


def load_results(work_dir: str) -> List[Dict]:
    """Every WORK/MODEL/PROTOCOL/seedN/result.json."""
    try:
        return load_all(work_dir, ("model", "protocol", "seed", "accuracy"))
    except recipe.RecipeError as err:
        raise SystemExit(f"error: {err}")


def _order(models, setup="seq2seq"):
    known = [m for m in (recipe.ALL_MODELS if setup == "seq2seq" else recipe.CLASSIFY_MODELS) if m in models]
    return known + sorted(set(models) - set(known))


TITLES = {"seq2seq": "Table 5: accuracy (%) per number of operators (trained on 0-6) and on the "
                     "compositional splits A/B/C",
          "classify": "Classify setup (the recurrent-transformers paper's Table 2: Siamese "
                      "encoder-only classifiers): accuracy (%) per number of operators "
                      "(trained on 0-6) and on the compositional splits A/B/C"}


def summarize_results(results: List[Dict], setup: str = "seq2seq") -> Dict:
    """The numbers behind the tables and the figure (the content of table5.json)."""
    acc = defaultdict(lambda: defaultdict(list))      # model -> key -> [accuracy per seed]
    depth = defaultdict(lambda: defaultdict(list))    # model -> bucket -> [{DEPTHS key: value}]
    meta = defaultdict(lambda: {"configs": set(), "params": set(), "seeds": set()})
    training = defaultdict(lambda: defaultdict(list))  # model -> quantity -> [value per run]
    for r in results:
        model = r["model"]
        for name, value in (run_training(r).items() if r["protocol"] == "standard" else ()):
            if value is not None:
                training[model][name].append(value)
        meta[model]["configs"].add(r.get("config", "?"))
        meta[model]["seeds"].add(r["seed"])
        if r.get("params"):
            meta[model]["params"].add(r["params"])
        for key, scored in r["accuracy"].items():
            acc[model][key].append(float(scored["accuracy"]))
        pooled = pooled_accuracy(r["accuracy"], IN_DISTRIBUTION_KEYS)
        if pooled is not None:
            acc[model][POOLED].append(pooled)
        if r["protocol"] == "standard" and r.get("halting_depth"):
            for key, d in r["halting_depth"].items():
                depth[model][key].append({name: d[side].get(field) for name, side, field, _ in DEPTHS})
    rows = {}
    grid = recipe.grid_for(setup)
    for model in _order(set(acc) | set(meta), setup):
        cells = {key: _mean_sd(v) for key, v in acc[model].items()}
        params = sorted(meta[model]["params"])
        rows[model] = {"label": grid.label(model), "halting": _halting(grid, model),
                       "configs": sorted(meta[model]["configs"]),
                       "params": params[0] if len(params) == 1 else (params or None),
                       "seeds": sorted(meta[model]["seeds"]), "cells": cells,
                       "training": {name: _mean_sd(v) for name, v in training[model].items()}}
        if training[model].get("hours"):
            rows[model]["training"]["hours_all_runs"] = sum(training[model]["hours"])
    depths, rho = {}, {}
    for model in _order(depth, setup):
        # a quantity is None in a bucket when one of its results predates it (expected depth)
        depths[model] = {key: {**{name: (None if any(x[name] is None for x in v)
                                          else statistics.mean(x[name] for x in v))
                                  for name, _, _, _ in DEPTHS}, "n": len(v)}
                         for key, v in sorted(depth[model].items(), key=lambda kv: int(kv[0]))}
        rho[model] = {}
        for name, _, _, _ in DEPTHS:
            points = [(int(k), c[name]) for k, c in depths[model].items()
                      if int(k) >= RHO_FROM and c[name] is not None]
            rho[model][name] = spearman([k for k, _ in points], [y for _, y in points])
    return {"runs": len(results), "setup": setup, "title": TITLES[setup], "columns": TABLE_KEYS, "rows": rows, "halting_depth": depths,
            "halting_depth_spearman": rho,
            "paper": {name: {str(k): v for k, v in row.items()}
                      for name, row in recipe.PAPER[setup].items()}}


def run_training(result: Dict) -> Dict:
    """What one run's training cost and reached: ``updates``, ``valid`` (the best validation
    accuracy, %, of its train.log), ``hours`` (of one core, ``training_hours``) and the
    executed encoder steps per position at 7 and 12 operators (``steps_7``, ``steps_12``,
    where the scoring recorded them); the train.log is the one beside result.json."""
    log = os.path.join(os.path.dirname(result["_path"]), "train.log")
    has_log = os.path.exists(log)
    steps = {f"steps_{k}": result["accuracy"].get(k, {}).get("mean_encoder_steps") for k in ("7", "12")}
    return {"updates": result.get("updates"), **steps,
            "valid": best_valid(log, "accuracy") if has_log else None,
            "hours": training_hours(log) if has_log else None}


def _mean_sd(values: List[float]) -> Dict:
    """A cell: ``summary.mean_std`` of ``values`` as a dict (the mean under ``accuracy``,
    whatever the quantity)."""
    mean, sd, n = mean_std(values)
    return {"accuracy": mean, "sd": sd, "n": n}


def pooled_accuracy(accuracy: Dict, keys: List[str]):
    """100 · Σ correct / Σ total over ``keys`` of one result's ``accuracy``; None unless every
    key was scored (with its counts)."""
    scored = [accuracy.get(k) for k in keys]
    if any(s is None or "correct" not in s or "total" not in s for s in scored):
        return None
    total = sum(int(s["total"]) for s in scored)
    return 100.0 * sum(int(s["correct"]) for s in scored) / total if total else None


def _halting(grid, model):
    try:
        return grid.has_halting(model)
    except recipe.RecipeError:
        return False


def _cell(cell) -> str:
    if cell is None:
        return "–"
    if cell["n"] == 1:
        return f"{cell['accuracy']:.1f}"
    return f"{cell['accuracy']:.1f} ± {cell['sd']:.1f} (n={cell['n']})"


def _number(cell, form: str) -> str:
    """A seed mean alone, in ``form`` ("–" for none)."""
    return "–" if cell is None else form.format(cell["accuracy"])


def _row_label(row) -> str:
    configs = ", ".join(row["configs"])
    return f"{row['label']} (ours, {configs})"


def format_tables(summary: Dict) -> str:
    rows = summary["rows"]
    table = [[_row_label(row), f"{row['params']:,}" if isinstance(row["params"], int) else "–"]
             + [_cell(row["cells"].get(k)) for k in TABLE_KEYS] for row in rows.values()]
    table += [[f"{name} (paper)", "–"] + [str(paper[k]) if k in paper else "–" for k in TABLE_KEYS]
              for name, paper in summary["paper"].items()]
    parts = [summary.get("title", TITLES["seq2seq"]), markdown_table(["Model", "params", *TABLE_KEYS], table)]
    seen = [k for k in IN_DISTRIBUTION_KEYS + [POOLED] if any(k in r["cells"] for r in rows.values())]
    if seen:
        parts += ["In-distribution buckets (accuracy %, standard protocol; 0-6: all their test "
                  "pairs pooled)", markdown_table(
            ["Model", *seen], [[_row_label(row)] + [_cell(row["cells"].get(k)) for k in seen]
                               for row in rows.values()])]
    trained = [(row, row.get("training", {})) for row in rows.values()]
    if any(t.get("hours") or t.get("valid") for _, t in trained):
        parts += ["Training per run of the standard protocol (mean ± sd over the seeds): updates, "
                  "the best validation accuracy (%, in distribution), the executed encoder steps "
                  "per position at 7 and 12 operators, and the hours of one core per run (from "
                  "fairseq's update rates) and for all the runs of the row", markdown_table(
            ["Model", "updates", "valid", "steps (7)", "steps (12)", "core-h per run", "core-h, all runs"],
            [[_row_label(row), _number(t.get("updates"), "{:,.0f}"), _cell(t.get("valid")),
              _number(t.get("steps_7"), "{:.1f}"), _number(t.get("steps_12"), "{:.1f}"),
              _number(t.get("hours"), "{:.2f}"),
              "–" if t.get("hours_all_runs") is None else f"{t['hours_all_runs']:.2f}"]
             for row, t in trained])]
    depths = summary["halting_depth"]
    if depths:
        keys = sorted({k for d in depths.values() for k in d}, key=int)
        table = []
        for model, d in depths.items():
            for name, _, _, row_name in DEPTHS:
                if all(c[name] is None for c in d.values()):
                    continue  # results that predate the quantity
                rho = summary["halting_depth_spearman"][model][name]
                table.append([recipe.label(model), row_name]
                             + ["–" if d.get(k, {}).get(name) is None else f"{d[k][name]:.2f}" for k in keys]
                             + ["–" if rho is None else f"{rho:.2f}"])
        parts += ["Average halting depth per number of operators (teacher-forced, standard protocol; "
                  "mean over sentences): executed steps per position (encoder) or target token "
                  "(decoder), and the expected depth Σ_l l · w_l, the ACT loss's summand: where the "
                  "halting weights put the depth, also when every step runs. ρ: Spearman's rank "
                  f"correlation of the row with the operator count over buckets {RHO_FROM}..12 "
                  "(Figure 4: > 0 when the depth rises with the operators)",
                  markdown_table(["Model", "depth", *keys, "ρ"], table, numeric_from=2)]
    return "\n\n".join(parts)


def plot_figure4(summary: Dict, path: str) -> bool:
    """Figure 4 as a PNG (atomically); False when no model with halting has depths."""
    lines = {m: d for m, d in summary["halting_depth"].items()
             if summary["rows"].get(m, {}).get("halting")}
    if not lines:
        return False
    series = {}
    for model, d in lines.items():
        for name, _, _, row_name in DEPTHS[:3]:  # the decoder's expected depth: in the table
            keys = [k for k in sorted(d, key=int) if d[k].get(name) is not None]
            if keys:
                series[f"{recipe.label(model)}, {row_name}"] = ([int(k) for k in keys],
                                                                [d[k][name] for k in keys])
    line_plot(path, series, "number of operators", "average halting depth",
              "Average halting depth (logical inference)",
              xticks=sorted({int(k) for d in lines.values() for k in d}))
    return True


def plot_accuracy(summary: Dict, path: str) -> bool:
    """Relation accuracy per number of operators (the standard protocol's buckets that were
    scored), one line per model: the mean over its seeds, with error bars of ± one sample
    sd where it has more than one; a PNG (atomically); False when no model has a bucket."""
    series, errors = {}, {}
    for model, row in summary["rows"].items():
        keys = sorted((k for k in row["cells"] if k.isdigit()), key=int)
        if keys:
            cells = [row["cells"][k] for k in keys]
            series[row["label"]] = ([int(k) for k in keys], [c["accuracy"] for c in cells])
            if any(c["n"] > 1 for c in cells):
                errors[row["label"]] = [c["sd"] for c in cells]
    if not series:
        return False
    buckets = sorted({x for xs, _ in series.values() for x in xs})
    line_plot(path, series, "number of operators (trained on 0-6)", "relation accuracy %",
              "Logical inference, standard protocol", xticks=buckets, errors=errors)
    return True


def summarize(work_dir: str, out_dir: str = None, setup: str = "seq2seq") -> str:
    """Print-ready text; writes table5.md, table5.json, figure4.png and accuracy.png into
    ``out_dir`` (the results of ``setup``'s runs, ``WORK`` or ``WORK/classify``)."""
    out_dir = out_dir or work_dir
    results = load_results(work_dir)
    if not results:
        raise SystemExit(f"error: no */*/seed*/result.json under {work_dir}")
    summary = summarize_results(results, setup)
    summary["work_dir"] = os.path.abspath(work_dir)
    text = f"{len(results)} runs from {work_dir}\n\n" + format_tables(summary)
    figure = os.path.join(out_dir, "figure4.png")
    if plot_figure4(summary, figure):
        summary["figure"] = os.path.abspath(figure)
        text += f"\n\nFigure 4 (average halting depth per number of operators): {figure}"
    accuracy = os.path.join(out_dir, "accuracy.png")
    if plot_accuracy(summary, accuracy):
        text += f"\nAccuracy per number of operators: {accuracy}"
    recipe.write_text_atomic(os.path.join(out_dir, "table5.md"), text + "\n")
    recipe.write_json_atomic(os.path.join(out_dir, "table5.json"), summary)
    return text


def compare_models(summary: Dict, a: str, b: str) -> str:
    """Model ``a`` against model ``b`` (names as in the grid: ``gut``, ``ut``, ...) on every
    reported bucket both were scored on (``summary.compare_text``); a model without results
    is refused, naming those with results."""
    models = {name: (row["label"], row["seeds"],
                     {k: (c["accuracy"], c["sd"], c["n"]) for k, c in row["cells"].items() if c})
              for name, row in summary["rows"].items()}
    return compare_text(models, a, b, TABLE_KEYS, "number of operators", "no results of that model")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("work_dir", help="table5.py's --work-dir")
    parser.add_argument("--out-dir", default=None,
                        help="where table5.md/.json, figure4.png and accuracy.png go")
    parser.add_argument("--setup", choices=["seq2seq", "classify"], default="seq2seq",
                        help="the setup whose runs WORK_DIR holds (default seq2seq; "
                             "table5.py --setup classify passes WORK/classify and classify)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                        help="model A against model B per bucket (e.g. gut ut): is A ahead beyond one sd?")
    args = parser.parse_args(argv)
    print(summarize(args.work_dir, args.out_dir, args.setup))
    if args.compare:
        summary = recipe.load_json(os.path.join(args.out_dir or args.work_dir, "table5.json"))
        print("\n" + compare_models(summary, *args.compare))


if __name__ == "__main__":
    main()
