"""Mean halting depth per test split (paper Figure 4; the Hyper-UT paper's depth per hop)
from the teacher-forced halting analysis (``halting_analysis.analyse``) of a checkpoint.

    python -m sut_fairseq.analysis.halting_depth DATA_BIN --path CKPT
        --subsets test7 test8 ... [--keys 7 8 ...] [--threshold A] [--batch-size 64] --json OUT

For each binarized split the checkpoint is run teacher-forced on every source-target pair
and the executed steps of every real position are read. Per split the JSON holds, for each
side (``encoder``, ``decoder``):

* ``mean_depth`` -- the mean over sentences of the sentence's mean executed steps over its
  positions (the "average halting depth" the papers plot; the encoder's, usually);
* ``mean_max_depth`` -- the mean over sentences of the deepest position's steps;
* ``position_mean_steps`` / ``executed_fraction`` -- ``analyse``'s pooled figures
  (executed (position, step) pairs over all positions, over L x positions);
* ``mean_expected_depth`` -- the same mean over sentences of the positions' expected
  depth (the ACT loss's summand, Σ_l l · w_l, N + R for ``act``): where the halting weights
  put the depth, also when no position reaches the threshold and every step runs;

and ``sentences``, ``max_steps`` and the threshold used. The JSON is written atomically.
The analysis runs on the CPU, one forward pass per pair.
"""
import argparse
import os
import time
from typing import Dict, List, Optional, Sequence


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _mean_of_sentence_means(lists: Sequence[Sequence[float]]) -> Optional[float]:
    """The mean over sentences of each sentence's mean over its positions."""
    return _mean([sum(values) / len(values) for values in lists if values])


def depth_summary(analysis: Dict, max_steps: Dict[str, int]) -> Dict:
    """Per side: mean / max depth over sentences, from ``analyse``'s output."""
    summary = {"sentences": len(analysis["sentences"]), "threshold": analysis["threshold"]}
    for side in ("encoder", "decoder"):
        per_sentence = [s[f"{side}_steps"] for s in analysis["sentences"] if s[f"{side}_steps"]]
        summary[side] = {
            "mean_depth": _mean_of_sentence_means(per_sentence),
            "mean_expected_depth": _mean_of_sentence_means(
                [s[f"{side}_expected"] for s in analysis["sentences"]]),
            "mean_max_depth": _mean([max(steps) for steps in per_sentence]),
            "position_mean_steps": analysis[side]["mean_steps"],
            "executed_fraction": analysis[side]["executed_fraction"],
            "max_steps": max_steps[side],
        }
    return summary


def split_depths(data: str, path: str, subsets: List[str], keys: List[str],
                 threshold: Optional[float] = None, batch_size: int = 64) -> Dict:
    """``{"checkpoint", "data", "splits": {key: depth_summary + "subset"}, "seconds"}``."""
    from .halting_analysis import analyse, load

    start = time.time()
    model, task = load(data, path, threshold, subsets[0])
    max_steps = {"encoder": model.encoder.side.num_steps, "decoder": model.decoder.side.num_steps}
    result = {"checkpoint": os.path.abspath(path), "data": os.path.abspath(data), "splits": {}}
    for key, subset in zip(keys, subsets):
        task.load_dataset(subset)
        summary = depth_summary(analyse(model, task, subset, threshold, batch_size=batch_size),
                                max_steps)
        summary["subset"] = subset
        result["splits"][key] = summary
        print(f"{subset}: {summary['sentences']} sentences, mean encoder depth "
              f"{summary['encoder']['mean_depth']:.3f} of {max_steps['encoder']} (expected "
              f"{summary['encoder']['mean_expected_depth']:.3f}), decoder "
              f"{summary['decoder']['mean_depth']:.3f} of {max_steps['decoder']}", flush=True)
    result["seconds"] = round(time.time() - start, 1)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", help="the binarized data directory")
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--subsets", nargs="+", required=True, help="binarized split names")
    parser.add_argument("--keys", nargs="+", default=None,
                        help="names of the splits in the JSON (default: the split names)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="alpha_thresh (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", required=True, help="output JSON")
    args = parser.parse_args(argv)
    keys = args.keys or args.subsets
    if len(keys) != len(args.subsets):
        parser.error("--keys must name every --subsets entry")
    from ..data.atomic import write_json_atomic

    result = split_depths(args.data, args.path, args.subsets, keys, args.threshold, args.batch_size)
    write_json_atomic(args.json, result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
