#!/usr/bin/env python3
"""ListOps: the mean halting depth per tree depth of the halting models of ``table1.py``
(UT, GUT, GUTLB, the chunked SUT), each seed's trained checkpoint run over a test split.

    python scripts/listops/depth.py --data-dir data/listops --work-dir runs/listops \\
        --seeds 1 2 3 [--models ut gut gutlb sut-chunked] [--splits test-iid ...]
        [--max-examples N] [--batch-size 64] [--threshold A] [--out PREFIX] [--force]

For each (model, seed) the encoder of ``WORK/MODEL/seedN/checkpoints/checkpoint_best.pt``
(this repository's code, at the checkpoint's alpha_thresh unless ``--threshold``) reads
every source line of ``DATA/SPLIT.src`` (the first ``--max-examples``), encoded with the
run's dictionary as fairseq-preprocess did (the end-of-sentence token appended), and for
every example the executed encoder steps are read from the encoder's halting result:

* ``depth``: the example's halting depth. Depth-wise models (UT, GUT): the mean over the
  example's positions (its tokens and </s>) of the steps each executed (GUT: one decision
  per sequence, so every position has the same steps). Chunk-wise models (GUTLB, the
  chunked SUT): the mean over the example's chunks of the block applications on the
  chunk (the most steps one of its tokens executed; GUTLB: one decision per chunk, so
  every token of a chunk has its chunk's steps), i.e. the compute per chunk;
* ``position_depth``: the mean steps over positions, for every model (the chunked SUT's
  tokens halt individually, so this is at most its per-chunk depth);
* the tree depth: the deepest nesting of the bracketed operator lists (``[MAX 1 2 ]`` is
  1), from the source text.

Each run's examples go to ``WORK/MODEL/seedN/depth-SPLIT.json`` (written atomically; a run
whose file holds the same number of examples at the same ``--threshold`` is not run again
unless ``--force``), with the checkpoint, the threshold, the time it
took and, when the whole split was read, a check of its pooled executed steps against
those fairseq-generate counted in the run's ``result.json``. The report, over the seeds:
per split and tree depth the mean over the split's examples of that depth of ``depth``,
per seed, then the mean and sample standard deviation over the seeds; Spearman's rho of
the examples' depth against their tree depth and against their length, and the partial
rho against the tree depth given the length (ListOps' deeper trees are longer). Written
atomically: ``PREFIX.json``, ``PREFIX.md`` (the tables) and ``PREFIX-SPLIT.png`` per split
(x: tree depth, y: mean halting depth, one line per model, error bars: the seeds' sd).
``PREFIX`` defaults to ``WORK/depth-per-tree-depth``. One thread (``--threads``); the
runs are printed as they start, with progress every ``--progress`` examples.
"""
import argparse
import math
import os
import sys
import time
from collections import OrderedDict, defaultdict
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import listops_recipe as recipe  # noqa: E402
from sut_fairseq.data import listops  # noqa: E402
from sut_fairseq.recipes.files import load_json, write_json_atomic, write_text_atomic  # noqa: E402
from sut_fairseq.recipes.summary import line_plot, markdown_table, mean_std, spearman  # noqa: E402

DEFAULT_SPLITS = ("test-iid",)


# --------------------------------------------------------------------------- tree depth

def tree_depth(source: str) -> int:
    """The deepest nesting of operator lists in a ListOps source line (tokens separated by
    spaces, operators ``[MAX``, ``[MIN``, ``[MED``, ``[SM`` opening a list, ``]`` closing
    it): ``[MAX 1 2 ]`` has depth 1, ``[MAX 1 [MIN 2 3 ] ]`` depth 2. A line whose brackets
    do not balance, or with an unknown token, raises ValueError."""
    current = deepest = 0
    tokens = source.split()
    for position, token in enumerate(tokens):
        if token in listops.OPERATORS:
            current += 1
            deepest = max(deepest, current)
        elif token == listops.CLOSE:
            current -= 1
            if current < 0:
                raise ValueError(f"token {position}: ']' closes no list in {source!r}")
        elif token not in listops.DIGITS:
            raise ValueError(f"token {position}: unknown token {token!r} in {source!r}")
    if current != 0 or not tokens:
        raise ValueError(f"{current} list(s) left open in {source!r}" if tokens else "empty line")
    return deepest


# --------------------------------------------------------------------------- the model

def load_checkpoint(path: str, data_bin: str, threshold: Optional[float] = None):
    """``(model, source dictionary)`` of a trained checkpoint: :func:`load_model_and_task`."""
    model, task = load_model_and_task(path, data_bin, threshold)
    return model, task.source_dictionary


def load_model_and_task(path: str, data_bin: str, threshold: Optional[float] = None):
    """``(model in eval mode, fairseq task)`` of a trained checkpoint, with its data
    directory replaced by ``data_bin`` (where its dictionaries are) and its ``--user-dir``
    by this repository's plugin (a run trained from another checkout names that one)."""
    from fairseq import checkpoint_utils

    import sut_fairseq  # noqa: F401  (registration, safe checkpoint loading)
    from sut_fairseq.user_dir import user_dir

    overrides = {"data": data_bin, "user_dir": user_dir()}
    if threshold is not None:
        overrides["halting_threshold"] = threshold
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    model = models[0].eval()
    if threshold is not None:
        model.set_halting_threshold(threshold)
    return model, task


def encode(dictionary, sources: Sequence[str]) -> list:
    """Each line as fairseq-preprocess binarizes it (whitespace tokens, </s> appended);
    a token outside the dictionary raises ValueError (it would be read as <unk>)."""
    encoded = []
    for k, line in enumerate(sources):
        tokens = dictionary.encode_line(line, add_if_not_exist=False, append_eos=True).long()
        if bool((tokens == dictionary.unk()).any()):
            raise ValueError(f"line {k + 1}: a token outside the dictionary in {line!r}")
        encoded.append(tokens)
    return encoded


def batches(lengths: Sequence[int], batch_size: int, max_tokens: int) -> List[List[int]]:
    """Indices sorted by length (longest first) in batches of at most ``batch_size``
    sentences and ``max_tokens`` padded tokens (one sentence at least)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out, current = [], []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # the batch's longest: its first
        if current and (len(current) + 1 > batch_size or (len(current) + 1) * width > max_tokens):
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def example_depths(model, dictionary, sources: Sequence[str], batch_size: int = 64,
                   max_tokens: int = 16384, progress: int = 0, prefix: str = "") -> List[Dict]:
    """One record per source line (in order): ``tree_depth``, ``length`` (source tokens,
    </s> not counted), ``steps`` (executed steps summed over its positions), ``positions``,
    ``position_depth`` (their mean), and for a chunk-wise encoder ``chunk_steps`` (block
    applications summed over its chunks) and ``chunks``; ``depth`` is the per-chunk mean
    for a chunk-wise encoder, else ``position_depth``. Batches are left-padded (as
    fairseq's translation task); every halting decision reads the real tokens only, so
    an example's steps do not depend on its batch."""
    import torch
    from fairseq.data import data_utils

    encoded = encode(dictionary, sources)
    records: List[Optional[Dict]] = [None] * len(sources)
    done, start = 0, time.time()
    with torch.no_grad():
        for batch in batches([len(t) for t in encoded], batch_size, max_tokens):
            tokens = data_utils.collate_tokens([encoded[i] for i in batch], dictionary.pad(),
                                               dictionary.eos(), left_pad=True)
            lengths = torch.tensor([len(encoded[i]) for i in batch])
            halting = model.encoder(tokens, lengths)["halting"][0]
            chunked = getattr(halting, "chunk_real", None) is not None
            for row, i in enumerate(batch):
                steps = halting.steps[row][halting.real[row]]
                record = {"tree_depth": tree_depth(sources[i]), "length": len(encoded[i]) - 1,
                          "steps": int(steps.sum()), "positions": int(steps.numel())}
                record["position_depth"] = record["steps"] / record["positions"]
                if chunked:
                    per_chunk = halting.chunk_steps[row][halting.chunk_real[row]]
                    record["chunk_steps"], record["chunks"] = int(per_chunk.sum()), int(per_chunk.numel())
                    record["depth"] = record["chunk_steps"] / record["chunks"]
                else:
                    record["depth"] = record["position_depth"]
                records[i] = record
            previous, done = done, done + len(batch)
            if progress and (done // progress > previous // progress or done == len(sources)):
                print(f"{prefix}{done} / {len(sources)} examples, {time.time() - start:.1f} s", flush=True)
    return records


# --------------------------------------------------------------------------- aggregation

def per_tree_depth(records: Sequence[Dict], key: str = "depth") -> "OrderedDict[int, Dict]":
    """``{tree depth: {"mean": mean of key over the examples of that depth, "examples": n}}``,
    in increasing tree depth."""
    groups = defaultdict(list)
    for r in records:
        groups[r["tree_depth"]].append(r[key])
    return OrderedDict((d, {"mean": sum(v) / len(v), "examples": len(v)}) for d, v in sorted(groups.items()))


def over_seeds(per_seed: Sequence[Dict[int, Dict]]) -> "OrderedDict[int, Dict]":
    """Per tree depth present in any seed: the mean and sample standard deviation over the
    seeds of the per-seed means (``mean``, ``sd``, ``seeds``: how many had the depth,
    ``per_seed``: their means, ``examples``: the examples of each of them)."""
    depths = sorted({d for table in per_seed for d in table})
    out = OrderedDict()
    for d in depths:
        values = [table[d]["mean"] for table in per_seed if d in table]
        mean, sd, n = mean_std(values)
        out[d] = {"mean": mean, "sd": sd, "seeds": n, "per_seed": values,
                  "examples": [table[d]["examples"] for table in per_seed if d in table]}
    return out


def partial_rho(rho_xy: Optional[float], rho_xz: Optional[float],
                rho_yz: Optional[float]) -> Optional[float]:
    """The partial correlation of x and y given z from the three pairwise correlations
    (None when one is undefined or z explains x or y entirely)."""
    if None in (rho_xy, rho_xz, rho_yz):
        return None
    denominator = (1 - rho_xz ** 2) * (1 - rho_yz ** 2)
    return (rho_xy - rho_xz * rho_yz) / math.sqrt(denominator) if denominator > 0 else None


def correlations(records: Sequence[Dict], key: str = "depth") -> Dict[str, Optional[float]]:
    """Spearman's rho of the examples' ``key`` against their tree depth and their length,
    and the partial rho against the tree depth given the length."""
    depth = [r[key] for r in records]
    tree, length = [r["tree_depth"] for r in records], [r["length"] for r in records]
    tree_rho, length_rho = spearman(tree, depth), spearman(length, depth)
    return {"tree_depth": tree_rho, "length": length_rho,
            "tree_depth_given_length": partial_rho(tree_rho, length_rho, spearman(tree, length))}


# --------------------------------------------------------------------------- runs

def run_file(work_dir: str, model: str, seed: int, split: str) -> str:
    return os.path.join(work_dir, model, f"seed{seed}", f"depth-{split}.json")


def pooled_check(records: Sequence[Dict], max_steps: int, result_path: str, split: str) -> Optional[Dict]:
    """The pooled executed encoder steps of ``records`` against those fairseq-generate
    counted (``result.json``'s ``encoder_steps_executed`` of the split), or None without them."""
    if not os.path.exists(result_path):
        return None
    counted = load_json(result_path).get("splits", {}).get(split, {}).get("encoder_steps_executed")
    if not counted:
        return None
    here = [sum(r["steps"] for r in records), max_steps * sum(r["positions"] for r in records)]
    return {"here": here, "generate": counted, "equal": here == list(counted)}


def analyse_run(args, model: str, seed: int, split: str) -> Dict:
    """One (model, seed, split): its records and what they came from; cached in the run."""
    path = run_file(args.work_dir, model, seed, split)
    title = f"== {recipe.GRID.label(model)} | seed {seed} | {split}"
    run_dir = os.path.dirname(path)
    checkpoint = os.path.join(run_dir, "checkpoints", "checkpoint_best.pt")
    source = os.path.join(args.data_dir, f"{split}.src")
    for needed in (checkpoint, source):
        if not os.path.exists(needed):
            raise SystemExit(f"error: {needed} not found")
    with open(source, encoding="utf-8") as handle:
        sources = [line.rstrip("\n") for line in handle]
    if not sources:
        raise SystemExit(f"error: {source} is empty")
    whole = args.max_examples is None or args.max_examples >= len(sources)
    sources = sources if whole else sources[:args.max_examples]
    if os.path.exists(path) and not args.force:
        cached = load_json(path)
        if cached.get("examples") == len(sources) and cached.get("threshold_option") == args.threshold:
            print(f"{title}: done before, {path} (--force to redo)", flush=True)
            return cached
        print(f"{title}: {path} holds {cached.get('examples')} examples at --threshold "
              f"{cached.get('threshold_option')}: redone", flush=True)
    print(f"{title}: {checkpoint} on {len(sources)} examples of {source}", flush=True)
    start = time.time()
    net, dictionary = load_checkpoint(checkpoint, os.path.join(args.data_dir, "bin"), args.threshold)
    records = example_depths(net, dictionary, sources, args.batch_size, args.max_tokens,
                             args.progress, prefix="   ")
    max_steps = net.encoder.side.num_steps
    result = {"model": model, "label": recipe.GRID.label(model), "seed": seed, "split": split,
              "checkpoint": os.path.abspath(checkpoint), "source": os.path.abspath(source),
              "examples": len(records), "whole_split": whole, "max_steps": max_steps,
              "chunk_size": getattr(getattr(net.encoder, "side", None), "chunk_size", 0) or None,
              "threshold": getattr(net.encoder.side.halting, "threshold", None),
              "threshold_option": args.threshold,
              "depth_unit": "chunk" if "chunks" in records[0] else "position",
              "check": (pooled_check(records, max_steps, os.path.join(run_dir, "result.json"), split)
                        if whole else None),
              "seconds": round(time.time() - start, 1), "records": records}
    check = result["check"]
    print(f"   {time.time() - start:.1f} s; mean depth {sum(r['depth'] for r in records) / len(records):.3f} "
          f"per {result['depth_unit']} of {max_steps}"
          + ("" if check is None else f"; pooled steps {check['here'][0]} / {check['here'][1]}, "
             f"fairseq-generate's {check['generate'][0]} / {check['generate'][1]}: "
             + ("equal" if check["equal"] else "DIFFERENT")), flush=True)
    write_json_atomic(path, result)
    return result


# --------------------------------------------------------------------------- report

def summarize(runs: Dict[str, Dict[str, List[Dict]]]) -> Dict:
    """``runs[split][model]``: the runs (one per seed) -> the report's numbers."""
    report = OrderedDict()
    for split, models in runs.items():
        report[split] = OrderedDict()
        for model, seeds in models.items():
            first = seeds[0]
            entry = {"label": first["label"], "seeds": [r["seed"] for r in seeds],
                     "max_steps": first["max_steps"], "depth_unit": first["depth_unit"],
                     "examples": [r["examples"] for r in seeds],
                     "checks_equal": [None if r["check"] is None else r["check"]["equal"] for r in seeds],
                     "depth": over_seeds([per_tree_depth(r["records"]) for r in seeds]),
                     "mean_depth": mean_std([sum(x["depth"] for x in r["records"]) / len(r["records"])
                                             for r in seeds]),
                     "mean_position_depth": mean_std([sum(x["position_depth"] for x in r["records"])
                                                      / len(r["records"]) for r in seeds])}
            rho = [correlations(r["records"]) for r in seeds]
            entry["spearman"] = {k: mean_std([c[k] for c in rho if c[k] is not None]) for k in rho[0]}
            if first["depth_unit"] == "chunk":
                entry["position_depth"] = over_seeds([per_tree_depth(r["records"], "position_depth")
                                                      for r in seeds])
            report[split][model] = entry
    return report


def _cell(value: Optional[Dict], seeds: int) -> str:
    """An ``over_seeds`` cell: ``mean ± sd``, ``(n=K)`` when only K of the ``seeds`` had
    examples of that depth."""
    if value is None:
        return "–"
    return (f"{value['mean']:.2f}" + (f" ± {value['sd']:.2f}" if value["seeds"] > 1 else "")
            + ("" if value["seeds"] == seeds else f" (n={value['seeds']})"))


def _mean_std_cell(value, seeds: int) -> str:
    """``mean ± sd`` of a ``mean_std`` triple, ``(n=K)`` when only K of the ``seeds`` had a
    value (a correlation is undefined for a seed whose depths are all equal)."""
    if value is None:
        return "–"
    return (f"{value[0]:.2f}" + (f" ± {value[1]:.2f}" if value[2] > 1 else "")
            + ("" if value[2] == seeds else f" (n={value[2]})"))


def markdown(report: Dict) -> str:
    """Per split: rows = tree depths (with the examples of each), one column per model
    (per chunk for the chunk-wise models, then their per-position depth), and the
    correlations."""
    parts = []
    for split, models in report.items():
        columns = [(m, "depth", f"{e['label']}, L {e['max_steps']}"
                    + (", per chunk" if e["depth_unit"] == "chunk" else "")) for m, e in models.items()]
        columns += [(m, "position_depth", f"{e['label']}, per position")
                    for m, e in models.items() if "position_depth" in e]
        depths = sorted({d for e in models.values() for d in e["depth"]})
        rows = []
        for d in depths:
            examples = {n for e in models.values() if d in e["depth"] for n in e["depth"][d]["examples"]}
            rows.append([str(d), "/".join(str(n) for n in sorted(examples))]
                        + [_cell(models[m][key].get(d), len(models[m]["seeds"])) for m, key, _ in columns])
        sizes = sorted({n for e in models.values() for n in e["examples"]})
        rows.append(["all", "/".join(map(str, sizes))]
                    + [_mean_std_cell(models[m][f"mean_{key}"], len(models[m]["seeds"])) for m, key, _ in columns])
        table = markdown_table(["tree depth", "examples"] + [c for _, _, c in columns], rows)
        rho = markdown_table(
            ["model", "ρ(depth, tree depth)", "ρ(depth, length)", "partial ρ(depth, tree depth), given the length"],
            [[e["label"]] + [_mean_std_cell(e["spearman"][k], len(e["seeds"]))
                             for k in ("tree_depth", "length", "tree_depth_given_length")]
             for e in models.values()])
        seeds = sorted({s for e in models.values() for s in e["seeds"]})
        parts.append(f"### {split}\n\nMean executed encoder steps per tree depth, mean ± sd over seeds "
                     f"{', '.join(map(str, seeds))} (of each seed's mean over the examples of that depth):\n\n"
                     f"{table}\n\nSpearman's ρ over the examples (mean ± sd over the seeds):\n\n{rho}\n")
    return "\n".join(parts)


def plot(path: str, split: str, models: Dict) -> None:
    """One line per model over the tree depths (integer ticks), error bars: the seeds' sd."""
    series, errors, depths = OrderedDict(), {}, set()
    for e in models.values():
        label = f"{e['label']}, L {e['max_steps']}" + (", per chunk" if e["depth_unit"] == "chunk" else "")
        points = list(e["depth"].items())
        depths.update(d for d, _ in points)
        series[label] = ([d for d, _ in points], [v["mean"] for _, v in points])
        if any(v["seeds"] > 1 for _, v in points):
            errors[label] = [v["sd"] for _, v in points]
    low, high = min(depths), max(depths)
    ticks = list(range(low, high + 1, 1 if high - low < 12 else 2))
    line_plot(path, series, "tree depth (nesting of operator lists)", "mean executed encoder steps",
              f"ListOps {split}: halting depth", xticks=ticks, errors=errors)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    halting = [m for m in recipe.MODELS if recipe.GRID.has_halting(m)]
    parser.add_argument("--data-dir", default=os.path.join("data", "listops"),
                        help="the generator's --out: SPLIT.src and bin/ (its dictionaries)")
    parser.add_argument("--work-dir", default=os.path.join("runs", "listops"),
                        help="table1.py's --work-dir: MODEL/seedN/checkpoints/checkpoint_best.pt")
    parser.add_argument("--models", nargs="+", default=halting, choices=recipe.MODELS,
                        help=f"default: the models with halting ({' '.join(halting)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--splits", nargs="+", default=list(DEFAULT_SPLITS), metavar="SPLIT",
                        help="test splits (DATA/SPLIT.src; default: test-iid)")
    parser.add_argument("--max-examples", type=int, default=None,
                        help="only the first N examples of each split (default: all)")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    parser.add_argument("--max-tokens", type=int, default=16384, help="padded tokens per batch")
    parser.add_argument("--threshold", type=float, default=None,
                        help="alpha_thresh (default: each checkpoint's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--progress", type=int, default=500, help="print progress every N examples (0: never)")
    parser.add_argument("--out", default=None,
                        help="PREFIX of PREFIX.json, PREFIX.md, PREFIX-SPLIT.png "
                             "(default: WORK/depth-per-tree-depth)")
    parser.add_argument("--force", action="store_true", help="redo runs that have a depth-SPLIT.json")
    args = parser.parse_args(argv)
    if args.max_examples is not None and args.max_examples < 1:
        parser.error("--max-examples must be at least 1")
    import torch

    torch.set_num_threads(args.threads)
    out = args.out or os.path.join(args.work_dir, "depth-per-tree-depth")
    start = time.time()
    runs = OrderedDict((split, OrderedDict((m, [analyse_run(args, m, s, split) for s in args.seeds])
                                           for m in args.models)) for split in args.splits)
    report = summarize(runs)
    text = markdown(report)
    seconds = round(time.time() - start, 1)
    runs_seconds = round(sum(r["seconds"] for models in runs.values() for seeds in models.values()
                             for r in seeds), 1)
    write_json_atomic(out + ".json", {
        "data_dir": os.path.abspath(args.data_dir), "work_dir": os.path.abspath(args.work_dir),
        "models": args.models, "seeds": args.seeds, "splits": args.splits,
        "max_examples": args.max_examples, "threshold": args.threshold,
        "command": [os.path.relpath(os.path.abspath(__file__), recipe.REPO),
                    *(sys.argv[1:] if argv is None else [str(a) for a in argv])],
        "seconds": seconds,
        "runs_seconds": runs_seconds,
        "runs": {split: {m: [{k: v for k, v in r.items() if k != "records"} for r in seeds]
                         for m, seeds in models.items()} for split, models in runs.items()},
        "report": report})
    write_text_atomic(out + ".md", text)
    for split, models in report.items():
        plot(f"{out}-{split}.png", split, models)
    print("\n" + text)
    print(f"written {out}.json, {out}.md, " + ", ".join(f"{out}-{s}.png" for s in report)
          + f" ({seconds:.1f} s; the runs took {runs_seconds:.1f} s when they ran)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
