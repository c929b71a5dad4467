#!/usr/bin/env python3
"""Turn original-format logic files into seq2seq text files (and optionally binarize them).

    python data-prep/logic/prepare.py --data DIR --out OUT --protocol standard [--binarize]

``--data`` holds ``train0`` .. ``train12`` / ``test0`` .. ``test12`` in the original
``RELATION<TAB>LEFT<TAB>RIGHT`` format (downloaded, or made by ``generate.py``).
Each pair becomes a source line ``LEFT #SEP# RIGHT`` and a target line holding the
relation token (SPEC §4.1). Files written into ``--out``:

* ``--protocol standard``: ``train.src/.tgt`` and ``valid.src/.tgt`` from train0..train6
  (the 0-based position ``i`` in the concatenation, bucket then line order, goes to valid
  when ``i % 10 == 9``), and ``test0.src/.tgt`` .. ``test12.src/.tgt``, one per bucket.
* ``--protocol A|B|C`` (compositional): ``train``, ``valid`` and ``test`` from train0..train6
  only; a pair is a test pair when either side contains the split's pattern
  (A: ``( and ( not a ) )``, B: ``( and ( not ``, C: ``( and ( not `` or ``( or ( not ``).

``--binarize`` then runs one ``fairseq-preprocess`` call (``--source-lang src
--target-lang tgt --joined-dictionary --workers 1``, dictionary built from train) into
``--bin-dir`` (default ``OUT/bin``). For the standard protocol the test buckets are passed
as ``--testpref OUT/test0,OUT/test1,...,OUT/test12``; fairseq names the k-th test prefix
``test{k}`` and the first one plain ``test``, so in the binarized directory

    bucket 0 -> split ``test``;  bucket k (1..12) -> split ``test{k}``

(e.g. ``fairseq-generate BIN --gen-subset test7`` scores bucket 7). For A/B/C the single
test file becomes split ``test``. The command is printed before it runs.

The library lives in ``sut_fairseq/data/logic_inference.py``; this script loads it by file
path, so preparing text files needs neither torch nor fairseq.
"""
import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_logic_module():
    """Load ``sut_fairseq/data/logic_inference.py`` without importing the package."""
    name = "_sut_logic_inference"
    if name not in sys.modules:
        path = os.path.join(REPO, "sut_fairseq", "data", "logic_inference.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def find_fairseq_preprocess(explicit=None):
    """The ``fairseq-preprocess`` executable: ``explicit``, else the one next to this
    Python interpreter (a virtual environment's bin/), else the one on PATH."""
    if explicit:
        return explicit
    beside = os.path.join(os.path.dirname(sys.executable), "fairseq-preprocess")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("fairseq-preprocess")
    if found is None:
        raise SystemExit("--binarize needs fairseq-preprocess (pip install fairseq-fixed); "
                         "none found next to this Python or on PATH; pass --fairseq-preprocess")
    return found


def binarize_command(executable, out_dir, bin_dir, split_names):
    """The ``fairseq-preprocess`` command line for the splits written to ``out_dir``."""
    prefix = lambda name: os.path.join(out_dir, name)
    tests = [name for name in split_names if name.startswith("test")]
    # test0..test12 in bucket order, so that fairseq's names test, test1, ... test12 line up.
    tests.sort(key=lambda name: int(name[4:] or 0))
    return [executable, "--source-lang", "src", "--target-lang", "tgt",
            "--trainpref", prefix("train"), "--validpref", prefix("valid"),
            "--testpref", ",".join(prefix(t) for t in tests),
            "--destdir", bin_dir, "--joined-dictionary", "--workers", "1"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for the file layout.")
    parser.add_argument("--data", required=True,
                        help="directory with train0..train12 and test0..test12 (original format)")
    parser.add_argument("--out", required=True, help="output directory for the seq2seq text files")
    parser.add_argument("--protocol", default="standard", choices=["standard", "A", "B", "C"],
                        help="standard (train on buckets 0..6, test per bucket) or a "
                             "compositional split A/B/C (default standard)")
    parser.add_argument("--check-relations", action="store_true",
                        help="verify every relation against the formulas' truth sets")
    parser.add_argument("--binarize", action="store_true", help="also run fairseq-preprocess")
    parser.add_argument("--bin-dir", default=None, help="binarized output (default OUT/bin)")
    parser.add_argument("--fairseq-preprocess", default=None,
                        help="path of the fairseq-preprocess executable")
    args = parser.parse_args(argv)

    li = load_logic_module()
    try:
        splits = li.make_protocol(args.data, args.protocol, check_relation=args.check_relations)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}")
    os.makedirs(args.out, exist_ok=True)
    print(f"protocol {args.protocol}: {args.data} -> {args.out}")
    for name, pairs in splits.items():
        li.write_seq2seq(args.out, name, pairs)
        print(f"  {name:>7}: {len(pairs):>7,} pairs -> {name}.src, {name}.tgt")

    if args.binarize:
        bin_dir = args.bin_dir or os.path.join(args.out, "bin")
        existing = [f for f in ("dict.src.txt", "dict.tgt.txt")
                    if os.path.exists(os.path.join(bin_dir, f))]
        if existing:
            raise SystemExit(f"error: {bin_dir} already holds {', '.join(existing)} "
                             "(fairseq-preprocess refuses to overwrite a dictionary); "
                             "remove it or pass another --bin-dir")
        command = binarize_command(find_fairseq_preprocess(args.fairseq_preprocess),
                                   args.out, bin_dir, list(splits))
        print("running: " + " ".join(shlex.quote(c) for c in command), flush=True)
        returncode = subprocess.run(command).returncode
        if returncode != 0:
            raise SystemExit(f"error: fairseq-preprocess failed with exit status {returncode}")
        if args.protocol == "standard":
            print("binarized test splits: bucket 0 -> test, bucket k -> test{k} (k = 1..12)")
        print(f"binarized data in {bin_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
