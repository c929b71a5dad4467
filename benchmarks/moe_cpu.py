"""MoE-FFD on the CPU reference path against a dense FFN with the same active MACs.

MoE-FFD (E=24, k=4, D=512) with d=512 on 4,096 tokens, forward + backward, against a
dense FFN of width k·D = 2,048 (what each token actually computes in the mixture), in the
same process, the two timed in turn within every repeat. Prints the median time of each
and, on its last line, ``ratio R``
(sparse / dense; the goal is R <= 1.3).

    python benchmarks/moe_cpu.py [--tokens 4096] [--repeats 7]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn

from sut_fairseq.modules.moe_ffd import MoEFeedForward


def median_times(fns, repeats: int, warmup: int = 2):
    """Median time of each function, the functions timed in turn within every repeat, so a
    slow spell of the machine (a shared VM) falls on all of them rather than on one."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--experts", type=int, default=24)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    d, k, D = args.dim, args.topk, args.hidden

    moe = MoEFeedForward(d, D, args.experts, k, router_hidden_dim=d, activation_fn="gelu")
    dense = nn.Sequential(nn.Linear(d, k * D), nn.GELU(), nn.Linear(k * D, d))
    x = torch.randn(args.tokens, d, requires_grad=True)
    active = torch.ones(args.tokens, dtype=torch.bool)

    def step_moe():
        moe.zero_grad(set_to_none=True)
        moe(x, active).sum().backward()

    def step_dense():
        dense.zero_grad(set_to_none=True)
        dense(x).sum().backward()

    t_moe, t_dense = median_times([step_moe, step_dense], args.repeats)
    macs = 2 * args.tokens * d * k * D  # forward MACs of both (router excluded)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens, d={d}")
    print(f"MoE-FFD (E={args.experts}, k={k}, D={D}) fwd+bwd: {1e3 * t_moe:8.1f} ms")
    print(f"dense FFN (width {k * D})       fwd+bwd: {1e3 * t_dense:8.1f} ms")
    print(f"active forward MACs each: {macs / 1e9:.2f} G")
    print(f"ratio {t_moe / t_dense:.2f}")


if __name__ == "__main__":
    main()
