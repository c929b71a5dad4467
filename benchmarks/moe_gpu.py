"""MoE-FFD expert GEMMs on a GPU: Triton kernels vs dense cuBLAS vs the PyTorch reference.

The two routed projections of MoE-FFD (E=24 experts, top-k=4, d=512, D=512): up
``(N, d) -> sorted (N*k, D)`` and gated down ``sorted (N*k, D) -> (N, d)``, for 4,096 to
16,384 tokens, forward and forward+backward, timed three ways:

* ``triton``: ``sut_fairseq.kernels.triton_routed_linear`` (grouped GEMM, no sync);
* ``dense``: two cuBLAS GEMMs of the same active size, ``(N*k, d) @ (d, D)`` and
  ``(N*k, D) @ (D, d)``, the speed of light for this work;
* ``reference``: ``reference_routed_linear`` (gather, one matmul per expert, scatter);
* ``grouped``: PyTorch's grouped GEMM (``grouped_mm_routed_linear``, the products under
  ``SUT_EXPERT_GEMM=grouped_mm``: a gather, one ``grouped_mm``, the masks and the scatter as
  separate kernels, eager), ``nan`` where this GPU's PyTorch has no grouped GEMM.

Then, per token count, the weight gradient of the up projection shared by ``--steps``
recurrence steps of N tokens each (``ops/weight_grads.py``): ``per-step``, one
weight-gradient launch per step over its N·k rows, each after the first adding the running
sum of the steps before it (``SUT_WEIGHT_GRADS=per-step``, the default), against ``deferred``, one launch over the L·N·k rows of all steps with the gathering of their
operands (``weight_grads.flush``, what step 1's backward runs)::

    wgrad over L steps of N tokens: per step X ms (L launches), deferred Y ms (one), per step / deferred R

FLOPs counted: 2 * N*k * d * D per projection forward, 3x that with backward. After warm-up
(and autotuning) the Triton passes also run under ``torch.cuda.set_sync_debug_mode("error")``
to show they make no device-to-host synchronisation.

    python benchmarks/moe_gpu.py [--tokens 4096 8192 16384] [--dtype bf16] [--repeats 20] [--steps 6]

Exits with a message (status 0) when no CUDA device is present. ``--device cpu`` runs the
same code on tiny shapes through Triton's interpreter (needs ``TRITON_INTERPRET=1``); it
checks the script, its timings mean nothing.
"""
import argparse
import sys

import torch

from sut_fairseq.ops import weight_grads
from sut_fairseq.ops.routed_linear import grouped_mm_routed_linear, reference_routed_linear
from sut_fairseq.ops.routing import make_routing
from sut_fairseq.selftest import median_seconds

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, repeats: int, device: torch.device, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (the self-test's timer)."""
    return median_seconds(fn, device, repeats, warmup)


def timed_if_supported(fn, repeats: int, device: torch.device) -> float:
    """``timed``, or nan where the operation is not there (a GPU without PyTorch's grouped
    GEMM: its RuntimeError names the operation)."""
    try:
        return timed(fn, repeats, device)
    except RuntimeError as error:
        print(f"moe_gpu.py: grouped_mm not timed: {str(error).splitlines()[0][:120]}")
        return float("nan")


def make_problem(tokens, E, k, d, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g)
    top = logits.softmax(-1).topk(k, dim=1)
    gates = (top.values / top.values.sum(1, keepdim=True)).to(device=device, dtype=dtype)
    routing = make_routing(top.indices.to(device), gates, E)

    def param(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()

    return dict(
        routing=routing, gates=gates,
        x=param(tokens, d, scale=1.0),
        w1=param(E, d, D, scale=d ** -0.5), b1=param(E, D, scale=0.1),
        w2=param(E, D, d, scale=D ** -0.5), b2=param(E, d, scale=0.1),
        # dense GEMMs of the same active size: N*k rows through d -> D -> d
        xd=param(tokens * k, d, scale=1.0),
        wd1=param(d, D, scale=d ** -0.5), wd2=param(D, d, scale=D ** -0.5),
    )


def moe_fn(impl, p):
    routing, k = p["routing"], p["routing"].k

    def run():
        h = impl(p["x"], p["w1"], p["b1"], routing, k, grouped_out=True)
        return impl(h, p["w2"], p["b2"], routing, 1, grouped_in=True, gates=p["gates"])

    return run


def dense_fn(p):
    def run():
        return (p["xd"] @ p["wd1"]) @ p["wd2"]

    return run


def with_backward(fn, params):
    def run():
        for t in params:
            t.grad = None
        y = fn()
        y.backward(torch.ones_like(y))

    return run


def wgrad_steps(tokens: int, steps: int, E, k, d, D, dtype, device, repeats: int):
    """Seconds of the up projection's weight gradient (dW, db) for ``steps`` steps of
    ``tokens`` tokens: (one launch per step, one launch over every step's rows)."""
    problems = [make_problem(tokens, E, k, d, D, dtype, device, seed=l) for l in range(steps)]
    w, b = problems[0]["w1"].detach(), problems[0]["b1"].detach()
    grads = [torch.randn(tokens * k, D, device=device, dtype=dtype) for _ in problems]

    def call(grad, x, routing, running):
        return torch.ops.sut.routed_linear_backward(
            grad, x, w, b, None, routing.expert_idxs, routing.sorted_expert_idxs,
            routing.sorted_scattered_idxs, routing.expert_offsets, k, False, True, "triton",
            False, True, True, False, None, "", None, 1.0, *running)

    def per_step():
        running = (None, None)  # the steps' sum, added by each launch after the first
        for p, grad in zip(problems, grads):
            running = call(grad, p["x"].detach(), p["routing"], running)[1:3]

    def deferred():
        bucket = weight_grads.Bucket(-1, deferred=True)
        for p, grad in zip(problems, grads):
            r = p["routing"]
            weight_grads.add(bucket, weight_grads.Entry(grad, p["x"].detach(), None, r.expert_idxs,
                                                        r.sorted_scattered_idxs, k, False, True))
        weight_grads.flush(bucket, w, b, "triton", True)

    return timed(per_step, repeats, device), timed(deferred, repeats, device)


def check_no_sync(fn, device) -> str:
    if device.type != "cuda":
        return "n/a"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as err:
        return f"SYNC ({str(err).splitlines()[0][:60]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--experts", type=int, default=24)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=6,
                        help="recurrence steps sharing the weights (sut_base: 6 per side)")
    args = parser.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        print("moe_gpu.py: no CUDA device is present; this benchmark needs a GPU "
              "(benchmarks/moe_cpu.py measures the CPU reference path).")
        return 0
    device = torch.device(args.device)
    from sut_fairseq.kernels import triton_routed_linear

    E, k, d, D = args.experts, args.topk, args.dim, args.hidden
    dtype = DTYPES[args.dtype]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"{name}; torch {torch.__version__}; MoE-FFD projections E={E} k={k} d={d} D={D} "
          f"{args.dtype}; median of {args.repeats}")
    head = (f"{'tokens':>7} {'pass':<8} {'triton ms':>9} {'TFLOP/s':>8} {'dense ms':>9} {'TFLOP/s':>8} "
            f"{'ref ms':>9} {'TFLOP/s':>8} {'grouped ms':>10} {'TFLOP/s':>8} {'triton/dense':>12} "
            f"{'host syncs':>10}")
    print(head)
    print("-" * len(head))
    for tokens in args.tokens:
        p = make_problem(tokens, E, k, d, D, dtype, device)
        flops_fwd = 2 * (2 * tokens * k * d * D)
        moe_params = [p[n] for n in ("x", "w1", "b1", "w2", "b2")]
        dense_params = [p[n] for n in ("xd", "wd1", "wd2")]
        passes = {
            "fwd": (moe_fn(triton_routed_linear, p), dense_fn(p), moe_fn(reference_routed_linear, p),
                    moe_fn(grouped_mm_routed_linear, p), 1),
        }
        passes["fwd+bwd"] = tuple(with_backward(f, ps) for f, ps in
                                  zip(passes["fwd"][:4], (moe_params, dense_params, moe_params,
                                                          moe_params))) + (3,)
        for pass_name, (*fns, mult) in passes.items():
            tri, dense, ref, grouped = (torch.no_grad()(f) if pass_name == "fwd" else f for f in fns)
            t_tri = timed(tri, args.repeats, device)
            t_dense = timed(dense, args.repeats, device)
            t_ref = timed(ref, args.repeats, device)
            t_grouped = timed_if_supported(grouped, args.repeats, device)
            syncs = check_no_sync(tri, device)
            flops = mult * flops_fwd
            print(f"{tokens:>7} {pass_name:<8} {1e3 * t_tri:>9.3f} {flops / t_tri / 1e12:>8.1f} "
                  f"{1e3 * t_dense:>9.3f} {flops / t_dense / 1e12:>8.1f} {1e3 * t_ref:>9.3f} "
                  f"{flops / t_ref / 1e12:>8.1f} {1e3 * t_grouped:>10.3f} {flops / t_grouped / 1e12:>8.1f} "
                  f"{t_tri / t_dense:>12.2f} {syncs:>10}")
        del p
    for tokens in args.tokens:
        t_step, t_deferred = wgrad_steps(tokens, args.steps, E, k, d, D, dtype, device, args.repeats)
        print(f"wgrad over {args.steps} steps of {tokens} tokens: per step {1e3 * t_step:.3f} ms "
              f"({args.steps} launches), deferred {1e3 * t_deferred:.3f} ms (one), "
              f"per step / deferred {t_step / t_deferred:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
