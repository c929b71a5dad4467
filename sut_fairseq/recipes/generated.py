"""Generated seq2seq data with named test splits: what the generators of
``data-prep/flipflop/`` and ``data-prep/listops/`` share.

A generator writes, into one output directory that is replaced as a whole
(``sut_fairseq.data.output_dir``: refused when not empty unless ``--overwrite``, staged
in a temporary sibling, renamed when complete):

* ``SPLIT.src`` / ``SPLIT.tgt`` per split (source tokens space-separated, the one target
  token), plus any side files of its own;
* ``stats.json``: its statistics, and with ``--binarize`` the binarized name of every
  test split (``binarized_test_splits``: fairseq names the first ``--testpref`` entry
  ``test`` and the k-th ``test{k}``);
* with ``--binarize``: ``bin/``, one ``fairseq-preprocess --joined-dictionary`` run
  (dictionary from train).

:func:`add_output_arguments` adds the options every generator shares and :func:`run`
does the rest around the task's own writer.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..data import output_dir
from .commands import RecipeError, tool


def binarized_names(test_splits: Sequence[str]) -> Dict[str, str]:
    """``{text split: binarized split}`` for ``--testpref`` in the given order."""
    return {name: ("test" if k == 0 else f"test{k}") for k, name in enumerate(test_splits)}


def binarize_command(executable: str, directory: str, bin_dir: str,
                     test_splits: Sequence[str]) -> List[str]:
    """The one ``fairseq-preprocess`` command over the text files of ``directory``."""
    def prefix(name):
        return os.path.join(directory, name)
    return [executable, "--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary",
            "--trainpref", prefix("train"), "--validpref", prefix("valid"),
            "--testpref", ",".join(prefix(t) for t in test_splits),
            "--destdir", bin_dir, "--workers", "1"]


def classify_commands(executable: str, directory: str, bin_dir: str, test_splits: Sequence[str],
                      label_dict: str) -> List[List[str]]:
    """The classification layout of the text files of ``directory`` (docs/classification.md):
    two ``fairseq-preprocess --only-source`` calls, the sources ``SPLIT.src`` into
    ``BIN/input0`` (dictionary from train) and the targets ``SPLIT.tgt`` into ``BIN/label``
    with the fixed ``label_dict`` (every class, whether or not train holds it); the test
    splits in ``test_splits`` order, so that they get the names :func:`binarized_names` gives."""
    def prefixes(suffix):
        return ["--trainpref", os.path.join(directory, f"train.{suffix}"),
                "--validpref", os.path.join(directory, f"valid.{suffix}"),
                "--testpref", ",".join(os.path.join(directory, f"{t}.{suffix}") for t in test_splits)]
    return [[executable, "--only-source", *prefixes("src"), "--destdir", os.path.join(bin_dir, "input0"),
             "--workers", "1"],
            [executable, "--only-source", "--srcdict", label_dict, *prefixes("tgt"),
             "--destdir", os.path.join(bin_dir, "label"), "--workers", "1"]]


def write_pairs(directory: str, name: str, pairs) -> int:
    """Write ``(source, target)`` lines to ``NAME.src`` / ``NAME.tgt``; returns how many."""
    count = 0
    with open(os.path.join(directory, f"{name}.src"), "w", encoding="utf-8") as src, \
            open(os.path.join(directory, f"{name}.tgt"), "w", encoding="utf-8") as tgt:
        for source, target in pairs:
            src.write(source + "\n")
            tgt.write(target + "\n")
            count += 1
    return count


def write_split(directory: str, name: str, examples: Iterable, to_pair: Callable,
                observers: Sequence[Callable] = ()) -> int:
    """Write ``to_pair(example)`` of every example (:func:`write_pairs`), handing each
    example to every observer first (statistics, side files); returns how many."""
    def pairs():
        for example in examples:
            for observe in observers:
                observe(example)
            yield to_pair(example)
    return write_pairs(directory, name, pairs())


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(obj, handle, indent=1)
        handle.write("\n")


def generator_parser(doc: str, configs, config_help: str) -> argparse.ArgumentParser:
    """A generator's parser: its docstring's first paragraph as the description, the
    output options (:func:`add_output_arguments`) and ``--config`` (default ``small``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     epilog="See the module docstring for the file layout.")
    add_output_arguments(parser)
    parser.add_argument("--config", default="small", choices=sorted(configs), help=config_help)
    return parser


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out``, ``--binarize``, ``--fairseq-preprocess``, ``--no-progress``, ``--overwrite``."""
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--binarize", action="store_true", help="also run fairseq-preprocess into OUT/bin")
    parser.add_argument("--fairseq-preprocess", default=None, help="path of fairseq-preprocess")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out when it exists and is not empty (else: error, exit 2)")


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="ex", desc="generating", file=sys.stderr)


def run(args: argparse.Namespace, total: int,
        write: Callable[[str, Optional[Callable[[int], None]]], Tuple[dict, object]]
        ) -> Tuple[int, Optional[dict]]:
    """Claim ``args.out``, call ``write(directory, progress)`` in the staged directory --
    it writes the split files and returns ``(stats, tests)``, the test files' names in
    ``--testpref`` order or a dict ``{key: name}`` when ``binarized_test_splits`` should
    be keyed otherwise -- then write ``stats.json`` (and binarize with ``args.binarize``)
    and commit the directory. Returns ``(exit status, stats)``; a refusal prints
    ``error: ...`` and returns 2."""
    refused = output_dir.claim(args.out, args.overwrite)
    if refused is not None:
        return refused, None
    executable = None
    if args.binarize:
        try:
            executable = tool("fairseq-preprocess", explicit=args.fairseq_preprocess)
        except RecipeError as err:
            raise SystemExit(f"error: --binarize needs {err}; or pass --fairseq-preprocess")
    bar = _progress_bar(total, not args.no_progress)
    try:
        with output_dir.StagedDir(args.out, overwrite=args.overwrite) as stage:
            try:
                stats, tests = write(stage.path, bar.update if bar else None)
            finally:
                if bar is not None:
                    bar.close()
            keys = tests if isinstance(tests, dict) else {name: name for name in tests}
            if args.binarize:
                command = binarize_command(executable, stage.path, os.path.join(stage.path, "bin"),
                                           list(keys.values()))
                print("running (in a temporary directory that becomes "
                      f"{os.path.join(args.out, 'bin')} when it succeeds): "
                      + " ".join(shlex.quote(c) for c in command), flush=True)
                returncode = subprocess.run(command).returncode
                if returncode != 0:
                    raise SystemExit(f"error: fairseq-preprocess failed with exit status {returncode}")
                names = binarized_names(list(keys.values()))
                stats["binarized_test_splits"] = {key: names[name] for key, name in keys.items()}
            write_json(os.path.join(stage.path, "stats.json"), stats)
    except output_dir.OutputExistsError as err:
        return output_dir.refuse(err), None
    return 0, stats


def data_stage(args: argparse.Namespace, complete: bool, command: Sequence[str]) -> None:
    """A recipe's stage 1 for generated data: run the generator's ``command`` into
    ``args.data_dir`` unless the data there is ``complete`` (printed only on a dry run)."""
    from .commands import run as run_command

    if complete:
        print(f"== data: {args.data_dir} is complete", flush=True)
        return
    print(f"== data: {args.data_config} -> {args.data_dir}", flush=True)
    run_command(command, dry_run=args.dry_run)


def parse_config(parser: argparse.ArgumentParser, argv, make: Callable[[argparse.Namespace], object]):
    """``(args, config)``: ``make(args)`` builds the task's configuration (a ValueError is
    a usage error naming the bad value); ``--binarize`` needs a validation split."""
    args = parser.parse_args(argv)
    try:
        config = make(args)
    except ValueError as err:
        parser.error(str(err))
    if args.binarize and config.valid_size == 0:
        parser.error("--binarize needs a validation set: --valid-size must be >= 1")
    return args, config


def main(args: argparse.Namespace, config, total: int, write: Callable,
         headline: Callable[[float], str], table: Callable[[Dict[str, dict]], str]) -> int:
    """A generator's run: :func:`run` with ``write(config, directory, progress)``, then
    ``headline(seconds)``, ``table(stats["splits"])`` and the binarized split names."""
    start = time.time()
    status, stats = run(args, total, lambda directory, progress: write(config, directory, progress))
    if status:
        return status
    print(headline(time.time() - start) + "\n")
    print(table(stats["splits"]))
    if args.binarize:
        names = stats["binarized_test_splits"]
        print("\nbinarized test splits: " + ", ".join(f"{k} -> {v}" for k, v in names.items()))
        print(f"binarized data in {os.path.join(args.out, 'bin')}")
    return 0
