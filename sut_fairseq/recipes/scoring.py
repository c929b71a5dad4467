"""The scorer API: one split's fairseq-generate output against its reference file.

Every scorer first aligns the output with the reference (:func:`aligned`) and refuses to
score -- ``ValueError`` naming both files -- unless

* every line of the reference file was scored exactly once (fairseq-generate without
  ``--required-batch-size-multiple 1`` silently drops up to 7 examples of a split), and
* each ``T-i`` line agrees with line ``i + 1`` of the reference token for token (a token
  the dictionary maps to ``<unk>`` counts as agreeing): the wrong reference file or split
  is caught.

Metrics (each returns counts and percentages in a dict):

* :func:`relation_accuracy` -- logical inference: the hypothesis is exactly the reference
  relation token (a longer output is wrong); also the first-token accuracy;
* :func:`exact_match` -- CFQ: the hypothesis equals the reference token for token; with
  ``canonical``, also the order-insensitive match of the canonical forms;
* :func:`bleu` -- WMT'14: tokenised BLEU with compound splitting and SacreBLEU
  (``sut_fairseq.eval.bleu``);
* :func:`detok_bleu` -- detokenised output (SentencePiece): SacreBLEU and lowercased
  Moses-tokenised BLEU (Multi30k).
"""
import os
from typing import Callable, Dict, List, Optional, Tuple

from ..eval.generate_output import Example, read_generate_output


def read_reference(path: str) -> List[str]:
    """The lines of a reference text file, without their newlines."""
    with open(path, encoding="utf-8") as handle:
        return handle.read().splitlines()


def aligned(generate_output: str, reference: str, check_targets: bool = True,
            hypothesis: str = "H") -> Tuple[List[Example], List[str]]:
    """The examples in id order and the reference lines, after the checks above
    (``hypothesis``: ``H`` or ``D`` lines, :func:`read_generate_output`)."""
    examples = read_generate_output(generate_output, hypothesis)
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
    if not examples:
        raise ValueError(f"{generate_output}: no examples scored ({reference} is empty)")
    if check_targets:
        for example in examples:
            shown, ref = example.reference.split(), references[example.id].split()
            if len(shown) != len(ref) or any(s != r and s != "<unk>" for s, r in zip(shown, ref)):
                raise ValueError(
                    f"{generate_output}: T-{example.id} is {example.reference!r} but line "
                    f"{example.id + 1} of {reference} is {references[example.id]!r}: wrong "
                    "reference file or split?")
    return examples, references


def _files(generate_output: str, reference: str) -> Dict:
    return {"generate_output": os.path.abspath(generate_output),
            "reference": os.path.abspath(reference)}


def relation_accuracy(generate_output: str, reference: str) -> Dict:
    """``accuracy``: % of examples whose output is exactly the reference relation token."""
    examples, references = aligned(generate_output, reference)
    correct = first = 0
    for example in examples:
        ref, hyp = references[example.id].strip(), example.hypothesis.split()
        correct += hyp == [ref]
        first += bool(hyp) and hyp[0] == ref
    n = len(examples)
    return {"total": n, "lines": len(references), "correct": correct,
            "accuracy": 100.0 * correct / n, "first_token_correct": first,
            "first_token_accuracy": 100.0 * first / n, **_files(generate_output, reference)}


def _matches(examples: List[Example], references: List[str]) -> List[bool]:
    return [e.hypothesis.split() == references[e.id].split() for e in examples]


def exact_matches(generate_output: str, reference: str) -> List[bool]:
    """Per line of the reference file (in order), whether the output equals it token for
    token, after :func:`aligned`'s checks."""
    return _matches(*aligned(generate_output, reference))


def exact_match(generate_output: str, reference: str,
                canonical: Optional[Callable[[str], object]] = None) -> Dict:
    """``exact_match``: % of examples whose output equals the reference token for token;
    with ``canonical`` (text -> comparable form, or None when it has none) also
    ``order_insensitive_exact_match``."""
    examples, references = aligned(generate_output, reference)
    strict = sum(_matches(examples, references))
    loose = 0
    if canonical is not None:
        for example in examples:
            form = canonical(" ".join(example.hypothesis.split()))
            loose += form is not None and form == canonical(" ".join(references[example.id].split()))
    n = len(examples)
    result = {"total": n, "lines": len(references), "correct": strict,
              "exact_match": 100.0 * strict / n, **_files(generate_output, reference)}
    if canonical is not None:
        result.update({"order_insensitive_correct": loose,
                       "order_insensitive_exact_match": 100.0 * loose / n})
    return result


def bleu(generate_output: str, tok_reference: str, raw_reference: str, target_lang: str,
         compound_split: str = "atat"):
    """Tokenised BLEU (compound-split) and SacreBLEU of the hypotheses, in test-set order.

    The ``T-`` lines are not compared (they are BPE-joined and ``<unk>``-ed forms of the
    tokenised reference), but both reference files must have one line per scored example.
    Returns ``(hypotheses, tokenised BLEU, SacreBLEU, detokenised hypotheses)``."""
    from ..eval import bleu as bleu_scores  # sacrebleu and sacremoses: only when scoring BLEU

    examples, tok_refs = aligned(generate_output, tok_reference, check_targets=False)
    raw_refs = read_reference(raw_reference)
    if len(raw_refs) != len(tok_refs):
        raise ValueError(f"{raw_reference} has {len(raw_refs)} lines but {tok_reference} has "
                         f"{len(tok_refs)}")
    hyps = [e.hypothesis for e in examples]
    tok, sacre, detok = bleu_scores.score_both(hyps, tok_refs, raw_refs, target_lang, compound_split)
    return hyps, tok, sacre, detok


def detok_bleu(generate_output: str, raw_reference: str, target_lang: str):
    """SacreBLEU and lowercased Moses-tokenised BLEU of the detokenised hypotheses (the
    ``D-`` lines of fairseq-generate run with ``--bpe sentencepiece``) against the raw
    reference, every line of which must be scored once. Returns ``(hypotheses, SacreBLEU,
    tokenised lowercased BLEU)`` (``sut_fairseq.eval.bleu``)."""
    from ..eval import bleu as bleu_scores

    examples, refs = aligned(generate_output, raw_reference, check_targets=False, hypothesis="D")
    hyps = [e.hypothesis for e in examples]
    return (hyps, bleu_scores.sacrebleu_score(hyps, refs),
            bleu_scores.lowercased_tokenized_bleu(hyps, refs, target_lang))


def cli(argv, description: str, score: Callable[[str, str], Dict],
        line: Callable[[Dict, str], str]) -> Dict:
    """The command line of a task's scorer script::

        SCRIPT GENERATE_OUTPUT --reference SPLIT.tgt [--json RESULT]

    ``score(generate_output, reference)`` gives the result, ``line(result, reference)``
    the line printed; a refused or unreadable output exits with status 1 and
    ``error: ...``. Returns the result (written atomically to ``--json`` when given)."""
    import argparse
    import sys

    from .files import write_json_atomic

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("generate_output", help="file holding fairseq-generate's stdout")
    parser.add_argument("--reference", required=True, help="the split's .tgt text file")
    parser.add_argument("--json", default=None, help="also write the result as JSON here (atomically)")
    args = parser.parse_args(argv)
    try:
        result = score(args.generate_output, args.reference)
    except (OSError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(line(result, args.reference), flush=True)
    if args.json:
        write_json_atomic(args.json, result)
    return result
