#!/usr/bin/env python3
"""The C-PVR report: accuracy and mean executed encoder depth per hop of every model,
beside the shortcut baselines of the data, as a table and two figures.

    python scripts/cpvr/summarize.py WORK [--data-dir data/cpvr]

Reads ``WORK/MODEL/seedN/result.json`` (``hops.py``'s evaluate stage) and
``DATA/baselines.json`` (``data-prep/cpvr/generate.py``); writes, atomically,
``WORK/hops.md`` (the table), ``WORK/hops.json`` (the same numbers),
``WORK/accuracy.png`` (accuracy per hop, with the capped solver and the first-or-last shortcut) and ``WORK/depth.png``
(mean executed encoder and decoder steps per hop). Seeds are averaged. Spearman's rho between
the hop count and the mean depth over hops 1-6, per side, says whether the depth rises with
the hops (the decoder's counts too: a model may do its retrieval in the decoder's
cross-attention, its encoder halting after one step).
"""
import os
import sys
from collections import OrderedDict
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpvr_recipe as recipe  # noqa: E402
from sut_fairseq.recipes import load_json, load_results, write_json_atomic, write_text_atomic  # noqa: E402
from sut_fairseq.recipes.summary import (line_plot, markdown_table, mean_std, spearman,  # noqa: E402
                                         summary_main)


#: The two halting sides a result.json reports a mean depth per hop for.
SIDES = ("encoder", "decoder")


def collect(work_dir: str) -> "OrderedDict[str, Dict]":
    """Per model (in the grid's order): label, seeds, params, updates, the seed means of
    accuracy and of each side's depth per hop (``encoder_depth``, ``decoder_depth``), and
    each side's Spearman rho over hops 1-6 (``encoder_depth_spearman_1_6``, ...)."""
    results = load_results(work_dir, ["model", "accuracy", "encoder_depth"],
                           pattern=os.path.join("*", "seed*", "result.json"))
    models: "OrderedDict[str, Dict]" = OrderedDict()
    for name in recipe.GRID.models:
        runs = [r for r in results if r["model"] == name]
        if not runs:
            continue
        hops = sorted({int(h) for r in runs for h in r["accuracy"]})
        models[name] = {
            "label": runs[0]["label"], "seeds": [r["seed"] for r in runs],
            "params": runs[0].get("params"), "updates": [r.get("updates") for r in runs],
            "max_steps": runs[0].get("max_steps"),
            "accuracy": {n: mean_std([r["accuracy"][str(n)] for r in runs if str(n) in r["accuracy"]])
                         for n in hops},
        }
        for side in SIDES:
            key = f"{side}_depth"
            depth = {n: mean_std([r[key][str(n)] for r in runs
                                  if r.get(key, {}).get(str(n)) is not None]) for n in hops}
            depth_hops = [n for n in recipe.DEPTH_HOPS if depth.get(n)]
            models[name][key] = depth
            models[name][f"{key}_spearman_1_6"] = spearman(depth_hops, [depth[n][0] for n in depth_hops])
    return models


def summarize(work_dir: str, data_dir: str) -> str:
    """Write hops.md, hops.json, accuracy.png and depth.png into ``work_dir``; return the
    markdown."""
    models = collect(work_dir)
    if not models:
        raise SystemExit(f"error: no result.json under {work_dir}: run the evaluate stage first")
    baselines = load_json(os.path.join(data_dir, "baselines.json"))
    hops = sorted({n for m in models.values() for n in m["accuracy"]})
    cell = lambda ms: "–" if ms is None else f"{ms[0]:.1f}"

    header = ["model", "params", "updates"] + [f"hop {n}" for n in hops]
    rows = [[m["label"], f"{m['params']:,}" if m["params"] else "–",
             "/".join(f"{u:,}" for u in m["updates"] if u is not None) or "–"]
            + [cell(m["accuracy"].get(n)) for n in hops] for m in models.values()]
    names = {"copy_first": "copy a[0]", "majority": "most frequent label",
             "first_or_last": "a[0] if one hop, else a[L−1]",
             f"capped_{baselines['capped_hops']}": f"solver capped at {baselines['capped_hops']} hops"}
    first_row = next(iter(baselines["hops"].values()))
    names = {key: name for key, name in names.items() if key in first_row}
    for key, name in names.items():
        rows.append([f"*{name}*", "–", "–"] + [
            f"*{100 * baselines['hops'][str(n)][key]:.1f}*" if str(n) in baselines["hops"] else "–"
            for n in hops])
    accuracy_table = markdown_table(header, rows)

    depth_rows = []
    for side in SIDES:
        for m in models.values():
            depth, rho = m[f"{side}_depth"], m[f"{side}_depth_spearman_1_6"]
            if not any(depth.values()):
                continue
            depth_rows.append([m["label"], side, str(m["max_steps"] or "–")]
                              + [("–" if depth.get(n) is None else f"{depth[n][0]:.2f}") for n in hops]
                              + ["–" if rho is None else f"{rho:.2f}"])
    depth_table = markdown_table(["model", "side", "L"] + [f"hop {n}" for n in hops]
                                 + ["Spearman ρ (hops 1–6)"], depth_rows)
    text = ("Accuracy (%, exact label) per hop; trained on hops 1–4:\n\n" + accuracy_table
            + "\n\nMean executed steps per position (encoder) and per target token (decoder), "
            "per hop (teacher-forced):\n\n" + depth_table + "\n")

    write_text_atomic(os.path.join(work_dir, "hops.md"), text)
    write_json_atomic(os.path.join(work_dir, "hops.json"), {
        "models": {name: {**m, **{key: {str(n): v for n, v in m[key].items()}
                                  for key in ("accuracy", "encoder_depth", "decoder_depth")}}
                   for name, m in models.items()},
        "baselines": baselines})
    series = OrderedDict((m["label"], (list(m["accuracy"]), [v[0] for v in m["accuracy"].values()]))
                         for m in models.values())
    for key in ("first_or_last", f"capped_{baselines['capped_hops']}"):  # the two telling shortcuts
        if key in names:
            series[names[key]] = (hops, [100 * baselines["hops"][str(n)][key] for n in hops])
    line_plot(os.path.join(work_dir, "accuracy.png"), series, "hops", "accuracy (%)",
              "C-PVR accuracy per hop (trained on 1–4)", xticks=hops)
    depth_series = OrderedDict()
    for side in SIDES:
        for m in models.values():
            measured = [n for n in hops if m[f"{side}_depth"].get(n)]
            if measured:
                depth_series[f"{m['label']} ({side})"] = (measured, [m[f"{side}_depth"][n][0] for n in measured])
    line_plot(os.path.join(work_dir, "depth.png"), depth_series,
              "hops", "mean executed steps", "C-PVR halting depth per hop", xticks=hops)
    return text


def main(argv=None):
    summary_main(__doc__, os.path.join("data", "cpvr"), summarize,
                 ["hops.md", "hops.json", "accuracy.png", "depth.png"], argv)


if __name__ == "__main__":
    main()
