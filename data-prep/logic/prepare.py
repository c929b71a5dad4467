#!/usr/bin/env python3
"""Turn original-format logic files into seq2seq or classification text files (and
optionally binarize them).

    python data-prep/logic/prepare.py --data DIR --out OUT --protocol standard [--binarize]
        [--format seq2seq|classify]

``--data`` holds ``train0`` .. ``train12`` / ``test0`` .. ``test12`` in the original
``RELATION<TAB>LEFT<TAB>RIGHT`` format (downloaded, or made by ``generate.py``).
Each pair becomes a source line ``LEFT #SEP# RIGHT`` and a target line holding the
relation token (docs/results/logic_data.md#protocols). Files written into ``--out``:

* ``--protocol standard``: ``train.src/.tgt`` and ``valid.src/.tgt`` from train0..train6
  (the 0-based position ``i`` in the concatenation, bucket then line order, goes to valid
  when ``i % 10 == 9``), and ``test0.src/.tgt`` .. ``test12.src/.tgt``, one per bucket.
* ``--protocol A|B|C`` (compositional): ``train``, ``valid`` and ``test`` from train0..train6
  only; a pair is a test pair when either side contains the split's pattern
  (A: ``( and ( not a ) )``, B: ``( and ( not ``, C: ``( and ( not `` or ``( or ( not ``).

``--format classify`` (the Siamese classifier's form, docs/classification.md) writes, per
split, ``NAME.input0`` (the left formulas), ``NAME.input1`` (the right ones) and
``NAME.label`` (the relations) instead of ``.src`` / ``.tgt``, and ``train.tokens`` (both
sides' training formulas, the vocabulary's source). Binarized, ``--bin-dir`` holds fairseq's
sentence-prediction layout for ``--task sut_classification``: ``input0/`` and ``input1/``
(one dictionary, built from ``train.tokens``) and ``label/``, from four
``fairseq-preprocess --only-source`` calls; the test splits are named as below.

``--binarize`` then runs one ``fairseq-preprocess`` call (``--source-lang src
--target-lang tgt --joined-dictionary --workers 1``, dictionary built from train) into
``--bin-dir`` (default ``OUT/bin``). For the standard protocol the test buckets are passed
as ``--testpref OUT/test0,OUT/test1,...,OUT/test12``; fairseq names the k-th test prefix
``test{k}`` and the first one plain ``test``, so in the binarized directory

    bucket 0 -> split ``test``;  bucket k (1..12) -> split ``test{k}``

(e.g. ``fairseq-generate BIN --gen-subset test7`` scores bucket 7). For A/B/C the single
test file becomes split ``test``. The command is printed before it runs.

Outputs are written as a whole: the text files (and, with ``--binarize``, what
``fairseq-preprocess`` writes) go into a temporary sibling directory
(``.NAME.tmp-PID-XXXX``) that is renamed to ``--out`` (and ``--bin-dir``, when it lies
outside ``--out``) only when everything has succeeded. An interrupted or failed run
leaves the previous directory as it was and no partial one under the final name, so a
``bin/`` that exists is always complete. An existing non-empty ``--out`` or ``--bin-dir``
-- including the complete output of an earlier run with the same arguments -- is refused
(error, exit status 2) unless ``--overwrite`` is given, which replaces it as a whole (so
no file of the earlier run, e.g. another protocol's ``test*`` files or an old ``bin/``,
survives); ``--data`` inside a directory to be replaced is refused.

The library is the installed package's ``sut_fairseq.data.logic_inference``.
"""
import argparse
import contextlib
import os
import shlex
import subprocess
import sys

from sut_fairseq.data import logic_inference, output_dir
from sut_fairseq.data.atomic import write_lines_atomic
from sut_fairseq.recipes.commands import RecipeError, tool


def _inside(path, directory):
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def binarize_command(executable, out_dir, bin_dir, split_names):
    """The ``fairseq-preprocess`` command line for the splits written to ``out_dir``."""
    prefix = lambda name: os.path.join(out_dir, name)
    return [executable, "--source-lang", "src", "--target-lang", "tgt",
            "--trainpref", prefix("train"), "--validpref", prefix("valid"),
            "--testpref", _test_prefixes(out_dir, split_names),
            "--destdir", bin_dir, "--joined-dictionary", "--workers", "1"]


def _test_prefixes(out_dir, split_names, suffix=""):
    """``--testpref``: the test splits in bucket order (test0..test12), so that fairseq's
    names test, test1, ... test12 line up."""
    tests = sorted((name for name in split_names if name.startswith("test")),
                   key=lambda name: int(name[4:] or 0))
    return ",".join(os.path.join(out_dir, name + suffix) for name in tests)


def classify_binarize_commands(executable, out_dir, bin_dir, split_names):
    """The ``fairseq-preprocess`` command lines of the classification form: the joint
    dictionary of both formulas (``--dict-only`` over ``train.tokens``), then input0,
    input1 (with that dictionary) and label, each ``--only-source``."""
    prefix = lambda name: os.path.join(out_dir, name)
    source_dict = os.path.join(bin_dir, "input0", "dict.txt")
    commands = [[executable, "--only-source", "--dict-only", "--trainpref", prefix("train.tokens"),
                 "--destdir", os.path.join(bin_dir, "input0"), "--workers", "1"]]
    for field in logic_inference.CLASSIFY_FIELDS:
        dictionary = [] if field == "label" else ["--srcdict", source_dict]
        commands.append([executable, "--only-source", *dictionary,
                         "--trainpref", prefix(f"train.{field}"), "--validpref", prefix(f"valid.{field}"),
                         "--testpref", _test_prefixes(out_dir, split_names, f".{field}"),
                         "--destdir", os.path.join(bin_dir, field), "--workers", "1"])
    return commands


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for the file layout.")
    parser.add_argument("--data", required=True,
                        help="directory with train0..train12 and test0..test12 (original format)")
    parser.add_argument("--out", required=True, help="output directory for the seq2seq text files")
    parser.add_argument("--protocol", default="standard", choices=["standard", "A", "B", "C"],
                        help="standard (train on buckets 0..6, test per bucket) or a "
                             "compositional split A/B/C (default standard)")
    parser.add_argument("--format", default="seq2seq", choices=["seq2seq", "classify"],
                        help="seq2seq (LEFT #SEP# RIGHT -> relation: --task translation) or "
                             "classify (left, right and relation apart: --task "
                             "sut_classification) (default seq2seq)")
    parser.add_argument("--check-relations", action="store_true",
                        help="verify every relation against the formulas' truth sets")
    parser.add_argument("--binarize", action="store_true", help="also run fairseq-preprocess")
    parser.add_argument("--bin-dir", default=None, help="binarized output (default OUT/bin)")
    parser.add_argument("--fairseq-preprocess", default=None,
                        help="path of the fairseq-preprocess executable")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out (and --bin-dir) when it exists and is not empty "
                             "(else: error, exit 2)")
    args = parser.parse_args(argv)

    od = output_dir
    bin_dir = (args.bin_dir or os.path.join(args.out, "bin")) if args.binarize else None
    separate_bin = bin_dir is not None and not _inside(bin_dir, args.out)
    if separate_bin and _inside(args.out, bin_dir):
        raise SystemExit(f"error: --out {args.out} lies inside --bin-dir {bin_dir}; "
                         "choose directories that do not contain each other")
    try:
        od.check_output_dir(args.out, args.overwrite, inputs=[args.data])
        if separate_bin:
            od.check_output_dir(bin_dir, args.overwrite, inputs=[args.data, args.out])
    except od.OutputExistsError as err:
        return od.refuse(err)
    od.remove_stale(args.out)
    if separate_bin:
        od.remove_stale(bin_dir)
    try:
        executable = tool("fairseq-preprocess", explicit=args.fairseq_preprocess) if args.binarize else None
    except RecipeError as err:
        raise SystemExit(f"error: --binarize needs {err}; or pass --fairseq-preprocess")

    li = logic_inference
    try:
        splits = li.make_protocol(args.data, args.protocol, check_relation=args.check_relations)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}")
    try:
        with contextlib.ExitStack() as stack:
            out_stage = stack.enter_context(od.StagedDir(args.out, overwrite=args.overwrite))
            print(f"protocol {args.protocol}: {args.data} -> {args.out}")
            for name, pairs in splits.items():
                if args.format == "classify":
                    li.write_classify(out_stage.path, name, pairs)
                    print(f"  {name:>7}: {len(pairs):>7,} pairs -> {name}.input0, {name}.input1, {name}.label")
                else:
                    li.write_seq2seq(out_stage.path, name, pairs)
                    print(f"  {name:>7}: {len(pairs):>7,} pairs -> {name}.src, {name}.tgt")
            if args.format == "classify":  # the vocabulary of both sides
                train = splits["train"]
                write_lines_atomic(os.path.join(out_stage.path, "train.tokens"),
                                   [p.left for p in train] + [p.right for p in train])
            if args.binarize:
                if separate_bin:
                    staged_bin = stack.enter_context(
                        od.StagedDir(bin_dir, overwrite=args.overwrite)).path
                else:
                    staged_bin = os.path.join(out_stage.path, os.path.relpath(
                        os.path.abspath(bin_dir), os.path.abspath(args.out)))
                if args.format == "classify":
                    commands = classify_binarize_commands(executable, out_stage.path, staged_bin, list(splits))
                else:
                    commands = [binarize_command(executable, out_stage.path, staged_bin, list(splits))]
                for command in commands:
                    print(f"running (into a temporary directory that becomes {bin_dir} when it "
                          "succeeds): " + " ".join(shlex.quote(c) for c in command), flush=True)
                    returncode = subprocess.run(command).returncode
                    if returncode != 0:
                        raise SystemExit(f"error: fairseq-preprocess failed with exit status {returncode}")
    except od.OutputExistsError as err:
        return od.refuse(err)
    if args.binarize:
        if args.protocol == "standard":
            print("binarized test splits: bucket 0 -> test, bucket k -> test{k} (k = 1..12)")
        print(f"binarized data in {bin_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
