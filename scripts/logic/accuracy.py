#!/usr/bin/env python3
"""Relation accuracy of fairseq-generate output on one logical-inference test split.

    python scripts/logic/accuracy.py GENERATE_OUTPUT --reference DATA/standard/test12.tgt [--json RESULT]

``GENERATE_OUTPUT`` is fairseq-generate's stdout (``H-i`` lines; ``i`` is the 0-based line
of the example in the split). ``--reference`` is the split's target text file written by
``data-prep/logic/prepare.py`` (one relation token per line: ``=`` ``<`` ``>`` ``^`` ``|``
``v`` ``#``).

An example is correct when the hypothesis is exactly the reference relation token (one
token; a longer output is wrong). Also reported: ``first_token_accuracy``, where only the
first output token is compared.

Fails (exit status 1) unless every line of the reference file was scored exactly once --
the check that catches fairseq-generate run without ``--required-batch-size-multiple 1``
(it then silently drops up to 7 examples per split) -- and when a ``T-i`` line disagrees
with line ``i + 1`` of the reference. The scorer is
``sut_fairseq.recipes.scoring.relation_accuracy``.
"""
from sut_fairseq.recipes import scoring
from sut_fairseq.recipes.scoring import relation_accuracy as score


def main(argv=None):
    return scoring.cli(argv, __doc__.split("\n\n")[0], score, lambda result, reference: (
        f"accuracy {result['accuracy']:.2f}% ({result['correct']} / {result['total']}; all "
        f"{result['lines']} lines of {reference} scored)"))


if __name__ == "__main__":
    main()
