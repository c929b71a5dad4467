#!/usr/bin/env python3
"""ListOps, the recurrent-transformers paper's Table 1 at CPU scale: UT, GUT, TLB, GUTLB
and the chunked SUT trained on expressions of length <= 100 and scored on the near-IID,
length and argument generalisation splits. The shared recipe template's four stages:
1 data, 2 train, 3 evaluate, 4 report.

    python scripts/listops/table1.py --data-dir data/listops --work-dir runs/listops
    # options: --stage S / --stop-stage S, --models ..., --seeds 1 2 3, --config cpu|full,
    # --data-config small|paper, --max-update N, --stop-time-hours H, --splits SPLIT ...,
    # --cpu, --train-args "...", --generate-args "...", --dry-run, --force, --cleanup

1 data: ``data-prep/listops/generate.py --config DATA_CONFIG --binarize`` into
``--data-dir``, skipped when it is complete (``--data-config``: ``small`` for
``--config cpu``, ``paper`` for ``--config full`` unless given).
2 train: fairseq-train for each (model, seed) that has no ``train.json`` yet; an
interrupted training resumes from its checkpoint_last.pt.
3 evaluate: for each trained run without ``result.json``, greedy fairseq-generate on
every test split, exact match of the value (every line scored once), and the mean
executed encoder steps from fairseq-generate's closing line.
4 report: ``summarize.py`` -> ``WORK/table1.md``, ``WORK/table1.json``,
``WORK/accuracy.png``.

Each run lives in ``WORK/MODEL/seedN/`` (``train.log``, ``checkpoints/``, ``train.json``,
``generate-SPLIT.txt``, ``score-SPLIT.json``, ``result.json``); commands are printed
before they run, ``--dry-run`` prints them only, ``--force`` redoes the chosen stages.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import listops_recipe as recipe  # noqa: E402
import summarize  # noqa: E402


def main(argv=None):
    return recipe.TASK.main(recipe.TASK.parser(__doc__), argv, summarize.summarize,
                            os.path.join(os.path.dirname(os.path.abspath(__file__)), "summarize.py"))


if __name__ == "__main__":
    sys.exit(main())
