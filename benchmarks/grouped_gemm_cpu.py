"""When does one grouped GEMM beat the per-expert loop on a CPU? The two forwards of the
reference backend (``ops/reference_linear.py``): ``_looped_forward`` (expert by expert:
gather, GEMM, gate and scatter of one expert's rows back to back) against
``_grouped_forward`` (the rows gathered once in expert order, one
``torch.nn.functional.grouped_mm`` for all experts, then bias, gate and scatter once),
on the same operands, one thread, the two timed in turn within every repeat.

Cases: the sizes of the logic model (E 12, d 128), of the Multi30k SUT (E 12, d 256) and of
``sut_base`` (E 24, d 512), top-4, at token counts from a beam-search decoder call (80, 320
rows) to a training batch (2,000), in the two layouts the decoder's projections use
(token rows -> slot rows with a bias: the query projection; slot rows -> gated sum: the
output projection).

    python benchmarks/grouped_gemm_cpu.py [--tokens 80 320 2000] [--repeats 20]

Prints one line per case ``... loop X ms grouped Y ms ratio R`` (below 1: the grouped GEMM
is faster), then ``grouped / loop time, rows per expert <= T: R`` and ``> T`` (geometric
means over the cases on either side of ``GROUPED_MAX_ROWS_PER_EXPERT``, the threshold the
backend uses to choose).
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_cpu import median_times  # noqa: E402  (this folder is on sys.path)
from sut_fairseq.ops import reference_linear  # noqa: E402

K = 4
SIZES = {"logic": (12, 128), "multi30k": (12, 256), "sut_base": (24, 512)}  # name: (E, d)


def operands(tokens: int, experts: int, d: int, gated: bool, seed: int):
    """The forward's arguments (x, W, b, gates, src, dst, ends, out_rows) for ``tokens``
    tokens routed top-K (random picks), as ``reference_routed_linear`` builds them."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(tokens)])
    slots = torch.sort(picks.reshape(-1), stable=True).indices
    ends = tuple(torch.bincount(picks.reshape(-1), minlength=experts).cumsum(0).tolist())
    x = torch.randn(tokens * K if gated else tokens, d, generator=g)
    W = torch.randn(experts, d, d, generator=g) / d ** 0.5
    if gated:  # output projection: slot rows in, gated sum over each token's slots out
        return (x, W, None, torch.rand(slots.numel(), 1, generator=g), slots, slots // K, ends, tokens)
    return (x, W, torch.randn(experts, d, generator=g), None, slots // K, slots, ends, tokens * K)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[80, 320, 2000])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    limit = reference_linear.GROUPED_MAX_ROWS_PER_EXPERT
    print(f"torch {torch.__version__}, 1 thread; top-{K}; median of {args.repeats}; "
          f"the backend groups at <= {limit} rows per expert")
    ratios = {True: [], False: []}
    with torch.no_grad():
        for name, (experts, d) in SIZES.items():
            for tokens in args.tokens:
                for gated in (False, True):
                    ops = operands(tokens, experts, d, gated, args.seed)
                    loop, grouped = (reference_linear._looped_forward(*ops),
                                     reference_linear._grouped_forward(*ops))
                    torch.testing.assert_close(grouped, loop, rtol=1e-4, atol=1e-4)
                    loop_s, grouped_s = median_times(
                        [lambda: reference_linear._looped_forward(*ops),
                         lambda: reference_linear._grouped_forward(*ops)], args.repeats, warmup=2)
                    per_expert = tokens * K / experts
                    ratios[per_expert <= limit].append(grouped_s / loop_s)
                    layout = "slot rows -> gated sum" if gated else "token rows -> slot rows"
                    print(f"{name:9s} E {experts:2d} d {d:3d} {tokens:5d} tokens ({per_expert:6.1f} rows/expert) "
                          f"{layout:23s} loop {loop_s * 1e3:8.3f} ms  grouped {grouped_s * 1e3:8.3f} ms  "
                          f"ratio {grouped_s / loop_s:.2f}")
    for small, label in ((True, "<="), (False, ">")):
        if ratios[small]:
            print(f"grouped / loop time, rows per expert {label} {limit}: "
                  f"{statistics.geometric_mean(ratios[small]):.2f}")


if __name__ == "__main__":
    main()
