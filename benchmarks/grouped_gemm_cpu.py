"""Would grouped GEMMs speed up the CPU's expert layers? The per-expert loop of the CPU
backend (``ExpertBlockLinear``: one GEMM per expert, gather and scatter block by block)
against the same routed linear map as ``torch.nn.functional.grouped_mm`` (one GEMM call
for all experts per pass, the rows gathered once), forward and forward + backward, at the
logic model's sizes (E = 12 experts, top-4, d = 128) on one thread.

    python benchmarks/grouped_gemm_cpu.py [--tokens 2000] [--repeats 10]

Prints one line per layout (the four the expert layers use) and pass, then
``grouped / loop time: R`` (below 1: grouped GEMMs are faster).
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_cpu import median_times  # noqa: E402  (this folder is on sys.path)
from sut_fairseq.ops import make_routing, routed_linear  # noqa: E402

E, K = 12, 4
LAYOUTS = {  # name: (in, out, routed_linear keywords, rows of x per token)
    "ffd up (token rows -> sorted rows)": (128, 128, dict(fan_out=K, grouped_out=True), 1),
    "ffd down (sorted rows -> gated sum)": (128, 128, dict(fan_out=1, grouped_in=True, gates=True), K),
    "query (token rows -> slot rows)": (128, 64, dict(fan_out=K), 1),
    "output (slot rows -> gated sum)": (64, 128, dict(fan_out=1, gates=True), K),
}


def grouped(x, weight, bias, routing, fan_out, grouped_in=False, grouped_out=False, gates=None):
    """The routed linear map with one ``grouped_mm`` per pass (autograd through it)."""
    ends = routing.expert_offsets
    active = int(ends[-1])
    slots = routing.sorted_scattered_idxs[:active]
    rows = x[:active] if grouped_in else x.index_select(0, slots // fan_out)
    y = F.grouped_mm(rows, weight, offs=ends.to(torch.int32))
    y = y + bias.index_select(0, routing.sorted_expert_idxs[:active])
    if grouped_out:
        return torch.cat([y, y.new_zeros(routing.num_slots - active, y.size(1))])
    if gates is None:
        return y.new_zeros(routing.num_slots, y.size(1)).index_copy(0, slots, y)
    y = y * gates.reshape(-1).index_select(0, slots).unsqueeze(1)
    return y.new_zeros(routing.num_tokens, y.size(1)).index_add(0, slots // routing.k, y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--halted", type=float, default=0.3, help="share of halted tokens")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not hasattr(F, "grouped_mm"):
        raise SystemExit(f"torch {torch.__version__} has no torch.nn.functional.grouped_mm")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    os.environ["SUT_KERNELS"] = "reference"
    N = args.tokens
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    active = torch.rand(N) >= args.halted
    idx = torch.where(active[:, None], idx, E)
    gates = torch.rand(N, K) * active[:, None]
    routing = make_routing(idx, gates, E)
    print(f"torch {torch.__version__}, 1 thread; {N} tokens, {int(active.sum())} running, "
          f"E = {E}, k = {K}; median of {args.repeats}")
    ratios = []
    for name, (din, dout, kw, per_token) in LAYOUTS.items():
        x = torch.randn(N * per_token, din, requires_grad=True)
        W = (torch.randn(E, din, dout) / din ** 0.5).requires_grad_()
        b = torch.zeros(E, dout, requires_grad=True)
        g = gates.clone().requires_grad_()
        kw = dict(kw, gates=g if kw.get("gates") else None)
        if kw.get("grouped_in"):  # sorted rows in: the first `active` rows are the routed ones
            kw["grouped_in"] = True
        for label, fn in (("loop", routed_linear), ("grouped", grouped)):
            y = fn(x, W, b, routing, **kw)
            if label == "loop":
                reference = y.detach()
            else:
                torch.testing.assert_close(y.detach(), reference, rtol=1e-4, atol=1e-4)
        fns = (routed_linear, grouped)

        def forward(fn):
            with torch.no_grad():
                fn(x, W, b, routing, **kw)

        def both(fn):
            y = fn(x, W, b, routing, **kw)
            y.backward(torch.ones_like(y))
        # each pass: the two ways timed in turn within every repeat (median_times)
        times = {"loop": [], "grouped": []}
        for run in (forward, both):
            for label, t in zip(times, median_times([lambda f=f: run(f) for f in fns], args.repeats, warmup=1)):
                times[label].append(t)
        for i, pass_name in enumerate(("forward", "forward + backward")):
            loop_s, grouped_s = times["loop"][i], times["grouped"][i]
            ratios.append(grouped_s / loop_s)
            print(f"{name:38s} {pass_name:18s} loop {loop_s * 1e3:7.2f} ms  grouped {grouped_s * 1e3:7.2f} ms"
                  f"  ratio {grouped_s / loop_s:.2f}")
    print(f"grouped / loop time: {statistics.geometric_mean(ratios):.2f}")


if __name__ == "__main__":
    main()
