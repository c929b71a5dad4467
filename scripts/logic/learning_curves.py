#!/usr/bin/env python3
"""Learning curves of logic runs from their fairseq-train logs: validation accuracy
against updates and against wall-clock time, one line per run.

    python scripts/logic/learning_curves.py LABEL=TRAIN_LOG|CURVE.json [...]
        --out runs/logic-cpu/learning_curves.png [--table runs/logic-cpu/learning_curves.md]
        [--setup seq2seq|classify] [--save-curves DIR]

``TRAIN_LOG`` is fairseq-train's output in ``--log-format simple`` (``train.log`` of a
``table5.py`` run). A ``.json`` file is a curve saved before (``--save-curves DIR`` writes
one per log, ``DIR/LABEL.json``): ``{"label", "source", "points": [{"updates",
"accuracy", "seconds"}]}``, ``seconds`` null where the wall-clock time is not known; such
points are left out of the wall-clock panel. Saved curves keep a run's validation history
(a few hundred bytes) in the repository after its checkpoints and logs are gone
(``docs/results/logic/curves/``). Validation accuracy is fairseq's ``accuracy`` of the ``valid``
subset: in the seq2seq setup (``--setup seq2seq``, the default) token accuracy over the
relation and ``</s>``, where 77.18 % is "always the majority relation ``#``"; in the
classify setup (``--setup classify``) the relation's accuracy, where the majority is
54.35 %. The wall-clock time of a validation is the time the run had been running when it
was logged: from each ``Start iterating over samples`` to the last progress line
(``train_inner``, ``valid``, ``train``, checkpoint saves) before the next one (a resumed
run's pause and start-up are not counted; fairseq logs the same line at each epoch's
start, where the segments then lose only the second or so between two log lines),
so it includes the validations themselves. Writes the PNG and, with ``--table``, a
markdown table of every validation (both atomically). Standard library + matplotlib.
"""
import argparse
import datetime
import os
import re
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logic_recipe as recipe  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
VALID = re.compile(r"\| valid on 'valid' subset \|.*")
FIELD = re.compile(r"\| (\w+) ([-\d.]+)")
#: Lines only a training that is iterating logs (progress, validation, epoch summary,
#: checkpoint saves); a resumed process's start-up lines are not among them.
PROGRESS = re.compile(r"^\S+ \S+ \| \w+ \| (train_inner|valid|train|fairseq\.checkpoint_utils) \|")
#: validation accuracy of always answering the majority relation ``#`` (7,391 of the 13,599
#: valid pairs): per setup, as fairseq's ``accuracy`` counts it (seq2seq: tokens, the
#: relation and ``</s>``; classify: pairs)
MAJORITY_ACCURACY = {"seq2seq": 77.18, "classify": 54.35}


def parse_log(path: str) -> List[Dict]:
    """Every validation of a log: ``{"updates", "seconds", "accuracy", "nll_loss"}``,
    ``seconds`` the running time before it: the segments from each ``Start iterating over
    samples`` to its last progress line (``PROGRESS``) summed, the gaps between them (the
    run stopped, then resumed, and the new process's start-up) left out."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: no such log: {path}")
    start, last, before, points = None, None, 0.0, []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            stamp = STAMP.match(line)
            if not stamp:
                continue
            when = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")
            if "Start iterating over samples" in line:
                if start is not None:  # a resume: close the segment at its last progress line
                    before += (last - start).total_seconds()
                start = last = when
            elif PROGRESS.match(line):
                last = when
            match = VALID.search(line)
            if match and start is not None:
                fields = {k: float(v) for k, v in FIELD.findall(match.group(0))}
                if "num_updates" in fields and "accuracy" in fields:
                    points.append({"updates": int(fields["num_updates"]),
                                   "seconds": before + (when - start).total_seconds(),
                                   "accuracy": fields["accuracy"],
                                   "nll_loss": fields.get("nll_loss")})
    return points


def load_curve(path: str) -> List[Dict]:
    """The points of a saved curve (``save_curve``), checked: every point has integer
    ``updates``, a numeric ``accuracy`` and ``seconds`` (a number or null)."""
    import json

    if not os.path.isfile(path):
        raise SystemExit(f"error: no such curve: {path}")
    try:
        with open(path, encoding="utf-8") as handle:
            points = json.load(handle)["points"]
        for p in points:
            if not (isinstance(p["updates"], int) and isinstance(p["accuracy"], (int, float))
                    and (p["seconds"] is None or isinstance(p["seconds"], (int, float)))):
                raise ValueError(p)
    except (ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"error: {path} is not a curve file ({{\"points\": [{{\"updates\": int, "
                         f"\"accuracy\": float, \"seconds\": float|null}}, ...]}}): {err!r}")
    return points


def save_curve(directory: str, label: str, source: str, points: List[Dict]) -> str:
    """Write ``DIRECTORY/LABEL.json`` (atomically) and return its path."""
    import json

    name = re.sub(r"[^\w.-]+", "_", label).strip("_") or "curve"
    path = os.path.join(directory, name + ".json")
    os.makedirs(directory, exist_ok=True)
    recipe.write_text_atomic(path, json.dumps({"label": label, "source": source, "points": [
        {"updates": p["updates"], "accuracy": p["accuracy"], "seconds": p["seconds"]}
        for p in points]}, indent=1) + "\n")
    return path


def table(curves: Dict[str, List[Dict]]) -> str:
    updates = sorted({p["updates"] for points in curves.values() for p in points})
    lines = ["| updates | " + " | ".join(f"{label} (acc. %, minutes)" for label in curves) + " |",
             "|---:|" + "---:|" * len(curves)]
    for n in updates:
        cells = []
        for points in curves.values():
            at = [p for p in points if p["updates"] == n]
            if not at:
                cells.append("–")
            else:
                minutes = "–" if at[0]["seconds"] is None else f"{at[0]['seconds'] / 60:.0f}"
                cells.append(f"{at[0]['accuracy']:.2f} ({minutes})")
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(curves: Dict[str, List[Dict]], path: str, setup: str) -> None:
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, points in curves.items():
        axes[0].plot([p["updates"] for p in points], [p["accuracy"] for p in points], "o-", label=label)
        timed = [p for p in points if p["seconds"] is not None]
        axes[1].plot([p["seconds"] / 3600 for p in timed], [p["accuracy"] for p in timed], "o-",
                     label=label)
    for ax, xlabel in zip(axes, ("updates", "running hours (runs whose time is known)")):
        ax.axhline(MAJORITY_ACCURACY[setup], color="grey", ls=":", lw=1, label="majority relation")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("valid token accuracy (%)" if setup == "seq2seq" else "valid accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Logical inference, trained on 0–6 operators: validation accuracy")
    fig.tight_layout()
    with recipe.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("runs", nargs="+", metavar="LABEL=TRAIN_LOG|CURVE.json")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--table", default=None, help="also write a markdown table here")
    parser.add_argument("--setup", choices=sorted(MAJORITY_ACCURACY), default="seq2seq",
                        help="the runs' setup, for the majority line: seq2seq (token accuracy) "
                             "or classify (the relation's accuracy)")
    parser.add_argument("--save-curves", default=None, metavar="DIR",
                        help="write each train log's validation points to DIR/LABEL.json")
    args = parser.parse_args(argv)
    curves = {}
    for run in args.runs:
        if "=" not in run:
            parser.error(f"expected LABEL=TRAIN_LOG or LABEL=CURVE.json, got {run!r}")
        label, path = run.split("=", 1)
        if path.endswith(".json"):
            curves[label] = load_curve(path)
            continue
        points = parse_log(path)
        if not points:
            raise SystemExit(f"error: {path} holds no validation of the 'valid' subset")
        curves[label] = points
        if args.save_curves:
            print(f"saved {save_curve(args.save_curves, label, path, points)}")
    plot(curves, args.out, args.setup)
    text = table(curves)
    if args.table:
        recipe.write_text_atomic(args.table, text)
    print(text, end="")
    print(f"written {args.out}" + (f" and {args.table}" if args.table else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
