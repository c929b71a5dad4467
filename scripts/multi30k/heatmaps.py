#!/usr/bin/env python3
"""Halting heat maps of a few test sentences of a trained halting model (SUT or UT): one
PNG per sentence, the encoder panel over its source pieces and the decoder panel over the
target pieces it predicts (teacher-forced), coloured by the remaining stick
1 - sum_{l' < l} alpha_l' at every step (``sut_fairseq.analysis.plots.halting_heatmap``).

    python scripts/multi30k/heatmaps.py --path CKPT --data DATA_BIN [--subset test] \\
        --ids 0 1 2 --output DIR/heatmaps.png      # writes DIR/heatmaps-0.png, -1.png, -2.png
"""
import argparse
import os
import sys


def output_path(output: str, sentence_id: int) -> str:
    root, ext = os.path.splitext(output)
    return f"{root}-{sentence_id}{ext or '.png'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--data", required=True, help="fairseq data-bin directory")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--ids", nargs="+", type=int, required=True, help="sentence ids of the subset")
    parser.add_argument("--threshold", type=float, default=None, help="alpha_thresh (default: the model's)")
    parser.add_argument("--output", required=True, help="PNG path; the sentence id is added to its name")
    args = parser.parse_args(argv)
    from sut_fairseq.analysis.halting_analysis import analyse, load
    from sut_fairseq.analysis.plots import halting_heatmap
    from sut_fairseq.analysis.sweep import heatmap_panels

    model, task = load(args.data, args.path, args.threshold, args.subset)
    if not hasattr(model.encoder, "side"):
        raise SystemExit(f"error: {args.path} is not a sut_transformer checkpoint (no halting to draw)")
    size = len(task.dataset(args.subset))
    bad = [i for i in args.ids if not 0 <= i < size]
    if bad:
        raise SystemExit(f"error: --ids {bad[0]} is not a sentence of {args.subset} (ids 0..{size - 1})")
    analysis = analyse(model, task, args.subset, args.threshold, max_sentences=None)
    by_id = {s["id"]: s for s in analysis["sentences"]}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for sentence_id in args.ids:
        path = output_path(args.output, sentence_id)
        halting_heatmap(heatmap_panels(by_id[sentence_id]), path,
                        title=f"{args.subset} sentence {sentence_id}, alpha_thresh {analysis['threshold']:g}")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
