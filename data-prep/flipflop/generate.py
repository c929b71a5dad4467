#!/usr/bin/env python3
"""Generate flip-flop language data as seq2seq text files (docs/flipflop.md), optionally
binarized.

    python data-prep/flipflop/generate.py --config small --out data/flipflop [--binarize]

writes into ``--out``:

* ``train.src/.tgt`` (the training setting), ``valid.src/.tgt`` (the training setting and
  every test setting, round-robin; ``--valid-mix train``: the training setting only;
  omitted with ``--valid-size 0``) and ``test{LENGTH}-p{P_I}.src/.tgt`` per test setting
  (every test length with every p_i); a source line is the string up to and including its
  final ``r``, space-separated, a target line the bit that read returns;
* ``test{LENGTH}-p{P_I}.meta.jsonl``: per test example (same line order) the token index
  of the last write instruction (``write``), of the last carrier of the answer (``carrier``:
  the last write or a later read, whose bit is the answer) and of the final read (``read``),
  the source length and the target: the recipe's subset "the answer lies only in chunks
  before the read's" for any chunk size g is ``(carrier + 1) // g < read // g``;
* ``stats.json``: the configuration and per split its size, lengths, the shares of the
  random instructions (w / r / i), the share of target 1, the distance from the last
  written bit to the read, the share whose answer lies only before the read's chunk for
  g = 8 and 10, and two baselines (the bit before the final ``r``; the majority bit). The same
  table is printed.

All splits are deduplicated and mutually disjoint. ``--binarize`` runs one
``fairseq-preprocess`` (``--joined-dictionary``, dictionary from train) into ``OUT/bin``;
the k-th test setting becomes split ``test{k}`` (the first ``test``), a mapping printed
and stored in ``stats.json`` (``binarized_test_splits``).

``--out`` is written as a whole (a temporary sibling renamed when complete); an existing
non-empty ``--out`` is refused (exit status 2) unless ``--overwrite``. A progress bar is
shown when ``tqdm`` is installed. The generator is ``sut_fairseq.data.flipflop``.
"""
import argparse
import dataclasses
import json
import os
import sys

from sut_fairseq.data import flipflop
from sut_fairseq.recipes import generated


def write_dataset(config, directory, progress=None):
    """Write the split files and the test side files into ``directory``; return
    ``(stats, test split names)``."""
    per_split = {}
    for name, examples in flipflop.iter_dataset(config, progress):
        stats = per_split[name] = flipflop.SplitStats()
        records = []
        generated.write_split(directory, name, examples, flipflop.to_seq2seq,
                              [stats.add, lambda e: records.append(flipflop.to_meta(e))])
        if name.startswith("test"):
            with open(os.path.join(directory, f"{name}.meta.jsonl"), "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
    tests = [flipflop.setting_name(*s) for s in config.test_settings()]
    return {"config": dataclasses.asdict(config),
            "settings": {flipflop.setting_name(*s): {"length": s[0], "p_ignore": s[1]}
                         for s in config.test_settings()},
            "splits": {name: s.summary() for name, s in per_split.items()}}, tests


def number_list(kind):
    """argparse type: comma-separated numbers (``64,128`` or ``0.1,0.8``)."""
    def parse(text):
        try:
            return tuple(kind(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    return parse


def parse_args(argv):
    parser = generated.generator_parser(
        __doc__, flipflop.CONFIGS, "small (train length 64, the CPU experiment; default) or "
                                   "paper (train length 512, 160,000 examples)")
    parser.add_argument("--train-length", type=int, help="tokens per training string (even)")
    parser.add_argument("--train-p-ignore", type=float, help="p_i of the training strings")
    parser.add_argument("--train-size", type=int, help="training examples")
    parser.add_argument("--test-lengths", type=number_list(int), help="e.g. 64,128")
    parser.add_argument("--test-p-ignore", type=number_list(float), help="e.g. 0.1,0.8,0.98")
    parser.add_argument("--test-size", type=int, help="examples per test setting")
    parser.add_argument("--valid-size", type=int, help="validation examples per validation setting")
    parser.add_argument("--valid-mix", choices=flipflop.VALID_MIXES,
                        help="mixed (the training and every test setting; default) or train")
    parser.add_argument("--seed", type=int, help="seed (default 1)")
    return generated.parse_config(parser, argv, lambda args: flipflop.make_config(
        args.config, train_length=args.train_length, train_p_ignore=args.train_p_ignore,
        train_size=args.train_size, test_lengths=args.test_lengths,
        test_p_ignore=args.test_p_ignore, test_size=args.test_size,
        valid_size=args.valid_size, valid_mix=args.valid_mix, seed=args.seed))


def main(argv=None):
    args, c = parse_args(argv)
    return generated.main(
        args, c, flipflop.total_examples(c), write_dataset,
        lambda seconds: f"wrote flip-flop data ({c.name}: train length {c.train_length}, p_i "
                        f"{c.train_p_ignore:g}, seed {c.seed}) to {args.out} in {seconds:.1f} s",
        flipflop.stats_table)


if __name__ == "__main__":
    sys.exit(main())
