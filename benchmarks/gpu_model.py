"""A model of one GPU training step that runs on the CPU: kernel launches and device time.

One training step of ``benchmarks/train_step.py`` (zero grads, criterion forward,
backward; no optimizer step, as the GPU profiles timed) runs on "meta" tensors, which
carry shapes and dtypes but no data, with the CUDA code path forced (``Tensor.is_cuda``
reads True on them, so the routed ops take their Triton branch, ``masked_linear`` and the
dropout their CUDA form). A ``TorchDispatchMode`` records every leaf aten operation, the
Triton launches of the routed ops are recorded instead of run (``kernels.aot``'s launch
recorder), ``scaled_dot_product_attention`` counts as the fused kernel a GPU runs, and
what reads data on the host gets a fixed answer: every position runs every step (the
fresh model of the GPU runs did: 60 routed-linear backwards per step), every mask row
is selected.

Each record becomes kernels of a kind:

* ``gemm``: cuBLAS products (``mm``, ``bmm``, ``addmm``, ``baddbmm``), one launch each,
  with their (batch, M, N, K) and dtype, and PyTorch's grouped GEMM (``_grouped_mm``, the
  routed products under ``--expert-gemm grouped_mm``, priced by their own factor); the alignment lint flags any dimension that is
  not a multiple of 8 in bf16/fp16 (cuBLAS then falls back to slow kernels);
* ``attention``: a fused ``scaled_dot_product_attention``, or with ``--flex-attention``
  (the ``+flex`` suffix of an arch) the FlexAttention kernel (1 launch forward, 2 backward);
* ``custom``: aten work inside the plugin's custom ops (``sut::*``: zero-fills, sums, casts);
* ``triton``: the routed ops' Triton launches (``_routed_gemm``, ``_routed_wgrad``) and the
  label-smoothed cross entropy's (``_ce_forward``, ``_ce_backward``: one pass over the
  logits each, priced by their bytes) and the routers' (``_route_rows``, ``_route_sort``:
  ``sut::route_top_k``, priced by the bytes of their tensors);
* ``accum``: the backward's additions of a shared parameter's gradients (one per extra use);
* ``aten``: every other aten kernel (elementwise, reductions, sorts: ``LAUNCHES`` lists the
  operations of more than one kernel);
* ``inductor``: compiled models only, the fusion model below.

**Compiled** (``--compile-step``, ``--compile-loop``; fairseq's transformer as
``torch.compile`` whole): inductor's CUDA code cannot be generated without a GPU here, so
the compiled regions (each side's step or loop, its backward; the transformer's forward and
backward) run the same code eagerly, ``torch.compiler.is_compiling()`` reading True in
them (so they take the branches a traced graph has: the counting sort, ``masked_linear``),
and a stated fusion model replaces inductor: GEMMs,
attention, sorts and the custom ops stay extern kernels (as inductor keeps them); between
two extern kernels of a region (scalar constants, ``CONSTANTS``, are literals there), the
other operations that share data (a producer and its consumer, readers of one tensor)
fuse into one kernel per distinct iteration size (numel of the op's largest tensor; a sum
over fewer than 8 elements per output and a gather, which inductor writes as pointwise
code, at their output's size), which reads the tensors made before the run and writes
those read after it; an operation that repeats an
earlier one of its region on the same values (AOT autograd's common-subexpression
elimination of the joint graph: the masks each step of a compiled loop builds alike) is
no kernel. Views cost nothing. Everything outside the
regions (embeddings, the loss, the recurrence's glue, the gradient accumulation over
steps) stays eager (but for the criterion's auxiliary terms, a compiled region of their
own in a SUT/UT with a compiled step: ``criterions/auxiliary.py``'s ``COMPILED_TERMS``), but for the accumulation inside a loop region (``--compile-loop``):
there every use of a shared parameter is in one graph, whose single-use adds inductor
inlines into one kernel per parameter reading its L step gradients, but for a weight whose
step gradients are whole GEMM outputs: their sum goes into the GEMMs (``addmm`` with the
running sum as input), no kernel at all (``inductor_accumulation.py``).

**Inductor's own kernels** (``--inductor``, with a compiled form): instead of the fusion
model, each compiled region is compiled by inductor itself on the CPU with its Triton
backend, which schedules and fuses as for CUDA (``inductor_kernels.py``): its fused
kernels (priced by the bytes inductor's scheduler counts for them) and extern GEMMs replace
the recorder's aten kernels and GEMMs inside the regions and the sums over a loop's steps;
the custom ops' launches, attention and everything outside the regions stay as recorded.
Slower (about two minutes for ``sut_base`` and the transformer) and without a per-step
split of the regions' own kernels.

**Device time**: per kernel max(FLOPs / (peak x efficiency), bytes / (bandwidth x
efficiency), floor), with the bf16 dense peak and HBM bandwidth of ``DEVICES`` and the
factors of ``FACTORS``, calibrated once (``--calibrate``) against the H200 profiles of
``docs/results/gpu.md`` (``RECORDED``); every run prints the calibration error. The routed
kernels' efficiencies can be refit on a GPU profile of today's kernels
(``--measured-kernels LOG``: the ``== plugin kernels`` lines ``train_step.py --profile``
prints on a GPU), the rest of the step still predicted.

    python benchmarks/gpu_model.py --arch sut_base [sut_base+flex] transformer_wmt_en_de [--compile-step]
        [--compile-loop] [--inductor] [--expert-gemm grouped_mm] [--weight-grads deferred]
        [--device H100] [--batch 128 --len 32]
        [--top 12] [--calibrate] [--measured-kernels TRAIN_STEP_LOG]

Ends with ``gpu model: ARCH launches N device_ms X misaligned_gemms M`` per architecture
and ``gpu model: sut_base / transformer_wmt_en_de device time R``.
"""
import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inductor_kernels  # noqa: E402
import train_step  # noqa: E402

from sut_fairseq.criterions import auxiliary  # noqa: E402
from sut_fairseq.criterions.losses import record_routing  # noqa: E402
from sut_fairseq.kernels import grouped_gemm as gg  # noqa: E402
from sut_fairseq.kernels import launch  # noqa: E402
from sut_fairseq.modules import flex_attention  # noqa: E402
from sut_fairseq.modules.recurrence import TensorLoop  # noqa: E402
from sut_fairseq.ops import weight_grads  # noqa: E402


@dataclass(frozen=True)
class Device:
    """A GPU's bf16 dense tensor-core peak (TFLOP/s) and HBM bandwidth (TB/s)."""
    name: str
    bf16_tflops: float
    hbm_tbs: float


H100 = Device("H100 SXM", 989.0, 3.35)
H200 = Device("H200", 989.0, 4.8)
DEVICES = {"H100": H100, "H200": H200}


@dataclass(frozen=True)
class Factors:
    """Calibrated efficiencies (fractions of the peak / bandwidth) and the floor of one kernel."""
    floor_us: float = 4.5          # the least time of any kernel (launch latency, tail)
    gemm: float = 0.9              # cuBLAS products with aligned dimensions, attention
    #: products with a dimension not a multiple of 8 (bf16/fp16): by hand from the recorded
    #: cutlass sm75 kernel (12 calls, 4.667 ms) of the O = 63 relative-position product,
    #: 2 x 128 x 4 x 128 x 64 x 63 FLOPs per call in 389 us: 1.4 TFLOP/s
    misaligned_gemm: float = 0.0014
    #: the routed expert kernels, each to its rows of the profile (eager ``sut_base``): the
    #: GEMM (forward and input gradient, 120 launches, 3.134 ms) and the weight gradient
    #: (60 launches, 4.330 ms)
    routed_gemm: float = 0.235
    routed_wgrad: float = 0.085
    #: PyTorch's grouped GEMM (``_grouped_mm``: CUTLASS on sm_90; ``--expert-gemm
    #: grouped_mm``), its forward, input gradient and weight gradient alike. NOT MEASURED:
    #: priced at the routed Triton GEMM's fitted efficiency until a profile measures it
    grouped_mm: float = 0.235
    bandwidth: float = 0.4         # every kernel's bytes


#: calibrated by ``--calibrate`` (see docs/gpu-step.md, "A model of the GPU step on the CPU")
FACTORS = Factors()
#: the routed Triton kernels and the factor that prices each (refit on a GPU profile of
#: today's code by ``--measured-kernels``); the plugin's other Triton kernels take
#: ``routed_wgrad``'s
ROUTED_FACTORS = {"_routed_gemm": "routed_gemm", "_routed_wgrad": "routed_wgrad"}

#: the H200 profiles (bf16, 128 x 32 = 4,096 target tokens; docs/results/gpu.md, fourth
#: lease, call 2; device ms = the profiles' "Self CUDA time total") of checkout 4073c4e:
#: (arch, compiled) -> (kernel launches, device ms)
RECORDED = {("sut_base", False): (5844, 39.5), ("sut_base", True): (3558, 34.2),
            ("transformer_wmt_en_de", False): (996, 10.5),
            ("transformer_wmt_en_de", True): (896, 8.6)}
RECORDED_DEVICE = H200

#: aten operations of no kernel: views, metadata, allocation, host reads
FREE = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
        "slice", "select", "as_strided", "detach", "alias", "split", "split_with_sizes",
        "unbind", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
        "_local_scalar_dense", "is_nonzero", "lift_fresh", "_reshape_alias", "diagonal",
        "unfold", "narrow", "expand_as", "view_as", "_to_copy_noop", "sym_size", "sym_stride",
        "_unsafe_split", "unsafe_split", "chunk", "resize_", "set_", "equal"}
#: aten operations of more than one kernel on CUDA (a cub radix sort: about 8.5 passes per
#: sort in the H200 profile, plus its index fill)
LAUNCHES = {"sort": 10, "topk": 3, "nonzero": 3, "embedding_dense_backward": 8,
            "native_layer_norm_backward": 2, "nll_loss_backward": 2, "_index_put_impl_": 5}
#: (``linear`` and ``matmul`` reach the recorder undecomposed inside the custom ops' bodies)
GEMMS = {"mm", "bmm", "addmm", "baddbmm", "linear", "matmul", "_grouped_mm"}
#: operations inductor keeps as calls of their own (no fusion across them)
EXTERN = GEMMS | {"sort", "topk", "nonzero", "cumsum"}
#: operations that inductor lowers inside a compiled region to kernels of their own, and
#: how many: an embedding's backward is a zero fill and an atomic scatter-add
REGION_LAUNCHES = {"embedding_dense_backward": 2}
ATTENTION_LAUNCHES = (1, 2)  # fused attention: forward, backward
#: operations that make a constant: a fill kernel eager (``where(c, x, 0.0)`` makes its
#: scalar on the device, as the backward of ``where`` does), a literal in inductor's code
CONSTANTS = {"scalar_tensor"}
#: reductions that inductor writes as pointwise code when the reduced extent is below
#: ``torch._inductor.config.unroll_reductions_threshold`` (8): e.g. the sum over a token's
#: k = 4 expert slots is then a pointwise kernel at its output's size, fusable with its
#: neighbours
REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "any", "all"}
UNROLL_REDUCTIONS_BELOW = 8
#: operations never merged with an identical earlier one (``Recorder.cse``): random ones,
#: and the allocations whose contents a later kernel writes
NEVER_CSE = {"bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
             "normal_", "uniform_", "exponential_", "native_dropout", "multinomial", "randperm",
             "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
#: gathers that inductor writes as pointwise code over their output (an indirect load per
#: element), whatever the size of the tensor they read from
INDEXING = {"gather", "index_select", "index", "embedding"}


@dataclass
class Kernel:
    """One or more launches of one recorded operation: ``kind`` (module docstring), its
    name, launches, FLOPs and bytes moved, for a GEMM (batch, M, N, K) and dtype; where it
    ran: ``step`` (label of a recurrence step / layer, or ""), ``phase`` ("fwd"/"bwd"),
    ``region`` (index of a compiled region's invocation, or None); ``reads``/``writes``
    (storage key, bytes) for the fusion model."""
    kind: str
    name: str
    launches: int
    flops: float
    bytes: float
    step: str = ""
    phase: str = "fwd"
    region: Optional[int] = None
    gemm: Optional[Tuple[int, int, int, int]] = None
    dtype: Optional[torch.dtype] = None
    numel: int = 0
    reads: Tuple = ()
    writes: Tuple = ()
    out_numels: Tuple = ()
    custom: bool = False    # recorded inside a custom op's body
    loop_sum: bool = False  # a shared parameter's sum over a loop region's steps

    def misaligned(self) -> bool:
        """A bf16/fp16 GEMM with M, N or K not a multiple of 8."""
        return (self.gemm is not None and self.dtype in (torch.bfloat16, torch.float16)
                and any(d % 8 for d in self.gemm[1:]))


def kernel_ms(k: Kernel, device: Device, factors: Optional[Factors] = None) -> float:
    """Estimated device ms of ``k``: per launch max(FLOPs / (peak x eff), bytes /
    (bandwidth x eff), floor); eff of the GEMMs and attention, of a misaligned GEMM or of
    the Triton kernels by kind; FLOPs and bytes are ``k``'s totals over its launches."""
    if k.launches == 0:
        return 0.0
    factors = factors or FACTORS
    routed = getattr(factors, ROUTED_FACTORS.get(k.name, "routed_wgrad"))
    gemm = factors.grouped_mm if k.name == "_grouped_mm" else factors.gemm
    eff = {"gemm": factors.misaligned_gemm if k.misaligned() else gemm,
           "attention": factors.gemm, "triton": routed}.get(k.kind)
    compute = k.flops / (device.bf16_tflops * 1e12 * eff) if eff else 0.0
    memory = k.bytes / (device.hbm_tbs * 1e12 * factors.bandwidth)
    return 1e3 * max(compute, memory, k.launches * factors.floor_us * 1e-6)


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) if t.numel() else 0


def gemm_dims(name: str, args) -> Tuple[int, int, int, int]:
    """(batch, M, N, K) of an aten GEMM's arguments (a grouped GEMM: its M or its K the sum
    over the groups, every row multiplied once: (M, K) x (G, K, N), or (K', M) x (M, N) for
    the weight gradient, grouped over M)."""
    if name == "linear":  # x (.., K) W^T, W (N, K)
        x, w = args[0], args[1]
        return 1, x.numel() // x.size(-1), w.size(0), x.size(-1)
    if name in ("mm", "matmul", "_grouped_mm"):
        a, b = args[0], args[1]
    elif name == "addmm":
        a, b = args[1], args[2]
    elif name == "bmm":
        a, b = args[0], args[1]
    else:  # baddbmm
        a, b = args[1], args[2]
    return math.prod(a.shape[:-2]), a.size(-2), b.size(-1), a.size(-1)


class _FusedAttention(torch.autograd.Function):
    """A fused attention kernel as the GPU runs it: one launch forward, two backward; on
    meta tensors only the output shapes. ``name`` ``sdpa``: ``scaled_dot_product_attention``
    with ``extra`` its bias mask (its gradient returned, its bytes not counted); ``flex``:
    ``--flex-attention``'s kernel with ``extra`` the relative scores or T5 table a
    ``score_mod`` reads (read forward, its gradient written backward)."""

    @staticmethod
    def forward(ctx, recorder, name, q, k, v, extra):
        B, H, T, D = q.shape
        S = k.size(-2)
        ctx.recorder, ctx.name, ctx.shape = recorder, name, (B, H, T, S, D)
        ctx.extra_shape = None if extra is None else extra.shape
        ctx.extra_numel = 0 if extra is None or name != "flex" else extra.numel()
        io = (q.numel() * 2 + k.numel() + v.numel() + ctx.extra_numel) * q.element_size()
        recorder.add_synthetic("attention", f"{name}_fwd", ATTENTION_LAUNCHES[0], 4 * B * H * T * S * D, io)
        return q.new_empty(B, H, T, v.size(-1))

    @staticmethod
    def backward(ctx, do):
        B, H, T, S, D = ctx.shape
        io = (2 * (2 * B * H * T * D + 2 * B * H * S * D) + 2 * ctx.extra_numel) * do.element_size()
        ctx.recorder.add_synthetic("attention", f"{ctx.name}_bwd", ATTENTION_LAUNCHES[1],
                                   10 * B * H * T * S * D, io)
        shape_q, shape_kv = (B, H, T, D), (B, H, S, D)
        dextra = None if ctx.extra_shape is None else do.new_empty(ctx.extra_shape)
        return (None, None, do.new_empty(shape_q), do.new_empty(shape_kv), do.new_empty(shape_kv),
                dextra)


class Recorder(TorchDispatchMode):
    """Records the kernels of the aten operations that run under it (module docstring)."""

    def __init__(self, param_shapes):
        super().__init__()
        self.kernels: List[Kernel] = []
        self.param_shapes = param_shapes
        self.custom = 0           # depth inside a sut:: custom op
        self.paused = False
        self.step, self.region, self.phase = "", None, "fwd"
        self.ranges: List[Tuple[int, int, str, Optional[int]]] = []  # seq lo, hi, step, region
        self.accumulating = False  # between a backward node's end and the next one's start
        self.loop_regions = set()  # regions that hold several steps (``--compile-loop``)
        self.loop_sums = set()     # storages of the gradient sums made in them
        self.producer: Dict[tuple, str] = {}  # storage key -> the operation that made it
        self.generation = Counter()  # storage address -> allocations seen at it
        # common-subexpression elimination inside a compiled region (``cse``)
        self.values: Dict[tuple, int] = {}  # storage key -> number of the value it holds
        self.computed: Dict[tuple, Tuple[int, ...]] = {}  # (region, operation) -> output values
        self.value_count = itertools.count()
        self.region_calls: List[inductor_kernels.RegionCall] = []  # for ``--inductor``

    def region_call(self, key: Tuple[str, ...], args: tuple = (), kwargs: Optional[dict] = None):
        """Note the call of the compiled region just entered (``--inductor`` compiles it)."""
        self.region_calls.append(inductor_kernels.RegionCall(self.region, key, args, kwargs or {}))

    # --- where an operation runs -------------------------------------------------------
    def seq(self) -> int:
        """The autograd sequence number the next node will get."""
        self.paused = True
        try:
            leaf = torch.empty(1, device="meta", requires_grad=True)
            return (leaf * 1).grad_fn._sequence_nr() + 1
        finally:
            self.paused = False

    @contextlib.contextmanager
    def scope(self, step: Optional[str] = None, region: bool = False, loop: bool = False):
        """Operations in the block (and their backward) belong to ``step`` / a new region
        (``loop``: one that holds several steps)."""
        before = self.step, self.region
        if step is not None:
            self.step = step
        if region:
            self.region = 1 + max([r for *_, r in self.ranges if r is not None] + [-1])
            if loop:
                self.loop_regions.add(self.region)
        lo = self.seq()
        try:
            yield
        finally:
            self.ranges.append((lo, self.seq(), self.step, self.region))
            self.step, self.region = before

    def _where(self):
        """(step, phase, region) of the operation running now."""
        node = torch._C._current_autograd_node()
        if node is None:
            return self.step, "fwd", self.region
        nr = node._sequence_nr()
        found = [(hi - lo, s, r) for lo, hi, s, r in self.ranges if lo <= nr < hi]
        if not found:
            return "", "bwd", None
        _, step, region = min(found, key=lambda f: f[0])  # the innermost range
        region = next((r for lo, hi, s, r in self.ranges if lo <= nr < hi and r is not None), None)
        return step, "bwd", region

    # --- records -----------------------------------------------------------------------
    def add_synthetic(self, kind, name, launches, flops, nbytes):
        step, phase, region = self._where()
        self.kernels.append(Kernel(kind, name, launches, flops, nbytes, step, phase, region))

    def triton(self, kernel, args: dict):
        """A Triton launch: the routed ops' (FLOPs 2 M K N, bytes of x rows, weights, a
        running sum the weight gradient adds, output rows), or the loss's and the routers'
        (no tensor-core FLOPs; each of their tensors read or written once: the logits, the
        gradient written, the per-row vectors)."""
        for t in args.values():  # a kernel may write any tensor it is given
            if isinstance(t, torch.Tensor):
                self.values[self.key(t)] = next(self.value_count)
        if kernel not in gg.KERNELS:
            nbytes = sum(_nbytes(t) for t in args.values() if isinstance(t, torch.Tensor))
            self.add_synthetic("triton", kernel.fn.__name__, 1, 0.0, nbytes)
            return
        M = args["sorted_scattered_idxs"].numel() if "M" not in args else args["M"]
        K, N, E = args["K"], args["N"], args["E"]
        size = args["X"].element_size()
        name = "_routed_gemm" if kernel is gg.routed_gemm_kernel else "_routed_wgrad"
        weights = E * K * N * (2 if args.get("ACCUMULATE") else 1)  # + a running sum read
        self.add_synthetic("triton", name, 1, 2 * M * K * N, size * (M * K + weights + M * N))

    def key(self, t: torch.Tensor):
        """A tensor's storage: its address and the allocation count there."""
        address = t.untyped_storage()._cdata
        return address, self.generation[address]

    def cse(self, name: str, region: Optional[int], args, kwargs, outs, ins) -> bool:
        """Whether this operation repeats one of its compiled region's (AOT autograd removes
        such a repeat from the joint graph, ``fx_graph_cse``: the masks and relative-position
        indices every step of a compiled loop builds alike): the same operation on the same
        values (numbered by storage, with their shapes, strides and offsets) and the same
        other arguments. Its outputs then hold the earlier outputs' values. Random and
        ``empty`` operations and those inside custom ops are never repeats."""
        def described(a):
            if isinstance(a, torch.Tensor):
                key = self.key(a)
                if key not in self.values:
                    self.values[key] = next(self.value_count)
                return (self.values[key], tuple(a.shape), a.stride(), a.storage_offset(), a.dtype)
            return repr(a)

        mergeable = (region is not None and not self.custom and name not in NEVER_CSE
                     and "out" not in kwargs)
        signature = None
        if mergeable:  # (eager work is never merged: no signature to build)
            flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
            signature = (region, name, tuple(described(a) for a in flat))
        reuse = signature in self.computed
        values = (self.computed[signature] if reuse
                  else tuple(next(self.value_count) for _ in outs))
        if mergeable and not reuse:
            self.computed[signature] = values
        inputs = {self.key(t) for t in ins}
        writes = name.endswith("_") or "out" in kwargs
        for t, value in zip(outs, values):
            if writes or self.key(t) not in inputs:  # a view keeps its values
                self.values[self.key(t)] = value
        return reuse

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "sut":
            return self._custom(func, args, kwargs)
        out = self._run(func, args, kwargs)
        if not self.paused:
            self._record(func, args, kwargs, out)
        return out

    def _custom(self, func, args, kwargs):
        """A plugin custom op: its Python body, recorded (its fake one would hide the work)."""
        from torch._library.custom_ops import OPDEFS

        body = OPDEFS[func._schema.name]._init_fn
        self.custom += 1
        try:
            with self:
                return body(*args, **kwargs)
        finally:
            self.custom -= 1

    @staticmethod
    def _run(func, args, kwargs):
        """``func`` on meta tensors; data-dependent results get fixed answers."""
        name = func.overloadpacket.__name__
        if not any(t.device.type == "meta" for t in _tensors((args, kwargs))):
            return func(*args, **kwargs)  # host tensors: real values
        if name == "_shape_as_tensor":  # a shape is known on the host
            return torch.tensor(args[0].shape)
        if name == "nonzero":  # every row selected
            x = args[0]
            return torch.empty(x.numel(), x.dim(), dtype=torch.long, device=x.device)
        if name == "_to_copy" and str(kwargs.get("device", "meta")) == "cpu":  # a host read
            return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if name in ("_local_scalar_dense", "is_nonzero", "equal"):  # "still running"
            x = args[0]
            return True if x.dtype == torch.bool or name != "_local_scalar_dense" else (
                1.0 if x.is_floating_point() else 1)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs, out):
        name = func.overloadpacket.__name__
        outs, ins = _tensors(out), _tensors((args, kwargs))
        if not any(t.device.type == "meta" for t in outs + ins):
            return  # host work
        numel = max([t.numel() for t in outs + ins] + [0])
        out_numels = tuple(t.numel() for t in outs)
        if name in REDUCTIONS and outs and numel < UNROLL_REDUCTIONS_BELOW * max(out_numels):
            numel = max(out_numels)  # unrolled: pointwise over the output
        elif name in INDEXING and outs:
            numel = max(out_numels)  # pointwise over the output
        if not name.endswith("_") and {self.key(o) for o in outs} & {self.key(i) for i in ins}:
            launches = 0  # a view or no-op of its input (reshape, .to, contiguous)
        elif name in FREE or numel == 0 or not outs and name not in GEMMS:
            launches = 0 if name in FREE or numel == 0 else 1
        else:
            launches = LAUNCHES.get(name, 1)
        step, phase, region = self._where()
        kind = ("gemm" if name in GEMMS else "custom" if self.custom else
                "accum" if self.accumulating and name in ("add", "add_")
                and tuple(outs[0].shape) in self.param_shapes else "aten")
        reads = tuple({self.key(t): _nbytes(t) for t in ins if t.device.type == "meta"}.items())
        # the engine's sum over steps: outside the compiled graphs, but for a loop's, where
        # a parameter's later adds join its first one's kernel (reading one more gradient)
        in_loop = kind == "accum" and region in self.loop_regions
        continued = in_loop and any(key in self.loop_sums for key, _ in reads)
        if continued:
            launches, reads = 0, tuple(r for r in reads if r[0] not in self.loop_sums)
        # a step's gradient that is a whole GEMM output: inductor adds the running sum in
        # that GEMM (``addmm`` with the sum as its input; benchmarks/inductor_accumulation.py)
        if in_loop and any(self.producer.get(self.key(t)) in GEMMS
                           and _nbytes(t) == t.untyped_storage().nbytes() for t in ins):
            launches, reads = 0, ()
        if kind == "accum":
            region = None
        fresh = {t.untyped_storage()._cdata for t in outs} - {t.untyped_storage()._cdata for t in ins}
        self.generation.update(fresh)  # new storages (an address may be reused after a free)
        self.producer.update({self.key(t): name for t in outs if t.untyped_storage()._cdata in fresh})
        if self.cse(name, region, args, kwargs, outs, ins):
            launches, reads = 0, ()  # computed before in this graph
        writes = tuple({self.key(t): _nbytes(t) for t in outs}.items())
        if in_loop:
            self.loop_sums.update(key for key, _ in writes)
        nbytes = sum(b for _, b in reads) + (0 if continued else sum(b for _, b in writes))
        gemm, flops, dtype = None, float(numel), (outs[0].dtype if outs else None)
        if name in GEMMS:
            gemm = gemm_dims(name, args)
            flops = 2.0 * math.prod(gemm)
        if name == "native_layer_norm_backward":  # rows and columns
            out_numels += (numel // outs[0].size(-1),)
        self.kernels.append(Kernel(kind, name, launches, flops, nbytes, step, phase, region, gemm,
                                   dtype, numel, reads, writes, out_numels, self.custom > 0, in_loop))

    def node_hooks(self, loss: torch.Tensor) -> None:
        """Mark, during the backward, the stretch after a node ran, where the engine sums the
        gradients a tensor receives from its several uses (``accumulating``)."""
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_prehook(self._node_starts)
            node.register_hook(self._node_ends)
            todo += [n for n, _ in node.next_functions]

    def _node_starts(self, grads):
        self.accumulating = False

    def _node_ends(self, grads_in, grads_out):
        self.accumulating = True


# --- running one step on meta tensors --------------------------------------------------

@contextlib.contextmanager
def cuda_code_path(recorder: Recorder):
    """Meta tensors read as CUDA ones (``is_cuda``), the routed ops' Triton launches and
    ``scaled_dot_product_attention`` recorded, and every backward's nodes hooked."""
    is_cuda, sdpa, backward = torch.Tensor.is_cuda, F.scaled_dot_product_attention, torch.Tensor.backward
    attend = flex_attention.attend
    recorder_before = launch.recorder

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        return _FusedAttention.apply(recorder, "sdpa", q, k, v, attn_mask)

    def flex(q, key, value, picks, q_start, hidden, qr=None, window=0, lo=0, t5=None):
        return _FusedAttention.apply(recorder, "flex", q, key, value, qr if qr is not None else t5)

    def hooked_backward(self, *args, **kwargs):
        recorder.node_hooks(self)
        recorder.phase = "bwd"
        return backward(self, *args, **kwargs)

    torch.Tensor.is_cuda = property(lambda self: self.device.type in ("cuda", "meta"))
    F.scaled_dot_product_attention = attention
    flex_attention.attend = flex
    torch.Tensor.backward = hooked_backward
    launch.recorder = recorder.triton
    try:
        yield
    finally:
        torch.Tensor.is_cuda, F.scaled_dot_product_attention = is_cuda, sdpa
        flex_attention.attend = attend
        torch.Tensor.backward = backward
        launch.recorder = recorder_before


def to_meta(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model on the meta device, floating parameters and buffers in ``dtype``."""
    model.to(device="meta")
    return model.to(dtype=dtype)


def meta_sample(sample: dict) -> dict:
    """The batch with every tensor an empty meta tensor of its shape and dtype."""
    return {k: meta_sample(v) if isinstance(v, dict) else
            (torch.empty(v.shape, dtype=v.dtype, device="meta") if torch.is_tensor(v) else v)
            for k, v in sample.items()}


def step_modules(model) -> Dict[str, torch.nn.Module]:
    """Label prefix -> the module run once per recurrence step (SUT/UT: each side's block)
    or the layers of fairseq's transformer (``enc0``, ``dec5``, ...)."""
    if hasattr(model.encoder, "side"):
        return {"enc": model.encoder.side.block, "dec": model.decoder.side.block}
    return {**{f"enc{i}": m for i, m in enumerate(model.encoder.layers)},
            **{f"dec{i}": m for i, m in enumerate(model.decoder.layers)}}


def hook_steps(recorder: Recorder, model) -> None:
    """Each call of a step module is a scope: ``enc3`` = the encoder's third step."""
    calls = Counter()
    for prefix, module in step_modules(model).items():
        def wrap(forward, prefix=prefix):
            def call(*args, **kwargs):
                calls[prefix] += 1
                label = f"{prefix}{calls[prefix]}" if prefix in ("enc", "dec") else prefix
                with recorder.scope(step=label):
                    return forward(*args, **kwargs)
            return call
        module.forward = wrap(module.forward)


def hook_regions(recorder: Recorder, model, arch: str) -> None:
    """The compiled regions, run eagerly as scopes: a SUT/UT's ``CompiledStep`` calls (its
    step or loop module uncompiled) and its sides' input embeddings (``compiled_input``),
    fairseq's transformer's whole forward."""
    if train_step.is_recurrent(arch.split("+")[0]):
        for name, side in (("encoder", model.encoder.side), ("decoder", model.decoder.side)):
            compiled = side.compiled_step
            if compiled is None:
                raise SystemExit(f"gpu_model.py: {arch}: the model has no compiled step")

            def call(compiled=compiled, name=name, **inputs):
                with recorder.scope(region=True, loop=isinstance(compiled.step, TensorLoop)), compiling():
                    recorder.region_call(("step", name), kwargs=inputs)
                    return compiled.step(**inputs)
            side.compiled_step = _eager_step(compiled, call)
            side.compiled_input = _EagerRegion(recorder, side.compiled_input.fn, ("input", name))
        return
    forward = model.forward

    def call(*args, **kwargs):
        with recorder.scope(region=True), compiling():
            recorder.region_call(("model",), args, kwargs)
            return forward(*args, **kwargs)
    model.forward = call


class _EagerRegion:
    """A ``compiler.CompiledFunction`` stand-in that runs its function eagerly as a
    compiled region of ``recorder``."""

    def __init__(self, recorder: Recorder, fn, key: Tuple[str, ...]):
        self.recorder, self.fn, self.key = recorder, fn, key

    def run(self, device, *args):
        with self.recorder.scope(region=True), compiling():
            self.recorder.region_call(self.key, args)
            return self.fn(*args)


@contextlib.contextmanager
def compiled_criterion(recorder: Recorder):
    """The criterion's auxiliary terms (``auxiliary.COMPILED_TERMS``, which a model with a
    compiled step uses) run eagerly as a compiled region."""
    before = auxiliary.COMPILED_TERMS
    auxiliary.COMPILED_TERMS = _EagerRegion(recorder, auxiliary.auxiliary_terms, ("terms",))
    try:
        yield
    finally:
        auxiliary.COMPILED_TERMS = before


@contextlib.contextmanager
def compiling():
    """``torch.compiler.is_compiling()`` reads True in the block: a compiled region runs
    the branches its traced graph has (the counting sort, ``masked_linear``, ...).
    ``torch._dynamo`` is imported first: a module imported while the answer is patched
    keeps the fake for the rest of the process (``torch._dynamo.decorators`` binds
    ``is_compiling`` at import), and later compilations there would trace eager branches."""
    import torch._dynamo  # noqa: F401

    before = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = before


def _eager_step(compiled, call):
    """A ``CompiledStep`` stand-in that runs its module eagerly through ``call``."""
    from sut_fairseq.compiler import CompiledStep

    class EagerStep(CompiledStep):
        def usable(self, device) -> bool:
            return True

        def __call__(self, **inputs):
            return call(**inputs)

    return EagerStep(compiled.step, compiled.side)


def record_step(arch: str, compiled: bool, batch: int, length: int, vocab: int,
                dtype: torch.dtype = torch.bfloat16, inductor: bool = False) -> List[Kernel]:
    """The kernels of one training step of ``arch`` (a ``train_step`` wmt arch, ``+loop``
    for ``--compile-loop``) on a ``batch`` x ``length`` batch, eager or compiled: the
    compiled regions' kernels by the fusion model, or with ``inductor`` those inductor
    generates for them (``generated_step``)."""
    recurrent = train_step.is_recurrent(arch.split("+")[0])
    torch.manual_seed(0)
    model, criterion = train_step.build(arch, vocab, 0.0, compiled=compiled and recurrent)
    model = to_meta(model, dtype)
    params = {tuple(p.shape) for p in model.parameters()}
    recorder = Recorder(params)
    hook_steps(recorder, model)
    if compiled:
        hook_regions(recorder, model, arch)
    batch_sample = train_step.make_batch(batch, length, vocab, 0)
    step = train_step.step_closure(model, criterion, meta_sample(batch_sample))
    with cuda_code_path(recorder), recorder, compiled_criterion(recorder):
        step()
    kernels = recorder.kernels
    if compiled and inductor:
        return generated_step(arch, recorder, batch_sample, vocab, dtype)
    return fuse(kernels) if compiled else kernels


def generated_step(arch: str, recorder: Recorder, sample: dict, vocab: int,
                   dtype: torch.dtype) -> List[Kernel]:
    """``--inductor``: the recorded step with each compiled region's own kernels replaced by
    those inductor generates for it (``inductor_kernels.py``): the recorder's aten kernels
    and GEMMs inside the regions and its sums over a loop's steps give way to inductor's
    kernels and extern GEMMs; the custom ops' launches, attention and everything outside
    the regions stay as recorded."""
    from sut_fairseq import compiler
    from sut_fairseq.compiler import CompiledFunction

    recurrent = train_step.is_recurrent(arch.split("+")[0])
    torch.manual_seed(0)
    model, _ = train_step.build(arch, vocab, 0.0, compiled=recurrent)
    model = model.to(dtype=dtype)
    terms = CompiledFunction(auxiliary.auxiliary_terms, "criterion's auxiliary terms")
    # fairseq's transformer whole, through the backend ``compile_backend`` names when it runs
    whole = torch.compile(model, backend=lambda gm, inputs: compiler.compile_backend()(gm, inputs))
    regions = {("terms",): terms, ("model",): lambda *args, **kwargs: whole(**sample["net_input"])}
    def with_statistics(region):
        """The region called with the routers' statistics recorded, as the criterion records
        them (the MI loss's): it carries their running sums, and their gradient comes in as
        in training. Fresh per call: each call's backward runs before the next call."""
        def call(*args, **kwargs):
            with record_routing(model):
                return region(*args, **kwargs)
        return call

    for name in ("encoder", "decoder"):
        side = getattr(getattr(model, name), "side", None)
        if side is not None:
            regions[("step", name)] = with_statistics(side.compiled_step)
            regions[("input", name)] = side.compiled_input
    generated, mismatches = inductor_kernels.generated_kernels(recorder.region_calls, regions)
    for line in mismatches:
        print(f"gpu model: --inductor: {line}")
    kept = [k for k in recorder.kernels
            if not k.loop_sum and not (k.region is not None and k.kind in ("aten", "gemm") and not k.custom)]
    out = list(kept)
    for (region, phase), kernels in sorted(generated.items()):
        for g in kernels:
            launches = LAUNCHES.get(g.name, 1) if g.kind == "aten" else 1
            out.append(Kernel(g.kind, g.name, launches, g.flops, g.bytes, "", phase, region, g.gemm,
                              g.dtype, g.numel))
    return out


# --- the fusion model of a compiled region ------------------------------------------------

def fuse(kernels: List[Kernel]) -> List[Kernel]:
    """Compiled regions' kernels under the fusion model (module docstring): the ``aten``
    kernels of a region between two extern kernels become one ``inductor`` kernel per
    distinct iteration size, reading the storages written before the run and writing the
    ones read after it; everything else is kept."""
    readers = defaultdict(list)
    for i, k in enumerate(kernels):
        for key, _ in k.reads:
            readers[key].append(i)
    out, run = [], []

    def flush():
        if run:
            out.extend(_fused(run, readers))
            run.clear()

    for i, k in enumerate(kernels):
        if k.region is not None and k.name in CONSTANTS:
            continue  # a literal in inductor's code, no kernel
        if k.region is not None and k.name in REGION_LAUNCHES and k.launches:
            k = dataclasses.replace(k, launches=REGION_LAUNCHES[k.name])
        fusible = (k.region is not None and k.kind == "aten" and k.name not in EXTERN
                   and k.name not in REGION_LAUNCHES)
        if fusible and run and (run[-1][1].region, run[-1][1].phase) != (k.region, k.phase):
            flush()
        if fusible:
            run.append((i, k))
            continue
        if k.launches and k.region is not None:  # an extern kernel ends a run
            flush()
        out.append(k)
    flush()
    return out


def _fused(run, readers) -> List[Kernel]:
    """The ``inductor`` kernels of ``run`` ((index, Kernel) list): per distinct iteration
    size, one kernel per distinct reduced size of its reductions (inductor writes each
    reduction axis in a kernel of its own, e.g. a LayerNorm backward's rows and columns),
    or one if it has none. The group's bytes (read from before the run, written for after
    it) are shared evenly by its kernels."""
    last = run[-1][0]
    written = {key for _, k in run for key, _ in k.writes}
    groups = defaultdict(list)
    for _, k in run:
        if k.launches:
            groups[k.numel].append(k)
    fused = []
    for numel, same_size in groups.items():
        for members in _connected(same_size):
            reduced = {n for k in members for n in k.out_numels if n < numel}
            reads = {key: b for k in members for key, b in k.reads if key not in written}
            writes = {key: b for k in members for key, b in k.writes
                      if any(r > last for r in readers.get(key, ()))}
            count = max(1, len(reduced))
            nbytes = (sum(reads.values()) + sum(writes.values())) / count
            head = members[0]
            fused += [Kernel("inductor", f"fused {len(members)} ops", 1,
                             sum(k.flops for k in members) / count, nbytes, head.step, head.phase,
                             head.region, numel=numel) for _ in range(count)]
    return fused


def _connected(members: List[Kernel]) -> List[List[Kernel]]:
    """``members`` split into the groups that share data (one writes what another reads, or
    both read the same tensor): inductor fuses a producer into its consumer and kernels
    reading a common input, not unrelated work of the same size."""
    parent = list(range(len(members)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    seen = {}
    for i, k in enumerate(members):
        for key, _ in (*k.reads, *k.writes):
            if key in seen:
                parent[root(i)] = root(seen[key])
            else:
                seen[key] = i
    out = defaultdict(list)
    for i, k in enumerate(members):
        out[root(i)].append(k)
    return list(out.values())


# --- calibration, summary, command line ---------------------------------------------------

def total_ms(kernels: List[Kernel], device: Device, factors: Optional[Factors] = None) -> float:
    """Estimated device ms of a step's kernels."""
    return sum(kernel_ms(k, device, factors) for k in kernels)


def launches(kernels: List[Kernel]) -> int:
    return sum(k.launches for k in kernels)


#: the H200 profile's per-kernel rows (docs/results/gpu/2026-11-27-h200-train-compiled.txt,
#: eager sut_base): the routed kernels by name
RECORDED_KERNEL_MS = {"_routed_gemm": 3.134, "_routed_wgrad": 4.330}


def _fit(values, error):
    return min(values, key=error)


def calibrate(steps: Dict[Tuple[str, bool], List[Kernel]]) -> Factors:
    """Factors fitted to ``RECORDED`` on the H200: the routed kernels' efficiencies to the
    profile's rows of each (eager sut_base), then the floor,
    GEMM and bandwidth efficiencies by a grid search minimising the largest relative error
    of the four steps' device ms."""
    sut = steps[("sut_base", False)]

    def part_error(name, factor):
        def error(v):
            f = dataclasses.replace(FACTORS, **{factor: v})
            got = sum(kernel_ms(k, H200, f) for k in sut if k.kind == "triton" and k.name == name)
            return abs(got / RECORDED_KERNEL_MS[name] - 1)
        return error

    grid = [round(0.005 * i, 3) for i in range(1, 101)]
    routed_gemm = _fit(grid, part_error("_routed_gemm", "routed_gemm"))
    routed_wgrad = _fit(grid, part_error("_routed_wgrad", "routed_wgrad"))
    mis = FACTORS.misaligned_gemm  # today's step has no such product to fit it on

    def error(c):
        f = Factors(c[0], c[1], mis, routed_gemm, routed_wgrad, c[2])
        return max(abs(total_ms(ks, H200, f) / RECORDED[key][1] - 1) for key, ks in steps.items())

    combos = itertools.product([x / 2 for x in range(2, 15)], [x / 20 for x in range(4, 19)],
                               [x / 20 for x in range(6, 20)])
    floor, gemm, bandwidth = _fit(list(combos), error)
    return Factors(floor, gemm, mis, routed_gemm, routed_wgrad, bandwidth)


#: ``train_step.py --profile``'s line of the plugin's Triton kernels on a GPU:
#: ``== plugin kernels [compiled ]ARCH: NAME LAUNCHES MS; NAME LAUNCHES MS; ...``
PLUGIN_KERNELS_ROW = re.compile(r"^== plugin kernels (.+?): (.*)$")


def plugin_kernels_in(path: str) -> Dict[str, Dict[str, Tuple[int, float]]]:
    """{profile key (``sut_base``, ``compiled sut_base``, ...): {kernel: (launches, device
    ms)}} of the ``== plugin kernels`` lines of a ``train_step.py`` log (a key's last line)."""
    out = {}
    with open(path, errors="replace") as log:
        for line in log:
            m = PLUGIN_KERNELS_ROW.match(line.strip())
            if m:
                items = [item.split() for item in m.group(2).split(";") if item.strip()]
                out[m.group(1)] = {name: (int(n), float(ms)) for name, n, ms in items}
    return out


def profile_for(profiles: Dict[str, dict], arch: str, form: str) -> Optional[str]:
    """The key of ``arch``'s profile in ``profiles``: the one of the modelled form (eager
    ``ARCH``, compiled ``compiled ARCH``, the compiled loop ``compiled ARCH+loop``), else
    any of the same architecture (its routed launches are the same in every form), else
    None."""
    wanted = {"eager": arch, "step": f"compiled {arch}", "loop": f"compiled {arch}+loop"}[form]
    if wanted in profiles:
        return wanted
    same = [key for key in profiles if key.replace("compiled ", "").split("+")[0] == arch]
    return same[-1] if same else None


def fitted_efficiency(kernels: List[Kernel], name: str, measured_ms: float, device: Device,
                      factors: Factors) -> float:
    """The efficiency of ``name``'s factor (``ROUTED_FACTORS``) at which the model's device
    ms of the step's ``name`` launches equals ``measured_ms``: bisection (the time falls as
    the efficiency rises); 1.0 where the launches are bound by their bytes or the floor
    even at the peak."""
    field = ROUTED_FACTORS[name]
    ours = [k for k in kernels if k.kind == "triton" and k.name == name]

    def ms(eff):
        f = dataclasses.replace(factors, **{field: eff})
        return sum(kernel_ms(k, device, f) for k in ours)

    lo, hi = 1e-6, 1.0
    if ms(hi) >= measured_ms:
        return hi
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ms(mid) > measured_ms else (lo, mid)
    return hi


def refit_factors(kernels: List[Kernel], measured: Dict[str, Tuple[int, float]], key: str,
                  device: Device, factors: Factors) -> Factors:
    """``factors`` with each routed kernel's efficiency refit to its measured (launches, ms)
    of the profile ``key`` (summed over the names ``NAME`` and ``NAME_<n>``, as a compiled
    graph may number a kernel it launches); a kernel whose launches differ from the model's
    step keeps its factor (the profile is of other code or another form), with a line
    saying so."""
    for name, field in ROUTED_FACTORS.items():
        found = [v for k, v in measured.items() if re.fullmatch(rf"{name}(_\d+)?", k)]
        if not found:
            continue
        n, ms = sum(v[0] for v in found), sum(v[1] for v in found)
        modelled = sum(k.launches for k in kernels if k.kind == "triton" and k.name == name)
        if n != modelled:
            print(f"gpu model: measured {name}: {n} launches in the profile {key!r} against "
                  f"{modelled} in the modelled step: {field} not refit")
            continue
        eff = fitted_efficiency(kernels, name, ms, device, factors)
        print(f"gpu model: refit {field} {eff:.4g} (was {getattr(factors, field)}) from {name} "
              f"{n} launches {ms:.3f} ms (profile {key!r})")
        factors = dataclasses.replace(factors, **{field: eff})
    return factors


def print_step(arch: str, kernels: List[Kernel], device: Device, top: int) -> None:
    """Launches and device ms by kind, inside and outside the compiled regions (compiled
    steps), per recurrence step / layer, with ``--inductor`` inductor's kernels of the most
    device time, the GEMM shapes with the alignment lint; the ``gpu model:`` summary line."""
    by_kind = defaultdict(lambda: [0, 0.0])
    by_step = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        ms = kernel_ms(k, device)
        kind = f"triton {k.name}" if k.kind == "triton" else k.kind  # each routed kernel apart
        by_kind[kind][0] += k.launches
        by_kind[kind][1] += ms
        by_step[(k.step or "-", k.phase)][0] += k.launches
        by_step[(k.step or "-", k.phase)][1] += ms
    print(f"== {arch}: launches and device ms by kind ({device.name})")
    for kind, (n, ms) in sorted(by_kind.items(), key=lambda x: -x[1][1]):
        print(f"  {kind:20s} {n:6d} {ms:8.2f}")
    inside = [k for k in kernels if k.region is not None]
    if inside:  # compiled: what runs outside the graphs
        outside = [k for k in kernels if k.region is None]
        print(f"== {arch}: inside / outside the compiled regions (launches, device ms)")
        for where, part in (("inside", inside), ("outside", outside)):
            print(f"  {where:10s} {launches(part):6d} {total_ms(part, device):8.2f}")
    print(f"== {arch}: per step / layer (fwd, bwd; '-' = outside the steps)")
    for (step, phase), (n, ms) in sorted(by_step.items()):
        print(f"  {step:6s} {phase} {n:6d} {ms:8.2f}")
    fused = defaultdict(lambda: [0, 0.0, 0.0])  # inductor's kernels (``--inductor``): name -> n, ms, MB
    for k in kernels:
        if k.kind == "inductor" and not k.name.startswith("fused ") and k.launches:
            entry = fused[(k.name, round(k.bytes / 1e6))]
            entry[0] += k.launches
            entry[1] += kernel_ms(k, device)
    if fused:
        at_floor = sum(1 for k in kernels if k.kind == "inductor"
                       and kernel_ms(k, device) <= FACTORS.floor_us / 1e3 * 1.001)
        print(f"== {arch}: inductor's kernels with the most device time (launches, ms, MB each; "
              f"{at_floor} at the floor)")
        for (name, mb), (n, ms, _) in sorted(fused.items(), key=lambda x: -x[1][1])[:top]:
            print(f"  {n:4d} {ms:7.3f} {mb:5d}  {name[:110]}")
    gemms = Counter((k.name, k.gemm, str(k.dtype).replace("torch.", ""), k.misaligned())
                    for k in kernels if k.gemm is not None)
    print(f"== {arch}: GEMM shapes (batch, M, N, K), dtype, calls; MISALIGNED: a dim % 8 != 0")
    for (name, dims, dtype, bad), n in gemms.most_common(top):
        print(f"  {name:11s} {str(dims):26s} {dtype:9s} x{n:<4d}{' MISALIGNED' if bad else ''}")
    misaligned = sum(n for (*_, bad), n in gemms.items() if bad)
    print(f"gpu model: {arch} launches {launches(kernels)} device_ms {total_ms(kernels, device):.1f} "
          f"misaligned_gemms {misaligned}", flush=True)


def print_calibration(steps: Dict[Tuple[str, bool], List[Kernel]]) -> None:
    """Predicted against ``RECORDED`` (H200) for the steps run that it holds."""
    for (arch, compiled), kernels in steps.items():
        if (arch, compiled) in RECORDED:
            n, ms = RECORDED[(arch, compiled)]
            got_n, got_ms = launches(kernels), total_ms(kernels, RECORDED_DEVICE)
            print(f"calibration: {arch} {'compiled' if compiled else 'eager'}: launches {got_n} "
                  f"recorded {n} ({100 * (got_n / n - 1):+.0f}%), H200 device_ms {got_ms:.1f} "
                  f"recorded {ms} ({100 * (got_ms / ms - 1):+.0f}%)")


def replaced_factors(factors: Factors, items: List[str], error) -> Factors:
    """``factors`` with each ``NAME=VALUE`` of ``items`` put in (a positive number);
    ``error(message)`` on a bad item."""
    new = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in Factors.__dataclass_fields__:
            error(f"--factor {item}: {name!r} is not a factor (one of "
                  f"{', '.join(Factors.__dataclass_fields__)})")
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value > 0:
            error(f"--factor {item}: the value must be a positive number")
        new[name] = value
    return dataclasses.replace(factors, **new)


def measured_factors(args, steps, compiled) -> Factors:
    """FACTORS refit on ``--measured-kernels``' profile of the first modelled architecture
    that has routed kernels and a profile there; FACTORS as they are, with a line, if none."""
    profiles = plugin_kernels_in(args.measured_kernels)
    form = "loop" if args.compile_loop else "step" if compiled else "eager"
    for arch in args.arch:
        kernels = steps[(arch, compiled)]
        if not any(k.kind == "triton" and k.name in ROUTED_FACTORS for k in kernels):
            continue
        key = profile_for(profiles, arch.split("+")[0], form)
        if key is not None:
            return refit_factors(kernels, profiles[key], key, DEVICES[args.device], FACTORS)
    print(f"gpu model: no '== plugin kernels' line of a modelled architecture in "
          f"{args.measured_kernels}: the calibrated factors stand")
    return FACTORS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["sut_base", "transformer_wmt_en_de"],
                        help=f"models of train_step.py's wmt preset ({' '.join(train_step.MODELS)}, "
                             f"sut_tiny, ...; with the suffix +flex: --flex-attention, attention dropout 0)")
    parser.add_argument("--compile-step", action="store_true",
                        help="compiled: each side's step one graph (the transformer whole)")
    parser.add_argument("--compile-loop", action="store_true",
                        help="compiled: all steps of a side one graph (the transformer whole)")
    parser.add_argument("--inductor", action="store_true",
                        help="compiled: the regions' kernels as inductor generates them (its Triton "
                             "scheduler run on the CPU, inductor_kernels.py) instead of the fusion model")
    parser.add_argument("--expert-gemm", choices=("kernels", "grouped_mm"), default="kernels",
                        help="what multiplies the routed rows (SUT_EXPERT_GEMM): the Triton "
                             "kernels, or PyTorch's grouped GEMM (priced by the factor grouped_mm)")
    parser.add_argument("--weight-grads", choices=("per-step", "deferred"), default="per-step",
                        help="the shared expert weights' gradients (SUT_WEIGHT_GRADS): a "
                             "weight-gradient launch per step, or one per backward over every "
                             "step's rows (deferred)")
    parser.add_argument("--device", choices=sorted(DEVICES), default="H200")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--fp32", action="store_true", help="fp32 instead of bf16")
    parser.add_argument("--top", type=int, default=12, help="GEMM shapes to list")
    parser.add_argument("--factor", action="append", default=[], metavar="NAME=VALUE",
                        help="replace a calibrated factor, to ask what a faster kernel would give "
                             f"(names: {', '.join(Factors.__dataclass_fields__)}); repeatable")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit FACTORS to RECORDED (runs the four recorded steps) and print them")
    parser.add_argument("--measured-kernels", metavar="TRAIN_STEP_LOG",
                        help="refit the routed kernels' efficiencies (routed_gemm, routed_wgrad) "
                             "on the '== plugin kernels' lines of a GPU run of train_step.py "
                             "--profile (today's kernels), then predict the step with them")
    args = parser.parse_args(argv)
    if args.measured_kernels and args.calibrate:
        parser.error("--measured-kernels refits today's kernels; --calibrate fits the recorded "
                     "profiles: use one")
    if args.measured_kernels and not os.path.isfile(args.measured_kernels):
        parser.error(f"--measured-kernels {args.measured_kernels}: no such file")
    if args.compile_step and args.compile_loop:
        parser.error("--compile-step and --compile-loop exclude each other")
    if args.inductor and not (args.compile_step or args.compile_loop):
        parser.error("--inductor models the compiled regions: add --compile-step or --compile-loop")
    if args.inductor and any("+flex" in arch for arch in args.arch):
        parser.error("--inductor does not model FlexAttention (+flex); use the fusion model")
    from fairseq.models import ARCH_MODEL_REGISTRY
    for arch in args.arch:
        if arch.split("+")[0] not in ARCH_MODEL_REGISTRY:
            raise SystemExit(f"gpu_model.py: --arch {arch}: not a registered architecture "
                             f"(e.g. {' '.join(train_step.MODELS)} sut_tiny)")
    global FACTORS
    FACTORS = replaced_factors(FACTORS, args.factor, parser.error)
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    compiled = args.compile_step or args.compile_loop
    if args.calibrate:  # the code the profile ran: a weight-gradient launch per step
        with mock.patch.dict(os.environ, {"SUT_WEIGHT_GRADS": "per-step"}):
            steps = {key: record_step(key[0], key[1], 128, 32, 32768) for key in RECORDED}
        print(f"calibrated: {calibrate(steps)}")
        print_calibration(steps)
        return
    print(f"gpu model of one training step on {DEVICES[args.device].name}: batch {args.batch} x "
          f"{args.len} = {args.batch * args.len} target tokens, {str(dtype)[6:]}, "
          f"{('compiled (inductor' + chr(39) + 's kernels)' if args.inductor else 'compiled (fusion model)') if compiled else 'eager'}"
          f"{', routed products on grouped_mm' if args.expert_gemm == 'grouped_mm' else ''}"
          f"{', one weight-gradient launch per shared parameter' if args.weight_grads == 'deferred' else ''}")
    steps, ms = {}, {}
    for arch in args.arch:  # the routed products' path for these steps only (not --calibrate's)
        form = arch + ("+loop" if args.compile_loop and train_step.is_recurrent(arch) else "")
        weight_grads.Stats.reset()
        with mock.patch.dict(os.environ, {"SUT_EXPERT_GEMM": args.expert_gemm,
                                          "SUT_WEIGHT_GRADS": args.weight_grads}):
            steps[(arch, compiled)] = record_step(form, compiled, args.batch, args.len,
                                                  args.vocab, dtype, args.inductor)
        if weight_grads.Stats.peak:  # counted where the backward runs eagerly
            print(f"== {arch}: deferred weight gradients held at most "
                  f"{weight_grads.Stats.peak / 2 ** 20:.1f} MiB of step output gradients")
    if args.measured_kernels:
        FACTORS = measured_factors(args, steps, compiled)
    for arch in args.arch:
        kernels = steps[(arch, compiled)]
        ms[arch] = total_ms(kernels, DEVICES[args.device])
        print_step(arch, kernels, DEVICES[args.device], args.top)
    if (args.batch, args.len, args.vocab, dtype) == (128, 32, 32768, torch.bfloat16) \
            and not args.compile_loop and not args.measured_kernels:  # (recorded: the old kernels)
        print_calibration(steps)
    for arch in ms:
        if arch.split("+")[0] == "sut_base" and "transformer_wmt_en_de" in ms:
            print(f"gpu model: {arch} / transformer_wmt_en_de device time "
                  f"{ms[arch] / ms['transformer_wmt_en_de']:.2f}")


if __name__ == "__main__":
    main()
