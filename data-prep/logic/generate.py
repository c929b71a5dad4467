#!/usr/bin/env python3
"""Generate logical inference data in the original Bowman et al. (2015) format
(docs/results/logic_data.md#the-generator).

    python data-prep/logic/generate.py --out data/logic --pairs 500000 --seed 1

writes ``train0`` .. ``train12`` and ``test0`` .. ``test12`` (``RELATION<TAB>LEFT<TAB>RIGHT``)
into ``--out`` and prints per-bucket train/test sizes next to the sizes of the original
files (docs/results/logic_data.md#original-files; scaled by ``--pairs / 500000`` when
``--pairs`` differs; the scaled numbers are then only a rough guide, since deduplication
does not scale linearly).

``--out`` is written as a whole: the files go into a temporary sibling directory
(``.NAME.tmp-PID-XXXX``) that is renamed to ``--out`` once all 26 are written, so an
interrupted run leaves no ``--out`` (or the previous one) and a directory of that name
always holds a complete output. An existing non-empty ``--out`` -- including the
complete output of an earlier run with the same arguments -- is refused (error, exit
status 2) unless ``--overwrite`` is given, which replaces the whole directory.

The generator is the installed package's ``sut_fairseq.data.logic_inference``. A progress bar is shown when ``tqdm`` is
installed.
"""
import argparse
import sys
import time

from sut_fairseq.data import logic_inference, output_dir


def size_table(li, buckets, splits, n_pairs):
    """Rows of the size table and the largest |relative difference| over buckets 1..12."""
    scale = n_pairs / li.ORIGINAL_PAIRS
    header = ("bucket", "generated", "train", "orig train", "diff", "test", "orig test", "diff")
    rows = []
    worst = 0.0
    for k in li.BUCKETS:
        train, test = splits[k]
        orig_train, orig_test = (n * scale for n in li.ORIGINAL_SIZES[k])
        diffs = []
        for ours, orig in ((len(train), orig_train), (len(test), orig_test)):
            d = (ours - orig) / orig if orig else float("nan")
            diffs.append(d)
            if k >= 1 and orig:
                worst = max(worst, abs(d))
        rows.append((str(k), f"{len(buckets[k]):,}", f"{len(train):,}", f"{orig_train:,.0f}",
                     f"{diffs[0]:+.1%}", f"{len(test):,}", f"{orig_test:,.0f}", f"{diffs[1]:+.1%}"))
    total_train = sum(len(t) for t, _ in splits)
    total_test = sum(len(t) for _, t in splits)
    orig_total_train = sum(v[0] for v in li.ORIGINAL_SIZES.values()) * scale
    orig_total_test = sum(v[1] for v in li.ORIGINAL_SIZES.values()) * scale
    rows.append(("total", f"{n_pairs:,}", f"{total_train:,}", f"{orig_total_train:,.0f}",
                 f"{(total_train - orig_total_train) / orig_total_train:+.1%}",
                 f"{total_test:,}", f"{orig_total_test:,.0f}",
                 f"{(total_test - orig_total_test) / orig_total_test:+.1%}"))
    return header, rows, worst


def format_table(header, rows):
    """A Markdown table with right-aligned columns."""
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory for train0..12/test0..12")
    parser.add_argument("--pairs", type=int, default=500_000,
                        help="number of accepted pairs to generate (default 500000, the size "
                             "the original files' sizes correspond to)")
    parser.add_argument("--seed", type=int, default=1, help="seed of random.Random (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out when it exists and is not empty (else: error, exit 2)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be >= 1, got {args.pairs}")

    refused = output_dir.claim(args.out, args.overwrite)
    if refused is not None:
        return refused
    li = logic_inference
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.pairs, unit="pair", desc="generating", file=sys.stderr)
        except ImportError:
            pass
    start = time.time()
    try:
        buckets = li.generate_buckets(args.pairs, args.seed, progress=bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    splits = li.split_buckets(buckets)
    try:
        with output_dir.StagedDir(args.out, overwrite=args.overwrite) as stage:
            li.write_original(stage.path, splits)
    except output_dir.OutputExistsError as err:
        return output_dir.refuse(err)
    elapsed = time.time() - start

    header, rows, worst = size_table(li, buckets, splits, args.pairs)
    scaled = "" if args.pairs == li.ORIGINAL_PAIRS else \
        f" (original sizes scaled by {args.pairs:,}/{li.ORIGINAL_PAIRS:,})"
    print(f"wrote train0..train12, test0..test12 to {args.out} in {elapsed:.1f} s "
          f"(pairs={args.pairs}, seed={args.seed})")
    print(f"generated = accepted pairs per bucket before deduplication; diff = (ours - orig) / orig{scaled}")
    print(format_table(header, rows))
    print(f"largest |diff| over buckets 1..12: {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
