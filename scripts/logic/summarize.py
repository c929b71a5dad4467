#!/usr/bin/env python3
"""Paper Table 5 and Figure 4 from per-run results of ``table5.py``.

    python scripts/logic/summarize.py WORK_DIR [--out-dir DIR]

Reads every ``WORK_DIR/MODEL/PROTOCOL/seedN/result.json`` (``model``, ``protocol``,
``seed``, ``accuracy`` {bucket or A/B/C: {"accuracy": %, ...}}, ``halting_depth``).
A cell is the mean accuracy over the seeds found (``(n=K)`` when K > 1). Printed:

* Table 5: accuracy (%) per operator count 7..12 (standard protocol) and on the
  compositional splits A/B/C, one row per model, the paper's SUT, LSTM and Transformer rows beneath;
* the in-distribution buckets 0..6 when they were evaluated;
* the average encoder halting depth per operator count (teacher-forced, standard protocol),
  and the expected depth (the ACT loss's summand) where the results have it.

Written into ``--out-dir`` (default WORK_DIR), each atomically: ``table5.md`` (the printed
text), ``table5.json`` (the same numbers) and ``figure4.png`` (paper Figure 4: x = number
of operators, y = average halting depth of the encoder, one line per model with halting,
and one per model for its expected depth; matplotlib's Agg backend).
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
from sut_fairseq.recipes.summary import line_plot, markdown_table  # noqa: E402

TABLE_KEYS = [str(k) for k in recipe.REPORT_BUCKETS] + list(recipe.COMPOSITIONAL)
IN_DISTRIBUTION_KEYS = [str(k) for k in recipe.ALL_BUCKETS if k not in recipe.REPORT_BUCKETS]


def load_results(work_dir: str) -> List[Dict]:
    """Every WORK/MODEL/PROTOCOL/seedN/result.json."""
    try:
        return load_all(work_dir, ("model", "protocol", "seed", "accuracy"))
    except recipe.RecipeError as err:
        raise SystemExit(f"error: {err}")


def _order(models):
    known = [m for m in recipe.MODELS if m in models]
    return known + sorted(set(models) - set(known))


def summarize_results(results: List[Dict]) -> Dict:
    """The numbers behind the tables and the figure (the content of table5.json)."""
    acc = defaultdict(lambda: defaultdict(list))      # model -> key -> [accuracy per seed]
    depth = defaultdict(lambda: defaultdict(list))    # model -> bucket -> [(enc, dec, enc expected)]
    meta = defaultdict(lambda: {"configs": set(), "params": set(), "seeds": set()})
    for r in results:
        model = r["model"]
        meta[model]["configs"].add(r.get("config", "?"))
        meta[model]["seeds"].add(r["seed"])
        if r.get("params"):
            meta[model]["params"].add(r["params"])
        for key, scored in r["accuracy"].items():
            acc[model][key].append(float(scored["accuracy"]))
        if r["protocol"] == "standard" and r.get("halting_depth"):
            for key, d in r["halting_depth"].items():
                depth[model][key].append((d["encoder"]["mean_depth"], d["decoder"]["mean_depth"],
                                          d["encoder"].get("mean_expected_depth")))
    rows = {}
    for model in _order(set(acc) | set(meta)):
        cells = {key: {"accuracy": statistics.mean(v), "n": len(v)} for key, v in acc[model].items()}
        params = sorted(meta[model]["params"])
        rows[model] = {"label": recipe.label(model), "halting": _halting(model),
                       "configs": sorted(meta[model]["configs"]),
                       "params": params[0] if len(params) == 1 else (params or None),
                       "seeds": sorted(meta[model]["seeds"]), "cells": cells}
    depths = {}
    for model in _order(depth):
        depths[model] = {key: {"encoder": statistics.mean(e for e, _, _ in v),
                               "decoder": statistics.mean(d for _, d, _ in v),
                               # None when a result predates the expected depth
                               "encoder_expected": (None if any(x is None for _, _, x in v)
                                                    else statistics.mean(x for _, _, x in v)),
                               "n": len(v)}
                         for key, v in sorted(depth[model].items(), key=lambda kv: int(kv[0]))}
    return {"runs": len(results), "columns": TABLE_KEYS, "rows": rows, "halting_depth": depths,
            "paper": {name: {str(k): v for k, v in row.items()}
                      for name, row in recipe.PAPER_TABLE5.items()}}


def _halting(model):
    try:
        return recipe.has_halting(model)
    except recipe.RecipeError:
        return False


def _cell(cell) -> str:
    if cell is None:
        return "–"
    return f"{cell['accuracy']:.1f}" + ("" if cell["n"] == 1 else f" (n={cell['n']})")


def _row_label(row) -> str:
    configs = ", ".join(row["configs"])
    return f"{row['label']} (ours, {configs})"


def format_tables(summary: Dict) -> str:
    rows = summary["rows"]
    table = [[_row_label(row), f"{row['params']:,}" if isinstance(row["params"], int) else "–"]
             + [_cell(row["cells"].get(k)) for k in TABLE_KEYS] for row in rows.values()]
    table += [[f"{name} (paper)", "–"] + [str(paper[k]) if k in paper else "–" for k in TABLE_KEYS]
              for name, paper in summary["paper"].items()]
    parts = ["Table 5: accuracy (%) per number of operators (trained on 0-6) and on the "
             "compositional splits A/B/C", markdown_table(["Model", "params", *TABLE_KEYS], table)]
    seen = [k for k in IN_DISTRIBUTION_KEYS if any(k in r["cells"] for r in rows.values())]
    if seen:
        parts += ["In-distribution buckets (accuracy %, standard protocol)", markdown_table(
            ["Model", *seen], [[_row_label(row)] + [_cell(row["cells"].get(k)) for k in seen]
                               for row in rows.values()])]
    depths = summary["halting_depth"]
    if depths:
        keys = sorted({k for d in depths.values() for k in d}, key=int)
        parts += ["Average halting depth of the encoder (mean over sentences of the mean "
                  "executed steps per position; teacher-forced; standard protocol)", markdown_table(
                      ["Model", *keys], [[recipe.label(model)] + [f"{d[k]['encoder']:.2f}" if k in d else "–"
                                                                  for k in keys] for model, d in depths.items()])]
        expected = {m: d for m, d in depths.items() if any(c["encoder_expected"] is not None for c in d.values())}
        if expected:
            parts += ["Expected depth of the encoder (mean over sentences of the positions' "
                      "Σ_l l · w_l, the ACT loss's summand: where the halting weights put the depth, "
                      "also when every step runs)", markdown_table(
                          ["Model", *keys], [[recipe.label(model)] + [
                              "–" if d.get(k, {}).get("encoder_expected") is None
                              else f"{d[k]['encoder_expected']:.2f}" for k in keys]
                              for model, d in expected.items()])]
    return "\n\n".join(parts)


def plot_figure4(summary: Dict, path: str) -> bool:
    """Figure 4 as a PNG (atomically); False when no model with halting has depths."""
    lines = {m: d for m, d in summary["halting_depth"].items()
             if summary["rows"].get(m, {}).get("halting")}
    if not lines:
        return False
    series = {}
    for model, d in lines.items():
        keys = sorted(d, key=int)
        series[recipe.label(model)] = ([int(k) for k in keys], [d[k]["encoder"] for k in keys])
        with_expected = [k for k in keys if d[k].get("encoder_expected") is not None]
        if with_expected:
            series[f"{recipe.label(model)}, expected"] = (
                [int(k) for k in with_expected], [d[k]["encoder_expected"] for k in with_expected])
    line_plot(path, series, "number of operators", "average halting depth",
              "Average encoder halting depth (logical inference)",
              xticks=sorted({int(k) for d in lines.values() for k in d}))
    return True


def summarize(work_dir: str, out_dir: str = None) -> str:
    """Print-ready text; writes table5.md, table5.json and figure4.png into ``out_dir``."""
    out_dir = out_dir or work_dir
    results = load_results(work_dir)
    if not results:
        raise SystemExit(f"error: no */*/seed*/result.json under {work_dir}")
    summary = summarize_results(results)
    summary["work_dir"] = os.path.abspath(work_dir)
    text = f"{len(results)} runs from {work_dir}\n\n" + format_tables(summary)
    figure = os.path.join(out_dir, "figure4.png")
    if plot_figure4(summary, figure):
        summary["figure"] = os.path.abspath(figure)
        text += f"\n\nFigure 4 (average halting depth per number of operators): {figure}"
    recipe.write_text_atomic(os.path.join(out_dir, "table5.md"), text + "\n")
    recipe.write_json_atomic(os.path.join(out_dir, "table5.json"), summary)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("work_dir", help="table5.py's --work-dir")
    parser.add_argument("--out-dir", default=None, help="where table5.md/.json and figure4.png go")
    args = parser.parse_args(argv)
    print(summarize(args.work_dir, args.out_dir))


if __name__ == "__main__":
    main()
