#!/usr/bin/env python3
"""Prepare any parallel corpus from local files for fairseq (docs/multi30k.md#data).

    python data-prep/parallel/prepare.py --workdir data/corpus --src en --tgt de \\
        --train DIR/train --valid DIR/val --test DIR/test_a [--test DIR/test_b ...] \\
        [--subword spm|bpe] [--vocab-size 8000] [--spm-type unigram|bpe] \\
        [--bpe-merges 8000] [--workers N]

Each PREFIX names two files, ``PREFIX.SRC`` and ``PREFIX.TGT``, each plain text or gzip
(``PREFIX.SRC.gz``), one sentence per line, aligned line by line. Test sets are named by
their prefix's last component (``DIR/test_2016_flickr`` -> ``test_2016_flickr``) and are
binarized in the order given as fairseq's subsets ``test``, ``test1``, ``test2``, ...;
``data-bin/subsets.json`` records which is which.

The steps are the WMT'14 preparation's (``data-prep/wmt14_en_de/wmt14_prep.py``: the
same step runner, text normalisation, Moses tokenisation, length filter, SentencePiece,
BPE and binarization), on the files given instead of the WMT corpora:

  read-NAME.L      raw/NAME.L: the input, decompressed if gzip; both sides of a pair must
                   have the same number of lines.
  --subword spm (default): one joint SentencePiece model on untokenised text
  text-NAME.L      text/NAME.L: non-printing characters removed, whitespace collapsed.
  learn-spm        spm/spm.model, spm/dict.txt: --spm-type, --vocab-size pieces (the
                   fairseq dictionary's size), trained on text/train.{SRC,TGT}.
  apply-spm-NAME.L spm/NAME.L: pieces.
  --subword bpe: Moses tokens and joint BPE (subword-nmt)
  tokenise-NAME.L  tok/NAME.L: normalize-punctuation, remove-non-printing-char, tokenizer -a.
  clean-train      clean/train.L: pairs outside [--min-len, --max-len] tokens or above
                   --max-ratio dropped (train only).
  learn-bpe        bpe/codes: --bpe-merges merges.
  apply-bpe-NAME.L bpe/NAME.L.
  binarize         data-bin/: fairseq-preprocess --joined-dictionary (spm: --srcdict
                   spm/dict.txt, spm.model copied in), and subsets.json.

Kept for scoring: raw/TEST.TGT, the untouched references. Every output is renamed into
place complete before its step's marker (``done/``) is written; running the same command
again resumes, and a work directory holding other files or another run's parameters is
refused unless --overwrite (as the WMT'14 preparation).
"""
import argparse
import gzip
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "data-prep", "wmt14_en_de"))

import wmt14_prep as wp  # noqa: E402
from sut_fairseq.data.atomic import write_text_atomic  # noqa: E402
from sut_fairseq.recipes.commands import RecipeError, tool  # noqa: E402

SUBSETS_FILE = "subsets.json"


class Corpus:
    """The input files of one preparation: ``{name: prefix}`` for train, valid and each
    test set, and the language pair. :meth:`path` finds ``PREFIX.LANG`` or its ``.gz``."""

    def __init__(self, src: str, tgt: str, train: str, valid: str, tests: Sequence[str]):
        if src == tgt:
            raise wp.PrepError(f"--src and --tgt are both {src!r}: give two languages")
        self.src, self.tgt = src, tgt
        self.tests = [os.path.basename(os.path.normpath(t)) for t in tests]
        if not tests:
            raise wp.PrepError("no --test set given: give at least one")
        dupes = sorted({n for n in self.tests if self.tests.count(n) > 1})
        if dupes:
            raise wp.PrepError(f"two --test sets are named {dupes[0]!r}: test sets are named by "
                               "their prefix's last component, which must differ")
        clash = [n for n in self.tests if n in ("train", "valid")]
        if clash:
            raise wp.PrepError(f"a --test set may not be named {clash[0]!r} (train and valid are "
                               "the other splits' names)")
        self.prefixes: Dict[str, str] = {"train": train, "valid": valid, **dict(zip(self.tests, tests))}

    @property
    def langs(self):
        return (self.src, self.tgt)

    def path(self, name: str, lang: str) -> str:
        """The file of split ``name`` in ``lang``: ``PREFIX.LANG`` or ``PREFIX.LANG.gz``
        (PrepError naming both when neither or both exist)."""
        plain = f"{self.prefixes[name]}.{lang}"
        packed = plain + ".gz"
        found = [p for p in (plain, packed) if os.path.isfile(p)]
        if not found:
            raise wp.PrepError(f"missing file: {plain} (or {os.path.basename(packed)}), the "
                               f"{lang} side of {name}")
        if len(found) == 2:
            raise wp.PrepError(f"both {plain} and {packed} exist: keep one")
        return found[0]

    def check(self) -> None:
        """Every file exists once (plain or gzip) and both sides of every split are
        readable with the same number of lines."""
        for name in self.prefixes:
            counts = [count_input_lines(self.path(name, lang)) for lang in self.langs]
            if counts[0] != counts[1]:
                raise wp.PrepError(f"the two sides of {name} have different line counts: "
                                   f"{self.path(name, self.src)} has {counts[0]} lines, "
                                   f"{self.path(name, self.tgt)} has {counts[1]}")
            if counts[0] == 0:
                raise wp.PrepError(f"{self.path(name, self.src)} is empty")

    def fingerprint(self, name: str, lang: str) -> dict:
        path = self.path(name, lang)
        return {"path": os.path.abspath(path), "bytes": os.path.getsize(path)}


def _open_input(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def count_input_lines(path: str) -> int:
    """Lines of a plain or gzip file (PrepError naming a gzip file that is not one)."""
    try:
        return wp.count_lines(path)
    except (OSError, EOFError) as err:
        raise wp.PrepError(f"cannot read {path}: {err}") from err


def read_input(src: str, dest: str) -> None:
    """``src`` (plain or gzip) decompressed into ``dest``, written through a temporary
    file beside it."""
    tmp = wp._temp_beside(dest)
    try:
        with _open_input(src) as inp, open(tmp, "wb") as out:
            shutil.copyfileobj(inp, out)
        os.replace(tmp, dest)
    except (OSError, EOFError) as err:
        wp._unlink_quietly(tmp)
        raise wp.PrepError(f"cannot read {src}: {err}") from err
    except BaseException:
        wp._unlink_quietly(tmp)
        raise


def subsets_record(corpus: Corpus, subword: str) -> dict:
    """``data-bin/subsets.json``: fairseq's subset of each test set, the pair, the subword model."""
    subsets = {("test" if i == 0 else f"test{i}"): name for i, name in enumerate(corpus.tests)}
    return {"src": corpus.src, "tgt": corpus.tgt, "subword": subword, "test_subsets": subsets}


def read_subsets(data_bin: str) -> Dict[str, str]:
    """``{fairseq subset: test set name}`` of a data-bin this script wrote."""
    path = os.path.join(data_bin, SUBSETS_FILE)
    if not os.path.isfile(path):
        raise wp.PrepError(f"missing {path}: {data_bin} was not prepared by "
                           "data-prep/parallel/prepare.py")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)["test_subsets"]


def build(args, corpus: Corpus, pipe=None) -> wp.Pipeline:
    """Declare (and, with a :class:`wp.Pipeline`, run) every step; a :class:`wp.Plan`
    only records them."""
    W = os.path.abspath(args.workdir)
    raw, tok, clean, text, sub = (os.path.join(W, d) for d in
                                  ("raw", "tok", "clean", "text", args.subword))
    pipe = pipe if pipe is not None else wp.Pipeline(W, force=args.force)
    names = list(corpus.prefixes)

    for name in names:
        for lang in corpus.langs:
            out = os.path.join(raw, f"{name}.{lang}")
            pipe.step(f"read-{name}.{lang}", [out], {"input": corpus.fingerprint(name, lang)},
                      lambda name=name, lang=lang, out=out: read_input(corpus.path(name, lang), out),
                      count=[out])
        pipe.check(lambda name=name: wp.check_parallel(*(os.path.join(raw, f"{name}.{l}")
                                                         for l in corpus.langs)))

    if args.subword == "spm":
        text_params = {"text": "remove-non-printing-char, whitespace collapsed"}
        for name in names:
            for lang in corpus.langs:
                src, out = os.path.join(raw, f"{name}.{lang}"), os.path.join(text, f"{name}.{lang}")
                pipe.step(f"text-{name}.{lang}", [out], text_params,
                          lambda src=src, out=out: wp.normalise_text_file(src, out, args.workers),
                          deps=[f"read-{name}.{lang}"], count=[out])
        model, vocab, dictionary = (os.path.join(sub, n) for n in ("spm.model", "spm.vocab", "dict.txt"))
        train = [os.path.join(text, f"train.{l}") for l in corpus.langs]
        pipe.step("learn-spm", [model, vocab, dictionary],
                  {"model_type": args.spm_type, "vocab_size": args.vocab_size, "seed": 1,
                   "character_coverage": args.spm_character_coverage,
                   "special_ids": wp.SPM_SPECIAL_IDS},
                  lambda: wp.learn_spm(train, model, vocab, dictionary, args.vocab_size, args.spm_type,
                                       character_coverage=args.spm_character_coverage, seed=1,
                                       threads=args.workers, hard_vocab_limit=False),
                  deps=[f"text-train.{l}" for l in corpus.langs], count=[dictionary])
        subword_step, apply_params = "learn-spm", {"encoder": "sentencepiece pieces"}
        apply = lambda src, out: wp.apply_spm_file(model, src, out, args.workers)  # noqa: E731
        source_dir, source_step = text, "text"
        extra, srcdict = {"spm.model": model}, dictionary
    else:
        tok_params = {"steps": "normalize-punctuation, remove-non-printing-char, tokenizer -a"}
        for name in names:
            for lang in corpus.langs:
                src, out = os.path.join(raw, f"{name}.{lang}"), os.path.join(tok, f"{name}.{lang}")
                pipe.step(f"tokenise-{name}.{lang}", [out], dict(tok_params, lang=lang),
                          lambda lang=lang, src=src, out=out: wp.tokenise_file(lang, src, out, args.workers),
                          deps=[f"read-{name}.{lang}"], count=[out])
        cleaned = [os.path.join(clean, f"train.{l}") for l in corpus.langs]
        pipe.step("clean-train", cleaned,
                  {"min_len": args.min_len, "max_len": args.max_len, "max_ratio": args.max_ratio},
                  lambda: wp.clean_corpus([tuple(os.path.join(tok, f"train.{l}") for l in corpus.langs)],
                                          *cleaned, min_len=args.min_len, max_len=args.max_len,
                                          max_ratio=args.max_ratio).as_dict(),
                  deps=[f"tokenise-train.{l}" for l in corpus.langs], count=cleaned)
        codes = os.path.join(sub, "codes")
        pipe.step("learn-bpe", [codes], {"merges": args.bpe_merges, "min_frequency": 2},
                  lambda: {"merges_learnt": wp.learn_joint_bpe(cleaned, codes, args.bpe_merges,
                                                               workers=args.workers)},
                  deps=["clean-train"])
        subword_step, apply_params = "learn-bpe", {"separator": "@@"}
        apply = lambda src, out: wp.apply_bpe_file(codes, src, out, args.workers)  # noqa: E731
        source_dir, source_step = tok, "tokenise"
        extra, srcdict = {}, None

    for name in names:
        for lang in corpus.langs:
            if args.subword == "bpe" and name == "train":
                src, dep = os.path.join(clean, f"train.{lang}"), "clean-train"
            else:
                src, dep = os.path.join(source_dir, f"{name}.{lang}"), f"{source_step}-{name}.{lang}"
            out = os.path.join(sub, f"{name}.{lang}")
            pipe.step(f"apply-{args.subword}-{name}.{lang}", [out], apply_params,
                      lambda src=src, out=out: apply(src, out),
                      deps=[subword_step, dep], count=[out])

    dest = os.path.join(W, "data-bin")
    record = subsets_record(corpus, args.subword)
    record_path = os.path.join(sub, SUBSETS_FILE)
    try:
        preprocess = tool("fairseq-preprocess", explicit=args.fairseq_preprocess)
    except RecipeError as err:
        raise wp.PrepError(f"{err}; or pass --fairseq-preprocess PATH")
    command = wp.binarize_command(preprocess, sub, dest, args.workers, srcdict=srcdict,
                                  src=corpus.src, tgt=corpus.tgt, tests=corpus.tests)

    def binarize():
        write_text_atomic(record_path, json.dumps(record, indent=1) + "\n")
        return wp.run_binarize(command, dest, dict(extra, **{SUBSETS_FILE: record_path}), lang=corpus.src)

    pipe.step("binarize", [dest], {"command": "fairseq-preprocess --joined-dictionary",
                                   "subword": args.subword, "subsets": record["test_subsets"]},
              binarize, deps=[f"apply-{args.subword}-{n}.{l}" for n in names for l in corpus.langs])
    return pipe


def add_arguments(parser: argparse.ArgumentParser, vocab_size: int = 8000) -> None:
    """The options of the subword model, the filter and the work directory (shared with
    the preparations that call this one, e.g. data-prep/multi30k/prepare.py)."""
    parser.add_argument("--workdir", required=True, help="where every step writes its outputs")
    parser.add_argument("--subword", choices=("spm", "bpe"), default="spm",
                        help="spm: one joint SentencePiece model on untokenised text (default); "
                        "bpe: Moses tokens + joint subword-nmt BPE")
    parser.add_argument("--vocab-size", type=int, default=vocab_size,
                        help=f"SentencePiece pieces incl. <s> <pad> </s> <unk> = the fairseq "
                        f"dictionary's size (default {vocab_size})")
    parser.add_argument("--spm-type", choices=wp.SPM_TYPES, default="unigram",
                        help="SentencePiece model type (--subword spm)")
    parser.add_argument("--spm-character-coverage", type=float, default=1.0,
                        help="share of characters the SentencePiece model covers (default 1.0: "
                        "a small corpus has few characters)")
    parser.add_argument("--bpe-merges", type=int, default=vocab_size,
                        help="joint BPE merge operations (--subword bpe)")
    parser.add_argument("--min-len", type=int, default=1, help="fewest tokens per side (bpe, train)")
    parser.add_argument("--max-len", type=int, default=250, help="most tokens per side (bpe, train)")
    parser.add_argument("--max-ratio", type=float, default=9.0,
                        help="largest length ratio of a pair (bpe, train); 0 disables")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes for tokenisation, subwords and fairseq-preprocess")
    parser.add_argument("--fairseq-preprocess", default=None, help="path of fairseq-preprocess")
    parser.add_argument("--force", action="store_true", help="rerun every step (implies --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="prepare into a WORKDIR that holds other files or the output of a "
                        "run with other parameters (else: error, exit 2)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--src", required=True, help="source language suffix (e.g. en)")
    parser.add_argument("--tgt", required=True, help="target language suffix (e.g. de)")
    parser.add_argument("--train", required=True, metavar="PREFIX", help="training files' prefix")
    parser.add_argument("--valid", required=True, metavar="PREFIX", help="validation files' prefix")
    parser.add_argument("--test", action="append", default=[], metavar="PREFIX",
                        help="a test set's prefix; repeatable (the first is fairseq's 'test')")
    add_arguments(parser)
    return parser.parse_args(argv)


def prepare(args, corpus: Corpus) -> int:
    """Check the inputs and the work directory, then run every step; 0, or 2 with an
    ``error:`` line."""
    start = time.time()
    inputs = [corpus.prefixes[n] for n in corpus.prefixes]
    try:
        if args.vocab_size <= len(wp.SPM_SPECIAL_IDS):
            raise wp.PrepError(f"--vocab-size {args.vocab_size} must exceed the "
                               f"{len(wp.SPM_SPECIAL_IDS)} special symbols")
        corpus.check()
        wp.check_workdir(args.workdir, lambda plan: build(args, corpus, plan),
                         inputs=[os.path.dirname(os.path.abspath(p)) for p in inputs],
                         overwrite=args.overwrite, force=args.force)
        pipe = build(args, corpus)
    except wp.PrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\nsummary (lines per file):")
    print(pipe.summary())
    print(f"\n{len(pipe.ran)} steps run, {len(pipe.skipped)} skipped (already complete) in "
          f"{time.time() - start:.0f} s; output: {os.path.join(os.path.abspath(args.workdir), 'data-bin')}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        corpus = Corpus(args.src, args.tgt, args.train, args.valid, args.test)
    except wp.PrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return prepare(args, corpus)


if __name__ == "__main__":
    sys.exit(main())
