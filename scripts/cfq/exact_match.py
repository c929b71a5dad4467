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
import argparse
import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cfq_recipe import load_light_modules  # noqa: E402

_cfq, _generate_output = load_light_modules()
QueryFormatError, simplify_query = _cfq.QueryFormatError, _cfq.simplify_query
write_lines_atomic, read_generate_output = _cfq.write_lines_atomic, _generate_output.read_generate_output


def _canonical(text: str):
    try:
        return simplify_query(text)
    except QueryFormatError:
        return None


def score(generate_output: str, reference: str) -> Dict:
    """Counts and accuracies; raises ValueError if the output does not cover every
    reference line exactly once or disagrees with the reference file."""
    examples = read_generate_output(generate_output)
    with open(reference, encoding="utf-8") as handle:
        references: List[str] = [line.rstrip("\n") for line in handle]
    ids = [e.id for e in examples]
    if ids != list(range(len(references))):
        missing = sorted(set(range(len(references))) - set(ids))
        extra = sorted(set(ids) - set(range(len(references))))
        raise ValueError(
            f"{generate_output}: scored {len(examples)} examples but {reference} has "
            f"{len(references)} lines" + (f"; missing ids e.g. {missing[:5]}" if missing else "")
            + (f"; ids beyond the file e.g. {extra[:5]}" if extra else "")
            + " (did fairseq-generate run with --required-batch-size-multiple 1 on this split?)")
    strict = loose = 0
    for example in examples:
        ref, hyp = references[example.id].split(), example.hypothesis.split()
        shown = example.reference.split()
        if len(shown) != len(ref) or any(s != r and s != "<unk>" for s, r in zip(shown, ref)):
            raise ValueError(f"{generate_output}: T-{example.id} does not match line "
                             f"{example.id + 1} of {reference}: wrong reference file or split?")
        strict += hyp == ref
        canonical = _canonical(" ".join(hyp))
        loose += canonical is not None and canonical == _canonical(" ".join(ref))
    n = len(examples)
    return {"total": n, "correct": strict, "exact_match": 100.0 * strict / n,
            "order_insensitive_correct": loose, "order_insensitive_exact_match": 100.0 * loose / n,
            "generate_output": os.path.abspath(generate_output), "reference": os.path.abspath(reference)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("generate_output", help="file holding fairseq-generate's stdout")
    parser.add_argument("--reference", required=True, help="the split's .tgt text file")
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    try:
        result = score(args.generate_output, args.reference)
    except (OSError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(f"exact match {result['exact_match']:.2f}% ({result['correct']} / {result['total']} "
          f"examples; all {result['total']} lines of {args.reference} scored); "
          f"order-insensitive {result['order_insensitive_exact_match']:.2f}%")
    if args.json:
        write_lines_atomic(args.json, [json.dumps(result, indent=2)])
    return result


if __name__ == "__main__":
    main()
