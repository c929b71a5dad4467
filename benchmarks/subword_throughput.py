#!/usr/bin/env python3
"""Throughput of applying the WMT'14 recipe's two subword models (docs/wmt14.md#subword-models-bpe-or-sentencepiece):
sentences per second of the SentencePiece path (``wmt14_prep.apply_spm_file``: the
sentencepiece library, one batch call per chunk, in worker processes) and of the BPE path
(``wmt14_prep.apply_bpe_file``: subword-nmt's ``apply_bpe``, line by line, in worker
processes), each with 1 and 2 workers, on the same generated text.

    python benchmarks/subword_throughput.py [--pairs 100000] [--workers 1 2] [--vocab 8000]

The text: ``--pairs`` sentence pairs (both sides are applied, so 2 x pairs sentences per
measurement) of 5-30 words drawn with a Zipf law from 30,000 generated words of 1-4
syllables, seeded; a source and a target side use different word lists. Both models are
learnt on the first 20,000 pairs: a joint unigram SentencePiece model of ``--vocab``
pieces and ``--vocab`` joint BPE merges (smaller than the recipe's 32k to keep learning
short; applying costs about the same). The BPE path is timed on the text as it is (it is
already whitespace-tokenised); its Moses tokenisation, which the SentencePiece path does
not need, is not included. Each figure is the wall time of one pass over the two files,
including the start of the worker processes; outputs with 2 workers are checked equal to
those with 1. Printed as a table; ``--json FILE`` also writes the figures.
"""
import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREP_DIR = os.path.join(REPO, "data-prep", "wmt14_en_de")
if PREP_DIR not in sys.path:
    sys.path.insert(0, PREP_DIR)

import wmt14_prep as wp  # noqa: E402

SYLLABLES = [c + v for c in "bdfghklmnprstvwzäöü" for v in ("a", "e", "i", "o", "u", "ei", "au", "en", "er")]


def make_words(rng: random.Random, n: int):
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))))
    return sorted(words)


def generate(directory: str, pairs: int, seed: int = 1):
    """Write ``train.{en,de}`` (``pairs`` lines each) in ``directory``; returns their paths."""
    rng = random.Random(seed)
    paths = []
    for lang in ("en", "de"):
        words = make_words(rng, 30000)
        cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
        path = os.path.join(directory, f"train.{lang}")
        with open(path, "w", encoding="utf-8") as out:
            for _ in range(pairs):
                sentence = rng.choices(words, cum_weights=cumulative, k=rng.randint(5, 30))
                out.write(" ".join(sentence).capitalize() + " .\n")
        paths.append(path)
    return paths


def head(path: str, lines: int, dest: str) -> str:
    with open(path, encoding="utf-8") as src, open(dest, "w", encoding="utf-8") as out:
        for i, line in enumerate(src):
            if i >= lines:
                break
            out.write(line)
    return dest


def timed(apply, model: str, inputs, outdir: str, workers: int, chunk_lines: int):
    start = time.perf_counter()
    n = 0
    outputs = []
    for path in inputs:
        out = os.path.join(outdir, f"{os.path.basename(path)}.w{workers}")
        n += apply(model, path, out, workers=workers, chunk_lines=chunk_lines)
        outputs.append(out)
    return n, time.perf_counter() - start, outputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--pairs", type=int, default=100000, help="generated sentence pairs")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time")
    parser.add_argument("--vocab", type=int, default=8000, help="SentencePiece pieces and BPE merges")
    parser.add_argument("--chunk-lines", type=int, default=10000, help="lines per work item")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="subword_throughput.") as tmp:
        inputs = generate(tmp, args.pairs)
        sample = [head(p, min(args.pairs, 20000), p + ".sample") for p in inputs]
        start = time.perf_counter()
        model = os.path.join(tmp, "spm.model")
        wp.learn_spm(sample, model, os.path.join(tmp, "spm.vocab"), os.path.join(tmp, "dict.txt"),
                     args.vocab, "unigram", input_sentences=len(sample) * 20000,
                     character_coverage=1.0, threads=1)
        learn_spm_s = time.perf_counter() - start
        start = time.perf_counter()
        codes = os.path.join(tmp, "codes")
        wp.learn_joint_bpe(sample, codes, args.vocab)
        learn_bpe_s = time.perf_counter() - start
        print(f"{2 * args.pairs:,} sentences ({args.pairs:,} pairs); models learnt on "
              f"{len(sample) * min(args.pairs, 20000):,} sentences: SentencePiece unigram "
              f"{args.vocab} pieces in {learn_spm_s:.1f} s, BPE {args.vocab} merges in "
              f"{learn_bpe_s:.1f} s; {os.cpu_count()} CPUs")
        for name, apply, arg in (("sentencepiece", wp.apply_spm_file, model),
                                 ("subword-nmt BPE", wp.apply_bpe_file, codes)):
            reference = None
            for workers in args.workers:
                n, seconds, outputs = timed(apply, arg, inputs, tmp, workers, args.chunk_lines)
                text = [open(o, encoding="utf-8").read() for o in outputs]
                if reference is None:
                    reference = text
                elif text != reference:
                    raise SystemExit(f"error: {name} with {workers} workers differs from "
                                     f"{args.workers[0]} worker(s)")
                rows.append({"model": name, "workers": workers, "sentences": n,
                             "seconds": round(seconds, 2), "sentences_per_s": round(n / seconds)})
    print("\n| subword model | workers | sentences | seconds | sentences/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['workers']} | {r['sentences']:,} | {r['seconds']:.1f} | "
              f"{r['sentences_per_s']:,} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"pairs": args.pairs, "vocab": args.vocab, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
