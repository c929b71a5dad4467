"""Where one CPU training step of ``sut_logic`` goes, against the transformer of the logic
recipe, on the same logical-inference batch as ``benchmarks/train_step.py --preset logic``
(pre-LN, the recipe's losses, the SUT's halting forced so that positions halt at different
steps, ``--halting-bias``).

For each model it profiles one step (``torch.profiler``, after two untimed steps) and
sorts the operators' self time into four groups:

* ``matmul``: mm, addmm, bmm, matmul and fused attention kernels (the arithmetic);
* ``gather/scatter``: index_select, index_add_, index_copy_, scatter_add_, gather,
  scatter, the row moves of routing;
* ``copies and fills``: copy_, fill_, zero_, clone, cat (layout changes, buffers);
* ``other``: every other operator (elementwise, softmax, LayerNorm, GELU, the autograd
  functions' own Python, …).

It prints the groups' milliseconds and shares, the number of operator calls, the top
operators, and two ratios the SUT would reach against the transformer (tokens/s): with
every non-matmul operator of the SUT free and the transformer as profiled (what removing
the SUT's overhead alone could give at most), and with only the arithmetic of both
(``matmul-only R``, the arithmetic's own ratio). Profiling slows every operator call a little, so
absolute times are above ``train_step.py``'s; the shares are what this script is for.

    python benchmarks/profile_step.py [--threads 1] [--top 12] [--halting-bias 0.5]
"""
import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step  # noqa: E402

GROUPS = {
    "matmul": {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
               "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward"},
    "gather/scatter": {"aten::index_select", "aten::index_add_", "aten::index_copy_",
                       "aten::scatter_add_", "aten::gather", "aten::scatter", "aten::scatter_"},
    "copies and fills": {"aten::copy_", "aten::fill_", "aten::zero_", "aten::clone", "aten::cat"},
}


def group_of(name: str) -> str:
    for group, names in GROUPS.items():
        if name in names:
            return group
    return "other"


def profile_step(step) -> list:
    """The profiler's per-operator averages of one call of ``step`` (after two untimed calls)."""
    step()
    step()
    return train_step.profiled(step)[0]


def summarise(name: str, events, top: int) -> float:
    """Print the groups and the top operators of one model; returns its matmul ms."""
    groups = collections.Counter()
    for e in events:
        groups[group_of(e.key)] += e.self_cpu_time_total / 1e3
    total = sum(groups.values())
    calls = sum(e.count for e in events)
    print(f"\n{name}: {total:.0f} ms of operator self time, {calls:,} operator calls")
    for group in list(GROUPS) + ["other"]:
        print(f"  {group:18s} {groups[group]:8.1f} ms  {100 * groups[group] / total:5.1f} %")
    print(f"  top {top} operators by self time:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"    {e.key:40s} {e.count:7,d} calls {e.self_cpu_time_total / 1e3:8.1f} ms")
    return groups["matmul"], total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--logic-tokens", type=int, default=2048,
                        help="source tokens of the batch (the recipe's --max-tokens)")
    parser.add_argument("--halting-bias", type=float, default=0.5,
                        help="the forcing of train_step.py --preset logic (about 8 of 12 steps)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sample, vocab, src_tokens = train_step.make_logic_batch(args.logic_tokens, args.seed)
    print(f"torch {torch.__version__}, {args.threads} thread(s); logic batch of "
          f"{sample['nsentences']} pairs, {src_tokens} source tokens")
    steps_log = []
    result = {}
    for arch in train_step.LOGIC_MODELS:
        step = train_step.make_step(arch, sample, vocab, args.halting_bias,
                                    steps_log if arch == "sut_logic" else None)
        result[arch] = summarise(arch, profile_step(step), args.top)
    (sut_mm, sut_total), (tf_mm, tf_total) = result["sut_logic"], result["transformer"]
    print(f"\nsut_logic mean executed encoder steps: {sum(steps_log) / len(steps_log):.2f} of 12")
    print(f"sut_logic / transformer tokens/s under the profiler: {tf_total / sut_total:.2f}; "
          f"with the SUT's non-matmul operators free: {tf_total / sut_mm:.2f}; "
          f"matmul-only R (both models' other operators free): {tf_mm / sut_mm:.2f}")


if __name__ == "__main__":
    main()
