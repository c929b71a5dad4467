"""Average the parameters of several fairseq checkpoints (the paper averages the 5 best by
validation NLL; docs/wmt14.md#evaluation).

The equivalent of fairseq's ``scripts/average_checkpoints.py``, which the fairseq wheel
does not install:

    python -m sut_fairseq.eval.average_checkpoints --inputs CKPT_DIR --num-best 5 \\
        --output CKPT_DIR/averaged_best5.pt
    python -m sut_fairseq.eval.average_checkpoints --inputs a.pt b.pt --output avg.pt

* A directory in ``--inputs`` stands for its ``checkpoint.best_METRIC_VALUE.pt`` files,
  written by ``fairseq-train --keep-best-checkpoints N [--best-checkpoint-metric METRIC]``
  (fairseq names them ``checkpoint.best_{metric}_{value:.3f}{tie-break digit}.pt``); the
  ``--num-best`` best are taken (lowest value, or highest with ``--maximize``). With
  several metrics in one directory pass ``--metric``. Files are used as given.
* Every checkpoint is read with ``torch.load(weights_only=True)`` (importing
  ``sut_fairseq`` allow-lists the ``argparse.Namespace`` fairseq 0.12 pickles).
* Floating-point tensors are averaged in float64 and stored in their original dtype
  (fp16 stays fp16); other tensors must be equal in every checkpoint and are copied.
  All checkpoints must have the same parameter names and shapes.
* The output is the first checkpoint with its ``model`` replaced by the average (so its
  ``cfg``/``args`` make it loadable by ``fairseq-generate``; the optimizer state is kept
  like fairseq's script does unless ``--drop-optimizer-state``), written atomically.
"""
import argparse
import collections
import glob
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

import torch

from .. import checkpoint_safety  # noqa: F401  (allow-lists argparse.Namespace)

BEST_PATTERN = re.compile(r"^checkpoint\.best_(?P<metric>.+)_(?P<value>-?\d+\.\d{3})(?P<tie>\d*)\.pt$")


def best_checkpoints(directory: str, num_best: int, metric: Optional[str] = None,
                     maximize: bool = False) -> List[str]:
    """The ``num_best`` best ``checkpoint.best_*`` files of ``directory``, best first."""
    found = collections.defaultdict(list)
    for path in glob.glob(os.path.join(directory, "checkpoint.best_*.pt")):
        match = BEST_PATTERN.match(os.path.basename(path))
        if match:
            found[match["metric"]].append((float(match["value"]), match["tie"], path))
    if not found:
        raise FileNotFoundError(
            f"no checkpoint.best_METRIC_VALUE.pt files in {directory}: train with "
            f"--keep-best-checkpoints {num_best} (or pass the checkpoint files themselves)")
    if metric is None:
        if len(found) > 1:
            raise ValueError(f"{directory} holds best checkpoints for several metrics "
                             f"{sorted(found)}; choose one with --metric")
        metric = next(iter(found))
    if metric not in found:
        raise FileNotFoundError(f"no checkpoint.best_{metric}_*.pt in {directory} "
                                f"(found metrics: {sorted(found)})")
    ranked = sorted(found[metric], key=lambda item: (item[0], item[1]), reverse=maximize)
    if len(ranked) < num_best:
        raise ValueError(f"asked for the {num_best} best checkpoints by {metric} but {directory} "
                         f"has only {len(ranked)}: {[os.path.basename(r[2]) for r in ranked]}")
    return [path for _, _, path in ranked[:num_best]]


def load_checkpoint(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{path} is not a fairseq checkpoint (no 'model' entry)")
    return state


def average_state_dicts(states: Sequence[Dict[str, torch.Tensor]], names: Sequence[str] = ()) -> "collections.OrderedDict[str, torch.Tensor]":
    """Element-wise mean of floating-point tensors (float64 accumulation, original dtype);
    non-floating tensors must agree and are copied."""
    if not states:
        raise ValueError("no checkpoints to average")
    names = list(names) or [f"#{i}" for i in range(len(states))]
    keys = list(states[0].keys())
    for state, name in zip(states[1:], names[1:]):
        if set(state.keys()) != set(keys):
            missing, extra = set(keys) - set(state), set(state) - set(keys)
            raise ValueError(f"{name} does not have the parameters of {names[0]} "
                             f"(missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]})")
    averaged = collections.OrderedDict()
    for key in keys:
        first = states[0][key]
        for state, name in zip(states[1:], names[1:]):
            if state[key].shape != first.shape:
                raise ValueError(f"{key}: shape {tuple(state[key].shape)} in {name}, "
                                 f"{tuple(first.shape)} in {names[0]}")
        if torch.is_floating_point(first):
            total = torch.zeros(first.shape, dtype=torch.float64)
            for state in states:
                total += state[key].to(torch.float64)
            averaged[key] = (total / len(states)).to(first.dtype)
        else:
            for state, name in zip(states[1:], names[1:]):
                if not torch.equal(state[key], first):
                    raise ValueError(f"{key} ({first.dtype}) differs between {names[0]} and {name}; "
                                     "non-floating tensors cannot be averaged")
            averaged[key] = first.clone()
    return averaged


def save_atomic(state: dict, path: str) -> None:
    from ..data.atomic import atomic_path

    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def resolve_inputs(inputs: Sequence[str], num_best: int, metric: Optional[str] = None,
                   maximize: bool = False) -> List[str]:
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            paths += best_checkpoints(item, num_best, metric, maximize)
        else:
            paths.append(item)
    return paths


def average_checkpoints(paths: Sequence[str], output: str, drop_optimizer_state: bool = False) -> dict:
    """Average ``paths`` into ``output``; returns the written state."""
    states = [load_checkpoint(p) for p in paths]
    new_state = dict(states[0])
    new_state["model"] = average_state_dicts([s["model"] for s in states], paths)
    new_state["averaged_from"] = [os.path.basename(p) for p in paths]
    if drop_optimizer_state:
        new_state.pop("last_optimizer_state", None)
    save_atomic(new_state, output)
    return new_state


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", nargs="+", required=True,
                        help="checkpoint files, or directories holding checkpoint.best_*.pt files")
    parser.add_argument("--output", required=True, help="where to write the averaged checkpoint")
    parser.add_argument("--num-best", type=int, default=5,
                        help="how many best checkpoints to take from each directory (default 5)")
    parser.add_argument("--metric", default=None,
                        help="metric in the best-checkpoint file names (default: the only one)")
    parser.add_argument("--maximize", action="store_true", help="higher metric values are better")
    parser.add_argument("--drop-optimizer-state", action="store_true",
                        help="leave the optimizer state out of the output (smaller file)")
    args = parser.parse_args(argv)
    try:
        paths = resolve_inputs(args.inputs, args.num_best, args.metric, args.maximize)
        print(f"averaging {len(paths)} checkpoints:")
        for path in paths:
            print(f"  {path}")
        state = average_checkpoints(paths, args.output, args.drop_optimizer_state)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in state["model"].values() if torch.is_floating_point(t))
    print(f"wrote {args.output} ({len(state['model'])} tensors, {n:,} floating-point values)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
