"""Beam-search throughput, sentences/s, of the SUT against fairseq's transformer and the UT
on the same synthetic test set, through fairseq's own ``SequenceGenerator`` as
fairseq-generate runs it, at two sizes (``--preset``):

* ``wmt`` (default): ``sut_base``, ``transformer_wmt_en_de``, ``ut_base`` over a
  32,768-entry joined dictionary (a 32k joined BPE), source lengths of a WMT test set;
* ``multi30k``: ``sut_multi30k``, ``transformer_multi30k``, ``ut_multi30k`` (d 256, the
  Multi30k recipe's models, docs/multi30k.md) over 8,000 entries (its joint SentencePiece).

The test set: ``--sentences`` sources; each has n subword tokens and </s>,
n = round(LogNormal(mu, sigma)) clipped to 2..150, drawn with ``--seed``: mu = 3.2, sigma =
0.5 for ``wmt`` (mean n about 28, median 24, about 1 in 100 above 80: chosen to resemble a
WMT test set such as newstest2014 under a 32k joined BPE, not fitted to it), mu = 2.63,
sigma = 0.32 for ``multi30k`` (fitted to Multi30k's test 2016 under the recipe's 8k
SentencePiece: mean 15.6 tokens with </s>); the tokens are uniform over the dictionary's
ordinary symbols.

Batches are fairseq-generate's: the sources sorted by length, then
``LanguagePairDataset.batch_by_size`` with ``--batch-size`` (default 64, the Multi30k
recipe's) or ``--max-tokens``, left-padded; with ``--required-batch-size-multiple 1``
(fairseq-generate's default 8 drops a last batch whose size is not a multiple of 8,
fairseq issue #5036). Search: beam ``--beam`` (5), length penalty 1,
``max_len = int(max_len_a * W + max_len_b)`` with W the batch's padded source width
(</s> included) and max_len_a 1.2, max_len_b 10, usual for WMT (fairseq's own defaults are
0 and 200).

The models are randomly initialised (seeded). Such a model almost never puts </s> among
a beam's best candidates, so every sentence runs to its batch's maximum length for every
model: the work per sentence is the same across models, and the generated tokens equal
the sum over sentences of max_len + 1 (fairseq-generate's count, </s> included). The
output says whether that held. The SUT and the UT decode at every ``--thresholds``
α_thresh (default 0.999 and 0.5; a random model's halting units give â = 0.5 everywhere,
so at 0.5 every position halts after its first step: the time of one step per position).

All models are built first, and each is warmed up, untimed: the encoder's forward on every
batch (with ``--compile`` the compilations of every source shape, which would otherwise
recompile inside the timed pass: a second shape, a width past a specialisation) and the
decoding of the first batch (allocator, kernel caches). Then one timed pass over all
batches, the models (and thresholds) taking turns batch by batch (a slow phase of a shared
machine hits all of them alike); progress on stderr. Printed per model, ``ARCH@T`` for a
threshold after the first::

    ARCH  S sentences/s  T generated tokens/s  D ms/decoder step [P GiB peak]
    ARCH: every sentence ran to its maximum length (N generated tokens) [| steps executed ...]

(D: the timed pass's time over its decoder calls, one per step and batch; P, on CUDA: the
most memory allocated while it decoded, every model's weights resident; for the SUT/UT the
plugin's executed-step accounting of the timed pass), then the ratios, ending with
``SUT_ARCH / TRANSFORMER_ARCH sentences/s: R`` (the SUT at the first threshold), e.g.
``sut_base / transformer_wmt_en_de sentences/s: R``.

``--compile``: then every model again, compiled: the SUT/UT with ``--compile-step`` (the
encoder's full forward runs its recurrence step as one compiled graph; the incremental
decoder step stays eager, ``sut_fairseq/modules/recurrence.py``) and the transformer
with its encoder's forward through ``torch.compile`` (its incremental decoder eager too).
Rows ``compiled ARCH ... (warm-up, compiling: S s)``, ``ARCH compiled / eager
sentences/s: R`` and ``compiled: SUT_ARCH / TRANSFORMER_ARCH sentences/s: R``.

``--compile-decoder``: then every model once more as with ``--compile``, and its
incremental decoder's whole forward through ``torch.compile`` as well (dynamic shapes,
graph breaks allowed: fairseq's incremental state and, in the SUT/UT, the recurrence's one
host read per step split it into several graphs). An experiment, not an option of the
plugin: it measures whether compiling the decoder step would pay. Rows ``compiled decoder
ARCH ...`` and ``ARCH compiled decoder / eager sentences/s: R``.

    python benchmarks/generate_throughput.py [--preset wmt|multi30k] [--sentences 64]
        [--batch-size 64 | --max-tokens N] [--beam 5] [--thresholds 0.999 0.5]
        [--arch ...] [--seed 0] [--device cuda --bf16] [--compile] [--compile-decoder]
"""
import argparse
import logging
import os
import sys
import time

import torch

logging.disable(logging.WARNING)

from fairseq.data import LanguagePairDataset  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

from sut_fairseq.models.standalone import build_model, synthetic_dictionary  # noqa: E402
from sut_fairseq.modules.accounting import StepMeter  # noqa: E402
from sut_fairseq.compiler import compile_backend  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import is_recurrent, to_device  # noqa: E402

#: --preset -> the SUT, the transformer and the UT; the dictionary; the source lengths
#: (subword tokens before </s>): exp(N(mu, sigma)), clipped to MIN_LENGTH..MAX_LENGTH
PRESETS = {
    "wmt": dict(archs=["sut_base", "transformer_wmt_en_de", "ut_base"], vocab=32768, mu=3.2, sigma=0.5),
    "multi30k": dict(archs=["sut_multi30k", "transformer_multi30k", "ut_multi30k"], vocab=8000,
                     mu=2.63, sigma=0.32),
}
LENGTH_MU, LENGTH_SIGMA = PRESETS["wmt"]["mu"], PRESETS["wmt"]["sigma"]
MIN_LENGTH, MAX_LENGTH = 2, 150


def source_lengths(n: int, seed: int, mu: float = LENGTH_MU, sigma: float = LENGTH_SIGMA) -> torch.Tensor:
    """(n,) source lengths in tokens, </s> included (docstring above)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.empty(n, dtype=torch.float64).log_normal_(mu, sigma, generator=g)
    return words.round().clamp(MIN_LENGTH, MAX_LENGTH).long() + 1


def make_batches(n: int, vocab: int, seed: int, max_tokens=None, batch_size=None,
                 mu: float = LENGTH_MU, sigma: float = LENGTH_SIGMA):
    """(the dictionary, fairseq-generate's batches of ``n`` synthetic sources): each batch
    a collated sample, ``net_input.src_tokens`` (B, W) left-padded, ``id`` (B,)."""
    d = synthetic_dictionary(vocab)
    g = torch.Generator().manual_seed(seed + 1)
    sources = [torch.cat([torch.randint(d.nspecial, len(d), (int(length) - 1,), generator=g),
                          torch.tensor([d.eos()])]) for length in source_lengths(n, seed, mu, sigma)]
    dataset = LanguagePairDataset(sources, [len(s) for s in sources], d, shuffle=False)
    order = dataset.ordered_indices()
    batches = dataset.batch_by_size(order, max_tokens=max_tokens, max_sentences=batch_size,
                                    required_batch_size_multiple=1)
    return d, [dataset.collater([dataset[i] for i in batch]) for batch in batches]


def max_len(sample, a: float, b: int) -> int:
    """The generator's length limit for a batch: int(a * W + b), W its padded width."""
    return int(a * sample["net_input"]["src_tokens"].size(1) + b)


def build(arch: str, vocab: int, compiled: str = "", device=torch.device("cpu"),
          dtype=torch.float32):
    """``arch`` in eval mode on ``device`` (seeded). ``compiled`` "" (eager), "compiled" (the
    plugin's models with ``--compile-step``, fairseq's transformer with its encoder's
    forward compiled) or "compiled decoder" (that, and the decoder's forward compiled)."""
    torch.manual_seed(0)
    extra = {"compile_step": True} if compiled and is_recurrent(arch) else {}
    model = build_model(arch, dict_size=vocab, share_all_embeddings=True, **extra)
    model.eval().to(device=device, dtype=dtype)
    if compiled and not is_recurrent(arch):  # the generator calls encoder.forward_torchscript
        model.encoder.forward = torch.compile(model.encoder.forward, backend=compile_backend())
    if compiled == "compiled decoder":
        model.decoder.forward = torch.compile(model.decoder.forward, dynamic=True, backend=compile_backend())
    return model


def decode(generator, model, sample, device):
    """(seconds, the length of every sentence's best hypothesis with </s>, the generator's
    decoder calls: its longest hypothesis) of decoding one batch."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    hypos = generator.generate([model], sample)  # under torch.no_grad, as in fairseq-generate
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start, [len(h[0]["tokens"]) for h in hypos],
            max(len(x["tokens"]) for h in hypos for x in h))


def warm_up(model, generator, batches, device) -> float:
    """Seconds of the encoder's forward on every batch (with --compile: compiling every
    source shape) and of decoding the first batch."""
    start = time.perf_counter()
    with torch.no_grad():
        for sample in batches:
            model.encoder.forward_torchscript(sample["net_input"])
    return time.perf_counter() - start + decode(generator, model, batches[0], device)[0]


def entries(archs, thresholds):
    """(label, arch, threshold) of every timed row: the SUT/UT at each threshold (labelled
    ``ARCH@T`` after the first), other models once (threshold None)."""
    out = []
    for arch in archs:
        if is_recurrent(arch):
            out += [(arch if i == 0 else f"{arch}@{t:g}", arch, t) for i, t in enumerate(thresholds)]
        else:
            out.append((arch, arch, None))
    return out


def use_meter(model, meter) -> None:
    """Route the SUT/UT's executed-step accounting to ``meter`` (one per timed row)."""
    model.step_meter = model.encoder.side.step_meter = model.decoder.side.step_meter = meter


def time_models(archs, d, batches, args, device, dtype, compiled: str = "") -> dict:
    """Build and warm up every arch, then decode the batches with the models (each SUT/UT at
    each threshold) taking turns (the first batch by every row, then the second, ...), so
    that a slow phase of a shared machine hits all of them alike. Per row label a dict of
    its figures; ``peak``: the largest allocated CUDA memory while it decoded (every
    model's weights resident)."""
    models = {arch: build(arch, len(d), compiled, device, dtype) for arch in archs}
    generators = {arch: SequenceGenerator([m], d, beam_size=args.beam, max_len_a=args.max_len_a,
                                          max_len_b=args.max_len_b) for arch, m in models.items()}
    warm = {arch: warm_up(models[arch], generators[arch], batches, device) for arch in archs}
    rows = entries(archs, args.thresholds)
    meters = {label: StepMeter(models[arch].step_meter.expert_slots) if threshold is not None else None
              for label, arch, threshold in rows}
    labels = [label for label, _, _ in rows]
    seconds, lengths, calls, peak = ({a: 0.0 for a in labels}, {a: [] for a in labels},
                                     {a: 0 for a in labels}, {})
    for i, sample in enumerate(batches, 1):
        for label, arch, threshold in rows:
            if threshold is not None:
                models[arch].set_halting_threshold(threshold)
                use_meter(models[arch], meters[label])
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t, got, c = decode(generators[arch], models[arch], sample, device)
            seconds[label] += t
            lengths[label].append(got)
            calls[label] += c
            if device.type == "cuda":
                peak[label] = max(peak.get(label, 0), torch.cuda.max_memory_allocated())
        print(f"[batch {i}/{len(batches)}, {sample['nsentences']} x {sample['net_input']['src_tokens'].size(1)}] "
              + ", ".join(f"{a} {seconds[a]:.1f} s" for a in labels), file=sys.stderr, flush=True)
    figures = {}
    for label, arch, _ in rows:
        limit = models[arch].max_decoder_positions() - 1
        expected = [[min(max_len(s, args.max_len_a, args.max_len_b), limit) + 1] * len(got)
                    for s, got in zip(batches, lengths[label])]
        tokens = sum(map(sum, lengths[label]))
        figures[label] = {
            "sentences_s": sum(map(len, lengths[label])) / seconds[label], "tokens_s": tokens / seconds[label],
            "ms_per_call": 1e3 * seconds[label] / calls[label], "tokens": tokens,
            "short": sum(g < w for b, e in zip(lengths[label], expected) for g, w in zip(b, e)),
            "expected": sum(map(sum, expected)), "warm_s": warm[arch], "peak": peak.get(label),
            "steps": meters[label].summary() if meters[label] is not None else ""}
    return figures


def row(arch: str, r: dict, prefix: str = "") -> str:
    memory = f" {r['peak'] / 2 ** 30:7.2f} GiB peak" if r["peak"] is not None else ""
    return (f"{prefix}{arch:24s} {r['sentences_s']:9.2f} sentences/s {r['tokens_s']:10.1f} generated "
            f"tokens/s {r['ms_per_call']:8.2f} ms/decoder step{memory}")


def print_ratios(figures: dict, archs, prefix: str = "") -> None:
    """Every SUT row against the UT and the transformer, ``SUT / TRANSFORMER`` (the SUT at
    the first threshold) last."""
    suts = [label for label in figures if label.split("@")[0].startswith("sut")]
    uts = [label for label in figures if label.split("@")[0].startswith("ut")]
    others = [a for a in archs if not is_recurrent(a) and a in figures]
    lines = [(s, u) for s in suts for u in uts if s.split("@")[1:] == u.split("@")[1:]]
    lines += [(s, o) for o in others for s in reversed(suts)]
    for sut, other in lines:
        print(f"{prefix}{sut} / {other} sentences/s: "
              f"{figures[sut]['sentences_s'] / figures[other]['sentences_s']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="wmt",
                        help="the models, dictionary and source lengths (default wmt)")
    parser.add_argument("--arch", nargs="+", default=None,
                        help="models (default: the preset's SUT, transformer and UT)")
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=None, help="source tokens per batch")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sentences per batch (default 64 when --max-tokens is not given)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.999, 0.5],
                        help="alpha_thresh of the SUT/UT rows (default 0.999 0.5)")
    parser.add_argument("--max-len-a", type=float, default=1.2,
                        help="max_len = int(a * source width + b) (fairseq's default a: 0)")
    parser.add_argument("--max-len-b", type=int, default=10, help="(fairseq's default b: 200)")
    parser.add_argument("--vocab", type=int, default=None, help="dictionary size (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="parameters and activations in bfloat16")
    parser.add_argument("--compile", action="store_true",
                        help="then every model compiled: the SUT/UT with --compile-step, the "
                             "transformer's encoder through torch.compile")
    parser.add_argument("--compile-decoder", action="store_true",
                        help="then every model compiled as with --compile and its incremental "
                             "decoder's forward through torch.compile (an experiment)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    args.arch = args.arch or preset["archs"]
    args.vocab = args.vocab or preset["vocab"]
    if args.max_tokens is None and args.batch_size is None:
        args.batch_size = 64
    for t in args.thresholds:
        if not 0.0 < t <= 1.0:
            raise SystemExit(f"generate_throughput.py: --thresholds must lie in (0, 1]; got {t}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("generate_throughput.py: --device cuda needs a CUDA device")
    device, dtype = torch.device(args.device), torch.bfloat16 if args.bf16 else torch.float32
    d, batches = make_batches(args.sentences, args.vocab, args.seed, args.max_tokens, args.batch_size,
                              preset["mu"], preset["sigma"])
    lengths = torch.cat([b["net_input"]["src_lengths"] for b in batches]).float()
    where = (torch.cuda.get_device_name() if device.type == "cuda"
             else f"cpu, {torch.get_num_threads()} threads")
    size = f"--max-tokens {args.max_tokens}" if args.max_tokens else f"--batch-size {args.batch_size}"
    print(f"--preset {args.preset}, torch {torch.__version__}, {where}, {'bf16' if args.bf16 else 'fp32'}; {args.sentences} "
          f"sentences, source tokens with </s> mean {lengths.mean():.1f}, max {lengths.max():.0f}; "
          f"vocabulary {len(d)}; beam {args.beam}, max_len_a {args.max_len_a}, max_len_b {args.max_len_b}; "
          f"{size}: {len(batches)} batches")
    batches = [to_device(b, device) for b in batches]
    print("randomly initialised models: every sentence should run to its maximum length "
          "(no </s> before it), the same work per sentence for every model", flush=True)
    passes = ([""] + (["compiled"] if args.compile else [])
              + (["compiled decoder"] if args.compile_decoder else []))
    figures = {}
    for compiled in passes:
        prefix = compiled + " " if compiled else ""
        figures[compiled] = time_models(args.arch, d, batches, args, device, dtype, compiled)
        for arch, r in figures[compiled].items():  # arch: a row label
            warm = f" (warm-up, compiling: {r['warm_s']:.1f} s)" if compiled else ""
            print(row(arch, r, prefix) + warm, flush=True)
            held = (f"{r['short']} of {args.sentences} sentences ended before their maximum length "
                    f"({r['tokens']} generated tokens of {r['expected']})" if r["short"] else
                    f"every sentence ran to its maximum length ({r['tokens']} generated tokens)")
            print(f"{prefix}{arch}: {held} {r['steps']}".rstrip())
        print_ratios(figures[compiled], args.arch, f"{compiled}: " if compiled else "")
    for compiled in passes[1:]:
        for arch in figures[compiled]:
            print(f"{arch} {compiled} / eager sentences/s: "
                  f"{figures[compiled][arch]['sentences_s'] / figures[''][arch]['sentences_s']:.2f}")


if __name__ == "__main__":
    main()
