#!/usr/bin/env python3
"""Flip-flop language accuracy (the recurrent-transformers paper's Table 3, at CPU scale)
for UT, GUT, TLB, GUTLB and the chunked SUT, end to end: the four stages of the shared
recipe template (``sut_fairseq.recipes``): 1 data, 2 train, 3 evaluate, 4 report.

    python scripts/flipflop/table3.py [--data-dir data/flipflop] [--work-dir runs/flipflop]
        [--stage S] [--stop-stage S] [--models ut gut tlb gutlb sut-chunked] [--seeds 1]
        [--config cpu|full] [--data-config small|paper] [--max-update N]
        [--stop-time-hours H] [--splits SPLIT ...] [--subset-chunk-size 8] [--cpu]
        [--train-args "..."] [--generate-args "..."] [--dry-run] [--force] [--cleanup]

Stages (``--stage``/``--stop-stage``, by name or number): *data* runs
``data-prep/flipflop/generate.py --config DATA_CONFIG --binarize`` into ``--data-dir``
unless it is complete (``--data-config`` defaults to ``small`` for ``--config cpu`` and
``paper`` for ``--config full``); *train* trains every run without a ``train.json`` (an
interrupted training resumes from its checkpoint_last.pt); *evaluate* scores every
trained run without a ``result.json``: greedy fairseq-generate on each test split (exact
match of the bit, every line scored once), the accuracy on the examples whose answer (the
last write's bit or a later read's) lies in an earlier chunk than the final read (chunks of the model's g, or ``--subset-chunk-size`` for a model
without chunks), the mean executed encoder steps, and for the chunk-wise models the
memory-reset control (fairseq-generate again with ``--model-overrides
"{'tlb_memory_reset': True}"``); *report* (``summarize.py``) writes ``WORK/table3.md``,
``WORK/table3.json`` and ``WORK/accuracy.png``.

Runs go one after another into ``WORK/MODEL/seedN/`` (``train.log``, ``checkpoints/``,
``train.json``, ``generate-SPLIT.txt``, ``generate-SPLIT-reset.txt``, ``score-SPLIT.json``,
``result.json``). ``--force`` redoes the selected stages of every run; every command is
printed before it runs; ``--dry-run`` only prints them.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flipflop_recipe as recipe  # noqa: E402
import summarize  # noqa: E402


def evaluate(args, model, seed, run_dir):
    """Stage 3 for one run: accuracy, subset accuracy, steps and the reset control."""
    recipe.TASK.evaluate(args, model, seed, run_dir, extra=lambda *a: recipe.split_extra(args, *a))


def main(argv=None):
    parser = recipe.TASK.parser(__doc__)
    parser.add_argument("--subset-chunk-size", type=int, default=recipe.DEFAULT_SUBSET_CHUNK,
                        help="chunk size g of the answer-before-the-read's-chunk subset for models without chunks "
                             f"(default: {recipe.DEFAULT_SUBSET_CHUNK})")
    return recipe.TASK.main(parser, argv, summarize.summarize,
                            os.path.join(os.path.dirname(os.path.abspath(__file__)), "summarize.py"),
                            evaluate)


if __name__ == "__main__":
    sys.exit(main())
