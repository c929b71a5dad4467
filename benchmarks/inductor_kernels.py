"""Inductor's own GPU kernels for a model's compiled regions, generated on the CPU.

``torch.compile`` cannot build CUDA code without a GPU, but inductor's Triton backend also
serves CPU tensors (``torch._inductor.config.cpu_backend = "triton"``): the same lowering,
the same scheduler and the same fusion rules as for CUDA (``SIMDScheduling``), up to the
point where Triton would compile the kernels for a CPU target, which this machine's Triton
cannot. This module compiles each compiled region of a training step that way and keeps,
for every graph, what inductor's scheduler decided before that point: one entry per
kernel it would launch (its fused nodes: pointwise and reduction kernels with the bytes
they move; extern kernels: the GEMMs with their shapes, and the aten operations it falls
back to). The regions then "run" as stand-ins that return zeros of their outputs' shapes
and add their graph's kernels to a tally: a forward and a backward of each region, as many
times as a step calls it, with no arithmetic done.

What differs from a GPU's compilation, and how it is handled:

* the code's CUDA branches: dynamo reads ``Tensor.is_cuda`` from the traced tensor's
  device, so while tracing it reads True (``kernel_backend`` then picks the Triton routed
  ops, ``masked_linear`` and the dropout their CUDA forms, as on a GPU);
* attention: inductor writes ``scaled_dot_product_attention`` on CPU tensors as its math
  (two batched products and a softmax) where a GPU runs one fused kernel; here it is an
  opaque op of this module (``gpu_model::attention``, with its backward), which the
  caller prices as the fused kernel;
* the plugin's custom ops (``sut::*``) and that attention op are extern calls in the
  graph; their kernels (Triton launches, aten work inside) are the caller's to count (the
  meta-tensor recorder of ``gpu_model.py`` records them), so they are left out here;
* shapes are static (each region is compiled for the one batch it is called with; a GPU
  run marks batch and length dynamic, which changes no kernel count of a fixed batch).

    calls = [RegionCall(region, key, args, kwargs), ...]     # from gpu_model's recorder
    kernels, mismatches = generated_kernels(calls, {key: compiled callable, ...})
"""
import contextlib
import copy
import dataclasses
import logging
import math
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import torch
import torch.nn.functional as F

#: extern kernels inductor keeps as GEMMs (``extern_kernels.NAME``)
GEMM_KERNELS = {"mm", "bmm", "addmm", "baddbmm", "_grouped_mm"}
#: namespaces of fallback ops counted by the caller (module docstring)
COUNTED_BY_CALLER = ("sut", "gpu_model")


@dataclass
class Generated:
    """One kernel launch inductor would make: ``kind`` ``inductor`` (a Triton kernel of
    fused nodes), ``gemm`` (an extern product, ``gemm`` = (batch, M, N, K)) or ``aten``
    (an op inductor falls back to); FLOPs, bytes moved, the output dtype; ``phase``
    ``fwd``/``bwd`` and ``region``, the index of the region call it belongs to."""
    kind: str
    name: str
    flops: float
    bytes: float
    dtype: Optional[torch.dtype]
    phase: str = "fwd"
    region: int = 0
    gemm: Optional[Tuple[int, int, int, int]] = None
    numel: int = 0


@dataclass
class RegionCall:
    """A compiled region's call in a training step: its index, what it is (``key``:
    ("step", side) / ("input", side) / ("terms",) / ("model",)) and its arguments (meta
    tensors: shapes, dtypes and ``requires_grad`` only)."""
    region: int
    key: Tuple[str, ...]
    args: tuple
    kwargs: dict


# --- attention as one opaque op ----------------------------------------------------------

@torch.library.custom_op("gpu_model::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              dropout_p: float, is_causal: bool, scale: Optional[float]) -> torch.Tensor:
    """softmax(q k^T · scale + mask) v (scale 1/sqrt(D) by default; ``is_causal``: keys
    after a query's position hidden). ``dropout_p`` is carried for the graph only (the
    generated regions never run this body); the body and its gradient leave dropout out."""
    return _SDPA(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


@attention.register_fake
def _(q, k, v, mask, dropout_p, is_causal, scale):
    # (B, H, T, D) in the memory order of (B, T, H, D), as CUDA's fused kernels write it:
    # the usual transpose back to (B, T, H·D) after attention is then a view, not a copy
    B, H, T = q.shape[:3]
    return q.new_empty(B, T, H, v.size(-1)).transpose(1, 2)


@torch.library.custom_op("gpu_model::attention_backward", mutates_args=())
def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: Optional[torch.Tensor], is_causal: bool,
                       scale: Optional[float]) -> List[torch.Tensor]:
    """dq, dk, dv (and the float mask's gradient) of ``attention``."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:  # SDPA's causal mask: query i sees keys j <= i
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    p = torch.softmax(scores, -1)
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    grads = [ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv]
    if mask is not None and mask.is_floating_point():
        grads.append(ds.sum_to_size(mask.shape))
    return grads


@attention_backward.register_fake
def _(do, q, k, v, mask, is_causal, scale):
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    if mask is not None and mask.is_floating_point():
        grads.append(torch.empty_like(mask))
    return grads


def _attention_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.float_mask = inputs[3] is not None and inputs[3].is_floating_point()
    ctx.is_causal, ctx.scale = inputs[5], inputs[6]


def _attention_grad(ctx, do):
    q, k, v, mask = ctx.saved_tensors
    grads = torch.ops.gpu_model.attention_backward(do, q, k, v, mask, ctx.is_causal, ctx.scale)
    return grads[0], grads[1], grads[2], grads[3] if ctx.float_mask else None, None, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)
_SDPA = F.scaled_dot_product_attention


def _opaque_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    """``F.scaled_dot_product_attention`` while a region is generated: the opaque op (with
    ``enable_gqa``, keys and values repeated to the query heads first, as SDPA does)."""
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    return torch.ops.gpu_model.attention(q, k, v, attn_mask, float(dropout_p), bool(is_causal),
                                         None if scale is None else float(scale))


# --- what the scheduler decided -----------------------------------------------------------

def _sizes(node) -> List[int]:
    return [int(s) for s in node.get_size()]


def _extern_kernel(node, phase: str) -> Optional[Generated]:
    """The launch of an extern scheduler node, or None (no kernel of its own, or one the
    caller counts)."""
    from torch._inductor import ir

    kernel = node.node
    if isinstance(kernel, ir.MultiOutput):
        return None  # an output of another op: indexing on the host
    layout = getattr(kernel, "layout", None)
    # an op of several outputs (``MultiOutputLayout``) has no dtype or size of its own; an
    # op that only mutates its first input (``NoneLayout``: the scatter-add of int64 that
    # CUDA's lowering leaves to aten) has that input's
    single = not isinstance(layout, ir.MultiOutputLayout)
    sized = kernel.inputs[0] if isinstance(layout, ir.NoneLayout) else kernel
    dtype = sized.get_dtype() if single else None
    name = getattr(kernel, "python_kernel_name", None) or type(kernel).__name__
    op = getattr(kernel, "op_overload", None)
    if op is not None:
        if op.namespace in COUNTED_BY_CALLER:
            return None
        name = f"{op.namespace}.{op._opname}"
    short = name.split(".")[-1]
    try:
        nbytes = float(node.get_read_write_buffers_sizes())
    except Exception:  # noqa: BLE001  (an op whose accesses inductor cannot size)
        nbytes = 0.0
    if short in GEMM_KERNELS:
        inputs = [i for i in kernel.inputs if hasattr(i, "get_size")]
        if short == "_grouped_mm":  # (a, b, offsets): a 2-d, b (G, K, N) or (M, N)
            a, b = _sizes(inputs[0]), _sizes(inputs[1])
            gemm = (1, a[0], b[-1], a[1])
        else:
            a, b = _sizes(inputs[-2]), _sizes(inputs[-1])
            gemm = (a[0], a[1], b[2], a[2]) if short in ("bmm", "baddbmm") else (1, a[0], b[1], a[1])
        return Generated("gemm", short, 2.0 * math.prod(gemm), nbytes, dtype, phase, gemm=gemm)
    numel = math.prod(_sizes(sized)) if single else 0
    return Generated("aten", short, float(numel), nbytes, dtype, phase, numel=numel)


def _kernel_name(node) -> str:
    """Inductor's own name of a fused node's kernel, from the aten operations it holds
    (``fused_add_native_layer_norm``, as in ``triton_per_fused_add_native_layer_norm_3``)."""
    from torch._inductor.utils import get_fused_kernel_name

    return get_fused_kernel_name(node.get_nodes(), "original_aten")


def scheduled_kernels(nodes, phase: str) -> List[Generated]:
    """The launches of a graph's scheduler nodes (after fusion), of region 0 until a call
    places them."""
    from torch._inductor import scheduler as sched

    out = []
    for node in nodes:
        if isinstance(node, sched.NopKernelSchedulerNode):
            continue
        if isinstance(node, sched.ExternKernelSchedulerNode):
            kernel = _extern_kernel(node, phase)
            if kernel is not None:
                out.append(kernel)
            continue
        numel = 0
        for sub in node.get_nodes():
            group = getattr(sub, "group", (None, ()))[1]
            numel = max(numel, int(math.prod(int(g) for g in group)) if group else 0)
        out.append(Generated("inductor", _kernel_name(node), float(numel),
                             float(node.get_read_write_buffers_sizes()), None, phase, numel=numel))
    return out


# --- compiling the regions ----------------------------------------------------------------

class _Tally:
    """The compiled graphs' kernels and the launches of the stand-ins' calls."""

    def __init__(self):
        self.region = 0
        self.open_calls: Dict[Any, List[int]] = defaultdict(list)  # graph -> forward calls' regions
        self.pending: List[Generated] = []
        self.wrapper_runs = 0
        self.mismatches: List[str] = []
        self.launched: Dict[Tuple[int, str], List[Generated]] = defaultdict(list)


def _stand_in(gm: torch.fx.GraphModule, kernels: List[Generated], tally: "_Tally", graph,
              backward: bool) -> Callable:
    """A callable in place of the compiled graph: adds the graph's kernels to the tally,
    under the region of the call (a backward: that of the latest forward call of its graph
    not yet differentiated), and returns zeros of the graph's output shapes (no
    arithmetic)."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]

    def zeros(node):
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
        if not isinstance(value, torch.Tensor):
            return value
        extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
        return torch.zeros(extent if value.numel() else 0, dtype=value.dtype).as_strided(
            value.shape, value.stride())

    def run(*args):
        calls = tally.open_calls[graph]
        if backward:
            region = calls.pop() if calls else tally.region
        else:
            region = tally.region
            calls.append(region)
        for k in kernels:
            tally.launched[(region, k.phase)].append(dataclasses.replace(k, region=region))
        return [zeros(n) for n in outputs]

    return run


@contextlib.contextmanager
def generating(tally: _Tally):
    """The patches under which ``torch.compile`` of a region generates a GPU's kernels on
    the CPU and runs the stand-ins (module docstring); restored on exit."""
    import torch._inductor.config as icfg
    import torch.utils._triton as torch_triton
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.tensor import TensorVariable
    from torch._inductor import scheduler as sched
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    import sut_fairseq.compiler as compiler

    current = {"phase": "fwd"}
    original_codegen, original_write = sched.Scheduler.codegen, PyCodeCache.__dict__["write"]

    def codegen(self):
        tally.pending = scheduled_kernels(self.nodes, current["phase"])
        return original_codegen(self)

    def write(cls, source_code, extra=""):
        if "def call(" in source_code:
            body = source_code[source_code.index("def call("):]
            tally.wrapper_runs = len(re.findall(r"^\s*\w+\.run\(", body, re.M))
        return original_write.__func__(cls, source_code, extra)

    def inner(gm, example_inputs, **kwargs):
        backward = bool(kwargs.get("is_backward"))
        graph = kwargs.get("graph_id")
        current["phase"] = "bwd" if backward else "fwd"
        tally.wrapper_runs = -1
        try:
            # cpp.fallback_scatter_reduce_sum: a CPU-only rule (a float scatter-add becomes
            # an aten fallback when more than one thread is visible); CUDA lowers it itself
            with icfg.patch({"cpu_backend": "triton", "compile_threads": 1,
                             "fx_graph_cache": False, "cpp.fallback_scatter_reduce_sum": False}):
                compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as error:  # noqa: BLE001  (Triton's missing CPU target, after codegen)
            if "compatible backends" not in str(error) and "active drivers" not in str(error):
                raise
        scheduled = sum(k.kind == "inductor" for k in tally.pending)
        if scheduled != tally.wrapper_runs:
            tally.mismatches.append(f"region {tally.region} {current['phase']} graph: "
                                    f"{scheduled} scheduled kernels, {tally.wrapper_runs} in the wrapper")
        return _stand_in(gm, tally.pending, tally, graph, backward)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    patches = [
        (TensorVariable, "method_attr_is_cuda", lambda self, tx: VariableTracker.build(tx, True)),
        (torch_triton, "triton_hash_with_backend", lambda: "CPU-GENERATING-GPU-KERNELS"),
        (sched.Scheduler, "codegen", codegen),
        (PyCodeCache, "write", classmethod(write)),
        (F, "scaled_dot_product_attention", _opaque_sdpa),
        (compiler, "mark_dynamic", lambda tensor, dims=(0, 1): tensor),
        (torch._dynamo, "maybe_mark_dynamic", lambda *args, **kwargs: None),
        (compiler, "compile_backend", lambda: backend),
    ]
    # Triton's failure to compile for the CPU target is expected (module docstring)
    triton_log = logging.getLogger("torch._inductor.runtime.triton_heuristics")
    torch._dynamo.reset()
    try:
        with contextlib.ExitStack() as stack:
            for owner, name, value in patches:
                stack.enter_context(mock.patch.object(owner, name, value))
            stack.callback(triton_log.setLevel, triton_log.level)
            triton_log.setLevel(logging.CRITICAL)
            stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False,
                                                           cache_size_limit=64))
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="Could not find an active CPU backend")
            warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd is returning")
            yield backend
    finally:
        torch._dynamo.reset()


def _cpu(value):
    """A meta tensor as CPU zeros of its shape and dtype (``requires_grad`` kept), in
    tuples, lists, dicts and dataclasses too."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            return value
        out = torch.zeros(value.shape, dtype=value.dtype)
        return out.requires_grad_() if value.requires_grad else out
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. HaltingResult
        out = copy.copy(value)
        for name, field in vars(value).items():
            setattr(out, name, _cpu(field))
        return out
    return value


def _differentiable(outputs) -> List[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs] if outputs.requires_grad else []
    if isinstance(outputs, (tuple, list)):
        return [t for o in outputs for t in _differentiable(o)]
    if isinstance(outputs, dict):
        return [t for o in outputs.values() for t in _differentiable(o)]
    return []


def generated_kernels(calls: Sequence[RegionCall], regions: Dict[Tuple[str, ...], Callable]
                      ) -> Tuple[Dict[Tuple[int, str], List[Generated]], List[str]]:
    """The kernels inductor generates for each region call of ``calls`` (forward, then its
    backward with zero output gradients): {(region, phase): [Generated]}, and the graphs
    whose scheduled kernels and generated wrapper disagree on the number of Triton
    launches (expected empty). ``regions`` maps each call's key to the callable that runs
    it through ``torch.compile`` with ``sut_fairseq.compiler.compile_backend()`` (here the
    generating backend): a compiled step of a CPU copy of the recorded model, say."""
    tally = _Tally()
    with generating(tally):
        for call in calls:
            tally.region = call.region
            args, kwargs = _cpu(call.args), _cpu(call.kwargs)
            with torch.enable_grad():
                outputs = regions[call.key](*args, **kwargs)
            grads = _differentiable(outputs)
            if grads:
                torch.autograd.backward(grads, [torch.zeros_like(g) for g in grads])
    return dict(tally.launched), tally.mismatches
