"""Triton kernels for the routed linear map (``sut_fairseq.ops.routed_linear``).

Layout (see ``sut_fairseq/ops/routing.py``): M = N * k slots, sorted by expert. Sorted row
``m`` belongs to expert ``e_m = sorted_expert_idxs[m]`` and to slot
``s_m = sorted_scattered_idxs[m]``; rows at and after ``expert_offsets[E - 1]`` (the
number of active rows) belong to the sentinel expert E (halted / padding positions).

A tensor with rows of width W is read or written in one of three row orders, chosen by
two compile-time constants ``*_GROUPED`` and ``*_FAN``:

* grouped (``GROUPED=True``): row ``m`` of an (M, W) tensor, the sorted order itself;
* scattered (``GROUPED=False``): row ``s_m // FAN`` of an (M / FAN, W) tensor: ``FAN=1``
  is slot order, ``FAN=k`` token order (one row serves the k slots of a token).

Kernels:

* ``routed_gemm_kernel``: ``Y[row_y(m)] = g_m * (X[row_x(m)] @ W[e_m] + b[e_m])`` for every
  active row m, one (BLOCK_M, BLOCK_N) tile of one expert's sorted rows x output columns
  per program. Expert e owns ``cdiv(count_e, BLOCK_M)`` consecutive row tiles; each
  program finds its expert from ``expert_offsets`` on the device (a cumsum over E), so
  tokens are never copied or padded to a capacity: only the last tile of an expert has
  masked rows. Grid: ``(cdiv(M, BLOCK_M) + E) * cdiv(N, BLOCK_N)``. Serves the forward pass
  (W = (E, in, out)) and the input gradient (W read transposed through its strides).
  With ``HAS_DG`` it also emits the gate-gradient partial sums
  ``DG[pid_n, s_m] = sum_cols(acc_m * AUX[row_aux(m)])`` (see ``routed_linear_triton``).
* ``routed_wgrad_kernel``: ``dW[e] = sum_{m in e} X[row_x(m)]^T (g_m * DY[row_dy(m)])``
  and ``db[e] = sum_{m in e} g_m * DY[row_dy(m)]``; one (BLOCK_K, BLOCK_N) tile of one
  expert's weight per program, looping over that expert's rows (bounds read on device).
  With ``ACCUMULATE`` it adds a running sum (the other recurrence steps' gradients of the
  shared weight) to each tile before storing it, as cuBLAS's beta = 1.

Output activation (``OUT_ACT``: 1 GELU, 2 ReLU; 0 none), for MoE-FFD's up projection: the
forward stores its result u and, beside it, the down projection's input act(u) ⊙ keep ·
keep_scale (``HAS_OUT_KEEP``: the activation dropout's mask, drawn before the launch), so
that no kernel of its own reads u back to form it.

Input activation's gradient (``ACT``: 1 GELU, 2 ReLU; 0 none), for MoE-FFD's down
projection, whose input x = act(u) ⊙ keep · keep_scale is made from the up projection's
pre-activations u (``HAS_KEEP``: the activation dropout's mask; the scale 1 / (1 - p)):
the input gradient multiplies its result by ``act'(u) ⊙ keep · keep_scale`` as it stores
it, so that it returns u's gradient and no kernel of its own reads x's gradient back
(the activation's backward was a pass over the (M, D) rows of its own).

Neither kernel needs a host-side count: grids come from the static upper bound M, and a
program whose row tile lies past the last expert's rows (at/after
``expert_offsets[E - 1]``) computes nothing: it writes zeros on the no-op rows of the
output (rows routed to the sentinel expert are never read), so the caller allocates the
outputs uninitialised instead of zeroing them in a launch of their own.
Operands come in ``X``'s dtype (the compute dtype: the caller casts weights, e.g. to the
autocast dtype); products accumulate in fp32 and gates are applied in fp32.

The kernels are built as plain ``JITFunction`` objects regardless of ``TRITON_INTERPRET``;
``launch.interpreted(kernel)`` gives the CPU-interpreter version (used for CPU tensors), so
ahead-of-time compilation and interpretation both work in one process.
"""
import inspect

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from . import launch

#: ``ACT`` / ``OUT_ACT`` codes of the input activation whose gradient the kernel applies and
#: of the output activation it forms (docstring)
ACTIVATIONS = {"": 0, "gelu": 1, "relu": 2}


def _slope_tile(PRE, KEEP, rows, cols, mask, stride_pm, stride_pk, stride_km, keep_scale,
                ACT: tl.constexpr, HAS_KEEP: tl.constexpr):
    """act'(u) ⊙ keep · keep_scale (fp32, 0 outside ``mask``) on the tile (rows, cols) of
    the pre-activations PRE and the mask KEEP: GELU's Φ(u) + u φ(u) (erf form, fairseq's
    ``gelu``), ReLU's [u > 0]."""
    u = tl.load(PRE + rows[:, None] * stride_pm + cols[None, :] * stride_pk, mask=mask,
                other=0.0).to(tl.float32)
    if ACT == 1:
        slope = (0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))
                 + u * 0.3989422804014327 * tl.exp(-0.5 * u * u))
    else:
        slope = (u > 0).to(tl.float32)
    if HAS_KEEP:
        keep = tl.load(KEEP + rows[:, None] * stride_km + cols[None, :], mask=mask, other=0) != 0
        slope = tl.where(keep, slope * keep_scale, 0.0)
    return slope


_slope = launch.helper(_slope_tile)


def _activated_tile(u, KEEP, rows, cols, mask, stride_km, keep_scale,
                    ACT: tl.constexpr, HAS_KEEP: tl.constexpr):
    """act(u) ⊙ keep · keep_scale (fp32) of the fp32 tile u (rows, cols): GELU's u Φ(u) (erf
    form), ReLU's max(u, 0); KEEP bool in u's rows."""
    if ACT == 1:
        value = u * (0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476)))
    else:
        value = tl.maximum(u, 0.0)
    if HAS_KEEP:
        keep = tl.load(KEEP + rows[:, None] * stride_km + cols[None, :], mask=mask, other=0) != 0
        value = tl.where(keep, value * keep_scale, 0.0)
    return value


_activated = launch.helper(_activated_tile)


def _routed_gemm(
    X, W, B, Y, G, AUX, DG, PRE, KEEP, Z, OUT_KEEP,
    sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
    M, K, N, E,
    stride_xm, stride_xk,
    stride_we, stride_wk, stride_wn,
    stride_be, stride_bn,
    stride_ym, stride_yn,
    stride_am, stride_ak,
    stride_dg, DG_ROWS, stride_pm, stride_pk, stride_km, keep_scale,
    stride_zm, stride_zn, stride_okm, out_keep_scale,
    X_GROUPED: tl.constexpr, X_FAN: tl.constexpr, Y_GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    HAS_DG: tl.constexpr, A_GROUPED: tl.constexpr, A_FAN: tl.constexpr, DG_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_KEEP: tl.constexpr, OUT_ACT: tl.constexpr, HAS_OUT_KEEP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """X: rows of width K; W: (E, K, N) via strides; B: (E, N); Y: rows of width N;
    G: (M,) gates by slot; AUX: rows of width N (HAS_DG); DG: (DG_ROWS, M) fp32 with
    DG_ROWS >= cdiv(N, BLOCK_N). ``DG_BIAS`` (with HAS_DG, no HAS_BIAS): B is (E, K) and
    column tile 0 adds ``X[row_x(m)] . B[e_m]`` to its partial (the gate gradient's bias
    term, accumulated in the K loop). ``ACT`` (an input gradient; PRE: u in Y's rows, KEEP
    bool in them too): Y gets the result times act'(u) ⊙ keep · keep_scale. ``OUT_ACT`` (a
    forward without gates; OUT_KEEP bool in Y's rows or none): Y gets u, the result, and Z
    (Y's rows and shape) act(u) ⊙ keep · out_keep_scale of u as stored. Every row of
    Y and every entry of DG is written: the tiles past the last expert's write zeros on the no-op rows,
    and DG's rows past cdiv(N, BLOCK_N) are zeros, so the caller allocates them empty.
    Grid: (cdiv(M, BLOCK_M) + E) * cdiv(N, BLOCK_N) programs."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M) + E
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order: GROUP_M row tiles sweep all column tiles together, so
    # consecutive programs share the same expert's weight panel in L2.
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    # Row tile pid_m -> (expert e, its rows [row0, row0 + BLOCK_M) clipped to `end`):
    # expert e owns cdiv(count_e, BLOCK_M) consecutive tiles; read on device, no sync.
    eids = tl.arange(0, E_POW2)
    ends = tl.load(expert_offsets + eids, mask=eids < E, other=0)
    starts = tl.load(expert_offsets + eids - 1, mask=(eids > 0) & (eids < E), other=0)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    tiles_end = tl.cumsum(tiles, 0)
    e = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)
    if e < E:
        this = eids == e
        end = tl.sum(tl.where(this, ends, 0), 0)
        row0 = tl.sum(tl.where(this, starts + (pid_m - (tiles_end - tiles)) * BLOCK_M, 0), 0)
        rm = row0 + tl.arange(0, BLOCK_M)
        row_ok = rm < end
        slot = tl.load(sorted_scattered_idxs + rm, mask=row_ok, other=0)
        if X_GROUPED:
            x_row = rm
        else:
            x_row = slot // X_FAN
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        dg_bias = tl.zeros((BLOCK_M,), dtype=tl.float32)  # Σ_k x_k b_k (DG_BIAS, tile 0)
        x_ptrs = X + x_row[:, None] * stride_xm + rk[None, :] * stride_xk
        w_ptrs = W + e * stride_we + rk[:, None] * stride_wk + rn[None, :] * stride_wn
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w.to(X.dtype.element_ty), acc, input_precision=INPUT_PRECISION)
            if DG_BIAS:
                if pid_n == 0:
                    bk = tl.load(B + e * stride_be + (k0 + rk) * stride_bn, mask=k_ok, other=0.0)
                    dg_bias += tl.sum(a.to(tl.float32) * bk.to(tl.float32)[None, :], axis=1)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk

        out_mask = row_ok[:, None] & n_ok[None, :]
        if HAS_BIAS:
            b = tl.load(B + e * stride_be + rn * stride_bn, mask=n_ok, other=0.0)
            acc += b.to(tl.float32)[None, :]
        if HAS_DG:
            if A_GROUPED:
                a_row = rm
            else:
                a_row = slot // A_FAN
            aux = tl.load(AUX + a_row[:, None] * stride_am + rn[None, :] * stride_ak, mask=out_mask, other=0.0)
            dg = tl.sum(acc * aux.to(tl.float32), axis=1) + dg_bias
            tl.store(DG + pid_n * stride_dg + slot, dg, mask=row_ok)
            if pid_n == num_pid_n - 1:  # DG's rows past the column tiles (allocated for
                for r in range(num_pid_n, DG_ROWS):  # narrower tiles, summed by the caller)
                    tl.store(DG + r * stride_dg + slot, tl.zeros((BLOCK_M,), dtype=tl.float32), mask=row_ok)
        if GATED:
            g = tl.load(G + slot, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * g[:, None]
        if Y_GROUPED:
            y_row = rm
        else:
            y_row = slot
        if ACT != 0:  # u's gradient: x's rounded as stored, times act'(u) ⊙ keep · scale
            acc = acc.to(Y.dtype.element_ty).to(tl.float32) * _slope(
                PRE, KEEP, y_row, rn, out_mask, stride_pm, stride_pk, stride_km, keep_scale,
                ACT, HAS_KEEP)
        tl.store(Y + y_row[:, None] * stride_ym + rn[None, :] * stride_yn,
                 acc.to(Y.dtype.element_ty), mask=out_mask)
        if OUT_ACT != 0:  # the next map's input act(u) ⊙ keep · scale, of u as stored
            z = _activated(acc.to(Y.dtype.element_ty).to(tl.float32), OUT_KEEP, y_row, rn,
                           out_mask, stride_okm, out_keep_scale, OUT_ACT, HAS_OUT_KEEP)
            tl.store(Z + y_row[:, None] * stride_zm + rn[None, :] * stride_zn,
                     z.to(Z.dtype.element_ty), mask=out_mask)
    else:
        # A spare row tile t (after the experts' tiles): zeros on the no-op rows
        # [A + t BLOCK_M, A + (t + 1) BLOCK_M) ∩ [A, M), A = expert_offsets[E - 1] the
        # active rows, their Y columns of tile pid_n and their DG entries. The spare tiles
        # cover every no-op row: cdiv(M, BLOCK_M) + E - Σ_e cdiv(count_e, BLOCK_M)
        # >= (M - A) / BLOCK_M of them.
        t = pid_m - tl.sum(tiles, 0)
        rm = tl.load(expert_offsets + E - 1) + t * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rm < M
        slot = tl.load(sorted_scattered_idxs + rm, mask=row_ok, other=0)
        if Y_GROUPED:
            y_row = rm
        else:
            y_row = slot
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(Y + y_row[:, None] * stride_ym + rn[None, :] * stride_yn,
                 tl.zeros((BLOCK_M, BLOCK_N), dtype=Y.dtype.element_ty),
                 mask=row_ok[:, None] & (rn < N)[None, :])
        if OUT_ACT != 0:  # act(0) = 0
            tl.store(Z + y_row[:, None] * stride_zm + rn[None, :] * stride_zn,
                     tl.zeros((BLOCK_M, BLOCK_N), dtype=Z.dtype.element_ty),
                     mask=row_ok[:, None] & (rn < N)[None, :])
        if HAS_DG:
            tl.store(DG + pid_n * stride_dg + slot, tl.zeros((BLOCK_M,), dtype=tl.float32), mask=row_ok)
            if pid_n == num_pid_n - 1:  # DG's rows past the column tiles: zeros too
                for r in range(num_pid_n, DG_ROWS):
                    tl.store(DG + r * stride_dg + slot, tl.zeros((BLOCK_M,), dtype=tl.float32), mask=row_ok)


def _routed_wgrad(
    X, DY, G, DW, DB, ACC_W, ACC_B,
    sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
    K, N, E,
    stride_xm, stride_xk,
    stride_dym, stride_dyn,
    stride_dwe, stride_dwk, stride_dwn,
    stride_dbe, stride_dbn,
    X_GROUPED: tl.constexpr, X_FAN: tl.constexpr, DY_GROUPED: tl.constexpr, DY_FAN: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """X: rows of width K; DY: rows of width N; G: (M,) gates by slot; DW: (E, K, N);
    DB: (E, N); with ``ACCUMULATE`` ACC_W and ACC_B (DW's and DB's shapes and strides) are
    running sums added to the tiles before they are stored (DW = ACC_W + the sum).
    Grid: E * cdiv(K, BLOCK_K) * cdiv(N, BLOCK_N) programs."""
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    e = pid // (num_k * num_n)
    tile = pid % (num_k * num_n)
    pid_k = tile // num_n
    pid_n = tile % num_n

    end = tl.load(expert_offsets + e).to(tl.int32)
    start = tl.where(e > 0, tl.load(expert_offsets + tl.maximum(e - 1, 0)), 0).to(tl.int32)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = rk < K
    n_ok = rn < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    # db's rows summed elementwise in the loop and across rows once after it: a sum over
    # axis 0 per iteration is a cross-warp reduction (shared memory and barriers each time).
    db_rows = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rm = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rm < end
        slot = tl.load(sorted_scattered_idxs + rm, mask=row_ok, other=0)
        if X_GROUPED:
            x_row = rm
        else:
            x_row = slot // X_FAN
        if DY_GROUPED:
            dy_row = rm
        else:
            dy_row = slot // DY_FAN
        x = tl.load(X + x_row[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        dy = tl.load(DY + dy_row[:, None] * stride_dym + rn[None, :] * stride_dyn,
                     mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        if GATED:
            g = tl.load(G + slot, mask=row_ok, other=0.0).to(tl.float32)
            dy = (dy.to(tl.float32) * g[:, None]).to(X.dtype.element_ty)
        else:
            dy = dy.to(X.dtype.element_ty)
        if HAS_BIAS:
            db_rows += dy.to(tl.float32)
        acc = tl.dot(tl.trans(x), dy, acc, input_precision=INPUT_PRECISION)

    dw_offsets = e * stride_dwe + rk[:, None] * stride_dwk + rn[None, :] * stride_dwn
    if ACCUMULATE:  # the running sum over the other recurrence steps, added in fp32
        acc += tl.load(ACC_W + dw_offsets, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    tl.store(DW + dw_offsets, acc.to(DW.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])
    if HAS_BIAS:
        if pid_k == 0:
            db = tl.sum(db_rows, axis=0)
            if ACCUMULATE:
                db += tl.load(ACC_B + e * stride_dbe + rn * stride_dbn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(DB + e * stride_dbe + rn * stride_dbn, db.to(DB.dtype.element_ty), mask=n_ok)


routed_gemm_kernel = JITFunction(_routed_gemm)
routed_wgrad_kernel = JITFunction(_routed_wgrad)
KERNELS = (routed_gemm_kernel, routed_wgrad_kernel)


# Configurations autotuned over on GPUs. Each compiles for sm_80 and sm_90 with no register
# spills and shared memory within both limits (tests/kernels/test_kernels_aot.py checks every one
# against every launch the autograd Function makes). Tensor-core lists serve fp16, bf16
# and fp32 with TF32; BLOCK_K = 32 keeps 128-wide fp32 tiles in budget and 128-row tiles
# use 8 warps (4 warps spill on sm_80). The *_IEEE lists serve fp32 when
# ``torch.backends.cuda.matmul.allow_tf32`` is off: ``tl.dot`` then runs on FMA units and
# needs small tiles. Every dimension of a ``tl.dot`` (BLOCK_M x BLOCK_K by BLOCK_K x BLOCK_N
# in the GEMM, BLOCK_K x BLOCK_M by BLOCK_M x BLOCK_N in the weight gradient) is at least
# 16: Triton before 3.7 refuses smaller ones ("K >= 16"), also on FMA units.
GEMM_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
]
GEMM_CONFIGS_IEEE = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=2),
]
WGRAD_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
]
WGRAD_CONFIGS_IEEE = [
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=2),
]
CONFIGS = {
    routed_gemm_kernel: {"tf32": GEMM_CONFIGS, "ieee": GEMM_CONFIGS_IEEE},
    routed_wgrad_kernel: {"tf32": WGRAD_CONFIGS, "ieee": WGRAD_CONFIGS_IEEE},
}


#: configurations left out of launches with an input activation's gradient (``ACT``) on fp32
#: operands: the epilogue's extra fp32 tiles spill there (tests/kernels/test_kernels_aot.py,
#: ``-m slow``: the IEEE 32x32x32 8 bytes on sm_90, the TF32 128x64x32 8 on sm_80 and 16 on
#: sm_90; in fp16/bf16 neither spills)
SPILL_WITH_FP32_ACTIVATION = {id(GEMM_CONFIGS_IEEE[1]), id(GEMM_CONFIGS[2])}


def shipped_configs(kernel, input_precision: str, activation: bool = False,
                    dtype: torch.dtype = torch.float32):
    """The configurations ``kernel`` is autotuned over for ``INPUT_PRECISION``
    ("tf32": tensor cores, used for fp16/bf16 too; "ieee": fp32 on FMA units), for a
    launch with an input activation's gradient (``activation``: ``ACT`` != 0) or without,
    on operands of ``dtype``."""
    configs = CONFIGS[kernel][input_precision]
    if activation and (input_precision == "ieee" or dtype == torch.float32):
        return [c for c in configs if id(c) not in SPILL_WITH_FP32_ACTIVATION]
    return configs


# Small blocks for the CPU interpreter: tiles straddle experts and dims, as on a GPU.
INTERPRET_CONFIGS = {
    routed_gemm_kernel: triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}),
    routed_wgrad_kernel: triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}),
}

def _prune_by_precision(kernel):
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        wanted = shipped_configs(kernel, args["INPUT_PRECISION"], bool(args.get("ACT", 0)),
                                 args["X"].dtype)
        return [c for c in configs if any(c is w for w in wanted)]

    return {"early_config_prune": prune}


_KEYS = {
    routed_gemm_kernel: ["K", "N", "X_GROUPED", "X_FAN", "Y_GROUPED", "GATED", "HAS_DG", "ACT",
                         "HAS_KEEP", "OUT_ACT", "HAS_OUT_KEEP", "INPUT_PRECISION"],
    routed_wgrad_kernel: ["K", "N", "X_GROUPED", "DY_GROUPED", "GATED", "ACCUMULATE",
                          "INPUT_PRECISION"],
}
# Arguments the autotuner would zero before its trial runs: none. The gemm's gate-gradient
# partials DG hold one row per column tile, cdiv(N, BLOCK_N) of them, and the caller sums
# all DG_ROWS rows it allocated (for the smallest BLOCK_N): the kernel writes zeros on the
# rows past its own tiles, so a narrower trial leaves nothing behind for the chosen run.
RESET_TO_ZERO = {routed_gemm_kernel: [], routed_wgrad_kernel: []}


#: Whether this Triton's autotuner can keep its choices on disk (``cache_results``, Triton
#: 3.2 and later): the timings of each key are then measured once per machine, in Triton's
#: cache directory, instead of once per process (every fairseq-train and fairseq-generate
#: call). The cache key holds Triton's version, the GPU target, the kernel's source, the
#: autotuning key and the configurations, so a change of any of them measures afresh.
AUTOTUNE_CACHES_RESULTS = "cache_results" in inspect.signature(triton.autotune).parameters


def autotuned(kernel, fn=None, configs=None, **options):
    """``kernel`` (or ``fn``, e.g. its interpreted version) autotuned over ``configs``
    (default: every shipped configuration, pruned to the launch's INPUT_PRECISION), its
    choices cached on disk where Triton can."""
    if configs is None:
        configs = CONFIGS[kernel]["tf32"] + CONFIGS[kernel]["ieee"]
        options["prune_configs_by"] = _prune_by_precision(kernel)
    if AUTOTUNE_CACHES_RESULTS:
        options.setdefault("cache_results", True)
    return triton.autotune(configs=configs, key=_KEYS[kernel], reset_to_zero=RESET_TO_ZERO[kernel] or None,
                           **options)(fn or kernel)


AUTOTUNED = {kernel: autotuned(kernel) for kernel in KERNELS}
