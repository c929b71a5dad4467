#!/usr/bin/env python3
"""Generate ListOps data as seq2seq text files (docs/listops.md), optionally binarized.

    python data-prep/listops/generate.py --config small --out data/listops [--binarize]

writes into ``--out``:

* ``train.src/.tgt`` and ``valid.src/.tgt`` (length <= 100, at most 5 arguments,
  generator depth 20), ``test-iid.src/.tgt`` (the same generator, length <= 1000: the
  near-IID split) and one file pair per generalisation split: ``test-len200-300``,
  ``test-len500-600``, ``test-len900-1000`` (lengths strictly inside the range) and
  ``test-args10``, ``test-args15`` (up to 10 / 15 arguments, generator depth 9, lengths
  100-1000). A source line is the expression's tokens (``[MAX 2 9 [MIN 4 7 ] 0 ]``), a
  target line its value (a digit);
* ``stats.json``: the configuration and per split its size, limits, length
  (min / mean / max), depth (mean / max), widest list, label counts and majority share,
  and operator counts; the same table is printed.

All splits are deduplicated and mutually disjoint; every label is recomputed and every
limit checked before it is counted. ``--binarize`` runs one ``fairseq-preprocess``
(``--joined-dictionary``, dictionary from train) into ``OUT/bin``; the k-th test split
becomes split ``test{k}`` (``test-iid``: ``test``), a mapping printed and stored in
``stats.json`` (``binarized_test_splits``).

``--out`` is written as a whole (a temporary sibling renamed when complete); an existing
non-empty ``--out`` is refused (exit status 2) unless ``--overwrite``. A progress bar is
shown when ``tqdm`` is installed. The generator is ``sut_fairseq.data.listops``. The
900-1000 split is the slow one (about 0.2 s per example on one core: such long
expressions are rare under the generator).
"""
import dataclasses
import sys

from sut_fairseq.data import listops
from sut_fairseq.recipes import generated


def write_dataset(config, directory, progress=None):
    """Write the split files into ``directory``; return ``(stats, test split names)``."""
    specs = dict(config.specs())
    per_split = {}
    for name, examples in listops.iter_dataset(config, progress):
        stats = per_split[name] = listops.SplitStats(specs[name])
        generated.write_split(directory, name, examples, listops.to_seq2seq, [stats.add])
    return {"config": dataclasses.asdict(config),
            "splits": {name: s.summary() for name, s in per_split.items()}}, config.test_names()


def parse_args(argv):
    parser = generated.generator_parser(
        __doc__, listops.CONFIGS, "small (30,000 training examples, 500 per generalisation "
                                  "split: the CPU experiment; default) or paper (90,000; 2,000)")
    parser.add_argument("--train-size", type=int, help="training examples")
    parser.add_argument("--valid-size", type=int, help="validation examples")
    parser.add_argument("--iid-test-size", type=int, help="near-IID test examples")
    parser.add_argument("--test-size", type=int, help="examples per generalisation split")
    parser.add_argument("--splits", nargs="*", default=None, metavar="SPLIT",
                        help="only these generalisation splits (none with an empty list); "
                             "default: all of " + ", ".join(n for n, _ in listops.CONFIGS["small"].tests))
    parser.add_argument("--seed", type=int, help="seed (default 1)")
    return generated.parse_config(parser, argv, lambda args: listops.make_config(
        args.config, train_size=args.train_size, valid_size=args.valid_size,
        iid_test_size=args.iid_test_size, test_size=args.test_size, seed=args.seed,
        splits=args.splits))


def main(argv=None):
    args, config = parse_args(argv)
    return generated.main(
        args, config, listops.total_examples(config), write_dataset,
        lambda seconds: f"wrote ListOps ({config.name}, seed {config.seed}) to {args.out} in {seconds:.1f} s",
        listops.stats_table)


if __name__ == "__main__":
    sys.exit(main())
