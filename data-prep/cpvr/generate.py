#!/usr/bin/env python3
"""Generate C-PVR data as seq2seq text files (docs/cpvr.md), optionally binarized.

    python data-prep/cpvr/generate.py --config small --out data/cpvr-small [--binarize]

writes into ``--out``:

* ``train.src/.tgt`` (train hops, interleaved round-robin), ``valid.src/.tgt`` (the
  train hops; omitted with ``--valid-per-hop 0``) and ``test{n}.src/.tgt`` per test hop n;
  a source line is the L numbers space-separated, a target line the label;
* ``stats.json``: the configuration, split sizes, label balance and the hop counts
  recomputed for every written example;
* ``baselines.json``: exact per-hop test accuracies of the shortcut baselines (copy
  a[0], the training set's most frequent label, a solver capped at 4 hops), also printed
  as a Markdown table.

All splits are deduplicated and mutually disjoint. ``--binarize`` runs one
``fairseq-preprocess`` (``--joined-dictionary``, dictionary from train) into ``OUT/bin``;
fairseq names the k-th ``--testpref`` entry ``test{k}`` and the first plain ``test``, so
with test hops 1..9: hop 1 -> split ``test``, hop n -> split ``test{n-1}`` (the mapping
is printed and stored in ``stats.json``).

``--out`` is written as a whole: everything goes into a temporary sibling directory
(``.NAME.tmp-PID-XXXX``) renamed to ``--out`` only when complete, so an interrupted run
leaves no partial ``--out``. An existing non-empty ``--out`` is refused (error, exit
status 2) unless ``--overwrite`` is given, which replaces it as a whole. A progress bar is
shown when ``tqdm`` is installed. The generator is the installed package's
``sut_fairseq.data.cpvr``.
"""
import argparse
import dataclasses
import json
import os
import sys
import time

from sut_fairseq.data import cpvr
from sut_fairseq.recipes import generated


def write_dataset(config, directory, progress=None):
    """Write the text files, ``stats.json`` and ``baselines.json`` into ``directory``;
    return ``(stats, baselines)``."""
    per_split = {}
    for name, examples in cpvr.iter_dataset(config, progress):
        stats = per_split[name] = cpvr.SplitStats()
        with open(os.path.join(directory, f"{name}.src"), "w") as src, \
                open(os.path.join(directory, f"{name}.tgt"), "w") as tgt:
            for example in examples:
                stats.add(example)
                source, target = cpvr.to_seq2seq(example)
                src.write(source + "\n")
                tgt.write(target + "\n")
    tests = {n: per_split[f"test{n}"] for n in config.test_hops}
    result = cpvr.baselines(tests, per_split["train"].labels)
    stats = {"config": dataclasses.asdict(config),
             "hop_probability": {str(n): float(cpvr.HopSampler(config.length, config.max_value)
                                               .probability(n)) for n in config.test_hops},
             "splits": {name: s.summary() for name, s in per_split.items()}}
    for name, value in (("stats.json", stats), ("baselines.json", result)):
        with open(os.path.join(directory, name), "w") as handle:
            json.dump(value, handle, indent=1)
            handle.write("\n")
    return stats, result


def hop_list(text):
    """argparse type: :func:`cpvr.parse_hops` with its message shown on error."""
    try:
        return cpvr.parse_hops(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv):
    parser = generated.generator_parser(
        __doc__, cpvr.CONFIGS, "small (L=16, K=100, the CPU experiment; default) or from-scratch "
                               "(L=100, K=1000, the paper's)")
    parser.add_argument("--variant", default="modulus", choices=cpvr.VARIANTS,
                        help="modulus (K > L; default) or plain (K = L)")
    parser.add_argument("--length", type=int, help="sequence length L")
    parser.add_argument("--max-value", type=int, help="largest value K (values are 1..K)")
    parser.add_argument("--train-hops", type=hop_list, help="e.g. 1-4")
    parser.add_argument("--test-hops", type=hop_list, help="e.g. 1-9")
    parser.add_argument("--train-per-hop", type=int, help="training examples per train hop")
    parser.add_argument("--valid-per-hop", type=int, help="validation examples per train hop")
    parser.add_argument("--test-per-hop", type=int, help="test examples per test hop")
    parser.add_argument("--seed", type=int, help="seed (default 1)")
    args = parser.parse_args(argv)
    try:
        config = cpvr.make_config(args.config, args.variant, length=args.length,
                                  max_value=args.max_value, train_hops=args.train_hops,
                                  test_hops=args.test_hops, train_per_hop=args.train_per_hop,
                                  valid_per_hop=args.valid_per_hop, test_per_hop=args.test_per_hop,
                                  seed=args.seed)
    except ValueError as err:
        parser.error(str(err))
    if args.binarize and config.valid_per_hop == 0:
        parser.error("--binarize needs a validation set: --valid-per-hop must be >= 1")
    return args, config


def main(argv=None):
    args, config = parse_args(argv)
    start, baselines = time.time(), {}

    def write(directory, progress):
        stats, baselines["result"] = write_dataset(config, directory, progress)
        return stats, {str(n): f"test{n}" for n in config.test_hops}

    status, stats = generated.run(args, cpvr.total_examples(config), write)
    if status:
        return status
    result, splits = baselines["result"], cpvr.binarized_test_splits(config.test_hops)
    c = config
    print(f"wrote C-PVR ({c.name}, {c.variant}: L={c.length}, K={c.max_value}, seed={c.seed}) "
          f"to {args.out} in {time.time() - start:.1f} s")
    for name, s in stats["splits"].items():
        labels = s["labels"]
        print(f"  {name:>7}: {s['size']:>8,} examples, hops {s['hops_checked']}, "
              f"{labels['distinct']} distinct labels, most frequent {labels['most_common'][0][0]} "
              f"({labels['majority_share']:.1%})")
    print("\nshortcut baselines: test accuracy (%) per hop count\n")
    print(cpvr.baseline_table(result))
    if args.binarize:
        print("\nbinarized test splits: " + ", ".join(f"hop {n} -> {s}" for n, s in splits.items()))
        print(f"binarized data in {os.path.join(args.out, 'bin')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
