#!/usr/bin/env python3
"""Report of the ListOps recipe (``table1.py``, stage 4).

    python scripts/listops/summarize.py WORK [--data-dir data/listops]

For every model in WORK (its seeds averaged) the accuracy on each test split, set beside
the most frequent label of that split (from the generator's ``DATA/stats.json``) and the
paper's Table 1, the mean executed encoder steps, and what each model's runs cost and
reached (updates, best validation accuracy, hours of one core). Output, written atomically:
``WORK/table1.md`` (the tables), ``WORK/table1.json`` (their numbers) and
``WORK/accuracy.png``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import listops_recipe as recipe  # noqa: E402
from sut_fairseq.recipes import load_json  # noqa: E402
from sut_fairseq.recipes.split_grid import (STEP_METRICS, add_rows, collect, metric_table,  # noqa: E402
                                            ordered_splits, reference_row, report_main,
                                            steps_text, training_text, write_report)


def summarize(work_dir: str, data_dir: str) -> str:
    """Write table1.md, table1.json and accuracy.png into ``work_dir``; return the markdown."""
    # the classify grid's models are the seq2seq grid's and fairseq's transformer encoder
    models = collect(work_dir, recipe.CLASSIFY_TASK.grid, ("accuracy",) + STEP_METRICS)
    if not models:
        raise SystemExit(f"error: no result.json under {work_dir}: run the evaluate stage first")
    stats = load_json(os.path.join(data_dir, "stats.json"))
    splits = ordered_splits(models, list(stats.get("binarized_test_splits", {})))
    data = stats["splits"]
    majority = {s: data[s]["majority"]["share"] for s in splits if s in data}
    accuracy = add_rows(metric_table(models, splits, "accuracy"),
                        [reference_row("majority label of the split", majority, splits, scale=100)]
                        + [reference_row(f"paper: {label}", values, splits)
                           for label, values in recipe.PAPER_TABLE1.items()])
    text = ("Accuracy (%, exact value) per test split; trained on length <= "
            f"{stats.get('config', {}).get('train_max_length', 100)}, at most 5 arguments, "
            f"generator depth 20 (the paper's rows: its Table 1, trained on the original data):\n\n"
            f"{accuracy}\n\n" + steps_text(models, splits) + "\n" + training_text(models))
    return write_report(work_dir, "table1", text, models, splits, "ListOps accuracy per test split",
                        {"majority": majority, "paper": recipe.PAPER_TABLE1})


def main(argv=None):
    report_main(__doc__, "listops", summarize, "table1", argv)


if __name__ == "__main__":
    main()
