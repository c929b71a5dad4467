"""Teacher-forced halting analysis (paper §4.4): run source-target pairs through a trained
model at a given threshold and record executed steps per position, per step (layer) and
per sentence, and the halting weights behind them.

    python -m sut_fairseq.analysis.halting_analysis DATA_BIN --path CKPT [--gen-subset test]
        [--threshold 0.8] [--max-sentences 1000] [--output analysis.json]

The JSON holds, per side, ``executed_fraction`` (executed (position, step) pairs / (L ×
real positions)), ``positions_per_step`` (how many positions ran step l = 1..L) and
``mean_steps``; and per sentence the source/target strings, the executed steps of every
position, the halting weights (positions × L) and each position's expected depth (the
L_ACT summand the ACT loss averages: Σ_l l · w_l, or N + R for ``act``; it moves while
the threshold is never reached and the executed steps stay at L). The sweep and
plotting tools consume it (``analyse`` is the same as a Python function).
"""
import argparse
import json
from typing import Dict, List, Optional

import torch


def _side_summary(steps: List[List[int]], max_steps: int) -> Dict:
    flat = [s for sent in steps for s in sent]
    per_step = [sum(1 for s in flat if s >= l) for l in range(1, max_steps + 1)]
    return {
        "executed_fraction": sum(flat) / max(1, len(flat) * max_steps),
        "positions_per_step": per_step,
        "mean_steps": sum(flat) / max(1, len(flat)),
        "positions": len(flat),
    }


@torch.no_grad()
def analyse(model, task, subset: str, threshold: Optional[float] = None,
            max_sentences: Optional[int] = None, batch_size: int = 64) -> Dict:
    """Teacher-forced pass over ``subset``; returns the dictionary described above."""
    if threshold is not None:
        model.set_halting_threshold(threshold)
    model.eval()
    dataset = task.dataset(subset)
    itr = task.get_batch_iterator(dataset=dataset, max_sentences=batch_size,
                                  required_batch_size_multiple=1, seed=1,
                                  ignore_invalid_inputs=False).next_epoch_itr(shuffle=False)
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    sentences = []
    for sample in itr:
        if not sample:
            continue
        net_input = sample["net_input"]
        _, extra = model(**net_input)
        enc, dec = extra["halting_encoder"], extra["halting_decoder"]
        for i, sid in enumerate(sample["id"].tolist()):
            src_real, tgt_real = enc.real[i], dec.real[i]
            sentences.append({
                "id": sid,
                "source": src_dict.string(net_input["src_tokens"][i][src_real]),
                "target": tgt_dict.string(sample["target"][i][sample["target"][i].ne(tgt_dict.pad())]),
                "encoder_steps": enc.steps[i][src_real].tolist(),
                "decoder_steps": dec.steps[i][tgt_real].tolist(),
                "encoder_weights": enc.weights[i][src_real].tolist(),
                "decoder_weights": dec.weights[i][tgt_real].tolist(),
                "encoder_expected": enc.expected_depth[i][src_real].tolist(),
                "decoder_expected": dec.expected_depth[i][tgt_real].tolist(),
            })
        if max_sentences is not None and len(sentences) >= max_sentences:
            sentences = sentences[:max_sentences]
            break
    sentences.sort(key=lambda s: s["id"])
    return {
        "subset": subset,
        "threshold": model.encoder.side.halting.threshold,
        "encoder": _side_summary([s["encoder_steps"] for s in sentences], model.encoder.side.num_steps),
        "decoder": _side_summary([s["decoder_steps"] for s in sentences], model.decoder.side.num_steps),
        "sentences": sentences,
    }


def load(data: str, path: str, threshold: Optional[float] = None, subset: str = "test"):
    """Load a checkpoint (and its task) with the data directory overridden."""
    from fairseq import checkpoint_utils

    import sut_fairseq  # noqa: F401  (registration, safe checkpoint loading)

    overrides = {"data": data}
    if threshold is not None:
        overrides["halting_threshold"] = threshold
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    task.load_dataset(subset)
    return models[0], task


def write_json_atomic(path: str, obj) -> None:
    from ..data.atomic import atomic_path

    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="fairseq binarised data directory")
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--threshold", type=float, default=None,
                        help="α_thresh to analyse at (default: the checkpoint's)")
    parser.add_argument("--max-sentences", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", default=None, help="write the full analysis as JSON")
    args = parser.parse_args(argv)
    model, task = load(args.data, args.path, args.threshold, args.gen_subset)
    result = analyse(model, task, args.gen_subset, args.threshold, args.max_sentences, args.batch_size)
    for side in ("encoder", "decoder"):
        r = result[side]
        print(f"| {side} steps executed {100 * r['executed_fraction']:.1f}% | mean steps "
              f"{r['mean_steps']:.2f} | positions per step {r['positions_per_step']}")
    print(f"| threshold {result['threshold']} | {len(result['sentences'])} sentences")
    if args.output:
        write_json_atomic(args.output, result)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
