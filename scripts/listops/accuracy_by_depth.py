#!/usr/bin/env python3
"""ListOps, classify setup: each model's test accuracy per tree depth and per length, seed
mean ± sd -- which expressions a model has learned to compute.

    python scripts/listops/accuracy_by_depth.py WORK --data-dir data/listops \\
        [--models ut gut] [--seeds 1 2 3] [--split test-iid] [--compare gut ut] [--out PREFIX]

``WORK`` is a classify work directory of ``table1.py`` (``WORK/MODEL/seedN/``, e.g.
``runs/listops/classify``). For each (model, seed) with a
``checkpoints/checkpoint_best.pt``, the classifier reads every line of
``DATA/SPLIT.src`` (encoded with the run's dictionary, ``DATA/classify``, as
fairseq-preprocess did), and an example is correct when its argmax label is the line of
``DATA/SPLIT.tgt``. The run's examples go to ``WORK/MODEL/seedN/accuracy-SPLIT.json``
(atomically; not redone unless ``--force``), with the check that their number correct is
the one ``fairseq-validate`` counted in the run's ``result.json``.

The report groups the split's examples by tree depth (the deepest nesting of operator
lists: ``[MAX 1 2 ]`` is 1; groups 1, 2, 3, 4, 5-6, 7-9, 10 and deeper), by length (the
training lengths, at most 100 tokens, and longer) and by the root operator (MAX, MIN,
MED, SM: the one whose value is the label): per group its examples, the
share of its most frequent label (what a model that ignores the expression reaches) and
each model's accuracy, mean ± sample sd over its seeds. ``--compare A B`` adds A against
B per group (ahead beyond one sd: the difference larger than both sds). Written
atomically: ``PREFIX.json``, ``PREFIX.md`` and ``PREFIX.png`` (accuracy per tree-depth
group, one line per model, error bars the seeds' sd); ``PREFIX`` defaults to
``WORK/accuracy-by-depth-SPLIT``. One thread (``--threads``).
"""
import argparse
import os
import sys
import time
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import depth as depth_tool  # noqa: E402
import listops_recipe as recipe  # noqa: E402
from sut_fairseq.data import listops  # noqa: E402
from sut_fairseq.recipes.files import load_json, write_json_atomic, write_text_atomic  # noqa: E402
from sut_fairseq.recipes.summary import ahead_table, format_mean_std, line_plot, markdown_table, mean_std  # noqa: E402

#: Tree-depth groups (lowest, highest; None: no upper end) of the report.
DEPTH_GROUPS: Tuple[Tuple[int, Optional[int]], ...] = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, 9), (10, None))
#: The group every example is in (the whole split).
ALL = "all"
#: The longest training expression (tokens): the length groups are up to it and beyond.
TRAIN_MAX_LENGTH = 100


def depth_group(tree_depth: int) -> str:
    """The name of the group of ``tree_depth`` (``"5-6"``, ``"10+"``)."""
    for low, high in DEPTH_GROUPS:
        if tree_depth >= low and (high is None or tree_depth <= high):
            return str(low) if high == low else (f"{low}+" if high is None else f"{low}-{high}")
    raise ValueError(f"tree depth {tree_depth!r} is not >= 1")


def length_group(length: int) -> str:
    return f"<= {TRAIN_MAX_LENGTH} tokens" if length <= TRAIN_MAX_LENGTH else f"> {TRAIN_MAX_LENGTH} tokens"


def operator_group(source: str) -> str:
    """The root list's operator (``MAX``, ``MIN``, ``MED``, ``SM``): the one the label is
    the value of."""
    return source.split()[0].lstrip("[")


def group_names() -> List[str]:
    return ([depth_group(low) for low, _ in DEPTH_GROUPS] + [length_group(1), length_group(TRAIN_MAX_LENGTH + 1)]
            + [op.lstrip("[") for op in listops.OPERATORS])


def group_title(name: str) -> str:
    """A group's name as the report's rows show it (``"tree depth 5-6"``)."""
    if name == ALL:
        return ALL
    kind = "tree depth" if name[0].isdigit() else ("length" if name[0] in "<>" else "root operator")
    return f"{kind} {name}"


def example_groups(source: str) -> Tuple[str, str, str]:
    """(tree-depth group, length group, root operator) of one source line."""
    return (depth_group(depth_tool.tree_depth(source)), length_group(len(source.split())),
            operator_group(source))


# --------------------------------------------------------------------------- the model

def predictions(model, task, sources: Sequence[str], batch_size: int = 64,
                max_tokens: int = 16384) -> List[str]:
    """The classifier's label (the label dictionary's symbol of its argmax) for every
    source line, in order. Batches are right-padded, as the classify task's; the pooled
    vector does not depend on the padding, so neither does a prediction."""
    import torch
    from fairseq.data import data_utils

    dictionary, labels = task.source_dictionary, task.label_dictionary
    encoded = depth_tool.encode(dictionary, sources)
    out: List[Optional[str]] = [None] * len(sources)
    with torch.no_grad():
        for batch in depth_tool.batches([len(t) for t in encoded], batch_size, max_tokens):
            tokens = data_utils.collate_tokens([encoded[i] for i in batch], dictionary.pad(),
                                               dictionary.eos(), left_pad=False)
            lengths = torch.tensor([len(encoded[i]) for i in batch])
            logits, _ = model(tokens, lengths)
            for row, i in enumerate(batch):
                out[i] = labels[int(logits[row].argmax()) + labels.nspecial]
    return out


def score_run(args, model_name: str, seed: int, sources: Sequence[str],
              references: Sequence[str]) -> Optional[Dict]:
    """One run's per-example results on the split's ``sources`` against its
    ``references`` (cached in its directory); None when it has no checkpoint."""
    run_dir = os.path.join(args.work_dir, model_name, f"seed{seed}")
    checkpoint = os.path.join(run_dir, "checkpoints", "checkpoint_best.pt")
    if not os.path.exists(checkpoint):
        print(f"{model_name} seed {seed}: no {checkpoint}, left out", flush=True)
        return None
    path = os.path.join(run_dir, f"accuracy-{args.split}.json")
    if os.path.exists(path) and not args.force:
        cached = load_json(path)
        if cached.get("examples") == len(sources):
            print(f"{model_name} seed {seed}: done before, {path} (--force to redo)", flush=True)
            return cached
    print(f"{model_name} seed {seed}: {checkpoint} on the {len(sources)} examples of {args.split}", flush=True)
    start = time.time()
    model, task = depth_tool.load_model_and_task(checkpoint, os.path.join(args.data_dir, "classify"))
    predicted = predictions(model, task, sources, args.batch_size, args.max_tokens)
    correct = [p == r for p, r in zip(predicted, references)]
    result = {"model": model_name, "seed": seed, "split": args.split, "checkpoint": os.path.abspath(checkpoint),
              "examples": len(sources), "correct": sum(correct), "seconds": round(time.time() - start, 1),
              "check": validate_check(sum(correct), os.path.join(run_dir, "result.json"), args.split),
              "per_example": [int(c) for c in correct]}
    write_json_atomic(path, result)
    print(f"   {result['seconds']} s; {result['correct']} / {len(sources)} correct; {result['check']}", flush=True)
    return result


def validate_check(correct: int, result_json: str, split: str) -> str:
    """Whether ``correct`` is the number fairseq-validate counted for ``split`` in the run's
    result.json."""
    if not os.path.exists(result_json):
        return "no result.json to check against"
    counted = load_json(result_json).get("splits", {}).get(split, {}).get("correct")
    if counted is None:
        return f"result.json has no count for {split}"
    return (f"equal to fairseq-validate's count ({counted})" if counted == correct
            else f"MISMATCH: fairseq-validate counted {counted}")


def read_split(data_dir: str, split: str) -> Tuple[List[str], List[str]]:
    lines = []
    for suffix in ("src", "tgt"):
        path = os.path.join(data_dir, f"{split}.{suffix}")
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} not found (--data-dir: the ListOps text files of "
                             "data-prep/listops/generate.py)")
        with open(path, encoding="utf-8") as handle:
            lines.append([line.strip() for line in handle])
    sources, references = lines
    if len(sources) != len(references) or not sources:
        raise SystemExit(f"error: {split}.src has {len(sources)} lines and {split}.tgt {len(references)}; "
                         "they must be equal and not empty")
    return sources, references


# --------------------------------------------------------------------------- the report

def group_accuracy(per_example: Sequence[int], groups: Sequence[Tuple[str, str]]) -> Dict[str, float]:
    """Accuracy (%) per group name of one run's per-example 0/1 results."""
    hits, counts = Counter(), Counter()
    for ok, names in zip(per_example, groups):
        for name in names:
            hits[name] += ok
            counts[name] += 1
    return {name: 100.0 * hits[name] / counts[name] for name in counts}


def majority_share(references: Sequence[str], groups: Sequence[Tuple[str, str]]) -> Dict[str, Tuple[int, float]]:
    """Per group: (examples, % of its most frequent label)."""
    labels: Dict[str, Counter] = {}
    for label, names in zip(references, groups):
        for name in names:
            labels.setdefault(name, Counter())[label] += 1
    return {name: (sum(c.values()), 100.0 * c.most_common(1)[0][1] / sum(c.values())) for name, c in labels.items()}


def report(args, runs: Dict[str, List[Dict]], sources: Sequence[str], references: Sequence[str]) -> Dict:
    groups = [example_groups(s) + (ALL,) for s in sources]
    prior = majority_share(references, groups)
    names = [n for n in group_names() if n in prior]  # the groups; the rows add ALL
    per_run = {m: [group_accuracy(r["per_example"], groups) for r in rs] for m, rs in runs.items()}
    cells = {m: {n: mean_std([accuracy[n] for accuracy in per_run[m]]) for n in names + [ALL]} for m in runs}
    labels = {m: recipe.CLASSIFY_TASK.grid.label(m) for m in runs}
    header = ["group", "examples", "majority label"] + [labels[m] for m in runs]
    rows = []
    for n in names + [ALL]:
        rows.append([group_title(n), str(prior[n][0]), f"{prior[n][1]:.1f}"]
                    + [format_mean_std(cells[m][n], len(runs[m])) for m in runs])
    seeds = ", ".join(f"{labels[m]} {[r['seed'] for r in rs]}" for m, rs in runs.items())
    text = (f"Accuracy (%) on {args.split} per tree depth and length, seed mean ± sample sd (seeds: {seeds}); "
            f"'majority label': the share of the group's most frequent label.\n\n"
            + markdown_table(header, rows))
    checks = [f"{labels[m]} seed {r['seed']}: {r['check']}" for m, rs in runs.items() for r in rs]
    text += "\n\nChecks against fairseq-validate: " + "; ".join(checks) + "."
    if args.compare:
        a, b = args.compare
        for name in (a, b):
            if name not in runs:
                raise SystemExit(f"--compare {name}: no scored run (models: {', '.join(runs)})")
        titled = [{group_title(n): cells[m][n] for n in names} for m in (a, b)]
        text += (f"\n\n{labels[a]} against {labels[b]} per group:\n\n"
                 + ahead_table((labels[a], labels[b]), tuple(titled), [group_title(n) for n in names]))
    depth_names = [n for n in names if n[0].isdigit()]
    series = {labels[m]: (range(len(depth_names)), [cells[m][n][0] for n in depth_names]) for m in runs}
    series["majority label"] = (range(len(depth_names)), [prior[n][1] for n in depth_names])
    errors = {labels[m]: [cells[m][n][1] for n in depth_names] for m in runs}
    prefix = args.out or os.path.join(args.work_dir, f"accuracy-by-depth-{args.split}")
    line_plot(prefix + ".png", series, "tree depth", "accuracy (%)", f"ListOps {args.split}",
              xticks=list(range(len(depth_names))), xticklabels=depth_names, errors=errors)
    write_text_atomic(prefix + ".md", text + "\n")
    summary = {"split": args.split, "groups": {n: {"examples": prior[n][0], "majority_label": prior[n][1]} for n in names},
               "accuracy": {m: {n: cells[m][n] for n in names} for m in runs},
               "all": {m: cells[m][ALL] for m in runs}, "runs": {m: [{k: r[k] for k in ("seed", "correct", "examples", "check")} for r in rs]
                                      for m, rs in runs.items()}}
    write_json_atomic(prefix + ".json", summary)
    print(text)
    print(f"\nwritten: {prefix}.md, {prefix}.json, {prefix}.png")
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("work_dir", metavar="WORK", help="classify work directory (WORK/MODEL/seedN/)")
    parser.add_argument("--data-dir", default=os.path.join("data", "listops"),
                        help="the ListOps text files, with the binarized classify data in DATA/classify")
    parser.add_argument("--models", nargs="+", default=["ut", "gut"], choices=recipe.CLASSIFY_MODELS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--split", default="test-iid", help="test split (DATA/SPLIT.src, .tgt)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None, help="A against B per group")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    parser.add_argument("--max-tokens", type=int, default=16384, help="padded tokens per batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", default=None, help="prefix of the report files")
    parser.add_argument("--force", action="store_true", help="score runs scored before again")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.work_dir):
        raise SystemExit(f"error: work directory {args.work_dir} not found")
    import torch
    torch.set_num_threads(args.threads)
    sources, references = read_split(args.data_dir, args.split)
    runs: Dict[str, List[Dict]] = {}
    for model_name in args.models:
        scored = [r for r in (score_run(args, model_name, s, sources, references) for s in args.seeds)
                  if r is not None]
        if scored:
            runs[model_name] = scored
    if not runs:
        raise SystemExit(f"error: no checkpoint of {args.models} seeds {args.seeds} in {args.work_dir}")
    return report(args, runs, sources, references)


if __name__ == "__main__":
    main()
