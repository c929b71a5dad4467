"""Read ``fairseq-generate`` output and score it by exact match.

fairseq-generate prints, per example ``i``: ``S-i<TAB>source``, ``T-i<TAB>reference``,
``H-i<TAB>score<TAB>hypothesis`` (and D-/P- lines). Only the first hypothesis of each
example (the best beam) is kept.
"""
import argparse
import re
import sys
from dataclasses import dataclass
from typing import Dict, List


@dataclass
class Example:
    id: int
    source: str = ""
    reference: str = ""
    hypothesis: str = ""


def read_generate_output(path: str, hypothesis: str = "H") -> List[Example]:
    """Examples in id order. ``hypothesis``: the lines the hypotheses come from, ``H``
    (the model's tokens) or ``D`` (decoded by ``--bpe`` / ``--tokenizer``: detokenised
    text). Raises ValueError naming the file if a hypothesis is missing."""
    if hypothesis not in ("H", "D"):
        raise ValueError(f"hypothesis lines {hypothesis!r}: choose H or D")
    examples: Dict[int, Example] = {}
    seen_h = set()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            tag, _, rest = line.rstrip("\n").partition("\t")
            kind, dash, index = tag.partition("-")
            if not dash or kind not in ("S", "T", hypothesis) or not index.isdigit():
                continue
            ex = examples.setdefault(int(index), Example(int(index)))
            if kind == "S":
                ex.source = rest
            elif kind == "T":
                ex.reference = rest
            elif int(index) not in seen_h:
                seen_h.add(int(index))
                ex.hypothesis = rest.partition("\t")[2]
    missing = [i for i in examples if i not in seen_h]
    if missing:
        raise ValueError(f"{path}: {len(missing)} examples have no {hypothesis}- line (e.g. id {missing[0]})")
    return [examples[i] for i in sorted(examples)]


#: The closing line of a generate run over a model with halting (modules/accounting.py).
_EXECUTED_STEPS = re.compile(r"(encoder|decoder) steps executed [\d.]+% \((\d+)/(\d+)")
_PER_CHUNK = re.compile(r"([\d.]+) per chunk over (\d+) chunks")


def read_executed_steps(path: str) -> Dict[str, Dict]:
    """Per side, from the closing ``| encoder steps executed ...`` line of a generate
    output: ``executed`` and ``possible`` (position, step) block applications (``possible``
    is L times the real positions, so ``L * executed / possible`` is the mean executed
    steps per position) and, for a side with chunks, ``per_chunk`` (the mean steps per
    chunk) and ``chunks``, else None. Empty when the output has no such line (a model
    without that accounting)."""
    found: Dict[str, Dict] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            for part in line.split("|"):
                match = _EXECUTED_STEPS.search(part)
                if match is None:
                    continue
                chunked = _PER_CHUNK.search(part)
                found[match.group(1)] = {
                    "executed": int(match.group(2)), "possible": int(match.group(3)),
                    "per_chunk": float(chunked.group(1)) if chunked else None,
                    "chunks": int(chunked.group(2)) if chunked else None}
    return found


def exact_match(examples: List[Example]) -> float:
    """Fraction of examples whose hypothesis equals the reference token for token."""
    if not examples:
        raise ValueError("no examples to score")
    return sum(e.hypothesis.split() == e.reference.split() for e in examples) / len(examples)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Exact-match accuracy of fairseq-generate output")
    parser.add_argument("generate_output", help="file holding fairseq-generate's stdout")
    parser.add_argument("--expect", type=int, default=None,
                        help="fail unless exactly this many examples were scored")
    args = parser.parse_args(argv)
    examples = read_generate_output(args.generate_output)
    if args.expect is not None and len(examples) != args.expect:
        sys.exit(f"error: scored {len(examples)} examples, expected {args.expect}")
    print(f"exact match {100 * exact_match(examples):.2f}% on {len(examples)} examples")


if __name__ == "__main__":
    main()
