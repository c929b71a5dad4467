"""The compiled recurrence on a CUDA device (the GPU stage ``tests-compiled``):

1. The compiled recurrence step (``--compile-step``): no host synchronisation inside the
   step's graph, forward and backward (the loop's one read per step is outside it).
2. The compiled loop (``--compile-loop``) replayed as CUDA graphs (torch.compile's mode
   reduce-overhead, ``benchmarks/train_step.py``'s ``+graphs``) equals the eager model:
   outputs and every gradient, on a recorded shape replayed and on a new shape.

Every test here is marked ``gpu`` and skipped when no CUDA device is present:

    pytest -m gpu tests/gpu/test_gpu_compiled.py
"""
import pytest
import torch

from conftest import make_model
# _default_backend: test_gpu.py's autouse fixture (Triton for CUDA tensors, no TF32), here too
from test_gpu import DEV, _default_backend, _without_host_sync  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with pytest -m gpu on a GPU machine)"),
]


# --------------------------------------------------------------------------------------
# 1. The compiled recurrence step (--compile-step) makes no host synchronisation


def _compiled_tiny_model():
    """``sut_tiny`` with ``--compile-step`` on CUDA, in training mode (dropout 0), halting
    units randomised so that positions halt at different steps."""
    from conftest import randomise_halting

    model = make_model(compile_step=True)
    randomise_halting(model)
    return model.to(DEV).train()


def _tiny_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (4, 11), generator=g)
    src[0, :3] = 1  # left padding
    prev = torch.randint(4, 40, (4, 9), generator=g)
    prev[1, 6:] = 1  # right padding
    return src.to(DEV), src.ne(1).sum(1).to(DEV), prev.to(DEV)


def test_compiled_step_makes_no_host_sync(monkeypatch):
    """Every call of both sides' compiled step, forward, runs under
    ``set_sync_debug_mode("error")``: the only host read of the compiled recurrence is the
    loop's ``bool(running.any())`` between steps (outside the step). Inductor generates
    the step's code at the first call (which synchronises), so a first batch compiles it and
    a second batch of other B and T is checked (dynamic shapes: no new compilation either)."""
    from sut_fairseq.compiler import CompiledStep

    model = _compiled_tiny_model()
    src, lengths, prev = _tiny_batch(0)
    model(src, lengths, prev)[0].float().logsumexp(-1).sum().backward()  # compile
    calls = []
    compiled_call = CompiledStep.__call__

    def checked(self, *args, **kwargs):
        calls.append(self.side)
        return _without_host_sync(lambda: compiled_call(self, *args, **kwargs))

    monkeypatch.setattr(CompiledStep, "__call__", checked)
    src, lengths, prev = _tiny_batch(1)
    src, prev = src[:3, :10], prev[:3, :8]
    model.zero_grad()
    out, _ = model(src, src.ne(1).sum(1), prev)
    assert {"encoder", "decoder"} <= set(calls), calls
    assert all(not side.compiled_step.failed for side in (model.encoder.side, model.decoder.side))
    out.float().logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(t).all() for t in grads)


def test_compiled_step_backward_makes_no_host_sync():
    """The backward of a compiled training step (the step graphs' backward, the expert
    ops' backward, embeddings and output layer) under ``set_sync_debug_mode("error")``."""
    model = _compiled_tiny_model()
    src, lengths, prev = _tiny_batch(0)
    model(src, lengths, prev)[0].float().logsumexp(-1).sum().backward()  # compile
    model.zero_grad()
    src, lengths, prev = _tiny_batch(1)
    loss = model(src, lengths, prev)[0].float().logsumexp(-1).sum()
    _without_host_sync(loss.backward)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --------------------------------------------------------------------------------------
# 2. CUDA graphs over the compiled loop equal the eager model


def test_compiled_loop_as_cuda_graphs_equals_eager():
    """``sut_tiny`` with ``--compile-loop`` in torch.compile's mode reduce-overhead against
    the same weights eager, training steps on one batch three times (CUDA-graph trees warm
    up on a shape's first call, record on its second, replay from the graphs' static
    buffers after) and then on a batch of other B and T three times (the same for the new
    shape). Outputs and every parameter's gradient agree at every step (fp32, no TF32),
    each read before the next step replays the graphs; inductor replays every graph as a
    CUDA graph (no ``cudagraph_skips``: a skipped graph would leave the test comparing
    the plain compiled loop)."""
    from conftest import randomise_halting
    from torch._dynamo.utils import counters

    eager = make_model()
    randomise_halting(eager)
    graphs = make_model(compile_loop=True)
    graphs.load_state_dict(eager.state_dict())
    for side in (graphs.encoder.side, graphs.decoder.side):
        side.compiled_step.mode = "reduce-overhead"
    eager, graphs = eager.to(DEV).train(), graphs.to(DEV).train()
    small = tuple(t[:3, :8] if t.dim() == 2 else t[:3] for t in _tiny_batch(1))
    skips = counters["inductor"]["cudagraph_skips"]
    for src, lengths, prev in [_tiny_batch(0)] * 3 + [(small[0], small[0].ne(1).sum(1), small[2])] * 3:
        results = []
        for model in (eager, graphs):
            model.zero_grad(set_to_none=True)
            out = model(src, lengths, prev)[0]
            out.float().logsumexp(-1).sum().backward()
            results.append((out.detach().clone(),
                            {n: p.grad.detach().clone() for n, p in model.named_parameters()
                             if p.grad is not None}))
        (out_e, grads_e), (out_g, grads_g) = results
        torch.testing.assert_close(out_g, out_e, rtol=1e-4, atol=1e-4)
        assert grads_g.keys() == grads_e.keys()
        for name in grads_e:
            torch.testing.assert_close(grads_g[name], grads_e[name], rtol=1e-4, atol=1e-4, msg=name)
    assert not any(side.compiled_step.failed for side in (graphs.encoder.side, graphs.decoder.side))
    assert counters["inductor"]["cudagraph_skips"] == skips
