"""The two BLEU scores of the WMT'14 recipe (docs/wmt14.md#evaluation).

(a) **Tokenised BLEU with compound splitting** — the number most WMT'14 En-De papers
    (GNMT, ConvS2S, Transformer, the SUT paper) report. Hypothesis and reference are the
    Moses-tokenised text of the preparation (``tok/newstest2014.de``); hyphenated compounds
    are split on both sides into ``rich ##AT##-##AT## text``; then corpus BLEU on
    whitespace tokens, case-sensitive, no smoothing — what ``multi-bleu.perl`` computes. We
    compute it with SacreBLEU (``tokenize="none", smooth_method="none"``), which gives the
    same number as ``multi-bleu.perl`` on pre-tokenised text and needs no Perl.

    ``compound_split(mode="atat")`` (default) first joins the Moses ``-a`` hyphen tokens
    (``rich @-@ text`` -> ``rich-text``, as the detokeniser does), then applies the usual
    rule ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``: the result is what the standard script
    gives on text tokenised without ``-a``. ``mode="reference"`` applies the rule to the
    text as it is, like the SUT/Transformer-Clinic scoring script did on ``-a`` output:
    ``rich @-@ text`` -> ``rich @ ##AT##-##AT## @ text`` (three tokens for one hyphen, which
    raises n-gram matches; about +0.1..0.5 BLEU; use it to compare with their logs).

(b) **SacreBLEU** on detokenised output (sacremoses ``MosesDetokenizer``, unescaping
    ``&quot;`` etc.) against the *raw* reference (the newstest2014 SGML segments), default
    13a tokenisation; reported with its signature.

    python -m sut_fairseq.eval.bleu --hyp HYP.tok --tok-ref tok/newstest2014.de \\
        --raw-ref raw/newstest2014.de [--lang de] [--compound-split atat|reference]
    python -m sut_fairseq.eval.bleu --generate-output generate-test.txt ...   (H- lines)
"""
import argparse
import re
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

AT_SPLIT = "##AT##-##AT##"
_COMPOUND = re.compile(r"(\S)-(\S)")
_MOSES_HYPHEN = re.compile(r"\s*(?<!\S)@-@(?!\S)\s*")
COMPOUND_MODES = ("atat", "reference")


def compound_split(line: str, mode: str = "atat") -> str:
    """Split hyphenated compounds into ``left ##AT##-##AT## right`` (see module doc)."""
    if mode not in COMPOUND_MODES:
        raise ValueError(f"compound split mode {mode!r}: choose from {COMPOUND_MODES}")
    text = " ".join(line.split())
    if mode == "atat":
        text = _MOSES_HYPHEN.sub("-", text)
    return _COMPOUND.sub(r"\1 " + AT_SPLIT + r" \2", text)


def _check_lengths(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    if not hyps:
        raise ValueError("nothing to score")


@dataclass
class Score:
    score: float
    detail: str       # SacreBLEU's one-line summary (precisions, BP, lengths)
    signature: str


def tokenized_bleu(hyps: Sequence[str], refs: Sequence[str], mode: str = "atat") -> Score:
    """(a): compound-split tokenised BLEU (multi-bleu.perl equivalent)."""
    from sacrebleu.metrics import BLEU

    _check_lengths(hyps, refs)
    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    result = metric.corpus_score([compound_split(h, mode) for h in hyps],
                                 [[compound_split(r, mode) for r in refs]])
    return Score(result.score, str(result), f"{metric.get_signature()}|compound:{mode}")


def detokenize(lines: Sequence[str], lang: str = "de") -> List[str]:
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


def sacrebleu_score(detok_hyps: Sequence[str], raw_refs: Sequence[str]) -> Score:
    """(b): SacreBLEU with its default settings (13a, exp smoothing, mixed case)."""
    from sacrebleu.metrics import BLEU

    _check_lengths(detok_hyps, raw_refs)
    metric = BLEU()
    result = metric.corpus_score(list(detok_hyps), [list(raw_refs)])
    return Score(result.score, str(result), str(metric.get_signature()))


def moses_lowercase(lines: Sequence[str], lang: str) -> List[str]:
    """Moses punctuation normalisation and tokenisation (``tokenizer.perl -l LANG``, no
    ``-a``, no escaping), lowercased: the text the multimodal-translation literature
    scores Multi30k on."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normaliser, tokeniser = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [tokeniser.tokenize(normaliser.normalize(line), escape=False, return_str=True).lower()
            for line in lines]


def lowercased_tokenized_bleu(detok_hyps: Sequence[str], raw_refs: Sequence[str], lang: str) -> Score:
    """(c): BLEU of Moses-tokenised, lowercased hypotheses and references, whitespace
    tokens, no smoothing (``multi-bleu.perl -lc`` on tokenised text), as Multi30k papers
    report it."""
    from sacrebleu.metrics import BLEU

    _check_lengths(detok_hyps, raw_refs)
    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    result = metric.corpus_score(moses_lowercase(detok_hyps, lang), [moses_lowercase(raw_refs, lang)])
    return Score(result.score, str(result), f"{metric.get_signature()}|moses-tok:{lang}|lc")


def read_lines(path: str) -> List[str]:
    with open(path, encoding="utf-8", newline="\n") as handle:
        return [line.rstrip("\n") for line in handle]


def score_both(hyps_tok: Sequence[str], tok_refs: Sequence[str], raw_refs: Sequence[str],
               lang: str = "de", mode: str = "atat"):
    """(a) and (b) for tokenised hypotheses; returns (tokenised, sacrebleu, detok_hyps)."""
    detok = detokenize(hyps_tok, lang)
    return tokenized_bleu(hyps_tok, tok_refs, mode), sacrebleu_score(detok, raw_refs), detok


def format_scores(tok: Score, sacre: Score) -> str:
    return (f"tokenised BLEU (compound-split, multi-bleu equivalent): {tok.score:.2f}\n"
            f"    {tok.detail}\n    signature: {tok.signature}\n"
            f"SacreBLEU (detokenised vs raw reference): {sacre.score:.2f}\n"
            f"    {sacre.detail}\n    signature: {sacre.signature}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Tokenised (compound-split) BLEU and SacreBLEU")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hyp", help="tokenised hypotheses, one per line, in test-set order")
    source.add_argument("--generate-output",
                        help="fairseq-generate stdout (with --remove-bpe); its H- lines are used")
    parser.add_argument("--tok-ref", required=True, help="tokenised reference (tok/newstest2014.de)")
    parser.add_argument("--raw-ref", required=True, help="raw reference (raw/newstest2014.de)")
    parser.add_argument("--lang", default="de", help="target language of the detokeniser")
    parser.add_argument("--compound-split", choices=COMPOUND_MODES, default="atat")
    parser.add_argument("--detok-out", help="also write the detokenised hypotheses here")
    args = parser.parse_args(argv)
    if args.hyp:
        hyps = read_lines(args.hyp)
    else:
        from .generate_output import read_generate_output

        hyps = [e.hypothesis for e in read_generate_output(args.generate_output)]
    tok_refs, raw_refs = read_lines(args.tok_ref), read_lines(args.raw_ref)
    if len(tok_refs) != len(raw_refs):
        sys.exit(f"error: {args.tok_ref} has {len(tok_refs)} lines, {args.raw_ref} {len(raw_refs)}")
    if len(hyps) != len(tok_refs):
        sys.exit(f"error: {len(hyps)} hypotheses for {len(tok_refs)} reference lines")
    tok, sacre, detok = score_both(hyps, tok_refs, raw_refs, args.lang, args.compound_split)
    if args.detok_out:
        from ..data.atomic import write_lines_atomic

        write_lines_atomic(args.detok_out, detok)
    print(format_scores(tok, sacre))
    return 0


if __name__ == "__main__":
    sys.exit(main())
