"""The plugin's CPU dropout (``sut_fairseq.modules.dropout``) against ``F.dropout``.

Times the forward and the backward separately on the tensor shapes of a ``sut_base``
step (the (k·N, D) expert hidden units of 4,096 tokens, a (B, T, d) residual stream) at
p = 0.2, the two implementations taking turns in every repeat, and prints the medians
and the ratio ours / F.dropout of forward + backward on its last line.

    python benchmarks/dropout_cpu.py [--repeats 20] [--p 0.2]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from sut_fairseq.modules.dropout import dropout

SHAPES = [(16384, 512), (128, 32, 512)]


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--p", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    impls = {"F.dropout": lambda x: F.dropout(x, args.p, True),
             "sut_fairseq": lambda x: dropout(x, args.p, True)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, p = {args.p}")
    total = {name: 0.0 for name in impls}
    for shape in SHAPES:
        x = torch.randn(*shape, requires_grad=True)
        upstream = torch.randn(*shape)
        fwd = {name: [] for name in impls}
        bwd = {name: [] for name in impls}
        for i in range(args.repeats + 1):  # repeat 0 warms up
            for name, fn in impls.items():
                out = []
                t_fwd = timed(lambda: out.append(fn(x)))
                t_bwd = timed(lambda: torch.autograd.grad(out[0], x, upstream))
                if i > 0:
                    fwd[name].append(t_fwd)
                    bwd[name].append(t_bwd)
        for name in impls:
            f, b = statistics.median(fwd[name]), statistics.median(bwd[name])
            total[name] += f + b
            print(f"{str(shape):16s} {name:12s} forward {1e3 * f:8.2f} ms   backward {1e3 * b:8.2f} ms")
    print(f"ratio {total['sut_fairseq'] / total['F.dropout']:.2f}")


if __name__ == "__main__":
    main()
