"""Post-training halting-threshold sweep (paper §4.4, Figs 5–7): the skipped computation
and the task metric at each α_thresh, the efficiency/performance trade-off curve and the
halting heat map of one example.

    python -m sut_fairseq.analysis.sweep --path CKPT --data DATA_BIN --gen-subset test \\
        --metric {exact_match,accuracy,bleu} [--thresholds 0.1,0.2,...,0.9,0.99,0.999] \\
        [--example-id ID] [--output-dir sweep] [--beam 1] [--generate-args "--remove-bpe"]

Per threshold T:

* skipped computation, from the teacher-forced analysis (``halting_analysis.analyse``:
  the reference source-target pairs through the model, as the paper estimates it):
  ``skipped = 1 − executed (position, step) block applications / (L × real positions)``,
  per side and for both sides together;
* the metric, from decoding with the stock ``fairseq-generate ... --model-overrides
  "{'halting_threshold': T}" --required-batch-size-multiple 1`` (its closing line gives the
  fraction of steps executed while decoding, also recorded);
* optionally (``--macs-sentences N``) the mean executed MACs per sentence pair of the first
  N pairs (``sut_fairseq.analysis.macs``).

Early exits (``--patience 0,1,2,3,5 --entropy 0.01,0.1,0.5 [--exit-path CKPT]``): the
checkpoint with off-ramps (``--exit-path``, default ``--path``) is also decoded at each
PABEE patience P and entropy threshold S; ``exits.csv`` holds those rows and ``exits.png``
the three trade-off curves (α_thresh, P, S: metric against decoder steps executed while
decoding). See ``sut_fairseq.analysis.exit_sweep``.

Writes, atomically, into ``--output-dir``: ``sweep.csv``, ``sweep.json`` (the rows and
the heat-map matrices), ``tradeoff.png``, ``halting_heatmap.png`` and the
``fairseq-generate`` outputs ``generate-T.txt``.

Metrics (on fairseq-generate's H-/T- lines, best hypothesis): ``exact_match`` — % of
examples whose hypothesis equals the reference token for token; ``accuracy`` — % of
token positions right: Σ matches at the same position / Σ max(|hyp|, |ref|) (for one-token
targets such as logical inference's relation label it equals exact match); ``bleu`` —
``sut_fairseq.eval.bleu.tokenized_bleu`` (corpus BLEU on the tokens as printed, hyphenated
compounds split; pass ``--generate-args "--remove-bpe"`` for BPE data); ``sacrebleu`` —
SacreBLEU (13a) of detokenised text (SentencePiece data: ``--generate-args
"--post-process sentencepiece"``, which turns both the H- and the T- lines into text).
``decode_seconds``: fairseq-generate's wall time at that threshold.
"""
import argparse
import csv
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

DEFAULT_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 0.999)
METRICS = ("exact_match", "accuracy", "bleu", "sacrebleu")
METRIC_LABELS = {"exact_match": "exact match (%)", "accuracy": "token accuracy (%)", "bleu": "BLEU",
                 "sacrebleu": "SacreBLEU"}
CSV_COLUMNS = ("threshold", "skipped", "skipped_encoder", "skipped_decoder", "mean_steps_encoder",
               "mean_steps_decoder", "metric", "metric_name", "sentences",
               "decode_executed_encoder", "decode_executed_decoder", "decode_seconds",
               "macs_executed", "macs_static")


def parse_thresholds(text: str) -> List[float]:
    from ..modules.halting import check_threshold

    values = []
    for part in text.split(","):
        part = part.strip()
        if part:
            value = float(part)
            check_threshold(value)
            values.append(value)
    if not values:
        raise ValueError("no thresholds given")
    return sorted(set(values))


# ---- metrics --------------------------------------------------------------------------

def score(examples, metric: str) -> float:
    """The metric (in %, or BLEU) of fairseq-generate examples (see the module doc)."""
    if not examples:
        raise ValueError("no examples to score")
    if metric == "exact_match":
        from ..eval.generate_output import exact_match

        return 100.0 * exact_match(examples)
    if metric == "accuracy":
        right = total = 0
        for e in examples:
            hyp, ref = e.hypothesis.split(), e.reference.split()
            right += sum(h == r for h, r in zip(hyp, ref))
            total += max(len(hyp), len(ref), 1)
        return 100.0 * right / total
    if metric == "bleu":
        from ..eval.bleu import tokenized_bleu

        return tokenized_bleu([e.hypothesis for e in examples], [e.reference for e in examples]).score
    if metric == "sacrebleu":
        from ..eval.bleu import sacrebleu_score

        return sacrebleu_score([e.hypothesis for e in examples], [e.reference for e in examples]).score
    raise ValueError(f"unknown metric {metric!r}; choose from {METRICS}")


# ---- loading and decoding -------------------------------------------------------------

def load_checkpoint(data: str, path: str, subset: str):
    """(model, task, task name) with the data directory overridden; ``subset`` loaded."""
    from fairseq import checkpoint_utils

    import sut_fairseq  # noqa: F401  (registration, safe checkpoint loading)

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data})
    task.load_dataset(subset)
    name = getattr(cfg.task, "_name", None) or "translation"
    return models[0], task, name


def generate_command(data: str, path: str, task_name: str, source_lang: Optional[str],
                     target_lang: Optional[str], subset: str, threshold: float, beam: int,
                     batch_size: int, extra: Sequence[str] = ()) -> List[str]:
    from ..recipes.commands import tool as fairseq_tool
    from ..user_dir import user_dir

    command = [fairseq_tool("fairseq-generate"), data, "--user-dir", user_dir(), "--task", task_name]
    if source_lang and target_lang:
        command += ["--source-lang", source_lang, "--target-lang", target_lang]
    command += ["--path", path, "--gen-subset", subset, "--beam", str(beam),
                "--batch-size", str(batch_size), "--required-batch-size-multiple", "1",
                "--num-workers", "0", "--model-overrides", f"{{'halting_threshold': {threshold!r}}}",
                *extra]
    return command


_EXECUTED = re.compile(r"(encoder|decoder) steps executed ([\d.]+)%")


def run_generate(command: List[str], out_path: str) -> Dict[str, float]:
    """Run fairseq-generate, keep its stdout in ``out_path`` (atomically); returns the
    executed-step fractions of its closing summary line (side -> fraction)."""
    from ..data.atomic import atomic_path

    print("+ " + " ".join(shlex.quote(c) for c in command), flush=True)
    with atomic_path(out_path) as tmp:
        with open(tmp, "w") as out:
            proc = subprocess.run(command, stdout=out, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"fairseq-generate failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    executed = {}
    with open(out_path, encoding="utf-8") as handle:
        for line in handle:
            for side, value in _EXECUTED.findall(line):
                executed[side] = float(value) / 100.0
    return executed


# ---- the sweep ------------------------------------------------------------------------

def _skipped(analysis: Dict, model) -> Dict[str, float]:
    enc, dec = analysis["encoder"], analysis["decoder"]
    L_e, L_d = model.encoder.side.num_steps, model.decoder.side.num_steps
    max_e, max_d = enc["positions"] * L_e, dec["positions"] * L_d
    executed = enc["executed_fraction"] * max_e + dec["executed_fraction"] * max_d
    return {"skipped": 1.0 - executed / max(1, max_e + max_d),
            "skipped_encoder": 1.0 - enc["executed_fraction"],
            "skipped_decoder": 1.0 - dec["executed_fraction"],
            "mean_steps_encoder": enc["mean_steps"], "mean_steps_decoder": dec["mean_steps"]}


def heatmap_panels(sentence: Dict) -> List[Dict]:
    """Encoder and decoder panels of one analysed sentence: tokens (with the closing
    ``</s>``; a decoder position is labelled with the target token it predicts), the
    halting weights (positions × L) and the executed steps per position."""
    src = sentence["source"].split() + ["</s>"]
    tgt = sentence["target"].split() + ["</s>"]
    panels = []
    for name, tokens in (("encoder", src), ("decoder", tgt)):
        weights = sentence[f"{name}_weights"]
        if len(tokens) != len(weights):  # e.g. BPE / special symbols: fall back to indices
            tokens = [str(i) for i in range(len(weights))]
        panels.append({"name": name, "tokens": tokens, "weights": weights,
                       "steps": sentence[f"{name}_steps"]})
    return panels


def write_csv_atomic(path: str, rows: List[Dict], columns: Sequence[str] = CSV_COLUMNS) -> None:
    from ..data.atomic import atomic_path

    with atomic_path(path) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: ("" if row.get(c) is None else row.get(c)) for c in columns})


def sweep(path: str, data: str, subset: str = "test", metric: str = "exact_match",
          thresholds: Sequence[float] = DEFAULT_THRESHOLDS, output_dir: str = "sweep",
          example_id: Optional[int] = None, heatmap_threshold: Optional[float] = None,
          max_sentences: Optional[int] = None, beam: int = 1, batch_size: int = 128,
          generate_args: Sequence[str] = (), macs_sentences: int = 0,
          patience: Sequence[int] = (), entropy: Sequence[float] = (),
          exit_path: Optional[str] = None) -> Dict:
    """Run the sweep and write its files; returns ``{"rows": [...], "heatmap": {...}}``
    (and ``"exit_rows"`` when ``patience`` or ``entropy`` values are given)."""
    from ..eval.generate_output import read_generate_output
    from .halting_analysis import analyse
    from ..data.atomic import write_json_atomic
    from .plots import halting_heatmap, tradeoff_curve

    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {METRICS}")
    os.makedirs(output_dir, exist_ok=True)
    model, task, task_name = load_checkpoint(data, path, subset)
    if not hasattr(model.encoder, "side"):
        raise SystemExit("error: the sweep needs a sut_transformer checkpoint (halting threshold)")
    own_threshold = getattr(model.encoder.side.halting, "threshold", None) or 1.0
    heatmap_threshold = own_threshold if heatmap_threshold is None else heatmap_threshold
    src_lang, tgt_lang = getattr(task.cfg, "source_lang", None), getattr(task.cfg, "target_lang", None)
    exit_path = exit_path or path
    if patience or entropy:  # fails now, not after the α_thresh sweep
        from .exit_sweep import require_offramps

        require_offramps(model if exit_path == path else load_checkpoint(data, exit_path, subset)[0],
                         exit_path)

    static_macs = None
    if macs_sentences:
        from .macs import count_dataset

        static_macs = count_dataset(model, task, subset, max_sentences=macs_sentences)

    rows, heat_sentence = [], None
    for threshold in thresholds:
        start = time.time()
        analysis = analyse(model, task, subset, threshold, max_sentences)
        if not rows:  # the analysed sentences are the same at every threshold: check once
            if example_id is None:  # default: the first sentence analysed
                example_id = analysis["sentences"][0]["id"]
            _find(analysis, example_id)  # fails now, not after the whole sweep
        row = {"threshold": threshold, "metric_name": metric, **_skipped(analysis, model)}
        if abs(threshold - heatmap_threshold) < 1e-12:
            heat_sentence = _find(analysis, example_id)
        out = os.path.join(output_dir, f"generate-{threshold:g}.txt")
        decode_start = time.time()
        executed = run_generate(generate_command(data, path, task_name, src_lang, tgt_lang, subset,
                                                 threshold, beam, batch_size, generate_args), out)
        examples = read_generate_output(out)
        row.update(metric=score(examples, metric), sentences=len(examples),
                   decode_seconds=round(time.time() - decode_start, 2),
                   decode_executed_encoder=executed.get("encoder"),
                   decode_executed_decoder=executed.get("decoder"))
        if static_macs is not None:
            from .macs import count_dataset

            dyn = count_dataset(model, task, subset, threshold, macs_sentences, static=False)
            row["macs_executed"] = dyn["dynamic"].total / max(1, dyn["sentences"])
            row["macs_static"] = static_macs["static"].total / max(1, static_macs["sentences"])
        rows.append(row)
        print(f"α_thresh {threshold:g}: skipped {100 * row['skipped']:.1f}% "
              f"(enc {100 * row['skipped_encoder']:.1f}%, dec {100 * row['skipped_decoder']:.1f}%), "
              f"{metric} {row['metric']:.2f} ({time.time() - start:.0f} s)", flush=True)
    if heat_sentence is None:
        heat_sentence = _find(analyse(model, task, subset, heatmap_threshold, max_sentences), example_id)

    panels = heatmap_panels(heat_sentence)

    name = _short_path(path)
    mats = halting_heatmap(panels, os.path.join(output_dir, "halting_heatmap.png"),
                           title=f"{name}, {subset} example {example_id}, α_thresh {heatmap_threshold:g}")
    tradeoff_curve(rows, METRIC_LABELS[metric], os.path.join(output_dir, "tradeoff.png"),
                   title=f"{name} on {subset}: {metric} and skipped block applications")
    write_csv_atomic(os.path.join(output_dir, "sweep.csv"), rows)
    heatmap = {"example_id": example_id, "threshold": heatmap_threshold,
               "source": heat_sentence["source"], "target": heat_sentence["target"],
               **{p["name"]: {"tokens": p["tokens"], "steps": p["steps"], "remaining_stick": m.tolist()}
                  for p, m in zip(panels, mats)}}
    result = {"checkpoint": path, "data": data, "subset": subset, "metric": metric, "rows": rows,
              "heatmap": heatmap}
    if patience or entropy:
        from .exit_sweep import EXIT_COLUMNS, exits_figure, sweep_exits

        base = generate_command(data, exit_path, task_name, src_lang, tgt_lang, subset, own_threshold,
                                beam, batch_size, generate_args)
        exit_rows = sweep_exits(base, patience, entropy, metric, output_dir, run_generate, score,
                                read_generate_output)
        write_csv_atomic(os.path.join(output_dir, "exits.csv"), exit_rows, EXIT_COLUMNS)
        exits_figure(rows, exit_rows, METRIC_LABELS[metric], os.path.join(output_dir, "exits.png"),
                     title=f"{subset}: α_thresh of {_short_path(path, 3)}; P, S of {_short_path(exit_path, 3)}")
        result.update(exit_checkpoint=exit_path, exit_rows=exit_rows)
    write_json_atomic(os.path.join(output_dir, "sweep.json"), result)
    return result


def _short_path(path: str, parts: int = 5) -> str:
    """The checkpoint as a figure title names it: its last ``parts`` path components
    (``checkpoints/checkpoint_best.pt`` alone does not say which run it is)."""
    return "/".join(os.path.abspath(path).split(os.sep)[-parts:])


def _find(analysis: Dict, example_id: int) -> Dict:
    for sentence in analysis["sentences"]:
        if sentence["id"] == example_id:
            return sentence
    ids = [s["id"] for s in analysis["sentences"]]
    raise SystemExit(f"error: example id {example_id} not analysed ({len(ids)} sentences, ids "
                     f"{min(ids) if ids else '-'}..{max(ids) if ids else '-'}; see --max-sentences)")


def format_table(rows: List[Dict], metric: str) -> str:
    lines = [f"| α_thresh | skipped (both) | skipped enc | skipped dec | {metric} | "
             "executed while decoding enc / dec |", "|---|---|---|---|---|---|"]
    for r in rows:
        dec = " / ".join("–" if r.get(k) is None else f"{100 * r[k]:.1f}%"
                         for k in ("decode_executed_encoder", "decode_executed_decoder"))
        lines.append(f"| {r['threshold']:g} | {100 * r['skipped']:.1f}% | {100 * r['skipped_encoder']:.1f}% | "
                     f"{100 * r['skipped_decoder']:.1f}% | {r['metric']:.2f} | {dec} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--data", required=True, help="fairseq data-bin directory")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--metric", choices=METRICS, default="exact_match")
    parser.add_argument("--thresholds", default=",".join(f"{t:g}" for t in DEFAULT_THRESHOLDS),
                        help="comma-separated α_thresh values in (0, 1]")
    parser.add_argument("--example-id", type=int, default=None,
                        help="example for the heat map (default: the first one analysed; with "
                             "--max-sentences it must be among those)")
    parser.add_argument("--heatmap-threshold", type=float, default=None,
                        help="α_thresh of the heat map (default: the checkpoint's)")
    parser.add_argument("--output-dir", default="sweep")
    parser.add_argument("--max-sentences", type=int, default=None,
                        help="teacher-forced analysis on the first N pairs only (decoding uses all)")
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--generate-args", default="",
                        help="extra fairseq-generate options, e.g. \"--remove-bpe --lenpen 0.6\"")
    parser.add_argument("--macs-sentences", type=int, default=0,
                        help="also count mean executed MACs on the first N pairs (0: off)")
    parser.add_argument("--patience", default="",
                        help="early exits: also decode at these PABEE patiences P (comma-separated "
                             "integers >= 0; 0 = never exit), e.g. 0,1,2,3,5")
    parser.add_argument("--entropy", default="",
                        help="early exits: also decode at these entropy thresholds S in nats "
                             "(comma-separated, >= 0; 0 = never exit), e.g. 0.01,0.1,0.5")
    parser.add_argument("--exit-path", default=None,
                        help="checkpoint with off-ramps for --patience / --entropy (default: --path)")
    args = parser.parse_args(argv)
    from .exit_sweep import format_exit_table, parse_entropy, parse_patience

    try:
        patience, entropy = parse_patience(args.patience), parse_entropy(args.entropy)
    except ValueError as error:
        parser.error(str(error))
    result = sweep(args.path, args.data, args.gen_subset, args.metric, parse_thresholds(args.thresholds),
                   args.output_dir, args.example_id, args.heatmap_threshold, args.max_sentences,
                   args.beam, args.batch_size, shlex.split(args.generate_args), args.macs_sentences,
                   patience, entropy, args.exit_path)
    print(format_table(result["rows"], args.metric))
    if "exit_rows" in result:
        print(format_exit_table(result["exit_rows"], args.metric))
        print(f"wrote {os.path.join(args.output_dir, 'exits.csv')}, {os.path.join(args.output_dir, 'exits.png')}")
    print(f"wrote {', '.join(os.path.join(args.output_dir, f) for f in ('sweep.csv', 'sweep.json', 'tradeoff.png', 'halting_heatmap.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
