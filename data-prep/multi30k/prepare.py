#!/usr/bin/env python3
"""Prepare Multi30k English->German (task 1) for fairseq from a local directory
(docs/multi30k.md#data).

    python data-prep/multi30k/prepare.py --local-dir DIR --workdir data/multi30k \\
        [--vocab-size 8000] [--subword spm|bpe] [--workers N]

DIR holds the files of the ``multi30k/dataset`` repository's ``data/task1/raw/``
(https://github.com/multi30k/dataset), gzip as published or plain::

    train.{en,de}[.gz]              29,000 pairs   (required)
    val.{en,de}[.gz]                 1,014 pairs   (required; fairseq's valid)
    test_2016_flickr.{en,de}[.gz]    1,000 pairs   (required; fairseq's test)
    test_2017_flickr.{en,de}[.gz]    1,000 pairs   (optional; each found one is its own
    test_2017_mscoco.{en,de}[.gz]      461 pairs    subset: test1, test2, ... in this
    test_2018_flickr.{en,de}[.gz]    1,071 pairs    order; data-bin/subsets.json names them)

The preparation is ``data-prep/parallel/prepare.py``'s (one joint SentencePiece unigram
model of 8,000 pieces on untokenised text by default, then fairseq-preprocess
--joined-dictionary into WORKDIR/data-bin), so the model's output is detokenised text
scored with SacreBLEU against WORKDIR/raw/TEST.de. Nothing is downloaded: fetch the files
with ``git clone https://github.com/multi30k/dataset`` (or its raw file links) first.
A required file missing, a test set with only one side, or two sides of different lengths
is refused by name before anything is written; rerunning resumes.
"""
import argparse
import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "parallel_prepare", os.path.join(REPO, "data-prep", "parallel", "prepare.py"))
parallel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parallel)
wp = parallel.wp

SRC, TGT = "en", "de"
TRAIN, VALID = "train", "val"
#: The test sets in the order they become fairseq subsets (the first is required).
TEST_SETS = ("test_2016_flickr", "test_2017_flickr", "test_2017_mscoco", "test_2018_flickr")


def _present(local_dir: str, name: str, lang: str) -> bool:
    return any(os.path.isfile(os.path.join(local_dir, f"{name}.{lang}{gz}")) for gz in ("", ".gz"))


def find_test_sets(local_dir: str) -> list:
    """The Multi30k test sets present in ``local_dir`` (both sides), in :data:`TEST_SETS`
    order; PrepError naming the file when the required one is missing or a test set has
    one side only."""
    found = []
    for i, name in enumerate(TEST_SETS):
        sides = [_present(local_dir, name, lang) for lang in (SRC, TGT)]
        if all(sides):
            found.append(name)
        elif any(sides) or i == 0:
            missing = (SRC, TGT)[sides.index(False)]
            raise wp.PrepError(f"missing file: {os.path.join(local_dir, f'{name}.{missing}')}"
                               f"[.gz] ({'required test set' if i == 0 else 'the other side of ' + name})")
    return found


def corpus_of(local_dir: str) -> "parallel.Corpus":
    if not os.path.isdir(local_dir):
        raise wp.PrepError(f"--local-dir {local_dir} is not a directory")
    tests = [os.path.join(local_dir, name) for name in find_test_sets(local_dir)]
    return parallel.Corpus(SRC, TGT, os.path.join(local_dir, TRAIN), os.path.join(local_dir, VALID), tests)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--local-dir", required=True, metavar="DIR",
                        help="directory holding the Multi30k task-1 raw files (gzip or plain)")
    parallel.add_arguments(parser, vocab_size=8000)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        corpus = corpus_of(args.local_dir)
    except wp.PrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"Multi30k {SRC}->{TGT} from {os.path.abspath(args.local_dir)}: test sets "
          + ", ".join(f"{name} ({'test' if i == 0 else f'test{i}'})" for i, name in enumerate(corpus.tests)),
          flush=True)
    return parallel.prepare(args, corpus)


if __name__ == "__main__":
    sys.exit(main())
