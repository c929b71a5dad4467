#!/usr/bin/env python3
"""Prepare CFQ for fairseq (docs/cfq.md#data-preparation): stream dataset.json, cut the
requested splits, preprocess and simplify the targets, and optionally binarize with
fairseq-preprocess.

    python data-prep/cfq/prepare.py --out data/cfq [--split mcd1 mcd2 mcd3 random_split]
        [--cfq-dir DIR | --archive cfq1.1.tar.gz | (download)] [--binarize]

Where the data comes from (one of):

* ``--cfq-dir DIR``: the extracted archive (``DIR/dataset.json`` and ``DIR/splits/``, or
  the same under ``DIR/cfq/``);
* ``--archive FILE``: ``cfq1.1.tar.gz`` itself, read as a stream (nothing is extracted);
* neither: ``cfq1.1.tar.gz`` is downloaded from ``--url`` into ``--cache-dir`` (default
  ``OUT/download``) unless it is already there, then read as with ``--archive``.

A split is a name (``mcd1`` -> ``splits/mcd1.json``) or the path of a split file. All
splits are cut in ONE pass over dataset.json (4 GB; progress bar on stderr). For every
split ``LABEL`` (the name, or the file name without ``.json``) the files are::

    OUT/LABEL/{train,valid,test}.src     questions, punctuation split (trainIdxs, devIdxs, testIdxs)
    OUT/LABEL/{train,valid,test}.tgt     targets: preprocessed and simplified (--target-form)
    OUT/LABEL/{train,valid,test}.sparql  the preprocessed query before simplification
    OUT/LABEL/prep.json                  counts, source files, target form
    OUT/LABEL/bin/                       with --binarize: fairseq-preprocess output (src-tgt,
                                         joined dictionary built from train)

Lines follow the order of the index lists in the split file. Errors (a missing or
malformed file, a record without questionPatternModEntities / sparqlPatternModEntities, a
split index out of range) name the file and the record index and exit with status 1.

Each ``OUT/LABEL`` is written as a whole: its files (and, with ``--binarize``, what
``fairseq-preprocess`` writes into ``bin/``) go into a temporary sibling
``OUT/.LABEL.tmp-PID-XXXX`` that is renamed to ``OUT/LABEL`` only when every requested
split is complete; a failed or interrupted run leaves the previous ``OUT/LABEL`` as it
was and no partial one. Before anything is read, a requested ``OUT/LABEL`` that exists and
is not empty -- including the complete output of an earlier run with the same arguments
-- is refused (error, exit status 2) unless ``--overwrite`` is given, which replaces the
whole ``OUT/LABEL`` (no file of the earlier run survives). Other entries of ``OUT`` (other
splits, the ``download/`` cache) are never touched, so splits can be added one at a time.

The library is the installed package's ``sut_fairseq.data.cfq``.
"""
import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import time

from sut_fairseq.data import cfq, output_dir
from sut_fairseq.recipes.commands import RecipeError, tool

DEFAULT_SPLITS = ("mcd1", "mcd2", "mcd3", "random_split")


def binarize_command(executable, split_dir, bin_dir, workers=1):
    prefix = lambda subset: os.path.join(split_dir, subset)
    return [executable, "--source-lang", "src", "--target-lang", "tgt",
            "--trainpref", prefix("train"), "--validpref", prefix("valid"),
            "--testpref", prefix("test"), "--destdir", bin_dir, "--joined-dictionary",
            "--workers", str(workers)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring (--help of the file) for the layout.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--cfq-dir", help="extracted CFQ directory (dataset.json, splits/)")
    source.add_argument("--archive", help="local cfq1.1.tar.gz (read without extracting)")
    parser.add_argument("--url", default=None, help="download URL when neither is given "
                        "(default: the dataset's public storage)")
    parser.add_argument("--cache-dir", default=None, help="where the download goes (default OUT/download)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--split", nargs="+", default=list(DEFAULT_SPLITS),
                        help=f"split names or split-file paths (default: {' '.join(DEFAULT_SPLITS)})")
    parser.add_argument("--target-form", choices=["simplified", "plain"], default="simplified",
                        help="training targets: simplified (default; docs/cfq.md#target-simplification) "
                             "or only preprocessed")
    parser.add_argument("--binarize", action="store_true", help="run fairseq-preprocess per split")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a requested OUT/LABEL that exists and is not empty "
                             "(else: error, exit 2), its bin/ included")
    parser.add_argument("--workers", type=int, default=1, help="fairseq-preprocess workers")
    parser.add_argument("--fairseq-preprocess", default=None, help="fairseq-preprocess executable")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--chunk-chars", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    od = output_dir
    start = time.time()
    progress = not args.no_progress
    archive = args.archive
    labels = [cfq.split_label(s) for s in args.split]
    label_dirs = {label: os.path.join(args.out, label) for label in labels}
    cache = args.cache_dir or os.path.join(args.out, "download")
    inputs = [args.cfq_dir, args.archive, cache] + [s for s in args.split if s.endswith(".json")]
    try:
        for directory in label_dirs.values():
            od.check_output_dir(directory, args.overwrite, inputs=inputs)
    except od.OutputExistsError as err:
        return od.refuse(err)
    for directory in label_dirs.values():
        od.remove_stale(directory)
    try:
        executable = tool("fairseq-preprocess", explicit=args.fairseq_preprocess) if args.binarize else None
    except RecipeError as err:
        raise SystemExit(f"error: --binarize needs {err}; or pass --fairseq-preprocess")
    try:
        with contextlib.ExitStack() as stack:
            stages = {label: stack.enter_context(od.StagedDir(directory, overwrite=args.overwrite))
                      for label, directory in label_dirs.items()}
            try:
                if args.cfq_dir is None and archive is None:
                    archive = os.path.join(cache, cfq.ARCHIVE_NAME)
                    url = args.url or cfq.CFQ_URL
                    if not os.path.exists(archive):
                        print(f"downloading {url} -> {archive}", flush=True)
                    cfq.download(url, archive, progress)
                origin = args.cfq_dir or archive
                print(f"reading {origin}: splits {', '.join(args.split)}", flush=True)
                summary = cfq.prepare(args.out, args.split, cfq_dir=args.cfq_dir, archive=archive,
                                      target_form=args.target_form, progress=progress,
                                      label_dirs={label: stage.path for label, stage in stages.items()},
                                      **({"chunk_chars": args.chunk_chars} if args.chunk_chars else {}))
            except cfq.CfqDataError as err:
                raise SystemExit(f"error: {err}")
            for label, counts in summary.items():
                sizes = " / ".join(f"{counts[s]:,} {s}" for s in ("train", "valid", "test"))
                print(f"  {label}: {sizes} -> {label_dirs[label]}")

            if args.binarize:
                for label in summary:
                    split_dir = stages[label].path
                    command = binarize_command(executable, split_dir, os.path.join(split_dir, "bin"),
                                               args.workers)
                    print("+ " + " ".join(shlex.quote(c) for c in command), flush=True)
                    returncode = subprocess.run(command).returncode
                    if returncode != 0:
                        raise SystemExit(f"error: fairseq-preprocess failed for {label} (exit {returncode})")
                    print(f"  {label}: binarized into {os.path.join(label_dirs[label], 'bin')}")
    except od.OutputExistsError as err:
        return od.refuse(err)
    print(f"done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
