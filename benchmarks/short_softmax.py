"""How slow is PyTorch's CPU softmax on short rows, and what does padding them buy?
``softmax(-1)`` against ``ops.short_softmax.softmax_lastdim`` (rows shorter than 16 floats
padded with -inf to 16), forward and forward + backward, one thread, the two timed in
turn within every repeat, on the rows the SUT makes: a router over E = 12 experts (a
decoder call's 320 rows, a logic training batch's 2,048 slots), incremental self-attention
over 15 cached positions (beam 5 x 64 sentences, 4 heads, k = 4 picks), and rows of 16 and
24 (no padding: the same kernel).

    python benchmarks/short_softmax.py [--repeats 50]

Prints one line per case ``... softmax X us padded Y us speed-up S``.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_cpu import median_times  # noqa: E402  (this folder is on sys.path)
from sut_fairseq.ops.short_softmax import softmax_lastdim  # noqa: E402

CASES = {
    "router, decoder call (320, 12)": (320, 12),
    "router, logic batch (2048, 12)": (2048, 12),
    "self-attention, position 15 (320, 4, 4, 15)": (320, 4, 4, 15),
    "rows of 16 (5120, 16)": (5120, 16),
    "rows of 24 (5120, 24)": (5120, 24),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, median of {args.repeats}")
    g = torch.Generator().manual_seed(0)
    for name, shape in CASES.items():
        x = torch.randn(*shape, generator=g)
        xg = x.clone().requires_grad_()
        grad = torch.randn(*shape, generator=g)

        def backward(fn):
            return lambda: fn(xg).backward(grad)

        plain, padded, plain_bw, padded_bw = median_times(
            [lambda: x.softmax(-1), lambda: softmax_lastdim(x),
             backward(lambda t: t.softmax(-1)), backward(softmax_lastdim)], args.repeats)
        print(f"{name:45s} forward: softmax {plain * 1e6:7.0f} us padded {padded * 1e6:7.0f} us "
              f"speed-up {plain / padded:5.2f} | forward+backward: {plain_bw * 1e6:7.0f} / "
              f"{padded_bw * 1e6:7.0f} us speed-up {plain_bw / padded_bw:5.2f}")


if __name__ == "__main__":
    main()
