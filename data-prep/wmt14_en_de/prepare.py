#!/usr/bin/env python3
"""Prepare WMT'14 English->German for fairseq (docs/wmt14.md#data-preparation).

    python data-prep/wmt14_en_de/prepare.py --workdir data/wmt14_en_de \\
        [--local-dir DIR ...] [--no-download] [--workers N] [--bpe-merges 32764]
    python data-prep/wmt14_en_de/prepare.py --workdir data/wmt14_en_de --subword spm \\
        [--spm-type unigram|bpe] [--spm-vocab-size 32000] [--spm-input-sentences 2000000]

Steps (each skipped when its output is complete, see ``done/``; ``--force`` reruns all;
``--overwrite`` accepts changed parameters, see below):

  fetch-CORPUS     raw/CORPUS.{en,de}: from an extracted file or an archive in a
                   --local-dir, an archive in WORKDIR/orig, or downloaded into
                   WORKDIR/orig (Europarl v7, CommonCrawl, News Commentary v12,
                   newstest2013 from dev.tgz, newstest2014 full from test-full.tgz,
                   whose SGML is reduced to one segment per line). Both sides must have
                   the same number of lines.
  tokenise-CORPUS.L  tok/CORPUS.L: Moses normalize-punctuation, remove-non-printing-char,
                   tokenizer -a (sacremoses), in --workers processes.
  clean-train      clean/train.{en,de}: the three training corpora concatenated, pairs
                   with a side outside [--min-len, --max-len] tokens or a length ratio
                   above --max-ratio dropped (Moses clean-corpus-n).
  learn-bpe        bpe/codes: joint BPE, --bpe-merges merges (subword-nmt).
  apply-bpe-S.L    bpe/{train,valid,test}.L (valid = newstest2013, test = newstest2014).
  binarize         data-bin/: fairseq-preprocess --joined-dictionary.

With --subword spm the last three steps are replaced by:

  text-train       text/train.{en,de}: the pairs clean-train keeps, as their untokenised
                   raw text (non-printing characters removed, whitespace collapsed).
  text-S.L         text/{valid,test}.L from raw/ the same way.
  learn-spm        spm/spm.model, spm/spm.vocab, spm/dict.txt: one joint SentencePiece model
                   (--spm-type, --spm-vocab-size) trained on at most --spm-input-sentences
                   sampled lines of text/train.{en,de}; dict.txt (fairseq's dictionary)
                   lists exactly its pieces in id order.
  apply-spm-S.L    spm/{train,valid,test}.L: pieces, in --workers processes.
  binarize-spm     data-bin-spm/: fairseq-preprocess --srcdict spm/dict.txt
                   --joined-dictionary, with spm.model copied into it (the decoding side,
                   scripts/wmt14/evaluate.py, takes the model from there).

Kept for scoring (scripts/wmt14/evaluate.py): raw/newstest2014.de (the untouched reference
for SacreBLEU) and tok/newstest2014.de (the tokenised reference for tokenised BLEU).
A summary of line counts per step is printed at the end.

Rerunning into WORKDIR: with the same parameters it resumes (complete steps are skipped,
the rest run). Before anything is written, the run is refused (error, exit status 2) when
WORKDIR holds entries that are not this script's (anything but orig/ raw/ tok/ clean/ bpe/
data-bin/ done/, or a --local-dir kept inside it), or when a step's marker in done/
records other parameters than this run's (the error names the steps and parameters,
e.g. "clean-train: max_len 80 -> 12"). --overwrite accepts both: the changed steps and
everything downstream run again and replace their outputs, and the outputs and markers
of steps this run does not declare that were built from them (e.g. data-bin/ under
--no-binarize) are deleted, so nothing of the earlier run stays trusted. --force (rerun
every step) implies it. Every output is renamed into place complete (data-bin/: from a
temporary sibling directory) before its step's marker is written.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import wmt14_prep as wp  # noqa: E402
from sut_fairseq.recipes.commands import RecipeError, tool  # noqa: E402
from wmt14_prep import binarize_command, run_binarize  # noqa: E402

DEFAULT_MERGES = 32764  # the recipe's BPE_TOKENS ("32k"); the joined dictionary comes out near 32k
DEFAULT_SPM_VOCAB = 32000  # pieces including the 4 specials = the fairseq dictionary's size
DEFAULT_SPM_SENTENCES = 2000000  # sampled lines of train.en + train.de for training SentencePiece


def build(args, pipe=None) -> wp.Pipeline:
    """Declare (and, with a :class:`wp.Pipeline`, run) every step; a :class:`wp.Plan`
    only records them."""
    W = os.path.abspath(args.workdir)
    raw, tok, clean, bpe = (os.path.join(W, d) for d in ("raw", "tok", "clean", "bpe"))
    orig = os.path.join(W, "orig")
    local_dirs = [os.path.abspath(d) for d in args.local_dir]
    for d in local_dirs:
        if not os.path.isdir(d):
            raise wp.PrepError(f"--local-dir {d} is not a directory")
    pipe = pipe if pipe is not None else wp.Pipeline(W, force=args.force)

    # 1. fetch / extract
    for name, corpus in wp.CORPORA.items():
        outs = [os.path.join(raw, f"{name}.{l}") for l in wp.LANGS]
        params = {"sources": wp.source_fingerprint(corpus, local_dirs, orig)}
        pipe.step(f"fetch-{name}", outs, params,
                  lambda corpus=corpus: {"from": wp.fetch_corpus(
                      corpus, raw, local_dirs, orig, allow_download=not args.no_download)},
                  count=outs)

    # 2. normalise + tokenise
    tok_params = {"steps": "normalize-punctuation, remove-non-printing-char, tokenizer -a"}
    for name in wp.CORPORA:
        for lang in wp.LANGS:
            src, out = os.path.join(raw, f"{name}.{lang}"), os.path.join(tok, f"{name}.{lang}")
            pipe.step(f"tokenise-{name}.{lang}", [out], dict(tok_params, lang=lang),
                      lambda lang=lang, src=src, out=out: wp.tokenise_file(
                          lang, src, out, args.workers, args.chunk_lines),
                      deps=[f"fetch-{name}"], count=[out])
        pipe.check(lambda name=name: wp.check_parallel(*(os.path.join(tok, f"{name}.{l}")
                                                         for l in wp.LANGS)))

    # 3. length filter (train only)
    train = [os.path.join(clean, f"train.{l}") for l in wp.LANGS]
    pairs = [tuple(os.path.join(tok, f"{name}.{l}") for l in wp.LANGS) for name in wp.TRAIN_CORPORA]
    pipe.step("clean-train", train,
              {"min_len": args.min_len, "max_len": args.max_len, "max_ratio": args.max_ratio},
              lambda: wp.clean_corpus(pairs, *train, min_len=args.min_len, max_len=args.max_len,
                                      max_ratio=args.max_ratio).as_dict(),
              deps=[f"tokenise-{n}.{l}" for n in wp.TRAIN_CORPORA for l in wp.LANGS], count=train)

    if args.subword == "spm":
        build_spm(args, pipe, W, raw, tok)
        return pipe

    # 4. joint BPE
    codes = os.path.join(bpe, "codes")
    pipe.step("learn-bpe", [codes], {"merges": args.bpe_merges, "min_frequency": 2},
              lambda: {"merges_learnt": wp.learn_joint_bpe(train, codes, args.bpe_merges,
                                                           workers=args.workers,
                                                           chunk_lines=args.chunk_lines)},
              deps=["clean-train"])
    for split, corpus in (("train", None), ("valid", wp.VALID_CORPUS), ("test", wp.TEST_CORPUS)):
        for lang in wp.LANGS:
            src = (os.path.join(clean, f"train.{lang}") if corpus is None
                   else os.path.join(tok, f"{corpus}.{lang}"))
            out = os.path.join(bpe, f"{split}.{lang}")
            dep = "clean-train" if corpus is None else f"tokenise-{corpus}.{lang}"
            pipe.step(f"apply-bpe-{split}.{lang}", [out], {"separator": "@@"},
                      lambda src=src, out=out: wp.apply_bpe_file(
                          codes, src, out, args.workers, args.chunk_lines),
                      deps=["learn-bpe", dep], count=[out])

    # 5. fairseq-preprocess
    if not args.no_binarize:
        dest = os.path.join(W, "data-bin")
        try:
            preprocess = tool("fairseq-preprocess", explicit=args.fairseq_preprocess)
        except RecipeError as err:
            raise wp.PrepError(f"{err}; or pass --fairseq-preprocess PATH")
        command = binarize_command(preprocess, bpe, dest, args.workers)
        pipe.step("binarize", [dest], {"command": "fairseq-preprocess --joined-dictionary"},
                  lambda: run_binarize(command, dest),
                  deps=[f"apply-bpe-{s}.{l}" for s in ("train", "valid", "test") for l in wp.LANGS])
    return pipe


def build_spm(args, pipe, W: str, raw: str, tok: str) -> None:
    """Declare the SentencePiece steps (``--subword spm``) after clean-train."""
    text, spm = os.path.join(W, "text"), os.path.join(W, "spm")
    train = [os.path.join(text, f"train.{l}") for l in wp.LANGS]
    tok_pairs = [tuple(os.path.join(tok, f"{n}.{l}") for l in wp.LANGS) for n in wp.TRAIN_CORPORA]
    raw_pairs = [tuple(os.path.join(raw, f"{n}.{l}") for l in wp.LANGS) for n in wp.TRAIN_CORPORA]
    text_params = {"text": "remove-non-printing-char, whitespace collapsed"}
    pipe.step("text-train", train,
              dict(text_params, min_len=args.min_len, max_len=args.max_len, max_ratio=args.max_ratio),
              lambda: wp.select_text_pairs(tok_pairs, raw_pairs, *train, min_len=args.min_len,
                                           max_len=args.max_len, max_ratio=args.max_ratio).as_dict(),
              deps=[f"fetch-{n}" for n in wp.TRAIN_CORPORA]
              + [f"tokenise-{n}.{l}" for n in wp.TRAIN_CORPORA for l in wp.LANGS], count=train)
    for split, corpus in (("valid", wp.VALID_CORPUS), ("test", wp.TEST_CORPUS)):
        for lang in wp.LANGS:
            src, out = os.path.join(raw, f"{corpus}.{lang}"), os.path.join(text, f"{split}.{lang}")
            pipe.step(f"text-{split}.{lang}", [out], text_params,
                      lambda src=src, out=out: wp.normalise_text_file(
                          src, out, args.workers, args.chunk_lines),
                      deps=[f"fetch-{corpus}"], count=[out])

    model, vocab, dictionary = (os.path.join(spm, n) for n in ("spm.model", "spm.vocab", "dict.txt"))
    spm_params = {"model_type": args.spm_type, "vocab_size": args.spm_vocab_size,
                  "input_sentences": args.spm_input_sentences,
                  "character_coverage": args.spm_character_coverage, "seed": 1,
                  "special_ids": wp.SPM_SPECIAL_IDS}
    pipe.step("learn-spm", [model, vocab, dictionary], spm_params,
              lambda: wp.learn_spm(train, model, vocab, dictionary, args.spm_vocab_size,
                                   args.spm_type, args.spm_input_sentences,
                                   args.spm_character_coverage, seed=1, threads=args.workers),
              deps=["text-train"], count=[dictionary])
    for split in ("train", "valid", "test"):
        for lang in wp.LANGS:
            src = os.path.join(text, f"{split}.{lang}")
            out = os.path.join(spm, f"{split}.{lang}")
            dep = "text-train" if split == "train" else f"text-{split}.{lang}"
            pipe.step(f"apply-spm-{split}.{lang}", [out], {"encoder": "sentencepiece pieces"},
                      lambda src=src, out=out: wp.apply_spm_file(
                          model, src, out, args.workers, args.chunk_lines),
                      deps=["learn-spm", dep], count=[out])

    if not args.no_binarize:
        dest = os.path.join(W, "data-bin-spm")
        try:
            preprocess = tool("fairseq-preprocess", explicit=args.fairseq_preprocess)
        except RecipeError as err:
            raise wp.PrepError(f"{err}; or pass --fairseq-preprocess PATH")
        command = binarize_command(preprocess, spm, dest, args.workers, srcdict=dictionary)
        pipe.step("binarize-spm", [dest],
                  {"command": "fairseq-preprocess --joined-dictionary --srcdict spm/dict.txt",
                   "copied": ["spm.model"]},
                  lambda: run_binarize(command, dest, {"spm.model": model}),
                  deps=[f"apply-spm-{s}.{l}" for s in ("train", "valid", "test") for l in wp.LANGS])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--workdir", required=True, help="where every step writes its outputs")
    parser.add_argument("--local-dir", action="append", default=[], metavar="DIR",
                        help="a directory holding downloaded archives (e.g. "
                        "training-parallel-europarl-v7.tgz) or extracted files (e.g. "
                        "europarl-v7.de-en.en, newstest2014-deen-src.en.sgm); repeatable")
    parser.add_argument("--no-download", action="store_true",
                        help="fail with a clear message instead of downloading a missing corpus")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes for tokenisation, BPE and fairseq-preprocess")
    parser.add_argument("--chunk-lines", type=int, default=10000, help="lines per work item")
    parser.add_argument("--min-len", type=int, default=1, help="fewest tokens per side (train)")
    parser.add_argument("--max-len", type=int, default=80, help="most tokens per side (train)")
    parser.add_argument("--max-ratio", type=float, default=9.0,
                        help="largest length ratio of a pair (train; Moses clean-corpus-n's "
                        "default, which the recipe used); 0 disables")
    parser.add_argument("--bpe-merges", type=int, default=DEFAULT_MERGES,
                        help="joint BPE merge operations (the recipe: 32764)")
    parser.add_argument("--subword", choices=("bpe", "spm"), default="bpe",
                        help="bpe: Moses tokens + subword-nmt BPE (the paper's; data-bin/); spm: "
                        "one joint SentencePiece model on untokenised text (data-bin-spm/)")
    parser.add_argument("--spm-type", choices=wp.SPM_TYPES, default="unigram",
                        help="SentencePiece model type (--subword spm)")
    parser.add_argument("--spm-vocab-size", type=int, default=DEFAULT_SPM_VOCAB,
                        help="SentencePiece pieces including <s> <pad> </s> <unk> = the fairseq "
                        "dictionary's size (default 32000, as the BPE path's ~32k)")
    parser.add_argument("--spm-input-sentences", type=int, default=DEFAULT_SPM_SENTENCES,
                        help="most lines of train.en + train.de sampled to train SentencePiece "
                        "(memory grows with it)")
    parser.add_argument("--spm-character-coverage", type=float, default=0.9999,
                        help="share of characters the SentencePiece model covers; the rest map to <unk>")
    parser.add_argument("--no-binarize", action="store_true", help="stop before fairseq-preprocess")
    parser.add_argument("--fairseq-preprocess", default=None, help="path of fairseq-preprocess")
    parser.add_argument("--force", action="store_true",
                        help="rerun every step (implies --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="prepare into a WORKDIR that holds other files or the output of a "
                        "run with other parameters (else: error, exit 2); changed steps and "
                        "everything built from them run again")
    return parser.parse_args(argv)


def check_workdir(args) -> None:
    """Refuse a WORKDIR that holds foreign files or the output of other parameters unless
    --overwrite/--force (:func:`wmt14_prep.check_workdir`)."""
    wp.check_workdir(args.workdir, lambda plan: build(args, plan), inputs=args.local_dir,
                     overwrite=args.overwrite, force=args.force)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    try:
        check_workdir(args)
        pipe = build(args)
    except wp.PrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\nsummary (lines per file):")
    print(pipe.summary())
    ran = len(pipe.ran)
    print(f"\n{ran} steps run, {len(pipe.skipped)} skipped (already complete) in "
          f"{time.time() - start:.0f} s; output: {os.path.abspath(args.workdir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
