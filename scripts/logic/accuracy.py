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

Fails (exit status 1, ``ValueError`` from :func:`score`) unless every line of the
reference file was scored exactly once -- the check that catches fairseq-generate run
without ``--required-batch-size-multiple 1`` (it then silently drops up to 7 examples per
split) -- and when a ``T-i`` line disagrees with line ``i + 1`` of the reference.
"""
import argparse
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logic_recipe as recipe  # noqa: E402


def read_reference(path: str) -> List[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.strip() for line in handle.read().splitlines()]


def score(generate_output: str, reference: str) -> Dict:
    """Counts and accuracies (percent) of one split; raises ValueError unless the output
    covers every reference line exactly once and agrees with the reference file."""
    examples = recipe.load_generate_output_module().read_generate_output(generate_output)
    references = read_reference(reference)
    ids = [e.id for e in examples]
    if ids != list(range(len(references))):
        missing = sorted(set(range(len(references))) - set(ids))
        extra = sorted(set(ids) - set(range(len(references))))
        raise ValueError(
            f"{generate_output}: fairseq-generate scored {len(examples)} examples but "
            f"{reference} has {len(references)} lines"
            + (f"; {len(missing)} missing, e.g. ids {missing[:5]}" if missing else "")
            + (f"; ids beyond the file, e.g. {extra[:5]}" if extra else "")
            + " (was fairseq-generate run with --required-batch-size-multiple 1 on this split?)")
    correct = first = 0
    for example in examples:
        ref = references[example.id]
        shown = example.reference.strip()
        if shown != ref and shown != "<unk>":
            raise ValueError(f"{generate_output}: T-{example.id} is {shown!r} but line "
                             f"{example.id + 1} of {reference} is {ref!r}: wrong reference "
                             "file or split?")
        hyp = example.hypothesis.split()
        correct += hyp == [ref]
        first += bool(hyp) and hyp[0] == ref
    n = len(examples)
    if n == 0:
        raise ValueError(f"{generate_output}: no examples scored ({reference} is empty)")
    return {"total": n, "lines": len(references), "correct": correct,
            "accuracy": 100.0 * correct / n, "first_token_correct": first,
            "first_token_accuracy": 100.0 * first / n,
            "generate_output": os.path.abspath(generate_output),
            "reference": os.path.abspath(reference)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("generate_output", help="file holding fairseq-generate's stdout")
    parser.add_argument("--reference", required=True, help="the split's .tgt text file")
    parser.add_argument("--json", default=None, help="also write the result as JSON here (atomically)")
    args = parser.parse_args(argv)
    try:
        result = score(args.generate_output, args.reference)
    except (OSError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(f"accuracy {result['accuracy']:.2f}% ({result['correct']} / {result['total']}; all "
          f"{result['lines']} lines of {args.reference} scored)")
    if args.json:
        recipe.write_json_atomic(args.json, result)
    return result


if __name__ == "__main__":
    main()
