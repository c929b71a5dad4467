"""The Triton backend of the routed linear map: ``triton_forward`` / ``triton_backward``,
plain functions that the custom op of ``sut_fairseq/ops/routed_linear.py`` calls for CUDA
tensors (or under ``SUT_KERNELS=triton``), and their kernel launchers (the kernels:
``grouped_gemm.py``). The row layouts are ``ops/routed_linear.py``'s. Shapes: N tokens, k
slots each, M = N * k; x (N | M, in), weight (E, in, out), bias (E, out) or None, gates
(N, k) or None; the result is (M, out), or (N, out) with gates.

Passes (no device-to-host synchronisation in any of them):

* forward: one ``routed_gemm_kernel`` launch writes ``y_s = g_s (x W_e + b_e)`` for every
  active slot (0 for a no-op slot) into an (M, out) buffer, sorted (``grouped_out``) or in slot order.
  With gates, the op sums a token's k slots outside (deterministic, no atomics; a token's
  slots lie in different experts' tiles).
* input gradient: ``routed_gemm_kernel`` again, reading ``dout`` in the forward output's
  row order, ``W_e`` transposed through its strides and scaling rows by the gate; it
  writes the forward input's row order, or slot rows for token rows read by ``fan_out``
  slots (which the op sums outside, like the gated output).
* gate gradient: ``dg_s = dout_n . (x_s W_e + b_e) = x_s . (dout_n W_e^T) + dout_n . b_e``.
  The first term is summed in the epilogue of the input-gradient kernel (per column tile;
  the op adds the tiles up outside, or with gate rows (R, N, k) leaves tile r's partial as
  row r's gradient for the router's kernel to add up), the second in the same kernel's
  loop over dout's columns (column tile 0); no (M, out) activation is saved.
* outputs are allocated uninitialised: the kernel writes every row, the no-op rows' zeros
  by the row tiles past the last expert's.
* weight/bias gradient: ``routed_wgrad_kernel``, one program per (expert, weight tile).
* output activation (``out_activation``, MoE-FFD's up projection): the forward's launch
  also stores x = act(u) ⊙ keep · s of its rows u as it stores them (keep: the activation
  dropout's mask, drawn before): the down projection's input, with no pass of its own.
* input activation (``activation``, MoE-FFD's down projection): x = act(u) ⊙ keep · s was
  made from the up projection's pre-activations u; the input-gradient kernel multiplies
  its rows by act'(u) ⊙ keep · s as it stores them and returns u's gradient.

Mixed precision: the op hands over the inputs, weights and bias in the compute dtype (the
autocast dtype under autocast, as ``nn.Linear``) and the kernels run with autocast off; products
accumulate in fp32, gate scaling and the gate gradient are done in fp32. fp32 operands
use TF32 only when ``torch.backends.cuda.matmul.allow_tf32`` allows it.

CPU tensors run the same kernels in Triton's interpreter (tests; slow; needs
``TRITON_INTERPRET=1`` before ``triton`` is imported), with the small blocks of
``grouped_gemm.INTERPRET_CONFIGS``; CUDA tensors use the autotuned kernels.
"""
import contextlib
from typing import Optional

import torch
import triton

from . import grouped_gemm as gg
from . import launch
from ..ops.routing import plain_gates


def _no_autocast(device_type: str):
    if device_type in ("cuda", "cpu"):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _launch(kernel, grid_fn, args: dict, device: torch.device) -> None:
    """Launch ``kernel`` with keyword ``args``: autotuned on GPUs, interpreted on CPU
    (or recorded, ``launch.recorder``)."""
    if launch.recorder is not None:
        launch.recorder(kernel, args)
    elif device.type == "cpu":
        meta = dict(gg.INTERPRET_CONFIGS[kernel].kwargs)
        launch.interpreted(kernel)[grid_fn(meta)](**args, **meta)
    else:
        gg.AUTOTUNED[kernel][grid_fn](**args)


def routed_gemm(x, x_grouped, x_fan, w, w_transposed, bias, y, y_grouped, gates, routing,
                aux=None, aux_grouped=False, aux_fan=1, dg=None, dg_bias=None, activation="",
                pre=None, keep=None, keep_scale=1.0, z=None, out_activation="", out_keep=None,
                out_keep_scale=1.0):
    """Launch ``routed_gemm_kernel``: ``y[row_y(m)] = g (x[row_x(m)] @ W_e(^T) + b_e)``.

    x: rows of width K; w: (E, K, N), or (E, N, K) read transposed when ``w_transposed``;
    y: rows of width N, written whole (no-op rows 0; may come uninitialised); gates: (M,)
    or None; aux/dg: gate-gradient partials (``dg`` (T, M) fp32, T >= cdiv(N, min
    BLOCK_N), written whole), see the kernel docstring; ``dg_bias`` (E, K): adds
    ``x[row_x(m)] . dg_bias[e_m]`` to the partials (the gate gradient's bias term);
    ``activation`` ("gelu", "relu"; "" none): y's rows times act'(pre) ⊙ keep ·
    keep_scale (``pre`` in y's rows, ``keep`` bool in them or None);
    ``out_activation`` (no gates): y gets u, the result, and ``z`` (y's shape)
    act(u) ⊙ out_keep · out_keep_scale (``out_keep`` bool in y's rows or None).
    """
    E = routing.num_experts
    M = routing.num_slots
    if w_transposed:
        K, N = w.size(2), w.size(1)
        stride_wk, stride_wn = w.stride(2), w.stride(1)
    else:
        K, N = w.size(1), w.size(2)
        stride_wk, stride_wn = w.stride(1), w.stride(2)
    has_dg = dg is not None
    if dg_bias is not None and (bias is not None or not has_dg):
        raise ValueError("dg_bias is the gate gradient's bias term: with dg and no bias")
    b = bias if bias is not None else dg_bias  # the kernel's B: the bias, or the term's
    args = dict(
        X=x, W=w, B=b if b is not None else w, Y=y,
        G=gates if gates is not None else y, AUX=aux if has_dg else x, DG=dg if has_dg else y,
        sorted_expert_idxs=routing.sorted_expert_idxs,
        sorted_scattered_idxs=routing.sorted_scattered_idxs,
        expert_offsets=routing.expert_offsets,
        M=M, K=K, N=N, E=E,
        stride_xm=x.stride(0), stride_xk=x.stride(1),
        stride_we=w.stride(0), stride_wk=stride_wk, stride_wn=stride_wn,
        stride_be=b.stride(0) if b is not None else 0,
        stride_bn=b.stride(1) if b is not None else 0,
        stride_ym=y.stride(0), stride_yn=y.stride(1),
        stride_am=aux.stride(0) if has_dg else 0, stride_ak=aux.stride(1) if has_dg else 0,
        stride_dg=dg.stride(0) if has_dg else 0, DG_ROWS=dg.size(0) if has_dg else 0,
        X_GROUPED=x_grouped, X_FAN=1 if x_grouped else x_fan, Y_GROUPED=y_grouped,
        HAS_BIAS=bias is not None, GATED=gates is not None,
        HAS_DG=has_dg, A_GROUPED=aux_grouped, A_FAN=1 if aux_grouped else aux_fan,
        DG_BIAS=has_dg and dg_bias is not None,
        INPUT_PRECISION=_input_precision(x.dtype),
        E_POW2=triton.next_power_of_2(max(E, 2)),
        PRE=pre if activation else y, KEEP=keep if keep is not None else y,
        stride_pm=pre.stride(0) if activation else 0, stride_pk=pre.stride(1) if activation else 0,
        stride_km=keep.stride(0) if keep is not None else 0, keep_scale=float(keep_scale),
        ACT=gg.ACTIVATIONS[activation], HAS_KEEP=keep is not None,
        Z=z if out_activation else y, OUT_KEEP=out_keep if out_keep is not None else y,
        stride_zm=z.stride(0) if out_activation else 0, stride_zn=z.stride(1) if out_activation else 0,
        stride_okm=out_keep.stride(0) if out_keep is not None else 0,
        out_keep_scale=float(out_keep_scale),
        OUT_ACT=gg.ACTIVATIONS[out_activation], HAS_OUT_KEEP=out_keep is not None,
    )

    def grid(meta):
        return ((triton.cdiv(M, meta["BLOCK_M"]) + E) * triton.cdiv(N, meta["BLOCK_N"]),)

    _launch(gg.routed_gemm_kernel, grid, args, x.device)


def routed_wgrad(x, x_grouped, x_fan, dy, dy_grouped, dy_fan, gates, dw, db, routing,
                 acc_w=None, acc_b=None):
    """Launch ``routed_wgrad_kernel``: ``dw[e] = sum_m x_m^T (g_m dy_m)``, ``db[e] = sum_m g_m dy_m``.

    x: rows of width K; dy: rows of width N; dw: (E, K, N); db: (E, N) or None.
    Every expert's tile is written (zeros for an expert with no rows). ``acc_w`` / ``acc_b``
    (dw's / db's shape and strides, both or neither; acc_b None without db): running sums
    the kernel adds, ``dw = acc_w + the sum`` (the other recurrence steps' terms).
    """
    E = routing.num_experts
    K, N = dw.size(1), dw.size(2)
    accumulate = acc_w is not None
    if accumulate and (acc_w.stride() != dw.stride()
                       or (db is not None and (acc_b is None or acc_b.stride() != db.stride()))):
        raise ValueError("acc_w / acc_b must have dw's / db's strides (contiguous)")
    args = dict(
        X=x, DY=dy, G=gates if gates is not None else dy, DW=dw, DB=db if db is not None else dw,
        ACC_W=acc_w if accumulate else dw, ACC_B=acc_b if accumulate and db is not None else dw,
        sorted_expert_idxs=routing.sorted_expert_idxs,
        sorted_scattered_idxs=routing.sorted_scattered_idxs,
        expert_offsets=routing.expert_offsets,
        K=K, N=N, E=E,
        stride_xm=x.stride(0), stride_xk=x.stride(1),
        stride_dym=dy.stride(0), stride_dyn=dy.stride(1),
        stride_dwe=dw.stride(0), stride_dwk=dw.stride(1), stride_dwn=dw.stride(2),
        stride_dbe=db.stride(0) if db is not None else 0,
        stride_dbn=db.stride(1) if db is not None else 0,
        X_GROUPED=x_grouped, X_FAN=1 if x_grouped else x_fan,
        DY_GROUPED=dy_grouped, DY_FAN=1 if dy_grouped else dy_fan,
        GATED=gates is not None, HAS_BIAS=db is not None, ACCUMULATE=accumulate,
        INPUT_PRECISION=_input_precision(x.dtype),
    )

    def grid(meta):
        return (E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _launch(gg.routed_wgrad_kernel, grid, args, x.device)


#: the narrowest column tile (BLOCK_N) of the gemm's configurations on a GPU, per input
#: precision ("tf32", "ieee"): plain ints, which the routers read while traced
_MIN_BLOCK_N = {precision: min(c.kwargs["BLOCK_N"]
                               for c in gg.shipped_configs(gg.routed_gemm_kernel, precision))
                for precision in ("tf32", "ieee")}


@torch.compiler.assume_constant_result
def _interpret_block_n() -> int:
    """The interpreter's BLOCK_N (read at each call: tests swap its configuration; a
    constant to dynamo, which cannot hash the kernel that keys it)."""
    return gg.INTERPRET_CONFIGS[gg.routed_gemm_kernel].kwargs["BLOCK_N"]


def max_column_tiles(n: int, dtype: torch.dtype, device: torch.device) -> int:
    """An upper bound on ``cdiv(n, BLOCK_N)`` for the gemm configuration that will run."""
    block = _interpret_block_n() if device.type == "cpu" else _MIN_BLOCK_N[_input_precision(dtype)]
    return -(-n // block)


def partial_rows(gates, in_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows of the gate gradient's partial sums (T, M) for a map of input width ``in_dim``:
    R of gate rows (R, N, k) (one per column tile, at least the tiles), else
    ``max_column_tiles``."""
    tiles = max_column_tiles(in_dim, dtype, device)
    if gates.dim() != 3:
        return tiles
    if gates.size(0) < tiles:
        raise ValueError(f"gate rows (R, N, k) = {tuple(gates.shape)} need R >= {tiles}, "
                         f"the column tiles of this map's input gradient")
    return gates.size(0)


def _written_whole(like: torch.Tensor, shape, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An uninitialised buffer of ``shape`` on ``like``'s device (``like``'s dtype unless
    given) for a kernel that writes every element (no zero-fill launch)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def triton_forward(x, weight, bias, gates, routing, fan_out: int, grouped_in: bool,
                   grouped_out: bool, out_activation: str = "", out_keep=None,
                   out_keep_scale: float = 1.0):
    """The forward on the kernels (operands in the compute dtype; gates their own): (M, out)
    rows, gate-weighted with gates; with ``out_activation`` (no gates) the pair (u, the
    rows, and act(u) ⊙ out_keep · out_keep_scale of u as stored), one launch."""
    M, out_dim = routing.num_slots, weight.size(2)
    if M == 0:  # no tokens: nothing to launch
        y = x.new_zeros(0, out_dim)
        return (y, y.clone()) if out_activation else y
    x = x.contiguous()
    gates_flat = _gate_vector(gates)
    y = _written_whole(x, (M, out_dim))  # the kernel writes the no-op rows' zeros
    z = _written_whole(x, (M, out_dim)) if out_activation else None
    if out_keep is not None:
        out_keep = out_keep.contiguous()
    with _no_autocast(x.device.type):
        routed_gemm(x, grouped_in, fan_out, weight, False, bias, y, grouped_out, gates_flat, routing,
                    z=z, out_activation=out_activation, out_keep=out_keep,
                    out_keep_scale=out_keep_scale)
    return (y, z) if out_activation else y


def triton_backward(dout, x, weight, bias, gates, routing, fan_out: int, grouped_in: bool,
                    grouped_out: bool, dout_fan: int, needs, activation: str = "", pre=None,
                    keep=None, keep_scale: float = 1.0, acc_w=None, acc_b=None):
    """The gradients of ``triton_forward`` asked for by ``needs`` = (x, weight, bias, gates),
    None for the others (module docstring: the input gradient and the gate gradient in one
    kernel, the weight and bias gradients in another): the input gradient's rows (x's with
    ``grouped_in``, else slot rows (M, in)), dW, db and the gate gradient's partial sums
    (column tiles, M) fp32. ``dout``: sorted rows (``grouped_out``), slot rows, or token
    rows read by ``dout_fan`` slots each; ``acc_w`` / ``acc_b``: running sums that dW / db
    include (``routed_wgrad``)."""
    M = routing.num_slots
    need_x, need_w, need_b, need_g = needs
    gated = gates is not None
    need_g = need_g and gated
    tiles = partial_rows(gates, weight.size(1), x.dtype, x.device) if need_g else 0
    if M == 0:
        return (x.new_zeros(x.shape if grouped_in else (0, x.size(1))) if need_x else None,
                _running_or_zeros(acc_w, weight) if need_w else None,
                _running_or_zeros(acc_b, bias) if need_b and bias is not None else None,
                x.new_zeros(tiles, 0, dtype=torch.float32) if need_g else None)
    x = x.contiguous()
    gates_flat = _gate_vector(gates)
    dout = dout.contiguous().to(x.dtype)
    dy_grouped, dy_fan = grouped_out, dout_fan
    dx = dw = db = dg = None
    with _no_autocast(x.device.type):
        if need_x or need_g:
            in_dim = weight.size(1)
            # the kernel writes rows 0..M-1 (the no-op rows' zeros too); sorted rows past M
            # (a longer grouped x) are not rows of any slot and stay zero
            dx_rows = (x.new_zeros(x.shape) if grouped_in and x.size(0) > M else
                       _written_whole(x, x.shape if grouped_in else (M, in_dim)))
            partial = None
            if need_g:  # written whole by the kernel, zeros past its column tiles
                partial = _written_whole(x, (tiles, M), torch.float32)
            # dg_s = Σ_tiles partial = x_s . (dout_n W_e^T) + dout_n . b_e (the bias term in
            # the kernel's K loop; 0 for a no-op slot)
            routed_gemm(dout, dy_grouped, dy_fan, weight, True, None, dx_rows, grouped_in,
                        gates_flat, routing, aux=x, aux_grouped=grouped_in, aux_fan=fan_out,
                        dg=partial, dg_bias=bias if need_g else None, activation=activation,
                        pre=pre, keep=keep, keep_scale=keep_scale)
            dx = dx_rows if need_x else None
            dg = partial
        if need_w or (need_b and bias is not None):
            dw = torch.empty_like(weight)
            db = torch.empty_like(bias) if need_b and bias is not None else None
            routed_wgrad(x, grouped_in, fan_out, dout, dy_grouped, dy_fan, gates_flat, dw, db, routing,
                         acc_w=acc_w, acc_b=acc_b)
            dw = dw if need_w else None
    return dx, dw, db, dg


def _gate_vector(gates):
    """The (M,) gates the kernels read (of gate rows, the first); None without gates."""
    return None if gates is None else plain_gates(gates).reshape(-1).contiguous()


def _running_or_zeros(running, like):
    """A weight's gradient with no rows: the running sum's copy, or zeros."""
    return torch.zeros_like(like) if running is None else running.clone()


def check_operands(x, weight, bias, routing, fan_out: int, grouped_in: bool, grouped_out: bool,
                   gates) -> None:
    """The shapes the kernels rely on (they index without bounds checks); a ValueError
    naming the mismatch otherwise."""
    if gates is not None and grouped_out:
        raise ValueError("gates combine a token's slots and need grouped_out=False")
    M, E = routing.num_slots, routing.num_experts
    if weight.dim() != 3 or weight.size(0) != E or x.dim() != 2 or x.size(1) != weight.size(1):
        raise ValueError(f"x (rows, in) and weight (E={E}, in, out) do not match: "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (E, weight.size(2)):
        raise ValueError(f"bias must be (E, out); got {tuple(bias.shape)}")
    if gates is not None and tuple(gates.shape[-2:]) != tuple(routing.expert_idxs.shape) or (
            gates is not None and gates.dim() not in (2, 3)):
        raise ValueError(f"gates must be (N, k) = {tuple(routing.expert_idxs.shape)} or gate rows "
                         f"(R, N, k); got {tuple(gates.shape)}")
    if grouped_in:
        if x.size(0) < M:
            raise ValueError(f"grouped x needs >= M = {M} rows; got {x.size(0)}")
    elif fan_out < 1 or M % fan_out or x.size(0) < M // fan_out:
        raise ValueError(f"x with fan_out={fan_out} needs M / fan_out = {M}/{fan_out} rows; "
                         f"got {x.size(0)}")
