"""Ahead-of-time compilation of the kernels for GPUs that are not here (docs/model.md#kernels).

``shipped_launches(dtype)`` runs the forward and backward of the four routed-linear uses
(MoE-FFD up/down, MoMHA query/output) on "meta" tensors, recording each kernel launch
instead of running it, so the specialisations compiled here are exactly the ones the
autograd Function launches (argument dtypes, layout constants, strides equal to 1 and
16-divisible integers specialised as the Triton runtime does).
``compile_launch`` builds one of them for ``GPUTarget("cuda", arch, 32)`` with one
configuration and reads its registers / stack (spill) bytes from
``cuobjdump -res-usage`` and its shared memory from ``compiled.metadata.shared``, and
``main_loop`` reads the SASS of its main loop (``cuobjdump -sass``): the instructions,
block-wide barriers and matrix instructions of one iteration, the cost a profile would
show and a CPU can count. ``ce_jobs`` and ``route_jobs`` add the label-smoothed cross
entropy's two kernels (``cross_entropy.py``) and the routers' three (``routing_triton.py``,
with the logits' product and the hidden layer's gradient product inside); resources only.

    python -m sut_fairseq.kernels.aot [--dtype fp16] [--jobs 2]   # prints the table
"""
import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import cross_entropy as ce
from . import grouped_gemm as gg
from . import launch
from . import routed_linear_triton as rlf
from . import routing_triton

ARCHS = (80, 90)
# Largest dynamic shared memory one block may opt into (bytes).
SHARED_LIMITS = {80: 163 * 1024, 90: 227 * 1024}
# operand type -> (torch dtype, torch.backends.cuda.matmul.allow_tf32)
DTYPES = {"fp16": (torch.float16, False), "bf16": (torch.bfloat16, False),
          "fp32": (torch.float32, True), "fp32-ieee": (torch.float32, False)}
_TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
               torch.int64: "i64", torch.int32: "i32", torch.bool: "i1"}

# name -> (rows of x: "token" (N), "slot" or "sorted" (M), keyword arguments, has bias)
USES = {
    # the forward also forms the down projection's input GELU(u) ⊙ keep · s (training)
    "ffd_up": ("token", dict(grouped_out=True, out_activation="gelu"), True),
    # the input gradient times GELU's slope and the activation dropout's mask (training)
    "ffd_down": ("sorted", dict(grouped_in=True, gated=True, activation="gelu"), True),
    "momha_q": ("token", dict(), True),
    "momha_out": ("slot", dict(gated=True), False),
}


@contextlib.contextmanager
def record_launches():
    """Collect ``(kernel, args)`` of every kernel launch in the block instead of running it."""
    launches = []
    previous = launch.recorder
    launch.recorder = lambda kernel, args: launches.append((kernel, dict(args)))
    try:
        yield launches
    finally:
        launch.recorder = previous


def shipped_launches(dtype: str, E: int = 24, d: int = 512, D: int = 512, k: int = 4,
                     N: int = 4096) -> List[Tuple[str, object, dict]]:
    """``(name, kernel, args)`` for the forward and backward launches of every use, with
    operands of type ``dtype`` (a key of ``DTYPES``)."""
    dtype, allow_tf32 = DTYPES[dtype]
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        return _shipped_launches(dtype, E, d, D, k, N)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _shipped_launches(dtype, E, d, D, k, N):
    M = N * k
    meta = dict(device="meta")
    routing = SimpleNamespace(
        expert_idxs=torch.empty(N, k, dtype=torch.long, **meta),
        sorted_expert_idxs=torch.empty(M, dtype=torch.long, **meta),
        sorted_scattered_idxs=torch.empty(M, dtype=torch.long, **meta),
        expert_offsets=torch.empty(E, dtype=torch.long, **meta),
        num_experts=E, num_slots=M, num_tokens=N, k=k,
    )
    out = []
    for use, (rows, kwargs, has_bias) in USES.items():
        kwargs = dict(kwargs)
        gated = kwargs.pop("gated", False)
        activation = kwargs.pop("activation", "")
        out_activation = kwargs.pop("out_activation", "")
        x = torch.empty(N if rows == "token" else M, d, dtype=dtype, **meta)
        w = torch.empty(E, d, D, dtype=dtype, **meta)
        b = torch.empty(E, D, dtype=dtype, **meta) if has_bias else None
        gates = torch.empty(N, k, dtype=torch.float32, **meta) if gated else None
        fan_out = k if rows == "token" else 1
        layout = (routing, fan_out, kwargs.get("grouped_in", False), kwargs.get("grouped_out", False))
        keep = torch.empty(x.shape, dtype=torch.bool, **meta) if activation else None
        with record_launches() as launches:  # the op's backend, forward and backward
            y = rlf.triton_forward(x, w, b, gates, *layout, out_activation=out_activation,
                                   out_keep=torch.empty(M, D, dtype=torch.bool, **meta)
                                   if out_activation else None, out_keep_scale=1.25)
            y = y[0] if out_activation else y
            # the gated output's gradient as the op reads it: one row per token, k slots each
            dout = y.new_empty(gates.size(0), y.size(1)) if gated else torch.empty_like(y)
            rlf.triton_backward(dout, x, w, b, gates, *layout, dout_fan=k if gated else 1,
                                needs=(True, True, has_bias, gated), activation=activation,
                                pre=torch.empty_like(x) if activation else None, keep=keep,
                                keep_scale=1.25)
            # a later recurrence step's weight gradient: it adds the running sum of the others
            rlf.triton_backward(dout, x, w, b, gates, *layout, dout_fan=k if gated else 1,
                                needs=(False, True, has_bias, False), acc_w=torch.empty_like(w),
                                acc_b=torch.empty_like(b) if has_bias else None)
        names = ["fwd", "dx", "dw", "dw-acc"]
        assert len(launches) == 4, launches
        out += [(f"{use}.{n}", kernel, args) for n, (kernel, args) in zip(names, launches)]
    return out


def specialize(kernel, args: dict, config: triton.Config) -> ASTSource:
    """The ``ASTSource`` the runtime would build for ``args`` (pointers 16-byte aligned)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if name in config.kwargs:
            signature[name], constexprs[name] = "constexpr", config.kwargs[name]
            continue
        value = args[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPE_NAMES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):  # the runtime passes a Python float as fp32
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: unexpected argument {value!r}")
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def read_cubin(cubin: bytes, option: str) -> str:
    """``cuobjdump option`` of ``cubin`` (``-res-usage``, ``-sass``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), option, f.name], check=True,
                              capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """``{"regs", "stack", "shared", "local"}`` of the single function in ``cubin``."""
    text = read_cubin(cubin, "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not found:
        raise RuntimeError(f"unexpected cuobjdump output:\n{text}")
    return dict(zip(("regs", "stack", "shared", "local"), map(int, found.groups())))


# Matrix instructions in SASS: Hopper's warpgroup MMA, Ampere's warp MMA, and the FMA units'
# fused multiply-adds (fp32 without TF32).
_MMA = re.compile(r"\b(HGMMA|HMMA|FFMA)\b")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA (0x[0-9a-f]+)")


@dataclass(frozen=True)
class LoopStats:
    """One iteration of a kernel's main loop in SASS."""
    instructions: int
    barriers: int  # BAR.SYNC: every warp of the block waits
    mma: int


def main_loop(sass: str) -> LoopStats:
    """The loop (a backward branch's body) with the most matrix instructions in ``sass``,
    the text of ``cuobjdump -sass`` for one kernel; its instructions are counted once as
    written: what one iteration runs when the body has no branch, an upper bound when it
    has one (a branch not taken skips its instructions)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    best = None
    for address, text in code:
        branch = _BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= address]
            stats = LoopStats(len(body), sum("BAR.SYNC" in t for t in body),
                              sum(bool(_MMA.search(t)) for t in body))
            if best is None or stats.mma > best.mma:
                best = stats
    if best is None or best.mma == 0:
        raise RuntimeError("no loop with matrix instructions in this kernel's SASS")
    return best


@dataclass
class Result:
    launch: str
    kernel: str
    config: str
    arch: int
    dtype: str  # operand type, a key of DTYPES
    regs: int
    spill_bytes: int  # stack frame + local memory: spills are the only source here
    shared: int
    loop: Optional[LoopStats]  # None: a kernel without a matrix loop (the cross entropy's)
    seconds: float

    @property
    def ok(self) -> bool:
        return self.spill_bytes == 0 and self.shared <= SHARED_LIMITS[self.arch]


def config_name(config: triton.Config) -> str:
    kw = config.kwargs
    blocks = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} " if "BLOCK_M" in kw else ""
    return f"{blocks}w{config.num_warps} s{config.num_stages}"


def compile_launch(name: str, dtype: str, kernel, args: dict, config: triton.Config, arch: int) -> Result:
    """Build one launch for ``sm_<arch>`` and read its resource usage."""
    start = time.perf_counter()
    compiled = triton.compile(specialize(kernel, args, config), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    usage = resource_usage(compiled.asm["cubin"])
    loop = main_loop(read_cubin(compiled.asm["cubin"], "-sass")) if kernel in gg.KERNELS else None
    return Result(name, kernel.__name__, config_name(config), arch, dtype, usage["regs"],
                  usage["stack"] + usage["local"], compiled.metadata.shared, loop,
                  time.perf_counter() - start)


def all_jobs(dtypes=("fp16",), archs=ARCHS, launch_filter=None):
    """Every (launch, kernel, args, config, arch) to build: each shipped configuration."""
    jobs = []
    for dtype in dtypes:
        for name, kernel, args in shipped_launches(dtype):
            if launch_filter is not None and not launch_filter(name):
                continue
            for config in gg.shipped_configs(kernel, args["INPUT_PRECISION"], bool(args.get("ACT")),
                                             args["X"].dtype):
                for arch in archs:
                    jobs.append((name, dtype, kernel, args, config, arch))
    return jobs


def ce_launches(dtype: str, N: int = 4096, V: int = 32768) -> List[Tuple[str, object, dict]]:
    """``(name, kernel, args)`` of the cross entropy's forward and backward launches on
    "meta" logits of ``dtype`` (a key of ``DTYPES``)."""
    meta = dict(device="meta")
    logits = torch.empty(N, V, dtype=DTYPES[dtype][0], **meta)
    row = torch.empty(N, dtype=torch.float32, **meta)
    target = torch.empty(N, dtype=torch.long, **meta)
    with record_launches() as launches:
        lse, _ = ce.ce_forward(logits, target, 1, 0.9, 1e-5)
        ce.ce_backward(logits, lse, target, row[:1], 1, 0.9, 1e-5)
    return [(f"ce.{n}", kernel, args) for n, (kernel, args) in zip(("fwd", "bwd"), launches)]


def route_launches(dtype: str, E: int, k: int, N: int = 4096, D: int = 512) -> List[Tuple[str, object, dict]]:
    """``(name, kernel, args)`` of a router's forward (rows, sort) and backward launches on
    "meta" tensors of ``dtype``, as the routers make them: the hidden layer's
    pre-activation (N, D) (``pre_tanh``) with the gating dropout's mask (training) and
    without (``-nokeep``: evaluation, or no gating dropout), the last layer's weight (E, D),
    k picks."""
    meta = dict(device="meta")
    u = torch.empty(N, D, dtype=DTYPES[dtype][0], **meta)
    weight = torch.empty(E, D, dtype=u.dtype, **meta)
    active = torch.empty(N, dtype=torch.bool, **meta)
    running = torch.empty(2 * E + 2, **meta)  # a training forward's running statistics
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = DTYPES[dtype][1]  # the products' input precision
    out = []
    try:
        for keep, suffix in ((torch.empty(N, D, dtype=torch.bool, **meta), ""), (None, "-nokeep")):
            with record_launches() as launches:
                _, expert_idxs, *_ = routing_triton.route_top_k(u, weight, active, k, u.dtype, running,
                                                                keep, 1.25, True)
                routing_triton.route_top_k_backward(u, weight, active, expert_idxs,
                                                    torch.empty(N, k, **meta),
                                                    torch.empty(2 * E + 2, **meta), keep, 1.25, True)
            # the sort does not read the hidden layer: built once
            names = ("rows", "sort", "bwd") if not suffix else ("rows-nokeep", None, "bwd-nokeep")
            out += [(f"route.{n}.E{E}k{k}", kernel, args)
                    for n, (kernel, args) in zip(names, launches) if n is not None]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return out


def _operand_dtypes(dtypes):
    return dict.fromkeys("fp32" if d == "fp32-ieee" else d for d in dtypes)


def ce_jobs(dtypes=("fp16",), archs=ARCHS):
    """The cross entropy's builds (its one configuration: ``NUM_WARPS`` warps)."""
    config = triton.Config({}, num_warps=ce.NUM_WARPS)
    return [(name, dtype, kernel, args, config, arch) for dtype in _operand_dtypes(dtypes)
            for name, kernel, args in ce_launches(dtype) for arch in archs]


#: the routers built: sut_base's (E 24, k 4) and sut_big's (E 48)
ROUTERS = ((24, 4), (48, 4))


def route_jobs(dtypes=("fp16",), archs=ARCHS):
    """The routers' builds, for each of ``ROUTERS`` (one configuration: ``NUM_WARPS``)."""
    config = triton.Config({}, num_warps=routing_triton.NUM_WARPS)
    return [(name, dtype, kernel, args, config, arch) for dtype in dtypes
            for E, k in ROUTERS for name, kernel, args in route_launches(dtype, E, k)
            for arch in archs]


_JOBS = []


def _run_job(i: int) -> Result:
    return compile_launch(*_JOBS[i])


def compile_all(jobs, processes: int = 1) -> List[Result]:
    """Compile ``jobs`` (see ``all_jobs``), in ``processes`` forked workers if > 1."""
    global _JOBS
    _JOBS = list(jobs)
    if processes <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [_run_job(i) for i in range(len(_JOBS))]
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_run_job, range(len(_JOBS))))


def format_table(results: List[Result]) -> str:
    head = (f"{'launch':<16} {'config':<18} {'dtype':<9} {'sm':>3} {'regs':>4} {'spill B':>7} "
            f"{'shared B':>8} {'limit B':>7} ok  | main loop: {'instr':>5} {'bar':>3} {'mma':>4}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.launch:<16} {r.config:<18} {r.dtype:<9} {r.arch:>3} {r.regs:>4} "
                     f"{r.spill_bytes:>7} {r.shared:>8} {SHARED_LIMITS[r.arch]:>7} {'yes' if r.ok else 'NO ':<3} "
                     f"|            " + (f"{r.loop.instructions:>5} {r.loop.barriers:>3} {r.loop.mma:>4}"
                                           if r.loop else f"{'-':>5} {'-':>3} {'-':>4}"))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    start = time.perf_counter()
    results = compile_all(all_jobs(args.dtype) + ce_jobs(args.dtype) + route_jobs(args.dtype), args.jobs)
    print(format_table(results))
    bad = [r for r in results if not r.ok]
    print(f"{len(results)} builds in {time.perf_counter() - start:.0f} s; {len(bad)} over budget")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
