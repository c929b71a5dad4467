"""Ahead-of-time builds of the Triton kernels for sm_80 (Ampere) and sm_90 (Hopper), no GPU.

See docs/model.md#kernels. Every kernel launch the routed-linear autograd Function makes (forward,
input gradient, weight gradient of MoE-FFD up/down and MoMHA query/output) is compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` for every shipped
(autotuned) configuration; ``cuobjdump -res-usage`` must report no spills (zero stack and
local bytes) and ``compiled.metadata.shared`` must fit the architecture's per-block limit.

The default run covers fp16 operands (tensor-core configurations, as with autocast; bf16
and TF32 use the same configurations) and fp32 without TF32 (FMA configurations), so each
shipped configuration is checked; ``-m slow`` adds bf16 and fp32 with TF32.
``python -m sut_fairseq.kernels.aot`` prints the whole table.

Compiling needs a process where Triton is not in interpreter mode; otherwise the tests run
in a child pytest process without ``TRITON_INTERPRET`` (``sut_fairseq/kernels/testing.py``).
"""
import os

import pytest

from sut_fairseq.kernels.testing import compiler_active, delegate_module

IN_PROCESS = compiler_active()

ARCHS = (80, 90)
KERNELS = ("_routed_gemm", "_routed_wgrad")
DEFAULT_DTYPES = ("fp16", "fp32-ieee")
SLOW_DTYPES = ("bf16", "fp32")
_cache = {}


def _results(dtypes):
    """Build every job for ``dtypes`` once per session (2 worker processes)."""
    from sut_fairseq.kernels import aot

    if dtypes not in _cache:
        _cache[dtypes] = aot.compile_all(aot.all_jobs(dtypes), processes=min(2, os.cpu_count() or 1))
    return _cache[dtypes]


def _check(results, dtype, arch, kernel):
    from sut_fairseq.kernels import aot
    from sut_fairseq.kernels import grouped_gemm as gg

    mine = [r for r in results if r.dtype == dtype and r.arch == arch and r.kernel == kernel]
    table = aot.format_table(mine)
    assert mine, f"nothing built for {dtype} sm_{arch} {kernel}"
    bad = [r for r in mine if not r.ok]
    assert not bad, f"spills or shared memory over the sm_{arch} limit:\n{table}"
    # every shipped configuration of this kernel was built for every launch of it
    kernel_fn = next(k for k in gg.KERNELS if k.__name__ == kernel)
    precision = "ieee" if dtype == "fp32-ieee" else "tf32"
    # (with an input activation's gradient, the configurations that spill there left out)
    activated = {name for name, _, args in aot.shipped_launches("fp16") if args.get("ACT")}
    for launch in {r.launch for r in mine}:
        wanted = {aot.config_name(c) for c in gg.shipped_configs(kernel_fn, precision,
                                                                 launch in activated,
                                                                 aot.DTYPES[dtype][0])}
        built = {r.config for r in mine if r.launch == launch}
        assert built == wanted, (launch, built, wanted)
    print(table)


def test_cuobjdump_available():
    from sut_fairseq.kernels import aot

    assert os.access(aot.cuobjdump(), os.X_OK), aot.cuobjdump()


def test_launches_cover_every_use():
    """The recorded launches are the forward, input- and weight-gradient of each use, and
    the weight gradient that adds a running sum (a later recurrence step's)."""
    from sut_fairseq.kernels import aot

    for dtype in aot.DTYPES:
        names = [name for name, _, _ in aot.shipped_launches(dtype)]
        assert names == [f"{use}.{p}" for use in aot.USES for p in ("fwd", "dx", "dw", "dw-acc")]


def test_every_dot_dimension_is_at_least_16():
    """Triton before 3.7 refuses a ``tl.dot`` with a dimension below 16, also on FMA units
    (the GPU node's Triton 3.6 failed the fp32 launches on an 8-deep tile that this
    machine's Triton compiles); the builds above use this machine's Triton only. The gemm
    multiplies BLOCK_M x BLOCK_K by BLOCK_K x BLOCK_N, the weight gradient
    BLOCK_K x BLOCK_M by BLOCK_M x BLOCK_N."""
    from sut_fairseq.kernels import grouped_gemm as gg

    for kernel in gg.KERNELS:
        for precision in ("tf32", "ieee"):
            for config in gg.shipped_configs(kernel, precision):
                small = {k: v for k, v in config.kwargs.items() if k.startswith("BLOCK_") and v < 16}
                assert not small, (kernel.__name__, precision, config)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DEFAULT_DTYPES)
def test_no_spills_and_shared_memory_fits(dtype, arch, kernel):
    _check(_results(DEFAULT_DTYPES), dtype, arch, kernel)


# Block-wide barriers (BAR.SYNC) in one iteration of a kernel's main loop: the GEMM's
# pipelined loop has 2 (sm_90) or 3 (sm_80); the weight gradient 3-4 since its bias sum
# over rows is reduced once after the loop (10-11 when it was reduced every iteration).
MAX_LOOP_BARRIERS = 4


@pytest.mark.parametrize("arch", ARCHS)
def test_main_loops_wait_at_few_barriers(arch):
    """Every shipped launch and configuration: each iteration of the main loop (SASS)
    waits at most MAX_LOOP_BARRIERS times for the whole block and runs matrix
    instructions."""
    from sut_fairseq.kernels import aot

    mine = [r for r in _results(DEFAULT_DTYPES) if r.arch == arch]
    table = aot.format_table(mine)
    assert {r.launch for r in mine} == {f"{u}.{p}" for u in aot.USES for p in ("fwd", "dx", "dw", "dw-acc")}
    assert all(r.loop.mma > 0 for r in mine), table
    slow = [r for r in mine if r.loop.barriers > MAX_LOOP_BARRIERS]
    assert not slow, f"main loops waiting at more than {MAX_LOOP_BARRIERS} barriers:\n{table}"


def test_main_loop_reads_one_iteration_of_sass():
    """``main_loop`` on a hand-written listing: the loop with the most matrix
    instructions, counted once; a forward branch is not a loop."""
    from sut_fairseq.kernels.aot import LoopStats, main_loop

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/               @P0 BRA 0x0010 ;
        /*0040*/                   LDS R2, [R3] ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0070*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0080*/               @P1 BRA 0x00a0 ;
        /*0090*/               @P0 BRA 0x0040 ;
        /*00a0*/                   EXIT ;
    """
    assert main_loop(sass) == LoopStats(instructions=6, barriers=1, mma=2)
    with pytest.raises(RuntimeError, match="no loop with matrix instructions"):
        main_loop("/*0000*/  EXIT ;\n")


@pytest.mark.parametrize("arch", ARCHS)
def test_cross_entropy_kernels_build_without_spills(arch):
    """The label-smoothed cross entropy's forward and backward (``cross_entropy.py``) for
    the logits' dtypes a training run has (fp16, bf16 under autocast; fp32): built, no
    spills, shared memory within the limit."""
    from sut_fairseq.kernels import aot

    results = aot.compile_all(aot.ce_jobs(("fp16", "bf16", "fp32"), archs=(arch,)))
    table = aot.format_table(results)
    assert {(r.launch, r.dtype) for r in results} == {
        (f"ce.{p}", d) for p in ("fwd", "bwd") for d in ("fp16", "bf16", "fp32")}, table
    assert all(r.ok and r.loop is None for r in results), table


def _check_routers(arch, dtypes):
    from sut_fairseq.kernels import aot

    results = aot.compile_all(aot.route_jobs(dtypes, archs=(arch,)))
    table = aot.format_table(results)
    assert {(r.launch, r.dtype) for r in results} == {
        (f"route.{p}.E{E}k{k}", d) for p in ("rows", "sort", "bwd", "rows-nokeep", "bwd-nokeep")
        for E, k in aot.ROUTERS
        for d in dtypes}, table
    assert all(r.ok for r in results), table


@pytest.mark.parametrize("arch", ARCHS)
def test_router_kernels_build_without_spills(arch):
    """The routers' kernels (``routing_triton.py``: rows, sort, backward; the hidden layer
    formed in them, with and without the gating dropout's mask) for ``sut_base``'s
    and ``sut_big``'s routers (E 24 / 48, k 4) on bf16 logits: built (the interpreter does
    not check what the compiler refuses, e.g. a global that is not a constexpr), no spills,
    shared memory within the limit; ``-m slow`` adds fp32 (TF32 and IEEE products)."""
    _check_routers(arch, ("bf16",))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_router_kernels_build_without_spills_fp32(arch):
    _check_routers(arch, ("fp32", "fp32-ieee"))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", SLOW_DTYPES)
def test_no_spills_and_shared_memory_fits_other_dtypes(dtype, arch, kernel):
    _check(_results(SLOW_DTYPES), dtype, arch, kernel)


if not IN_PROCESS:
    delegate_module(globals(), {"TRITON_INTERPRET": None})
