#!/usr/bin/env python3
"""Print paper Table 4 (CFQ exact match, mean ± std over seeds) from per-run results.

    python scripts/cfq/summarize.py WORK_DIR [--markdown FILE]

Reads every ``WORK_DIR/VARIANT/SPLIT/seedN/result.json`` written by ``table4.py``
(fields ``variant``, ``split``, ``seed``, ``exact_match`` in percent). A cell is the mean
± the sample standard deviation (n - 1) over the seeds found, with ``(n=K)`` when K is
not 5; ``Avg.`` averages MCD1-3 per seed (seeds that have all three) and then takes
mean ± std over those seeds, as the paper's Avg. column does; ``Random`` is the
random split (not in the paper's table). The paper's rows are printed underneath.
"""
import argparse
import glob
import json
import os
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cfq_recipe import MCD_SPLITS, PAPER_TABLE4, VARIANTS  # noqa: E402

COLUMNS = (("mcd1", "MCD1"), ("mcd2", "MCD2"), ("mcd3", "MCD3"), ("avg", "Avg."),
           ("random_split", "Random"))


def load_results(work_dir: str) -> List[Dict]:
    results = []
    for path in sorted(glob.glob(os.path.join(work_dir, "*", "*", "seed*", "result.json"))):
        with open(path) as handle:
            try:
                result = json.load(handle)
            except json.JSONDecodeError as err:
                raise SystemExit(f"error: {path}: malformed JSON: {err}")
        for key in ("variant", "split", "seed", "exact_match"):
            if key not in result:
                raise SystemExit(f"error: {path}: no {key!r}")
        results.append(result)
    return results


def mean_std(values: List[float]) -> Optional[Tuple[float, float, int]]:
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.mean(values), std, len(values)


def table(results: List[Dict]) -> Dict[str, Dict[str, Optional[Tuple[float, float, int]]]]:
    """{variant: {column: (mean, std, n) or None}}."""
    by = defaultdict(dict)  # (variant, split) -> {seed: accuracy}
    for r in results:
        by[(r["variant"], r["split"])][r["seed"]] = float(r["exact_match"])
    variants = [v for v in VARIANTS if any(k[0] == v for k in by)]
    variants += sorted({k[0] for k in by} - set(variants))
    rows = {}
    for variant in variants:
        row = {}
        for column, _ in COLUMNS:
            if column == "avg":
                seeds = set.intersection(*(set(by.get((variant, s), {})) for s in MCD_SPLITS))
                row[column] = mean_std([statistics.mean(by[(variant, s)][seed] for s in MCD_SPLITS)
                                        for seed in sorted(seeds)])
            else:
                row[column] = mean_std(list(by.get((variant, column), {}).values()))
        rows[variant] = row
    return rows


def _cell(value) -> str:
    if value is None:
        return "–"
    mean, std, n = value
    return f"{mean:.1f} ± {std:.1f}" + ("" if n == 5 else f" (n={n})")


def format_table(rows) -> str:
    header = "| Model | " + " | ".join(name for _, name in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 1)]
    for variant, row in rows.items():
        label = VARIANTS.get(variant, {}).get("label", variant)
        lines.append(f"| {label} (ours) | " + " | ".join(_cell(row[c]) for c, _ in COLUMNS) + " |")
    for variant, paper in PAPER_TABLE4.items():
        cells = [_cell(paper[c] + (5,)) if c in paper else "–" for c, _ in COLUMNS]
        lines.append(f"| {VARIANTS[variant]['label']} (paper) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize(work_dir: str) -> str:
    results = load_results(work_dir)
    if not results:
        raise SystemExit(f"error: no */*/seed*/result.json under {work_dir}")
    text = (f"CFQ exact match (%), mean ± std over seeds; {len(results)} runs from {work_dir}\n\n"
            + format_table(table(results)))
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work_dir", help="table4.py's --work-dir")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    text = summarize(args.work_dir)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
