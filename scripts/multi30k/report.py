#!/usr/bin/env python3
"""Report of the Multi30k recipe (``table.py``, stage 4).

    python scripts/multi30k/report.py WORK [--max-loss 0.3]

Reads every ``WORK/MODEL/seedN/result.json`` and ``train.json`` and the analyses in
``WORK/analysis/``; writes, atomically, ``WORK/table.md`` (printed too), ``WORK/table.json``
and ``WORK/learning_curves.png`` (validation NLL against updates, one line per run):

* the table: one row per model, each test set's SacreBLEU (detokenised, cased, 13a) and
  lowercased Moses-tokenised BLEU as mean +- sd over the seeds that finished, with the
  seeds, updates, parameters, training core-hours per run (wall clock × threads), peak
  memory and the decoding speed (sentences/s, beam 5, one thread) on test 2016; the
  published range below it;
* the trade-off of each analysed halting model: per alpha_thresh the share of (position,
  step) block applications skipped (teacher-forced on test 2016), SacreBLEU and the
  decoding speed; the knee: the threshold that skips most while losing at most
  ``--max-loss`` (0.3) BLEU against the largest threshold;
* decoding: SUT / transformer sentences/s at the largest threshold (the evaluate stage's
  timing) and at the knee (that, times the sweep's own speed ratio knee / largest
  threshold: the sweep's decodings ran in one process under the same conditions).
"""
import argparse
import glob
import os
import re
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from sut_fairseq.recipes import load_json, write_json_atomic, write_text_atomic  # noqa: E402
from sut_fairseq.recipes.summary import line_plot, markdown_table, mean_std  # noqa: E402

MODELS = ("transformer", "sut", "ut")
LABELS = {"transformer": "Transformer (transformer_multi30k)", "sut": "SUT (sut_multi30k)",
          "ut": "UT (ut_multi30k)"}
PUBLISHED = ("published text-only transformers on test 2016 (lowercased, tokenised BLEU; "
             "the multimodal-translation literature's baselines): about 38-41")
_VALID = re.compile(r"valid on 'valid' subset \|.*?\| nll_loss ([\d.]+) .*?\| num_updates (\d+)")


def collect(work: str) -> Dict[str, List[dict]]:
    """``{model: [result.json of each finished seed, in seed order]}``."""
    found = {}
    for model in MODELS:
        paths = sorted(glob.glob(os.path.join(work, model, "seed*", "result.json")),
                       key=lambda p: int(re.search(r"seed(\d+)", p).group(1)))
        if paths:
            found[model] = [load_json(p) for p in paths]
    return found


def fmt(stats, digits: int = 2) -> str:
    if stats is None:
        return "–"
    mean, sd, n = stats
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if n > 1 else f"{mean:.{digits}f}"


def test_names(results: Dict[str, List[dict]]) -> List[str]:
    names: List[str] = []
    for runs in results.values():
        for run in runs:
            for name in run["tests"]:
                if name not in names:
                    names.append(name)
    return names


def model_rows(results: Dict[str, List[dict]], tests: List[str]):
    header = ["model", "seeds", "updates", "params"]
    for name in tests:
        header += [f"{name} SacreBLEU", f"{name} tok. lc BLEU"]
    header += ["train core-h / run", "peak RSS GB (train / decode)", f"{tests[0]} sentences/s",
               "steps executed enc / dec"]
    rows, numbers = [], {}
    for model, runs in results.items():
        first = tests[0]
        cells = {name: {key: mean_std([r["tests"][name][key] for r in runs if name in r["tests"]])
                        for key in ("sacrebleu", "tok_lc_bleu")} for name in tests}
        # hours of one core: fairseq's wall clock times the run's torch threads
        hours = mean_std([r["train"]["train_wall_seconds"] * r["train"].get("threads", 1) / 3600
                          for r in runs if r["train"].get("train_wall_seconds")])
        peak = max((r["train"].get("peak_rss_gb") or 0 for r in runs), default=0) or None
        decode_peak = max((r["tests"][first].get("decode_peak_rss_gb") or 0 for r in runs
                           if first in r["tests"]), default=0) or None
        speed = mean_std([r["tests"][first]["sentences_per_second"] for r in runs if first in r["tests"]])
        steps = [r["tests"][first].get("steps_executed", {}) for r in runs if first in r["tests"]]
        executed = " / ".join(
            f"{100 * mean_std([s[side] for s in steps])[0]:.1f} %" for side in ("encoder", "decoder")
            if steps and all(side in s for s in steps)) or "–"
        row = [LABELS[model], ", ".join(str(r["seed"]) for r in runs),
               ", ".join(sorted({str(r["updates"]) for r in runs})), f"{runs[0]['params'] / 1e6:.2f} M"]
        for name in tests:
            row += [fmt(cells[name]["sacrebleu"]), fmt(cells[name]["tok_lc_bleu"])]
        row += [fmt(hours), " / ".join(f"{p:.2f}" if p else "–" for p in (peak, decode_peak)),
                fmt(speed, 1), executed]
        rows.append(row)
        numbers[model] = {"seeds": [r["seed"] for r in runs], "tests": cells, "train_core_hours": hours,
                          "peak_rss_gb": peak, "decode_peak_rss_gb": decode_peak,
                          "sentences_per_second": speed, "params": runs[0]["params"],
                          "updates": [r["updates"] for r in runs]}
    return header, rows, numbers


def knee(rows: List[dict], max_loss: float) -> Optional[dict]:
    """The row that skips the largest share of block applications with a metric at most
    ``max_loss`` below the largest threshold's row (None without rows)."""
    if not rows:
        return None
    reference = max(rows, key=lambda r: float(r["threshold"]))
    good = [r for r in rows if float(r["metric"]) >= float(reference["metric"]) - max_loss]
    return max(good, key=lambda r: (float(r["skipped"]), float(r["threshold"])))


def tradeoffs(work: str, max_loss: float) -> Dict[str, dict]:
    found = {}
    for path in sorted(glob.glob(os.path.join(work, "analysis", "*", "sweep", "sweep.json"))):
        name = os.path.basename(os.path.dirname(os.path.dirname(path)))
        sweep = load_json(path)
        rows = sorted(sweep["rows"], key=lambda r: float(r["threshold"]))
        best = knee(rows, max_loss)
        found[name] = {"rows": rows, "knee": best, "reference": rows[-1] if rows else None,
                       "png": os.path.relpath(os.path.join(os.path.dirname(path), "tradeoff.png"), work)}
    return found


def tradeoff_text(name: str, t: dict, max_loss: float) -> str:
    header = ["α_thresh", "skipped (both sides)", "skipped enc", "skipped dec", "SacreBLEU",
              "decoding s", "sentences/s"]
    rows = []
    for r in t["rows"]:
        seconds = float(r["decode_seconds"]) if r.get("decode_seconds") not in (None, "") else None
        rows.append([f"{float(r['threshold']):g}", f"{100 * float(r['skipped']):.1f} %",
                     f"{100 * float(r['skipped_encoder']):.1f} %", f"{100 * float(r['skipped_decoder']):.1f} %",
                     f"{float(r['metric']):.2f}", f"{seconds:.1f}" if seconds else "–",
                     f"{int(r['sentences']) / seconds:.1f}" if seconds else "–"])
    k, ref = t["knee"], t["reference"]
    loss = float(ref["metric"]) - float(k["metric"])
    return (f"### Halting trade-off: {name} (test 2016, beam 5)\n\n"
            + markdown_table(header, rows)
            + f"\n\nKnee (most skipped at ≤ {max_loss:g} BLEU loss against α_thresh "
            f"{float(ref['threshold']):g}): **α_thresh {float(k['threshold']):g}**, "
            f"{100 * float(k['skipped']):.1f} % of the block applications skipped "
            f"(encoder {100 * float(k['skipped_encoder']):.1f} %, decoder "
            f"{100 * float(k['skipped_decoder']):.1f} %) at {-loss:+.2f} BLEU. Figure: {t['png']}.\n")


def speed_of(row: dict) -> Optional[float]:
    seconds = row.get("decode_seconds")
    return int(row["sentences"]) / float(seconds) if seconds not in (None, "") else None


def decoding_text(numbers: Dict[str, dict], trade: Dict[str, dict]) -> str:
    """SUT (and UT) / transformer sentences/s at the largest threshold (evaluate stage) and
    at the knee (the sweep's timing)."""
    if "transformer" not in numbers or numbers["transformer"]["sentences_per_second"] is None:
        return ""
    base = numbers["transformer"]["sentences_per_second"][0]
    lines = [f"Decoding (beam 5, batch 64, one thread, test 2016): transformer {base:.1f} sentences/s."]
    for model in ("sut", "ut"):
        if model not in numbers or numbers[model]["sentences_per_second"] is None:
            continue
        speed = numbers[model]["sentences_per_second"][0]
        line = f"{model.upper()}: {speed:.1f} sentences/s at its α_thresh (0.999): **{speed / base:.2f}×** the transformer"
        sweep = next((t for name, t in trade.items() if name.startswith(model + "-")), None)
        if sweep and sweep["knee"] and speed_of(sweep["knee"]) and speed_of(sweep["reference"]):
            # the sweep's own ratio knee / largest threshold (one run, same conditions)
            gain = speed_of(sweep["knee"]) / speed_of(sweep["reference"])
            at_knee = speed * gain
            line += (f"; at the knee (α_thresh {float(sweep['knee']['threshold']):g}) the sweep "
                     f"decoded {gain:.2f}× as fast as at α_thresh "
                     f"{float(sweep['reference']['threshold']):g}, so {at_knee:.1f} sentences/s: "
                     f"**{at_knee / base:.2f}×**")
        lines.append(line + ".")
    return "\n".join(lines) + "\n"


def learning_curves(work: str, path: str) -> Dict[str, list]:
    series = {}
    for model in MODELS:
        for log in sorted(glob.glob(os.path.join(work, model, "seed*", "train.log"))):
            seed = os.path.basename(os.path.dirname(log))
            points = {}
            with open(log, errors="replace") as handle:
                for line in handle:
                    match = _VALID.search(line)
                    if match:
                        points[int(match.group(2))] = float(match.group(1))
            if points:
                updates = sorted(points)
                series[f"{model} {seed}"] = (updates, [points[u] for u in updates])
    if series:
        line_plot(path, series, "updates", "validation NLL (bits per token)",
                  "Multi30k En→De: validation NLL")
    return {k: [list(x), list(y)] for k, (x, y) in series.items()}


def summarize(work: str, max_loss: float = 0.3) -> str:
    results = collect(work)
    if not results:
        raise SystemExit(f"error: no result.json under {work}: run the evaluate stage first")
    tests = test_names(results)
    header, rows, numbers = model_rows(results, tests)
    trade = tradeoffs(work, max_loss)
    curves = learning_curves(work, os.path.join(work, "learning_curves.png"))
    text = ("## Multi30k En→De\n\n" + markdown_table(header, rows)
            + f"\n\nmean ± sd over the seeds listed (one value: one seed); {PUBLISHED}.\n\n"
            + "".join(tradeoff_text(name, t, max_loss) + "\n" for name, t in trade.items())
            + decoding_text(numbers, trade)
            + ("\nLearning curves: learning_curves.png\n" if curves else ""))
    write_text_atomic(os.path.join(work, "table.md"), text)
    write_json_atomic(os.path.join(work, "table.json"),
                      {"models": numbers, "tests": tests, "tradeoffs": trade, "learning_curves": curves,
                       "max_loss": max_loss})
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work_dir")
    parser.add_argument("--max-loss", type=float, default=0.3, help="BLEU loss allowed at the knee")
    args = parser.parse_args(argv)
    print(summarize(args.work_dir, args.max_loss))
    return 0


if __name__ == "__main__":
    sys.exit(main())
