#!/usr/bin/env python3
"""ListOps, the recurrent-transformers paper's Table 1 at CPU scale: UT, GUT, TLB, GUTLB
and the chunked SUT trained on expressions of length <= 100 and scored on the near-IID,
length and argument generalisation splits. The shared recipe template's four stages:
1 data, 2 train, 3 evaluate, 4 report, in one of two setups (``--setup``):

* ``classify`` (default): the paper's encoder-only classifiers (``configs/listops/classify/``,
  ``--task sut_classification``); stage 1 also writes ``data-prep/listops/classify.py``'s
  layout into ``DATA/classify``, stage 3 scores the test splits with one fairseq-validate
  (``validate.txt``), runs and report in ``WORK/classify``;
* ``seq2seq``: the translation setup (``configs/listops/``) described below.

    python scripts/listops/table1.py [--setup classify|seq2seq] --data-dir data/listops --work-dir runs/listops
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
import argparse  # noqa: E402

import listops_recipe as recipe  # noqa: E402
import summarize  # noqa: E402
from sut_fairseq.recipes.classify import SETUPS, add_setup_argument  # noqa: E402


def setup_of(argv) -> str:
    """``--setup`` alone (the setup decides the models and configurations of the parser)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--setup", choices=SETUPS, default="classify")
    known, _ = pre.parse_known_args(argv)
    return known.setup


def main(argv=None):
    task = recipe.TASKS[setup_of(argv)]
    parser = task.parser(__doc__)
    add_setup_argument(parser)
    return task.main(parser, argv, summarize.summarize,
                     os.path.join(os.path.dirname(os.path.abspath(__file__)), "summarize.py"))


if __name__ == "__main__":
    sys.exit(main())
