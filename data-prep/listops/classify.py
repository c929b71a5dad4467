#!/usr/bin/env python3
"""ListOps in the classification layout (``--task sut_classification``, one sequence and
its label; docs/listops.md#the-classify-setup), from the text files ``generate.py`` wrote.

    python data-prep/listops/classify.py --data data/listops [--out DATA/classify]
        [--overwrite] [--fairseq-preprocess PATH]

Reads ``DATA/SPLIT.src`` / ``DATA/SPLIT.tgt`` and ``DATA/stats.json`` (the test splits, in
the generator's order) and writes into ``--out`` (default ``DATA/classify``):

* ``input0/``: the expressions (``fairseq-preprocess --only-source``, dictionary from
  train), ``label/``: the values with the fixed dictionary ``labels.txt`` (the ten digits,
  so that every class exists whether or not a small train split holds it);
* ``splits.json``: ``binarized_test_splits`` (``test-iid`` -> ``test``, the k-th
  generalisation split -> ``test{k}``, as in ``DATA/bin``) and ``labels``.

No text is copied: the two calls read the generator's files. ``--out`` is written as a
whole (a temporary sibling renamed when complete); an existing non-empty ``--out`` is
refused (exit status 2) unless ``--overwrite``.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys

from sut_fairseq.data import output_dir
from sut_fairseq.recipes.commands import RecipeError, tool
from sut_fairseq.recipes.generated import binarized_names, classify_commands, write_json

#: ListOps' classes: the values of an expression
LABELS = [str(d) for d in range(10)]


def test_splits(data_dir):
    """The test splits of ``DATA/stats.json`` in the generator's order."""
    path = os.path.join(data_dir, "stats.json")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} not found: run data-prep/listops/generate.py --out {data_dir} first")
    with open(path, encoding="utf-8") as handle:
        stats = json.load(handle)
    names = list(stats.get("binarized_test_splits") or
                 [name for name in stats.get("splits", {}) if name.startswith("test")])
    if not names:
        raise SystemExit(f"error: {path} names no test split")
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for the layout.")
    parser.add_argument("--data", required=True, help="generate.py's --out")
    parser.add_argument("--out", default=None, help="output directory (default DATA/classify)")
    parser.add_argument("--fairseq-preprocess", default=None, help="path of fairseq-preprocess")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.data, "classify")
    tests = test_splits(args.data)
    refused = output_dir.claim(out, args.overwrite)
    if refused is not None:
        return refused
    try:
        executable = tool("fairseq-preprocess", explicit=args.fairseq_preprocess)
    except RecipeError as err:
        raise SystemExit(f"error: {err}")
    try:
        with output_dir.StagedDir(out, overwrite=args.overwrite) as stage:
            label_dict = os.path.join(stage.path, "labels.txt")
            with open(label_dict, "w", encoding="utf-8") as handle:
                handle.writelines(f"{label} 1\n" for label in LABELS)
            for command in classify_commands(executable, args.data, stage.path, tests, label_dict):
                print("running (in a temporary directory that becomes "
                      f"{out} when it succeeds): " + " ".join(shlex.quote(c) for c in command), flush=True)
                if subprocess.run(command).returncode != 0:
                    raise SystemExit("error: fairseq-preprocess failed")
            write_json(os.path.join(stage.path, "splits.json"),
                       {"binarized_test_splits": binarized_names(tests), "labels": LABELS})
    except output_dir.OutputExistsError as err:
        return output_dir.refuse(err)
    print(f"classification layout in {out}: " + ", ".join(f"{k} -> {v}" for k, v in binarized_names(tests).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
