"""How inductor sums a shared weight's gradients over the steps of one compiled graph.

The GPU model (``gpu_model.py``) assumes that inside a ``--compile-loop`` graph the L
steps' gradients of a shared parameter cost no engine ``add`` per step (as they do between
the separately compiled graphs of ``--compile-step``). This compiles, on the CPU, a loop of
L steps ``x <- tanh(x W^T)`` over one shared W (as a recurrence uses its block's weights),
runs forward and backward, and prints what inductor generated for the backward: its GEMMs,
how many of them accumulate into the previous step's dW (``addmm`` with the running sum
as its input), and its other kernels. Inductor's scheduler is the same on CUDA; its
code generation is not, so this shows the graph transformation, not CUDA kernels.

    python benchmarks/inductor_accumulation.py [--steps 6]

Ends with ``inductor accumulation: L steps, G gemms, A accumulating, K other kernels``.
"""
import argparse
import re

import torch
from torch._inductor.utils import run_and_get_code


def loop(x: torch.Tensor, weight: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = torch.tanh(x @ weight.t())
    return x.sum()


def backward_code(steps: int) -> str:
    """The generated code of the compiled loop's backward graph."""
    torch.manual_seed(0)
    weight = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    compiled = torch.compile(lambda x, w: loop(x, w, steps), fullgraph=True)

    def run():
        compiled(x, weight).backward()
    _, codes = run_and_get_code(run)
    return codes[-1]  # forward first, then backward


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (a weight used once has nothing to sum); got {args.steps}")
    code = backward_code(args.steps)
    calls = code[code.index("def call("):]
    gemms = re.findall(r"extern_kernels\.(mm|addmm|bmm)\(", calls)
    accumulating = len(re.findall(r"extern_kernels\.addmm\(buf\d+,", calls))
    others = re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\(", calls, flags=re.M)
    print(f"backward of {args.steps} steps over one shared weight: {len(gemms)} GEMMs "
          f"({', '.join(f'{gemms.count(n)} {n}' for n in sorted(set(gemms)))}), "
          f"{accumulating} of them adding into the running dW; other kernels: {len(others)} "
          f"({', '.join(sorted(set(others)))})")
    print(f"inductor accumulation: {args.steps} steps, {len(gemms)} gemms, {accumulating} accumulating, "
          f"{len(others)} other kernels")


if __name__ == "__main__":
    main()
