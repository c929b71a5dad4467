"""Teacher-forced accuracy of every off-ramp of an early-exit checkpoint.

    python -m sut_fairseq.analysis.offramps --path CKPT --data DATA_BIN [--gen-subset test] [--json F]

For a model trained with ``--decoder-halting pabee|entropy``, runs the reference
source/target pairs through the model with every position computing all L decoder steps
(no exits) and reports, for each step l, the predictions ``argmax o_l`` with
``o_l = W_out LN_l(h_l)`` for l < L and the main head for l = L:

* token accuracy: % of target tokens predicted right;
* sentence accuracy: % of target sentences with every token right (teacher-forced: each
  position sees the reference prefix, so it bounds what greedy decoding from that
  off-ramp alone could reach).

A model trained without exit losses (``--exit-loss none``) still has its off-ramps, at
their initialisation (LayerNorm gain 1, bias 0, then the tied projection): that is the
"last-step-only" reference an exit-trained model's early off-ramps are compared with.
"""
import argparse
import sys
from typing import Dict, List

import torch


def offramp_accuracy(model, task, subset: str, batch_size: int = 256) -> List[Dict]:
    """Per step l = 1..L: ``{"step", "tokens", "token_accuracy", "sentences",
    "sentence_accuracy"}`` (accuracies in %)."""
    from ..modules.exits import ExitHalting

    decoder = model.decoder
    if not isinstance(decoder.side.halting, ExitHalting):
        raise SystemExit("error: the checkpoint has no off-ramps (train with --decoder-halting "
                         "pabee or entropy)")
    L = decoder.side.num_steps
    right = [0] * L
    sentence_right = [0] * L
    tokens = sentences = 0
    itr = task.get_batch_iterator(dataset=task.dataset(subset), max_sentences=batch_size,
                                  required_batch_size_multiple=1, seed=1,
                                  ignore_invalid_inputs=False).next_epoch_itr(shuffle=False)
    was_training = model.training
    model.eval()
    decoder.side.halting.train()  # the exit rule alone in training mode: all L steps, states kept
    pad = task.target_dictionary.pad()
    try:
        with torch.no_grad():
            for sample in itr:
                if not sample:
                    continue
                net = sample["net_input"]
                logits, extra = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
                target = sample["target"]
                mask = target.ne(pad)
                W = decoder.output_projection.weight
                per_step = [decoder.side.halting.offramp(h, l, W) for l, h in
                            enumerate(extra["decoder_exits"].hidden, start=1)] + [logits]
                for l, step_logits in enumerate(per_step):
                    correct = step_logits.argmax(-1).eq(target) & mask
                    right[l] += int(correct.sum())
                    sentence_right[l] += int((correct | ~mask).all(1).sum())
                tokens += int(mask.sum())
                sentences += target.size(0)
    finally:
        model.train(was_training)
    return [{"step": l + 1, "tokens": tokens, "token_accuracy": 100.0 * right[l] / max(1, tokens),
             "sentences": sentences, "sentence_accuracy": 100.0 * sentence_right[l] / max(1, sentences)}
            for l in range(L)]


def format_table(rows: List[Dict]) -> str:
    L = len(rows)
    lines = ["| step l | head | token accuracy (%) | sentence accuracy (%) |", "|---|---|---|---|"]
    for r in rows:
        head = "main head" if r["step"] == L else f"off-ramp {r['step']}"
        lines.append(f"| {r['step']} | {head} | {r['token_accuracy']:.2f} | {r['sentence_accuracy']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--data", required=True, help="fairseq data-bin directory")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    from .halting_analysis import load

    model, task = load(args.data, args.path, subset=args.gen_subset)
    rows = offramp_accuracy(model, task, args.gen_subset, args.batch_size)
    print(f"| {args.path} | {args.gen_subset}: {rows[0]['sentences']} sentences, {rows[0]['tokens']} "
          "target tokens, teacher-forced, all steps run")
    print(format_table(rows))
    if args.json:
        from ..data.atomic import write_json_atomic

        write_json_atomic(args.json, {"checkpoint": args.path, "subset": args.gen_subset, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
