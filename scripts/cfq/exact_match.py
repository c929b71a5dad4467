#!/usr/bin/env python3
"""Exact-match accuracy of fairseq-generate output on CFQ.

    python scripts/cfq/exact_match.py GENERATE_OUTPUT --reference DATA/mcd1/test.tgt [--json RESULT]

``GENERATE_OUTPUT`` is fairseq-generate's stdout (``H-i`` lines; ``i`` is the line number
of the example in the split). ``--reference`` is the split's target text file written by
``data-prep/cfq/prepare.py`` (the simplified targets, the form the model was trained to
produce): comparing against it rather than the ``T-i`` lines means a reference token that
the dictionary maps to ``<unk>`` can never be matched by a hypothesis ``<unk>``.

Prints the exact-match accuracy (the metric of paper Table 4: the hypothesis equals the
simplified reference token for token) and the count, and fails unless every line of the
reference file was scored exactly once. Also reported, not the paper's metric: the
order-insensitive accuracy, where a hypothesis counts when its canonical simplified form
(sorted groups, merged objects) equals the reference's -- it differs from the strict one
only when the model emits a correct query in a non-canonical order.
"""
from sut_fairseq.data.cfq import QueryFormatError, simplify_query
from sut_fairseq.recipes import scoring


def _canonical(text: str):
    """The canonical simplified form of a query, or None when it does not parse."""
    try:
        return simplify_query(text)
    except QueryFormatError:
        return None


def score(generate_output: str, reference: str):
    """Strict and order-insensitive exact match (``sut_fairseq.recipes.scoring.exact_match``)."""
    return scoring.exact_match(generate_output, reference, canonical=_canonical)


def main(argv=None):
    return scoring.cli(argv, __doc__.split("\n\n")[0], score, lambda result, reference: (
        f"exact match {result['exact_match']:.2f}% ({result['correct']} / {result['total']} "
        f"examples; all {result['total']} lines of {reference} scored); "
        f"order-insensitive {result['order_insensitive_exact_match']:.2f}%"))


if __name__ == "__main__":
    main()
