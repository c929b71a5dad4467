"""Does halting save wall-clock time in proportion to the steps it skips?

Builds ``sut_base`` (random weights; the halting unit's last layer is randomised so that
halting varies across positions), runs the encoder forward on a fixed batch of about
4,000 tokens at several thresholds, and prints per threshold the executed-step fraction
f and the time relative to threshold 1.0 (no early halting). The last line is
``efficiency E`` = median over thresholds (with f < 0.95) of (time saved) / (1 - f):
1.0 means the time falls exactly with the executed steps.

    python benchmarks/halting_savings.py [--batch 128] [--len 32] [--repeats 3] [--compile-step]

``--compile-step``: the model built with ``--compile-step`` (each recurrence step one
``torch.compile`` graph; the halted rows are skipped inside the expert op), so the line
says whether halting still saves time compiled. The compilation happens in the warm-up.
"""
import argparse
import logging
import statistics
import time

import torch

logging.disable(logging.WARNING)

from sut_fairseq.models.standalone import build_model  # noqa: E402

THRESHOLDS = [1.0, 0.999, 0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.3]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sut_base")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-step", action="store_true",
                        help="build the model with --compile-step")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = build_model(args.arch, dict_size=32768, share_all_embeddings=True,
                        compile_step=args.compile_step).eval()
    unit = model.encoder.side.halting.unit
    with torch.no_grad():  # spread the halting logits: positions halt at different steps
        unit.fc2.weight.normal_(0.0, 3.0 / unit.fc2.weight.size(1) ** 0.5)
        unit.fc2.bias.fill_(0.0)
    g = torch.Generator().manual_seed(args.seed)
    src = torch.randint(4, 32768, (args.batch, args.len), generator=g)
    print(f"{args.arch} encoder, {args.batch} x {args.len} = {src.numel()} tokens, "
          f"{torch.get_num_threads()} threads{', --compile-step' if args.compile_step else ''}")
    print(f"{'threshold':>9} {'executed f':>10} {'time (ms)':>10} {'relative':>9} {'saved/(1-f)':>11}")
    base_time, ratios = None, []
    with torch.no_grad():
        for _ in range(2):  # allocator and thread-pool warm-up before any timing
            model.encoder(src)
        for threshold in THRESHOLDS:
            model.set_halting_threshold(threshold)
            model.encoder(src)  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = model.encoder(src)
                times.append(time.perf_counter() - start)
            t = statistics.median(times)
            f = out["halting"][0].executed_fraction()
            base_time = base_time or t
            rel = t / base_time
            ratio = (1 - rel) / (1 - f) if f < 0.95 else float("nan")
            if f < 0.95:
                ratios.append(ratio)
            print(f"{threshold:>9} {f:>10.3f} {1e3 * t:>10.0f} {rel:>9.3f} {ratio:>11.2f}", flush=True)
    print(f"efficiency E {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
