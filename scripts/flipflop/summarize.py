#!/usr/bin/env python3
"""The flip-flop report: accuracy per test split of every model beside two shortcut
baselines, accuracy on the examples whose answer lies only before the read's chunk with the
memory-reset control of the chunk-wise models, mean executed encoder steps, the checks of
the CPU experiment and the paper's Table 3.

    python scripts/flipflop/summarize.py WORK [--data-dir data/flipflop]

Reads ``WORK/MODEL/seedN/result.json`` (``table3.py``'s evaluate stage) and
``DATA/stats.json`` (``data-prep/flipflop/generate.py``); writes, atomically,
``WORK/table3.md``, ``WORK/table3.json`` and ``WORK/accuracy.png``. Seeds are averaged.
"""
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flipflop_recipe as recipe  # noqa: E402
from sut_fairseq.recipes import load_json  # noqa: E402
from sut_fairseq.recipes.split_grid import (STEP_METRICS, add_rows, collect, metric_table,  # noqa: E402
                                            ordered_splits, reference_row, report_main,
                                            steps_text, write_report)
from sut_fairseq.recipes.summary import markdown_table  # noqa: E402

METRICS = ("accuracy", "subset_accuracy", "reset_accuracy", "reset_subset_accuracy",
           "subset_size", "subset_chunk_size") + STEP_METRICS


def check_rows(models: Dict[str, Dict], stats: Dict, splits: List[str]) -> List[List[str]]:
    """The CPU experiment's checks that the results allow: ``[check, value, pass]``."""
    config = stats.get("config", {})
    length, p = config.get("train_length"), config.get("train_p_ignore")
    name = {(recipe.setting(s, stats)): s for s in splits}
    home, double = name.get((length, p)), name.get((2 * length if length else None, p))
    limits, rows = recipe.CHECKS, []

    def cell(model, metric, split):
        value = models[model][metric].get(split) if split else None
        return None if value is None else value[0]

    for model, m in models.items():
        for split, low in ((home, limits["train_length_min"]), (double, limits["double_length_min"])):
            value = cell(model, "accuracy", split)
            if value is not None:
                rows.append([f"{m['label']}: accuracy on {split} ≥ {low:g}%", f"{value:.1f}",
                             "pass" if value >= low else "FAIL"])
        for split in splits:
            value = cell(model, "reset_subset_accuracy", split)
            size = cell(model, "subset_size", split)
            if value is not None and size is not None and size >= limits["reset_subset_min_size"]:
                high = limits["reset_subset_max"]
                rows.append([f"{m['label']}: memory reset, answer only before the read's chunk, "
                             f"{split} ≤ {high:g}%", f"{value:.1f}", "pass" if value <= high else "FAIL"])
    if "tlb" in models and "gutlb" in models:
        for split in (home, double):
            tlb, gutlb = cell("tlb", "accuracy", split), cell("gutlb", "accuracy", split)
            if tlb is not None and gutlb is not None:
                gap = limits["gutlb_gap_max"]
                rows.append([f"GUTLB within {gap:g} points of TLB on {split}", f"{gutlb - tlb:+.1f}",
                             "pass" if gutlb >= tlb - gap else "FAIL"])
        steps, max_steps = cell("gutlb", "mean_encoder_steps_per_chunk", home), models["gutlb"]["max_steps"]
        what = "per chunk"
        if steps is None:
            steps, what = cell("gutlb", "mean_encoder_steps", home), "per position"
        if steps is not None and max_steps:
            rows.append([f"GUTLB mean executed steps {what} < L = {max_steps} on {home}", f"{steps:.2f}",
                         "pass" if steps < max_steps else "FAIL"])
    return rows


def summarize(work_dir: str, data_dir: str) -> str:
    """Write table3.md, table3.json and accuracy.png into ``work_dir``; return the markdown."""
    models = collect(work_dir, recipe.GRID, METRICS)
    if not models:
        raise SystemExit(f"error: no result.json under {work_dir}: run the evaluate stage first")
    stats = load_json(os.path.join(data_dir, "stats.json"))
    splits = ordered_splits(models, list(stats.get("settings", {})))
    data = stats["splits"]
    config = stats.get("config", {})

    accuracy = add_rows(metric_table(models, splits, "accuracy"), [
        reference_row("the bit before the final r", {s: data[s]["baselines"]["previous_bit"]
                                                     for s in splits if s in data}, splits, scale=100),
        reference_row("majority bit", {s: data[s]["baselines"]["majority"] for s in splits if s in data},
                      splits, scale=100)])
    subset_rows = []
    for m in models.values():
        if any(v is not None for v in m["reset_subset_accuracy"].values()):
            subset_rows.append([f"{m['label']}, memory reset every chunk"]
                               + [("–" if m["reset_subset_accuracy"].get(s) is None
                                   else f"{m['reset_subset_accuracy'][s][0]:.1f}") for s in splits])
    subset = add_rows(metric_table(models, splits, "subset_accuracy", info=False), subset_rows)
    sizes = markdown_table(["model", "g"] + splits, [
        [m["label"], str(int(next(iter(m["subset_chunk_size"].values()))[0]))]
        + [("–" if m["subset_size"].get(s) is None else f"{m['subset_size'][s][0]:.0f}") for s in splits]
        for m in models.values()])
    checks = check_rows(models, stats, splits)
    paper_splits = [f"{n}, {p:g}" for n in (512, 1024) for p in (0.1, 0.8, 0.98)]
    paper = markdown_table(["model"] + paper_splits, [
        [label] + [f"{values[(n, p)]:.2f}" for n in (512, 1024) for p in (0.1, 0.8, 0.98)]
        for label, values in recipe.PAPER_TABLE3.items()])

    text = (f"Accuracy (%, exact bit) per test split; trained at length {config.get('train_length')} "
            f"with p_i {config.get('train_p_ignore')}:\n\n{accuracy}\n\n"
            "Accuracy (%) on the examples whose answer (the bit of the last write or of a later "
            "read) lies in an earlier chunk than the final read (the bit must pass through the "
            "memory of a chunk-wise model); the memory-reset "
            f"rows reset the memory before every chunk:\n\n{subset}\n\n"
            f"Examples in that subset, for chunks of g tokens:\n\n{sizes}\n\n"
            + steps_text(models, splits))
    if checks:
        text += "\nChecks of the CPU experiment (thresholds ours):\n\n" + \
            markdown_table(["check", "value", "result"], checks, numeric_from=1) + "\n"
    text += ("\nThe paper's Table 3 (trained at length 512, p_i 0.8; columns: length, p_i; "
             f"mean of 3 runs):\n\n{paper}\n")

    return write_report(work_dir, "table3", text, models, splits, "Flip-flop accuracy per test split",
                        {"checks": checks, "baselines": {s: data[s]["baselines"] for s in splits if s in data}})


def main(argv=None):
    report_main(__doc__, "flipflop", summarize, "table3", argv)


if __name__ == "__main__":
    main()
