"""Triton kernels of a router's top-k choice and its sorted layout (``ops/route_op.py``):
two launches where the PyTorch ops are a softmax, k argmax passes, a gather, a
renormalisation, masking and a counting sort (about 16 kernels per router in a compiled
step on a GPU, ``docs/performance.md``).

For router logits z (N, E) fp32, active rows a (N,) bool and k picks, with the layout of
``ops/routing.py`` (slot s = n k + j; inactive slots go to the no-op expert E, sorted last):

* ``route_rows_kernel``, one program per block of ``BLOCK_N`` rows:
  ``p = softmax(z)`` (N, E); the k picks ``i_j = argmax_e p^(j)`` (each pass masks its pick;
  ties: the lowest index, as ``torch.topk`` for distinct values); the gates
  ``g_j = a · p_{i_j} / max(Σ_j p_{i_j}, 1e-9)``; the slots' experts ``i_j`` (E where not a);
  and the block's count of slots per expert 0..E, (NB, BINS) int32.
* ``route_sort_kernel``, one program per block: each expert's start
  ``start_e = Σ_{e' < e} count_e'`` over all blocks, plus the block's base, the slots of
  its experts before this block; a slot's rank among its expert's slots in the block
  (a cumulative sum of the one-hot matrix of its slots' experts, in slot order); so
  ``position(s) = start_e + base_e + rank(s)``, a stable counting sort: the sorted slots,
  their experts, and (program 0) the experts' end offsets.

CUDA tensors launch the compiled kernels; CPU tensors run them in Triton's interpreter
(tests; ``TRITON_INTERPRET=1`` before ``triton`` is imported).
"""
import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

EPS = 1e-9      # the renormalisation's floor, as ``modules/router.py``
BLOCK_N = 64    # rows per program on a GPU
NUM_WARPS = 4
INTERPRET_BLOCK_N = 4  # small in the interpreter, so that tests span several blocks
BLOCKS_PER_ITER = 64   # block counts read per iteration by the sort


def _route_rows(LOGITS, ACTIVE, PROBS, TOP_IDX, EXPERT_IDX, GATES, COUNTS,
                N, E, stride_ln,
                K: tl.constexpr, K_POW2: tl.constexpr, BINS: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BINS)
    picks = tl.arange(0, K_POW2)
    in_rows = rows < N
    is_expert = cols[None, :] < E
    z = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_ln + cols[None, :],
                mask=in_rows[:, None] & is_expert, other=0.0).to(tl.float32)
    z = tl.where(is_expert, z, float("-inf"))  # rows past N: zeros, finite
    # p = softmax(z)
    e = tl.exp(z - tl.max(z, 1)[:, None])
    p = e / tl.sum(e, 1)[:, None]
    tl.store(PROBS + rows[:, None].to(tl.int64) * E + cols[None, :], p,
             mask=in_rows[:, None] & is_expert)
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
    active = tl.load(ACTIVE + rows, mask=in_rows, other=0) != 0
    gates = tl.where(active[:, None], top / tl.maximum(tl.sum(top, 1), EPS)[:, None], 0.0)
    experts = tl.where(active[:, None], idx, E)
    slot_ok = in_rows[:, None] & (picks[None, :] < K)
    slots = rows[:, None].to(tl.int64) * K + picks[None, :]
    tl.store(TOP_IDX + slots, idx.to(tl.int64), mask=slot_ok)
    tl.store(EXPERT_IDX + slots, experts.to(tl.int64), mask=slot_ok)
    tl.store(GATES + slots, gates, mask=slot_ok)
    # this block's slots per expert 0..E (padding slots are -1: no bin)
    flat = tl.reshape(tl.where(slot_ok, experts, -1), [BLOCK_N * K_POW2])
    counts = tl.sum((flat[:, None] == cols[None, :]).to(tl.int32), 0)
    tl.store(COUNTS + pid * BINS + cols, counts)


def _route_sort(EXPERT_IDX, COUNTS, SORTED_EXPERT, SORTED_SLOT, OFFSETS, N, E, NB,
                K: tl.constexpr, K_POW2: tl.constexpr, BINS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCKS_PER_ITER: tl.constexpr):
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


# Plain JITFunctions whatever TRITON_INTERPRET says (ahead-of-time builds need them).
route_rows_kernel = JITFunction(_route_rows)
route_sort_kernel = JITFunction(_route_sort)
KERNELS = (route_rows_kernel, route_sort_kernel)

# Set by the GPU model (benchmarks/gpu_model.py) and ``aot.route_launches`` to collect
# launches, e.g. on "meta" tensors, instead of running them.
_launch_recorder = None


@functools.lru_cache(maxsize=None)
def interpreted(kernel):
    return InterpretedFunction(kernel.fn)


def _launch(kernel, blocks: int, args: dict, device: torch.device) -> None:
    if _launch_recorder is not None:
        _launch_recorder(kernel, dict(args, num_warps=NUM_WARPS, blocks=blocks))
    elif device.type == "cpu":
        if not isinstance(tl.sum, InterpretedFunction):
            raise RuntimeError("the Triton kernels run on CPU tensors only in Triton's interpreter: "
                               "set TRITON_INTERPRET=1 before triton is imported")
        interpreted(kernel)[(blocks,)](**args)
    else:
        kernel[(blocks,)](**args, num_warps=NUM_WARPS)


def route_top_k(logits: torch.Tensor, active: torch.Tensor, k: int):
    """logits (N, E) fp32, active (N,) bool, 1 <= k <= E -> probs (N, E) fp32, top_idx (N, k),
    gates (N, k) fp32, expert_idxs (N, k) (E where inactive), sorted_expert_idxs (M,),
    sorted_scattered_idxs (M,), expert_offsets (E,), indices int64, M = N k."""
    N, E = logits.shape
    device = logits.device
    block = INTERPRET_BLOCK_N if device.type == "cpu" and _launch_recorder is None else BLOCK_N
    blocks = triton.cdiv(N, block)
    shape = dict(K=k, K_POW2=triton.next_power_of_2(k), BINS=triton.next_power_of_2(E + 1),
                 BLOCK_N=block)
    probs = torch.empty(N, E, dtype=torch.float32, device=device)
    top_idx, expert_idxs = (torch.empty(N, k, dtype=torch.long, device=device) for _ in range(2))
    gates = torch.empty(N, k, dtype=torch.float32, device=device)
    counts = torch.empty(blocks, shape["BINS"], dtype=torch.int32, device=device)
    sorted_expert, sorted_slot = (torch.empty(N * k, dtype=torch.long, device=device) for _ in range(2))
    offsets = torch.empty(E, dtype=torch.long, device=device)
    if N:
        _launch(route_rows_kernel, blocks, dict(
            LOGITS=logits, ACTIVE=active, PROBS=probs, TOP_IDX=top_idx, EXPERT_IDX=expert_idxs,
            GATES=gates, COUNTS=counts, N=N, E=E, stride_ln=logits.stride(0), **shape), device)
        _launch(route_sort_kernel, blocks, dict(
            EXPERT_IDX=expert_idxs, COUNTS=counts, SORTED_EXPERT=sorted_expert, SORTED_SLOT=sorted_slot,
            OFFSETS=offsets, N=N, E=E, NB=blocks, BLOCKS_PER_ITER=BLOCKS_PER_ITER, **shape), device)
    else:
        offsets.zero_()
    return probs, top_idx, gates, expert_idxs, sorted_expert, sorted_slot, offsets
