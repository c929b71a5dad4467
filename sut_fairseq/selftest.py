"""Self-test of an installation: device, versions, expert path, kernel parity, one speed figure.

    python -m sut_fairseq.selftest [--device auto|cpu|cuda] [--skip-speed]

Prints the device, the versions of python / torch / triton / fairseq / sut_fairseq, and
which routed-linear backend (``SUT_KERNELS``) a tensor of that device takes. Then:

* parity, forward and backward (gradients of x, W, b and the gates) of the four
  routed-linear calls MoE-FFD and MoMHA make, on small ragged shapes with an empty expert
  and halted (no-op) slots. On CUDA: the Triton kernels against the PyTorch reference
  (fp32, and bf16 against the fp32 reference of the same bf16 values). On CPU: the
  reference against the definition, a per-slot loop ``y[s] = x[row(s)] @ W[e_s] + b[e_s]``.
  The error of a result is ``max |got - want| / max(1, max |want|)``;
* speed, for information: on CUDA the MoE-FFD expert GEMMs (up and gated down
  projection, bf16) of the Triton routed linear against dense cuBLAS GEMMs of the same
  active size, in TFLOP/s; on CPU the reference routed linear against ``torch.mm``.

Exit status 0 when every check passed, 1 otherwise.
"""
import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .ops.routed_linear import kernel_backend, reference_routed_linear
from .ops.routing import Routing, make_routing

# The four calls the layers make: rows of x, keyword arguments, has a bias, is gated.
USES = {
    "ffd_up": ("token", dict(grouped_out=True), True, False),  # MoE-FFD up: token rows -> sorted rows
    "ffd_down": ("sorted", dict(grouped_in=True), True, True),  # MoE-FFD down: sorted rows -> gated sum
    "momha_q": ("token", dict(), True, False),  # MoMHA query: token rows -> slot rows
    "momha_out": ("slot", dict(), False, True),  # MoMHA output: slot rows -> gated sum
}


class Shape:
    """A routing problem: N tokens, E experts (``load`` their relative loads, 0 = empty),
    top-k, ``halted`` tokens routed to the no-op expert, widths d_in -> d_out."""

    def __init__(self, name, N, k, load, halted, d_in, d_out):
        self.name, self.N, self.k, self.load, self.halted = name, N, k, load, halted
        self.E, self.d_in, self.d_out = len(load), d_in, d_out

    def describe(self) -> str:
        empty = [str(e) for e, w in enumerate(self.load) if w == 0]
        parts = [f"N={self.N} E={self.E} k={self.k} {self.d_in}->{self.d_out}"]
        if empty:
            parts.append(f"expert {','.join(empty)} empty")
        parts.append(f"{self.halted} halted")
        return ", ".join(parts)


SHAPES = [
    Shape("ragged", N=13, k=2, load=[6.0, 1.0, 3.0, 0.0, 0.5], halted=2, d_in=20, d_out=24),
    Shape("multi-tile", N=96, k=2, load=[1.0, 2.0, 0.5, 3.0, 1.0, 0.0], halted=5, d_in=40, d_out=72),
    Shape("k=E", N=6, k=3, load=[1.0, 1.0, 1.0], halted=1, d_in=16, d_out=8),
]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
SPEED_GPU = dict(tokens=8192, E=24, k=4, d=512, D=512)
SPEED_CPU = dict(tokens=2048, E=8, k=2, d=256, D=256)


def loop_routed_linear(x, weight, bias, routing: Routing, fan_out: int, grouped_in: bool = False,
                       grouped_out: bool = False, gates: Optional[torch.Tensor] = None):
    """The definition, one slot at a time: ``y[s] = x[row(s)] @ W[e_s] + b[e_s]``.

    Slots of the no-op expert E give nothing. Output: slot rows, sorted rows
    (``grouped_out``) or, with gates, ``sum_j g_j y_j`` over each token's k slots."""
    E, k = routing.num_experts, routing.k
    sorted_row = {s: m for m, s in enumerate(routing.sorted_scattered_idxs.tolist())}
    flat_gates = gates.reshape(-1) if gates is not None else None
    rows = [x.new_zeros(weight.size(2))] * (routing.num_tokens if gates is not None else routing.num_slots)
    for s, e in enumerate(routing.expert_idxs.reshape(-1).tolist()):
        if e == E:
            continue
        y = x[sorted_row[s] if grouped_in else s // fan_out] @ weight[e]
        if bias is not None:
            y = y + bias[e]
        if gates is not None:
            rows[s // k] = rows[s // k] + flat_gates[s] * y
        else:
            rows[sorted_row[s] if grouped_out else s] = y
    return torch.stack(rows)


def _problem(shape: Shape, use: str, device: torch.device, seed: int = 0):
    """fp32 CPU operands [x, W, b, gates], the routing on ``device``, the call's kwargs."""
    g = torch.Generator().manual_seed(seed)
    load = torch.tensor(shape.load)
    idx = torch.multinomial(load.expand(shape.N, -1), shape.k, generator=g)
    idx[torch.randperm(shape.N, generator=g)[:shape.halted]] = shape.E
    gates = torch.rand(shape.N, shape.k, generator=g)
    gates = gates / gates.sum(1, keepdim=True) * (idx < shape.E)
    rows, kwargs, has_bias, gated = USES[use]
    x = torch.randn(shape.N if rows == "token" else shape.N * shape.k, shape.d_in, generator=g)
    w = torch.randn(shape.E, shape.d_in, shape.d_out, generator=g) / shape.d_in ** 0.5
    b = torch.randn(shape.E, shape.d_out, generator=g) if has_bias else None
    routing = make_routing(idx.to(device), gates.to(device), shape.E)
    kwargs = dict(kwargs, fan_out=shape.k if rows == "token" else 1)
    return [x, w, b, gates if gated else None], routing, kwargs


def _fwd_bwd(fn: Callable, operands, routing, kwargs, dy: torch.Tensor) -> List[torch.Tensor]:
    """[y, dx, dW, db, dgates] of ``fn`` (absent ones left out)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in operands]
    x, w, b, gates = leaves
    y = fn(x, w, b, routing, gates=gates, **kwargs)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves if t is not None]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def parity(shape: Shape, device: torch.device, dtype: torch.dtype,
           kernels: Optional[bool] = None) -> Tuple[float, float]:
    """(forward error, backward error), the largest over the four uses. ``kernels``
    (default: on CUDA): the Triton kernels against the reference, else the reference
    against the per-slot loop."""
    if device.type == "cuda" if kernels is None else kernels:
        from .kernels import triton_routed_linear as candidate

        oracle = reference_routed_linear
    else:  # the reference is the candidate, the loop the oracle
        candidate, oracle = reference_routed_linear, loop_routed_linear
    fwd = bwd = 0.0
    for seed, use in enumerate(USES):
        operands, routing, kwargs = _problem(shape, use, device, seed)
        operands = [t.to(device, dtype) if t is not None else None for t in operands]
        exact = [t.float() if t is not None else None for t in operands]  # same values, fp32
        out_rows = routing.num_tokens if operands[3] is not None else routing.num_slots
        dy = torch.randn(out_rows, shape.d_out, generator=torch.Generator().manual_seed(100 + seed))
        dy = dy.to(dtype).to(device)
        got = _fwd_bwd(candidate, operands, routing, kwargs, dy)
        want = _fwd_bwd(oracle, exact, routing, kwargs, dy.float())
        if len(got) != len(want):
            return float("inf"), float("inf")
        fwd = max(fwd, _error(got[0], want[0]))
        bwd = max([bwd] + [_error(a, e) for a, e in zip(got[1:], want[1:])])
    return fwd, bwd


def median_seconds(fn: Callable, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` after ``warmup`` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(device: torch.device, cfg: Optional[dict] = None,
          kernels: Optional[bool] = None) -> Tuple[str, str]:
    """(what was timed, the figures): the routed expert GEMMs against dense GEMMs of the
    same active size. ``kernels`` (default: on CUDA): time the Triton routed linear (bf16)
    against dense GEMMs, else the reference (fp32) against ``torch.mm``."""
    kernels = device.type == "cuda" if kernels is None else kernels
    cfg = cfg or (SPEED_GPU if kernels else SPEED_CPU)
    N, E, k, d, D = cfg["tokens"], cfg["E"], cfg["k"], cfg["d"], cfg["D"]
    dtype = torch.bfloat16 if kernels else torch.float32
    g = torch.Generator().manual_seed(0)
    top = torch.randn(N, E, generator=g).softmax(-1).topk(k, dim=1)
    gates = (top.values / top.values.sum(1, keepdim=True)).to(device, dtype)
    routing = make_routing(top.indices.to(device), gates, E)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device, dtype)

    x, xd = rand(N, d), rand(N * k, d)
    w1, b1, w2, b2 = rand(E, d, D, scale=d ** -0.5), rand(E, D), rand(E, D, d, scale=D ** -0.5), rand(E, d)
    wd1, wd2 = rand(d, D, scale=d ** -0.5), rand(D, d, scale=D ** -0.5)
    if kernels:  # MoE-FFD up and gated down projection, forward
        from .kernels import triton_routed_linear

        def routed():
            h = triton_routed_linear(x, w1, b1, routing, k, grouped_out=True)
            return triton_routed_linear(h, w2, b2, routing, 1, grouped_in=True, gates=gates)

        def dense():
            return (xd @ wd1) @ wd2

        flops, repeats, unit, scale = 2 * (2 * N * k * d * D), 20, "TFLOP/s", 1e12
        names = ("Triton routed linear", "dense cuBLAS")
    else:  # the up projection: token rows -> sorted rows
        def routed():
            return reference_routed_linear(x, w1, b1, routing, k, grouped_out=True)

        def dense():
            return torch.mm(xd, wd1)

        flops, repeats, unit, scale = 2 * N * k * d * D, 5, "GFLOP/s", 1e9
        names = ("reference routed linear", "dense torch.mm")
    with torch.no_grad():
        t_routed = median_seconds(routed, device, repeats)
        t_dense = median_seconds(dense, device, repeats)
    a, b = flops / t_routed / scale, flops / t_dense / scale
    what = (f"{'MoE-FFD up + gated down' if kernels else 'MoE-FFD up projection'} "
            f"forward, {N} tokens E={E} k={k} {d}->{D} {'bf16' if dtype == torch.bfloat16 else 'fp32'}")
    figures = f"{names[0]} {a:.1f} {unit} vs {names[1]} {b:.1f} {unit} ({a / b:.2f}x)"
    if device.type == "cpu":
        what += f", {torch.get_num_threads()} thread(s)"
        figures += "; the GPU figure needs a CUDA device"
    return what, figures


def _first_line(err: Exception, width: int) -> str:
    return (str(err).splitlines() or [""])[0][:width]


def _device_line(device: torch.device) -> str:
    if device.type != "cuda":
        why = "no CUDA device" if not torch.cuda.is_available() else "CUDA device not used (--device cpu)"
        return f"CPU: {why}"
    p = torch.cuda.get_device_properties(device)
    return (f"{p.name}, compute capability {p.major}.{p.minor}, "
            f"{p.total_memory / 2 ** 30:.1f} GiB, CUDA {torch.version.cuda}")


def _versions() -> str:
    import fairseq

    import sut_fairseq

    try:
        import triton

        triton_version = triton.__version__
    except Exception as err:  # noqa: BLE001  (not installed, or broken)
        triton_version = f"not importable ({type(err).__name__})"
    return (f"python {platform.python_version()}, torch {torch.__version__}, triton {triton_version}, "
            f"fairseq {fairseq.__version__}, sut_fairseq {sut_fairseq.__version__}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sut_fairseq.selftest", description=__doc__.splitlines()[0],
        epilog="Exit status 0 when every check passed, 1 otherwise.")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA when available (default)")
    parser.add_argument("--skip-speed", action="store_true", help="leave out the speed figure")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")

    results: Dict[str, bool] = {}

    def report(label: str, text: str) -> None:
        print(f"{label:<12}: {text}", flush=True)

    print("sut_fairseq self-test")
    report("device", _device_line(device))
    report("versions", _versions())
    try:
        backend = kernel_backend(torch.empty(0, device=device))
        report("expert path", f"{backend} (SUT_KERNELS={os.environ.get('SUT_KERNELS', 'auto')}, "
                              f"{device.type} tensors)")
    except Exception as err:  # noqa: BLE001
        report("expert path", f"ERROR {type(err).__name__}: {err}")
        results["expert path"] = False

    if device.type == "cuda":
        cases = [(s, torch.float32) for s in SHAPES] + [(SHAPES[1], torch.bfloat16)]
        report("parity", "Triton vs reference routed linear, 4 layouts, forward + backward")
    else:
        cases = [(s, torch.float32) for s in SHAPES]
        report("parity", "reference routed linear vs a per-slot loop, 4 layouts, forward + backward")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity in full fp32
    try:
        for shape, dtype in cases:
            label = f"{shape.name} {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
            try:
                fwd, bwd = parity(shape, device, dtype)
                ok = fwd <= TOL[dtype] and bwd <= TOL[dtype]
                text = f"fwd {fwd:.1e} bwd {bwd:.1e} (tol {TOL[dtype]:.0e})"
            except Exception as err:  # noqa: BLE001
                ok, text = False, f"ERROR {type(err).__name__}: {_first_line(err, 80)}"
            results[label] = ok
            print(f"  {label:<16} {shape.describe():<46} {text} {'PASS' if ok else 'FAIL'}", flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

    if not args.skip_speed:
        try:
            what, figures = speed(device)
            report("speed", what)
            print(" " * 14 + figures, flush=True)
        except Exception as err:  # noqa: BLE001
            report("speed", f"ERROR {type(err).__name__}: {_first_line(err, 100)}")
            results["speed"] = False
    passed = sum(results.values())
    report("result", f"{'PASS' if passed == len(results) else 'FAIL'} ({passed}/{len(results)} checks passed)")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
