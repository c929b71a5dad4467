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
import os
import statistics
import sys
from collections import defaultdict
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cfq_recipe import MCD_SPLITS, PAPER_TABLE4, VARIANTS  # noqa: E402
from sut_fairseq.recipes import RecipeError, load_results as load_all, write_text_atomic  # noqa: E402
from sut_fairseq.recipes.summary import format_mean_std, markdown_table, mean_std  # noqa: E402

COLUMNS = (("mcd1", "MCD1"), ("mcd2", "MCD2"), ("mcd3", "MCD3"), ("avg", "Avg."),
           ("random_split", "Random"))
SEEDS = 5  # the paper's; a cell over another number of seeds says (n=K)


def load_results(work_dir: str) -> List[Dict]:
    """Every WORK/VARIANT/SPLIT/seedN/result.json."""
    try:
        return load_all(work_dir, ("variant", "split", "seed", "exact_match"))
    except RecipeError as err:
        raise SystemExit(f"error: {err}")


def table(results: List[Dict]) -> Dict[str, Dict[str, object]]:
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


def format_table(rows) -> str:
    lines = []
    for variant, row in rows.items():
        label = VARIANTS.get(variant, {}).get("label", variant)
        lines.append([f"{label} (ours)"] + [format_mean_std(row[c], SEEDS) for c, _ in COLUMNS])
    for variant, paper in PAPER_TABLE4.items():
        lines.append([f"{VARIANTS[variant]['label']} (paper)"]
                     + [format_mean_std(paper[c] + (SEEDS,), SEEDS) if c in paper else "–"
                        for c, _ in COLUMNS])
    return markdown_table(["Model"] + [name for _, name in COLUMNS], lines)


def summarize(work_dir: str) -> str:
    results = load_results(work_dir)
    if not results:
        raise SystemExit(f"error: no */*/seed*/result.json under {work_dir}")
    return (f"CFQ exact match (%), mean ± std over seeds; {len(results)} runs from {work_dir}\n\n"
            + format_table(table(results)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work_dir", help="table4.py's --work-dir")
    parser.add_argument("--markdown", default=None, help="also write the table to this file (atomically)")
    args = parser.parse_args(argv)
    text = summarize(args.work_dir)
    print(text)
    if args.markdown:
        write_text_atomic(args.markdown, text + "\n")


if __name__ == "__main__":
    main()
