#!/usr/bin/env python3
"""Evaluate one trained logical-inference model: relation accuracy on every test split
(fairseq-generate, greedy) and, for the plugin's models, the average halting depth per
operator count (teacher-forced analysis, paper Figure 4).

    python scripts/logic/evaluate.py MODEL --data DATA/standard --protocol standard \\
        --checkpoint CKPT --out-dir DIR [--buckets 7..12] [--threshold A]
        [--batch-size 256] [--cpu] [--generate-args "..."] [--no-halting-analysis] [--dry-run]

``--data`` is ``data-prep/logic/prepare.py``'s ``--out`` for the protocol: the text files
``test{k}.tgt`` (standard) or ``test.tgt`` (A/B/C) are the references and ``DATA/bin``
the binarized data (``--data-bin`` to point elsewhere). Standard protocol: one
fairseq-generate per bucket in ``--buckets`` (default 7..12, the paper's; ``all`` or
``0..12`` adds the in-distribution buckets); bucket 0 is the binarized split ``test``,
bucket k is ``test{k}``. A/B/C: the split ``test``.

Each split is scored by ``accuracy.py`` (exact relation token; printed as that command
and run in this process), which fails unless every line of the split's text file was
scored exactly once. Files in ``--out-dir``: ``generate-SPLIT.txt`` (fairseq-generate's output),
``score-SPLIT.json`` (``accuracy.py``'s), ``halting.json``
(``python -m sut_fairseq.analysis.halting_depth``; standard protocol, SUT/UT models only) and ``eval.json`` (written
atomically): ``{"model", "protocol", "checkpoint", "accuracy": {KEY: counts and %},
"halting_depth": {KEY: ...} or null, "commands", "seconds"}`` where KEY is the bucket
number as a string (standard) or the protocol letter. Every command is printed before
it runs; ``--dry-run`` only prints them.
"""
import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accuracy  # noqa: E402
import logic_recipe as recipe  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def score_command(gen_out, reference, out_json):
    return [sys.executable, os.path.join(HERE, "accuracy.py"), gen_out, "--reference", reference,
            "--json", out_json]


def halting_command(data_bin, checkpoint, splits, out_json, threshold=None):
    command = [sys.executable, "-m", "sut_fairseq.analysis.halting_depth", data_bin,
               "--path", checkpoint, "--subsets", *[s["subset"] for s in splits],
               "--keys", *[s["key"] for s in splits], "--json", out_json]
    if threshold is not None:
        command += ["--threshold", f"{threshold:g}"]
    return command


def evaluate(model, protocol, data, checkpoint, out_dir, buckets=recipe.REPORT_BUCKETS,
             data_bin=None, batch_size=recipe.DEFAULT_GENERATE_BATCH, threshold=None, cpu=False,
             generate_extra=(), halting_analysis=True, dry_run=False):
    """Generate, score and (optionally) analyse halting for one run; returns the
    ``eval.json`` dictionary (None with ``dry_run``)."""
    data_bin = data_bin or os.path.join(data, "bin")
    splits = recipe.eval_splits(protocol, buckets)
    extra = list(generate_extra)
    if threshold is not None and recipe.is_sut_transformer(model):  # fairseq's transformer: no halting
        extra = recipe.merge_flags(["--model-overrides", repr({"halting_threshold": threshold})], extra)
    analyse = (halting_analysis and protocol == "standard" and recipe.is_sut_transformer(model)
               and not recipe.is_chunked(model))
    halting_json = os.path.join(out_dir, "halting.json")
    analysis = halting_command(data_bin, checkpoint, splits, halting_json, threshold) if analyse else None

    if dry_run:
        for split in splits:
            command = recipe.generate_command(data_bin, checkpoint, split["subset"], batch_size, cpu,
                                              extra, required=False)
            gen_out = os.path.join(out_dir, f"generate-{split['subset']}.txt")
            recipe.show(command, gen_out)
            recipe.show(score_command(gen_out, os.path.join(data, split["text"] + ".tgt"),
                                      os.path.join(out_dir, f"score-{split['subset']}.json")))
        if analysis:
            recipe.show(analysis)
        return None

    for path in [checkpoint, data_bin] + [os.path.join(data, s["text"] + ".tgt") for s in splits]:
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} not found")
    os.makedirs(out_dir, exist_ok=True)
    start = time.time()
    result = {"model": model, "label": recipe.label(model), "protocol": protocol,
              "checkpoint": os.path.abspath(checkpoint), "data_bin": os.path.abspath(data_bin),
              "threshold": threshold, "accuracy": {}, "halting_depth": None, "commands": []}
    for split in splits:
        command = recipe.generate_command(data_bin, checkpoint, split["subset"], batch_size, cpu, extra)
        gen_out = os.path.join(out_dir, f"generate-{split['subset']}.txt")
        recipe.run(command, gen_out)
        reference = os.path.join(data, split["text"] + ".tgt")
        score_json = os.path.join(out_dir, f"score-{split['subset']}.json")
        recipe.show(score_command(gen_out, reference, score_json))
        try:  # refuses unless every line of the split was scored exactly once
            scored = accuracy.main([gen_out, "--reference", reference, "--json", score_json])
        except SystemExit as err:
            raise recipe.RecipeError(f"scoring {gen_out} against {reference} failed: {err}")
        scored.update({"subset": split["subset"], "bucket": split["bucket"]})
        result["accuracy"][split["key"]] = scored
        result["commands"].append(command)
        print(f"   {split['subset']:>6} ({'bucket ' + split['key'] if split['bucket'] is not None else 'split ' + split['key']}): "
              f"accuracy {scored['accuracy']:.2f}% ({scored['correct']}/{scored['total']}; all "
              f"{scored['lines']} lines scored)", flush=True)
    if analysis:
        recipe.run(analysis, os.path.join(out_dir, "halting.log"))
        result["halting_depth"] = recipe.load_json(halting_json)["splits"]
        result["commands"].append(analysis)
    result["seconds"] = round(time.time() - start, 1)
    recipe.write_json_atomic(os.path.join(out_dir, "eval.json"), result)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("model", choices=recipe.ALL_MODELS)
    parser.add_argument("--data", required=True, help="prepare.py's --out for this protocol")
    parser.add_argument("--data-bin", default=None, help="binarized data (default DATA/bin)")
    parser.add_argument("--protocol", default="standard", choices=recipe.PROTOCOLS)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--buckets", default="7..12", help="standard protocol: e.g. 7..12 (default), all")
    parser.add_argument("--batch-size", type=int, default=recipe.DEFAULT_GENERATE_BATCH)
    parser.add_argument("--threshold", type=float, default=None,
                        help="alpha_thresh for decoding and the analysis (default: the checkpoint's)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--generate-args", default="", help="extra fairseq-generate options (one string)")
    parser.add_argument("--no-halting-analysis", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    try:
        buckets = recipe.parse_buckets(args.buckets)
    except (recipe.RecipeError, ValueError) as err:
        parser.error(str(err))
    try:
        result = evaluate(args.model, args.protocol, args.data, args.checkpoint, args.out_dir,
                          buckets, args.data_bin, args.batch_size, args.threshold, args.cpu,
                          shlex.split(args.generate_args), not args.no_halting_analysis,
                          args.dry_run)
    except recipe.RecipeError as err:
        raise SystemExit(f"error: {err}")
    if result is not None:
        print(f"wrote {os.path.join(args.out_dir, 'eval.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
