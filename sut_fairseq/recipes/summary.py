"""The report stage's pieces: means over seeds, markdown tables, a line plot (PNG).

A task's summariser collects its ``result.json`` files (:func:`..files.load_results`),
reduces the seeds of each cell with :func:`mean_std`, and writes one table with
:func:`markdown_table` (its rows, then the paper's) and, where a figure says more, one PNG
with :func:`line_plot`; every file is written atomically.
"""
import argparse
import os
import statistics
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from .files import atomic_path

MeanStd = Tuple[float, float, int]


def mean_std(values: Sequence[float]) -> Optional[MeanStd]:
    """(mean, sample standard deviation (n - 1; 0 for one value), n), or None for none."""
    values = [float(v) for v in values]
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.mean(values), std, len(values)


def ranks(values: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation (Pearson's r of the ranks); None when undefined
    (fewer than 2 points or a constant series). Says whether a halting depth rises with
    a task's difficulty (operators, hops)."""
    if len(x) != len(y) or len(x) < 2:
        return None
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                   numeric_from: int = 1) -> str:
    """A markdown table; columns from ``numeric_from`` on are right-aligned."""
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)} has {len(row)} cells for {len(header)} columns")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def line_plot(path: str, series: Mapping[str, Tuple[Sequence[float], Sequence[float]]],
              xlabel: str, ylabel: str, title: str, xticks: Optional[List[float]] = None,
              xticklabels: Optional[Sequence[str]] = None,
              errors: Optional[Mapping[str, Sequence[float]]] = None) -> None:
    """One line per series (label -> (x, y)), markers on the points, written atomically as
    a PNG (matplotlib's Agg backend: no display needed). ``xticklabels`` names the
    ``xticks`` (slanted: for split names); ``errors`` (label -> one value per point) draws
    error bars of ± that value."""
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # not its start-up and font search
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    try:
        for label, (x, y) in series.items():
            if errors and label in errors:
                ax.errorbar(list(x), list(y), yerr=list(errors[label]), marker="o", capsize=3,
                            label=label)
            else:
                ax.plot(list(x), list(y), marker="o", label=label)
        if xticks is not None:
            ax.set_xticks(xticks)
            if xticklabels is not None:
                ax.set_xticklabels(list(xticklabels), rotation=30, ha="right", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)


def ahead_table(labels: Tuple[str, str], cells: Tuple[Mapping[str, Optional[MeanStd]], Mapping[str, Optional[MeanStd]]],
                columns: Sequence[str]) -> str:
    """Model A against model B, one row per column (test split, bucket) both have: each
    one's seed mean ± sample sd, the difference of the means, and whether A is ahead beyond
    one standard deviation: A − B larger than both models' sds, which needs two seeds of
    each ("n/a" with fewer)."""
    a, b = labels
    rows = []
    for column in columns:
        x, y = cells[0].get(column), cells[1].get(column)
        if x is None or y is None:
            continue
        diff = x[0] - y[0]
        if min(x[2], y[2]) < 2:
            verdict = "n/a (one seed)"
        else:
            verdict = "yes" if diff > max(x[1], y[1]) else "no"
        # full_n -1: every cell states its number of seeds
        rows.append([column, format_mean_std(x, -1), format_mean_std(y, -1), f"{diff:+.1f}", verdict])
    if not rows:
        raise ValueError(f"{a} and {b} have no column in common")
    return markdown_table(["", a, b, f"{a} − {b}", f"{a} ahead beyond one sd"], rows)


def compare_text(models: Mapping[str, Tuple[str, Sequence[int], Mapping[str, Optional[MeanStd]]]],
                 a: str, b: str, columns: Sequence[str], unit: str, missing: str) -> str:
    """``--compare A B`` of a task's report: ``models`` maps a model's name to its (label,
    seeds, accuracy cells by column); a line saying what is compared (accuracy % per
    ``unit``), then :func:`ahead_table`. A name without an entry is refused: ``--compare
    NAME: MISSING (models: ...)``."""
    for name in (a, b):
        if name not in models:
            raise SystemExit(f"--compare {name}: {missing} (models: {', '.join(models)})")
    (label_a, seeds_a, cells_a), (label_b, seeds_b, cells_b) = models[a], models[b]
    return (f"{label_a} against {label_b}, accuracy (%) per {unit}, seed mean ± sample sd "
            f"(seeds {list(seeds_a)} and {list(seeds_b)}):\n\n"
            + ahead_table((label_a, label_b), (cells_a, cells_b), columns))


def format_mean_std(cell: Optional[MeanStd], full_n: int) -> str:
    """``mean ± std`` with one decimal, ``(n=K)`` when K seeds differ from ``full_n``; "–"
    for an empty cell."""
    if cell is None:
        return "–"
    mean, std, n = cell
    return f"{mean:.1f} ± {std:.1f}" + ("" if n == full_n else f" (n={n})")


def summary_main(doc: str, default_data_dir: str, summarize: Callable[[str, str], str],
                 written: Sequence[str], argv=None,
                 compare: Optional[Callable[[str, str, str], str]] = None) -> None:
    """The command line of a task's summariser, ``SCRIPT WORK [--data-dir DATA]``: print
    ``summarize(WORK, DATA)``, then the files it wrote (``written``, in WORK); with a
    ``compare`` function also ``[--compare A B]``, which prints ``compare(WORK, A, B)``
    after the report."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("work_dir")
    parser.add_argument("--data-dir", default=default_data_dir)
    if compare is not None:
        parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                            help="model A against model B per test split: is A ahead beyond one sd?")
    args = parser.parse_args(argv)
    print(summarize(args.work_dir, args.data_dir))
    print(f"\nwritten {os.path.join(args.work_dir, written[0])}, " + ", ".join(written[1:]))
    if getattr(args, "compare", None):
        print("\n" + compare(args.work_dir, *args.compare))
