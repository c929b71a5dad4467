"""One full training step (forward + backward through the criterion) on CPU for
``sut_base``, ``ut_base`` and fairseq's ``transformer_wmt_en_de``, on the same batch.

The batch: B sentences of T source and T target tokens (default 128 x 32 = 4,096 target
tokens) over a 32,768-entry joined dictionary with shared embeddings; criterion
``sut_label_smoothed_cross_entropy`` (label smoothing 0.1, MIM 0.1, ACT 0.01) for the
SUT/UT and ``label_smoothed_cross_entropy`` for the transformer; dropout as in each
preset. Prints the median time per step and target tokens/s of each model, then the
ratios (goals: sut_base >= 2.0x ut_base, sut_base >= 0.6x transformer). All three models
are built first; in each of ``--repeats`` rounds every model runs an untimed step and then
a timed one, the models taking turns, so that a slow phase of a shared machine hits all
of them alike while each timed step runs in its model's steady state.

    python benchmarks/train_step.py [--batch 128] [--len 32] [--repeats 3] [--arch ...]

``--arch ... transformer_wmt_en_de+fused-ce`` adds fairseq's transformer trained with the
plugin's label-smoothed CE op (``sut_fairseq.ops.label_smoothed_ce``, which the SUT/UT
criterion uses), to separate the loss's share from the model's.
"""
import argparse
import logging
import statistics
import time
from types import SimpleNamespace

import torch

logging.disable(logging.WARNING)

from fairseq.criterions.label_smoothed_cross_entropy import (  # noqa: E402
    LabelSmoothedCrossEntropyCriterion,
)

from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (  # noqa: E402
    SUTLabelSmoothedCrossEntropyCriterion,
)
from sut_fairseq.ops.label_smoothed_ce import label_smoothed_cross_entropy  # noqa: E402
from sut_fairseq.standalone import build_model  # noqa: E402

MODELS = ["sut_base", "ut_base", "transformer_wmt_en_de"]
FUSED_CE = "+fused-ce"  # suffix: fairseq's transformer with the plugin's CE op as its loss


class FusedLabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyCriterion):
    """fairseq's criterion with the loss computed by ``ops.label_smoothed_ce``."""

    def compute_loss(self, model, net_output, sample, reduce=True):
        logits, target = net_output[0], model.get_targets(sample, net_output)
        return label_smoothed_cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                            self.eps, self.padding_idx)


def make_batch(B: int, T: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (B, T), generator=g)
    tgt = torch.randint(4, vocab, (B, T), generator=g)
    tgt[:, -1] = 2
    prev = torch.cat([torch.full((B, 1), 2), tgt[:, :-1]], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((B,), T),
                          "prev_output_tokens": prev},
            "target": tgt, "ntokens": B * T, "nsentences": B}


def make_step(arch: str, sample, vocab: int):
    """A closure running one training step (zero grads, criterion forward, backward)."""
    torch.manual_seed(0)
    fused = arch.endswith(FUSED_CE)
    model = build_model(arch[: -len(FUSED_CE)] if fused else arch, dict_size=vocab,
                        share_all_embeddings=True).train()
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    if arch.startswith(("sut", "ut")):
        criterion = SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, mim_weight=0.1, act_weight=0.01)
    elif fused:
        criterion = FusedLabelSmoothedCrossEntropy(task, False, 0.1)
    else:
        criterion = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)

    def step():
        model.zero_grad(set_to_none=True)
        loss, _, _ = criterion(model, sample)
        loss.backward()

    return step


def time_steps(archs, sample, vocab: int, repeats: int):
    """Median seconds per step of each arch over ``repeats`` rounds. In every round each
    arch runs one untimed step (back in its steady state: caches and allocator warm with
    its own buffers, as in training) and then one timed step; the archs take turns within
    a round, so that a slow phase of a shared machine hits all of them alike."""
    steps = {arch: make_step(arch, sample, vocab) for arch in archs}
    times = {arch: [] for arch in archs}
    for _ in range(repeats):
        for arch, step in steps.items():
            step()
            start = time.perf_counter()
            step()
            times[arch].append(time.perf_counter() - start)
    return {arch: statistics.median(t) for arch, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", nargs="*", default=MODELS)
    args = parser.parse_args()
    sample = make_batch(args.batch, args.len, args.vocab, args.seed)
    tokens = sample["ntokens"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch} x "
          f"{args.len} = {tokens} target tokens")
    speed = {}
    for arch, t in time_steps(args.arch, sample, args.vocab, args.repeats).items():
        speed[arch] = tokens / t
        print(f"{arch:24s} {1e3 * t:9.0f} ms/step {speed[arch]:9.0f} tokens/s", flush=True)
    if {"sut_base", "ut_base"} <= speed.keys():
        print(f"sut_base / ut_base tokens/s: {speed['sut_base'] / speed['ut_base']:.2f} (goal >= 2.0)")
    if {"sut_base", "transformer_wmt_en_de"} <= speed.keys():
        print(f"sut_base / transformer_wmt_en_de tokens/s: "
              f"{speed['sut_base'] / speed['transformer_wmt_en_de']:.2f} (goal >= 0.6)")
    fused = "transformer_wmt_en_de" + FUSED_CE
    if {"sut_base", fused} <= speed.keys():
        print(f"sut_base / {fused} tokens/s: {speed['sut_base'] / speed[fused]:.2f}")


if __name__ == "__main__":
    main()
