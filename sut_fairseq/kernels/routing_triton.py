"""Triton kernels of a router's top-k choice and its sorted layout (``ops/route_op.py``):
two launches where the PyTorch ops are a softmax, k argmax passes, a gather, a
renormalisation, masking and a counting sort (about 16 kernels per router in a compiled
step on a GPU, ``docs/gpu-step.md``).

For router logits z (N, E) fp32, active rows a (N,) bool and k picks, with the layout of
``ops/routing.py`` (slot s = n k + j; inactive slots go to the no-op expert E, sorted last):

* ``route_rows_kernel``, one program per block of ``BLOCK_N`` rows:
  ``p = softmax(z)`` (N, E, not stored); the k picks ``i_j = argmax_e p^(j)`` (each pass masks its pick;
  ties: the lowest index, as ``torch.topk`` for distinct values); the gates
  ``g_j = a · p_{i_j} / max(Σ_j p_{i_j}, 1e-9)``; the slots' experts ``i_j`` (E where not a);
  the block's count of slots per expert 0..E, (NB, BINS) int32; and the block's sums of
  the routing statistics (Σ a p_e, Σ a Σ_e p_e log(p_e + 1e-9), Σ a), (NB, BINS) fp32.
* ``route_sort_kernel``, one program per block: each expert's start
  ``start_e = Σ_{e' < e} count_e'`` over all blocks, plus the block's base, the slots of
  its experts before this block; a slot's rank among its expert's slots in the block
  (a cumulative sum of the one-hot matrix of its slots' experts, in slot order); so
  ``position(s) = start_e + base_e + rank(s)``, a stable counting sort: the sorted slots,
  their experts, and (program 0) the experts' end offsets and the statistics summed over
  the blocks.
* ``route_backward_kernel``, one program per block of rows: the logits' gradient from the
  gates' and the statistics' (``ops/route_op.py`` has the formula), the softmax
  recomputed from the logits.

Gate rows (``GATE_ROWS`` = R >= 1): the gates are stored R times, (R, N, k), and their
gradient is read as R rows and summed. A gated expert map's input-gradient kernel leaves
the gate gradient as one partial sum per column tile of its output (``routed_linear``):
with R its column tiles the partials arrive as the gradient of the R rows, and this
kernel adds them up as it reads them, where a kernel of their own summed and cast them.

With ``PRE_TANH`` the input X is the pre-activation of the router's hidden layer and the
kernels form the layer as they load it, h = a · tanh(X) ⊙ keep / (1 - p) (keep: the
gating dropout's mask, (N, D) bool, or none; a: the row is active), so that no kernel of
its own reads and writes it; the backward also writes h (for the last layer's weight
gradient, a product outside) and returns X's gradient dX = a · (dz W) ⊙ keep / (1 - p) ⊙
(1 - tanh(X)^2).

CUDA tensors launch the compiled kernels; CPU tensors run them in Triton's interpreter
(tests; ``TRITON_INTERPRET=1`` before ``triton`` is imported).
"""
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from . import launch

EPS = tl.constexpr(1e-9)  # the floor of the renormalisation and the log, as ``ops/route_op.py``
BLOCK_N = 32    # rows per program on a GPU (the sort holds a (BLOCK_N k, E + 2) one-hot tile)
NUM_WARPS = 4
INTERPRET_BLOCK_N = 4  # small in the interpreter, so that tests span several blocks
BLOCKS_PER_ITER = 64   # block counts read per iteration by the sort
BLOCK_D = 64           # columns of the router's hidden layer per product (logits, dX); fp32: 16


def _route_rows(X, WEIGHT, ACTIVE, EXPERT_IDX, GATES, COUNTS, PARTIALS, KEEP, N, E, D, GATE_ROWS, stride_xn,
                stride_we, stride_kn, keep_scale, K: tl.constexpr, K_POW2: tl.constexpr,
                BINS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                HAS_WEIGHT: tl.constexpr, PRE_TANH: tl.constexpr, HAS_KEEP: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BINS)
    picks = tl.arange(0, K_POW2)
    in_rows = rows < N
    is_expert = cols[None, :] < E
    active = (tl.load(ACTIVE + rows, mask=in_rows, other=0) != 0) & in_rows
    p = _softmax(_logits(X, WEIGHT, KEEP, rows, cols, active if PRE_TANH else in_rows, E, D,
                         stride_xn, stride_we, stride_kn, keep_scale, BLOCK_N, BINS, BLOCK_D,
                         HAS_WEIGHT, PRE_TANH, HAS_KEEP, INPUT_PRECISION), is_expert)
    # k argmax passes; a pick is set to -2 and the padding columns are -1 (p >= 0)
    s = tl.where(is_expert, p, -1.0)
    idx = tl.zeros([BLOCK_N, K_POW2], tl.int32)
    top = tl.zeros([BLOCK_N, K_POW2], tl.float32)
    for j in tl.static_range(K):
        i = tl.argmax(s, 1)
        v = tl.max(s, 1)
        idx = tl.where(picks[None, :] == j, i[:, None], idx)
        top = tl.where(picks[None, :] == j, v[:, None], top)
        s = tl.where(cols[None, :] == i[:, None], -2.0, s)
    a = active.to(tl.float32)
    gates = tl.where(active[:, None], top / tl.maximum(tl.sum(top, 1), EPS)[:, None], 0.0)
    experts = tl.where(active[:, None], idx, E)
    slot_ok = in_rows[:, None] & (picks[None, :] < K)
    slots = rows[:, None].to(tl.int64) * K + picks[None, :]
    tl.store(EXPERT_IDX + slots, experts.to(tl.int64), mask=slot_ok)
    for r in range(GATE_ROWS):  # (GATE_ROWS, N, k): equal rows (``route_top_k``)
        tl.store(GATES + r * N * K + slots, gates.to(GATES.dtype.element_ty), mask=slot_ok)
    # this block's slots per expert 0..E (padding slots are -1: no bin)
    flat = tl.reshape(tl.where(slot_ok, experts, -1), [BLOCK_N * K_POW2])
    tl.store(COUNTS + pid * BINS + cols, tl.sum((flat[:, None] == cols[None, :]).to(tl.int32), 0))
    # this block's statistics: sum_n a_n p_ne (columns 0..E-1), sum_n a_n sum_e p log(p + eps)
    # (column E) and sum_n a_n (column E + 1); BINS >= E + 2
    p_log_p = tl.where(is_expert, p * tl.log(p + EPS), 0.0)
    part = tl.sum(a[:, None] * tl.where(is_expert, p, 0.0), 0)
    part = tl.where(cols == E, tl.sum(a * tl.sum(p_log_p, 1), 0), part)
    part = tl.where(cols == E + 1, tl.sum(a, 0), part)
    tl.store(PARTIALS + pid * BINS + cols, part)


def _tanh_fp32(x):
    """tanh of fp32 x: (1 - e) / (1 + e) with e = exp(-2|x|), its sign restored; below
    |x| = 1/8 the series x - x^3/3 + 2x^5/15 - 17x^7/315 (no cancellation in 1 - e there).
    Triton's interpreter has no libdevice tanh; relative error about 1e-7 in fp32."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    far = (1.0 - e) / (1.0 + e)
    x2 = x * x
    near = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
    t = tl.where(ax < 0.125, near, far)
    return tl.where(x < 0, -t, t)


def _hidden_rows(X, KEEP, rows, d, live, D, stride_xn, stride_kn, keep_scale,
                 HAS_KEEP: tl.constexpr):
    """The router's hidden layer on a (BLOCK_N, BLOCK_D) tile from its pre-activation X,
    and its slope, in fp32: h = tanh(X) ⊙ keep · keep_scale and ∂h/∂X = (1 - tanh(X)^2) ⊙
    keep · keep_scale, both 0 on rows not ``live`` and past D."""
    ok = live[:, None] & (d[None, :] < D)
    t = _tanh(tl.load(X + rows[:, None].to(tl.int64) * stride_xn + d[None, :], mask=ok,
                      other=0.0).to(tl.float32))
    if HAS_KEEP:
        keep = tl.load(KEEP + rows[:, None].to(tl.int64) * stride_kn + d[None, :], mask=ok,
                       other=0) != 0
        scale = tl.where(keep, keep_scale, 0.0)
        h, slope = t * scale, (1.0 - t * t) * scale
    else:  # t is 0 where nothing was loaded
        h, slope = t, tl.where(ok, 1.0 - t * t, 0.0)
    return h, slope


def _logits_rows(X, WEIGHT, KEEP, rows, cols, live, E, D, stride_xn, stride_we, stride_kn,
                 keep_scale, BLOCK_N: tl.constexpr, BINS: tl.constexpr, BLOCK_D: tl.constexpr,
                 HAS_WEIGHT: tl.constexpr, PRE_TANH: tl.constexpr, HAS_KEEP: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """The rows' logits (BLOCK_N, BINS) in fp32, rounded to X's dtype as a product in that
    dtype would be: X itself (N, E) without a weight, else X (N, D) W^T with W (E, D),
    accumulated in fp32 over blocks of BLOCK_D columns (0 past N and E); with ``PRE_TANH``
    the hidden layer h of X (``_hidden_tile``, rounded to X's dtype) W^T. ``live``: the
    rows read (the others' logits 0)."""
    if HAS_WEIGHT:
        acc = tl.zeros([BLOCK_N, BINS], tl.float32)
        ds = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + ds
            if PRE_TANH:
                h, _ = _hidden_tile(X, KEEP, rows, d, live, D, stride_xn, stride_kn, keep_scale,
                                    HAS_KEEP)
                x = h.to(X.dtype.element_ty)
            else:
                x = tl.load(X + rows[:, None].to(tl.int64) * stride_xn + d[None, :],
                            mask=live[:, None] & (d[None, :] < D), other=0.0)
            w = tl.load(WEIGHT + cols[:, None] * stride_we + d[None, :],
                        mask=(cols[:, None] < E) & (d[None, :] < D), other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=INPUT_PRECISION)
        return acc.to(X.dtype.element_ty).to(tl.float32)
    else:
        return tl.load(X + rows[:, None].to(tl.int64) * stride_xn + cols[None, :],
                       mask=live[:, None] & (cols[None, :] < E), other=0.0).to(tl.float32)


def _softmax_rows(z, is_expert):
    """softmax over the E columns of logits z (BLOCK_N, BINS) fp32 (rows past N: uniform)."""
    z = tl.where(is_expert, z, float("-inf"))
    e = tl.exp(z - tl.max(z, 1)[:, None])
    return e / tl.sum(e, 1)[:, None]


def _route_sort(EXPERT_IDX, COUNTS, PARTIALS, RUNNING, SORTED_EXPERT, SORTED_SLOT, OFFSETS, SUMS,
                N, E, NB, K: tl.constexpr, K_POW2: tl.constexpr, BINS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, HAS_RUNNING: tl.constexpr):
    pid = tl.program_id(0)
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], tl.int32)   # slots per expert, all blocks
    before = tl.zeros([BINS], tl.int32)  # slots per expert in the blocks before this one
    for first in range(0, NB, BLOCKS_PER_ITER):
        blocks = first + tl.arange(0, BLOCKS_PER_ITER)
        c = tl.load(COUNTS + blocks[:, None] * BINS + bins[None, :], mask=(blocks < NB)[:, None], other=0)
        total += tl.sum(c, 0)
        before += tl.sum(tl.where((blocks < pid)[:, None], c, 0), 0)
    ends = tl.cumsum(total, 0)
    base = ends - total + before  # start_e + this block's base
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    picks = tl.arange(0, K_POW2)
    slot_ok = (rows < N)[:, None] & (picks[None, :] < K)
    slots = rows[:, None].to(tl.int64) * K + picks[None, :]
    experts = tl.load(EXPERT_IDX + slots, mask=slot_ok, other=-1)
    flat = tl.reshape(experts, [BLOCK_N * K_POW2])
    flat_slots = tl.reshape(slots, [BLOCK_N * K_POW2])
    flat_ok = tl.reshape(slot_ok, [BLOCK_N * K_POW2])
    one_hot = (flat[:, None] == bins[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(one_hot, 0) * one_hot, 1) - 1
    position = tl.sum(one_hot * base[None, :], 1) + rank
    tl.store(SORTED_SLOT + position, flat_slots, mask=flat_ok)
    tl.store(SORTED_EXPERT + position, flat, mask=flat_ok)
    if pid == 0:
        tl.store(OFFSETS + bins, ends.to(tl.int64), mask=bins < E)
        # the statistics: [sum a p (E) | picks per expert (E) | sum a p log p | sum a]
        sums = tl.zeros([BINS], tl.float32)
        for first in range(0, NB, BLOCKS_PER_ITER):
            blocks = first + tl.arange(0, BLOCKS_PER_ITER)
            sums += tl.sum(tl.load(PARTIALS + blocks[:, None] * BINS + bins[None, :],
                                   mask=(blocks < NB)[:, None], other=0.0), 0)
        # positions of the three parts in SUMS: bins (< E), E + bins (< E), E + bins (E, E + 1)
        firsts = bins < E
        lasts = (bins == E) | (bins == E + 1)
        picked = total.to(tl.float32)
        if HAS_RUNNING:  # the forward's earlier calls
            sums += tl.load(RUNNING + bins, mask=firsts, other=0.0)
            sums += tl.load(RUNNING + E + bins, mask=lasts, other=0.0)
            picked += tl.load(RUNNING + E + bins, mask=firsts, other=0.0)
        tl.store(SUMS + bins, sums, mask=firsts)
        tl.store(SUMS + E + bins, picked, mask=firsts)
        tl.store(SUMS + E + bins, sums, mask=lasts)


def _route_backward(X, WEIGHT, ACTIVE, EXPERT_IDX, DGATES, DSUMS, DLOGITS, DX, KEEP, H, N, E, D, GATE_ROWS,
                    stride_xn, stride_we, stride_dn, stride_dxn, stride_kn, stride_hn, keep_scale,
                    K: tl.constexpr, K_POW2: tl.constexpr, BINS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    PRE_TANH: tl.constexpr, HAS_KEEP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BINS)
    picks = tl.arange(0, K_POW2)
    in_rows = rows < N
    is_expert = cols[None, :] < E
    active = (tl.load(ACTIVE + rows, mask=in_rows, other=0) != 0) & in_rows
    live = active if PRE_TANH else in_rows
    p = _softmax(_logits(X, WEIGHT, KEEP, rows, cols, live, E, D, stride_xn, stride_we, stride_kn,
                         keep_scale, BLOCK_N, BINS, BLOCK_D, HAS_WEIGHT, PRE_TANH, HAS_KEEP,
                         INPUT_PRECISION), is_expert)
    a = active.to(tl.float32)
    slot_ok = in_rows[:, None] & (picks[None, :] < K)
    slots = rows[:, None].to(tl.int64) * K + picks[None, :]
    experts = tl.load(EXPERT_IDX + slots, mask=slot_ok, other=-1)  # E where inactive
    g = tl.zeros([BLOCK_N, K_POW2], tl.float32)
    for r in range(GATE_ROWS):  # the gates' gradient: the sum of its (GATE_ROWS, N, k) rows
        g += tl.load(DGATES + r * N * K + slots, mask=slot_ok, other=0.0).to(tl.float32)
    g = g * a[:, None]
    # the picks' probabilities and S = max(sum_j p_{i_j}, eps)
    top = tl.zeros([BLOCK_N, K_POW2], tl.float32)
    for j in tl.static_range(K):
        e_j = tl.sum(tl.where(picks[None, :] == j, experts, 0), 1)
        p_j = tl.sum(tl.where(cols[None, :] == e_j[:, None], p, 0.0), 1)
        top = tl.where(picks[None, :] == j, p_j[:, None], top)
    total = tl.maximum(tl.sum(top, 1), EPS)
    c = tl.sum(g * top, 1) / total
    # dL/dp: the statistics' terms, then each pick's
    d_probs = tl.load(DSUMS + cols, mask=cols < E, other=0.0)
    d_neg_entropy = tl.load(DSUMS + 2 * E)
    dp = a[:, None] * (d_probs[None, :] + d_neg_entropy * (tl.log(p + EPS) + p / (p + EPS)))
    for j in tl.static_range(K):
        e_j = tl.sum(tl.where(picks[None, :] == j, experts, 0), 1)
        g_j = tl.sum(tl.where(picks[None, :] == j, g, 0.0), 1)
        dp += tl.where(cols[None, :] == e_j[:, None], ((g_j - c) / total)[:, None], 0.0)
    dp = tl.where(is_expert, dp, 0.0)
    dz = p * (dp - tl.sum(dp * p, 1)[:, None])
    dz = tl.where(in_rows[:, None] & is_expert, dz, 0.0).to(DLOGITS.dtype.element_ty)
    tl.store(DLOGITS + rows[:, None].to(tl.int64) * stride_dn + cols[None, :], dz,
             mask=in_rows[:, None] & is_expert)
    if HAS_WEIGHT:  # the input's gradient dX = dz W (BLOCK_N, D), dz rounded as stored
        ds = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + ds
            ok = in_rows[:, None] & (d[None, :] < D)
            w = tl.load(WEIGHT + cols[:, None] * stride_we + d[None, :],
                        mask=(cols[:, None] < E) & (d[None, :] < D), other=0.0)
            dx = tl.dot(dz, w.to(dz.dtype), input_precision=INPUT_PRECISION)
            if PRE_TANH:  # through the hidden layer: dX = dh ⊙ (1 - t^2) ⊙ keep · scale
                h, slope = _hidden_tile(X, KEEP, rows, d, live, D, stride_xn, stride_kn,
                                        keep_scale, HAS_KEEP)
                tl.store(H + rows[:, None].to(tl.int64) * stride_hn + d[None, :],
                         h.to(H.dtype.element_ty), mask=ok)
                # dh rounded as autograd's; the slope 0 on inactive rows
                dx = dx.to(DX.dtype.element_ty).to(tl.float32) * slope
            tl.store(DX + rows[:, None].to(tl.int64) * stride_dxn + d[None, :],
                     dx.to(DX.dtype.element_ty), mask=ok)


# Plain JITFunctions whatever TRITON_INTERPRET says (ahead-of-time builds need them); the
# kernels' helpers through ``launch.helper`` (plain Python when the interpreter calls them).
_softmax = launch.helper(_softmax_rows)
_tanh = launch.helper(_tanh_fp32)
_hidden_tile = launch.helper(_hidden_rows)
_logits = launch.helper(_logits_rows)
route_rows_kernel = JITFunction(_route_rows)
route_sort_kernel = JITFunction(_route_sort)
route_backward_kernel = JITFunction(_route_backward)
KERNELS = (route_rows_kernel, route_sort_kernel, route_backward_kernel)

def _launch(kernel, blocks: int, args: dict, device: torch.device) -> None:
    if launch.recorder is not None:
        launch.recorder(kernel, dict(args, num_warps=NUM_WARPS, blocks=blocks))
    elif device.type == "cpu":
        launch.interpreted(kernel)[(blocks,)](**args)
    else:
        kernel[(blocks,)](**args, num_warps=NUM_WARPS)


def _shape(N: int, E: int, k: int, device: torch.device) -> dict:
    """Block sizes; the bins (experts 0..E and the statistics' two columns) at least 16,
    the smallest dimension ``tl.dot`` takes."""
    block = INTERPRET_BLOCK_N if device.type == "cpu" and launch.recorder is None else BLOCK_N
    return dict(K=k, K_POW2=triton.next_power_of_2(k), BINS=max(16, triton.next_power_of_2(E + 2)),
                BLOCK_N=block)


def _input_precision(dtype: torch.dtype) -> str:
    """fp32 products in full precision unless TF32 is allowed (as the routed kernels)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _logits_args(x: torch.Tensor, weight: Optional[torch.Tensor], keep: Optional[torch.Tensor],
                 keep_scale: float, pre_tanh: bool) -> dict:
    """The kernels' arguments for the logits: x (N, E) themselves, or x (N, D) and the
    router's last layer weight (E, D), multiplied in the kernel; with ``pre_tanh`` x is
    the hidden layer's pre-activation and keep (N, D) bool or None its dropout mask."""
    block_d = BLOCK_D if x.element_size() < 4 else 16  # fp32 tiles: no register spills on sm_80
    if pre_tanh and weight is None:
        raise ValueError("pre_tanh: x is a hidden layer's pre-activation, which needs the "
                         "router's last layer (weight)")
    if keep is not None and (not pre_tanh or keep.shape != x.shape or keep.dtype != torch.bool):
        raise ValueError(f"keep must be a bool mask of x's shape {tuple(x.shape)} with "
                         f"pre_tanh; got {keep.dtype} {tuple(keep.shape)}, pre_tanh={pre_tanh}")
    return dict(X=x, WEIGHT=x if weight is None else weight, KEEP=x if keep is None else keep,
                D=x.size(1), stride_xn=x.stride(0),
                stride_we=0 if weight is None else weight.stride(0),
                stride_kn=0 if keep is None else keep.stride(0), keep_scale=float(keep_scale),
                BLOCK_D=block_d, HAS_WEIGHT=weight is not None, PRE_TANH=pre_tanh,
                HAS_KEEP=keep is not None, INPUT_PRECISION=_input_precision(x.dtype))


def route_top_k(x: torch.Tensor, weight: Optional[torch.Tensor], active: torch.Tensor, k: int,
                gate_dtype: torch.dtype = torch.float32, running: Optional[torch.Tensor] = None,
                keep: Optional[torch.Tensor] = None, keep_scale: float = 1.0,
                pre_tanh: bool = False, gate_rows: int = 0):
    """logits z = x (N, E) (``weight`` None), or z = x W^T from x (N, D) and the router's
    last layer W (E, D) (one product per block of rows, rounded to x's dtype); with
    ``pre_tanh`` z = h W^T from the hidden layer h = a tanh(x) ⊙ keep · keep_scale
    (module docstring); contiguous
    rows, any float dtype; active (N,) bool, 1 <= k <= E -> gates (N, k) in ``gate_dtype``
    (computed in fp32), expert_idxs (N, k) (E where inactive), sorted_expert_idxs (M,),
    sorted_scattered_idxs (M,), expert_offsets (E,), indices int64, M = N k; and the
    statistics (2 E + 2,) fp32 (``ops/route_op.py``), ``running`` (2 E + 2,) fp32 added;
    ``gate_rows`` R >= 1: the gates (R, N, k), R equal rows (module docstring)."""
    N = x.size(0)
    E = x.size(1) if weight is None else weight.size(0)
    device = x.device
    logits_args = _logits_args(x, weight, keep, keep_scale, pre_tanh)
    shape = _shape(N, E, k, device)
    blocks = triton.cdiv(N, shape["BLOCK_N"])
    expert_idxs = torch.empty(N, k, dtype=torch.long, device=device)
    gates = torch.empty(*((gate_rows,) if gate_rows else ()), N, k, dtype=gate_dtype, device=device)
    counts = torch.empty(blocks, shape["BINS"], dtype=torch.int32, device=device)
    partials = torch.empty(blocks, shape["BINS"], dtype=torch.float32, device=device)
    sorted_expert, sorted_slot = (torch.empty(N * k, dtype=torch.long, device=device) for _ in range(2))
    offsets = torch.empty(E, dtype=torch.long, device=device)
    sums = torch.empty(2 * E + 2, dtype=torch.float32, device=device)
    if N == 0:
        sums = running.clone() if running is not None else sums.zero_()
        return gates, expert_idxs, sorted_expert, sorted_slot, offsets.zero_(), sums
    _launch(route_rows_kernel, blocks, dict(
        ACTIVE=active, EXPERT_IDX=expert_idxs, GATES=gates, COUNTS=counts, PARTIALS=partials,
        N=N, E=E, GATE_ROWS=max(gate_rows, 1), **logits_args, **shape), device)
    _launch(route_sort_kernel, blocks, dict(
        EXPERT_IDX=expert_idxs, COUNTS=counts, PARTIALS=partials,
        RUNNING=running.contiguous() if running is not None else sums, SORTED_EXPERT=sorted_expert,
        SORTED_SLOT=sorted_slot, OFFSETS=offsets, SUMS=sums, N=N, E=E, NB=blocks,
        BLOCKS_PER_ITER=BLOCKS_PER_ITER, HAS_RUNNING=running is not None, **shape), device)
    return gates, expert_idxs, sorted_expert, sorted_slot, offsets, sums


def route_top_k_backward(x: torch.Tensor, weight: Optional[torch.Tensor], active: torch.Tensor,
                         expert_idxs: torch.Tensor, grad_gates: torch.Tensor, grad_sums: torch.Tensor,
                         keep: Optional[torch.Tensor] = None, keep_scale: float = 1.0,
                         pre_tanh: bool = False):
    """The logits' gradient dz (N, E) in x's dtype, from the gates' ((N, k), or the rows
    (R, N, k) it sums, any float dtype) and the statistics' (2 E + 2,) gradients (fp32; ``ops/route_op.py``), the logits and
    softmax recomputed from x (and W); with a weight also x's gradient dz W (N, D), in the
    same launch (None without); with ``pre_tanh`` x's gradient through the hidden layer and
    the hidden layer h (N, D) itself, for W's gradient dz^T h (else None): (dz, dx, h)."""
    N = x.size(0)
    E = x.size(1) if weight is None else weight.size(0)
    logits_args = _logits_args(x, weight, keep, keep_scale, pre_tanh)
    shape = _shape(N, E, expert_idxs.size(1), x.device)
    grad = torch.empty(N, E, dtype=x.dtype, device=x.device)
    grad_x = None if weight is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    hidden = torch.empty_like(x, memory_format=torch.contiguous_format) if pre_tanh else None
    if N:
        _launch(route_backward_kernel, triton.cdiv(N, shape["BLOCK_N"]), dict(
            ACTIVE=active, EXPERT_IDX=expert_idxs, DGATES=grad_gates, DSUMS=grad_sums,
            DLOGITS=grad, DX=grad if grad_x is None else grad_x,
            H=grad if hidden is None else hidden, N=N, E=E,
            GATE_ROWS=grad_gates.size(0) if grad_gates.dim() == 3 else 1,
            stride_dn=grad.stride(0), stride_dxn=0 if grad_x is None else grad_x.stride(0),
            stride_hn=0 if hidden is None else hidden.stride(0), **logits_args, **shape), x.device)
    return grad, grad_x, hidden
