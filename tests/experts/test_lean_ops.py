"""#48 item 4 (lean routed ops) against the code each change replaces: outputs and every
gradient within 1e-4 in fp32."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from conftest import LooksCuda, make_model, randomise_halting
from old_code import assert_same_as_old
from sut_fairseq.ops import masked_linear_op
from sut_fairseq.ops.masked_linear_op import dense_masked_linear


def _sut_tiny_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 40, (3, 7), generator=g), torch.randint(4, 40, (3, 6), generator=g)


def _grads(f, *inputs):
    out = f(*inputs)
    return (out, *torch.autograd.grad(out.sin().sum(), inputs))


# ------------------------------------------------- masked_linear as plain operations on CUDA

def test_dense_masked_linear_equals_the_op_and_the_old_cuda_body():
    """``dense_masked_linear`` (CUDA, inductor sees it) == ``sut::masked_linear`` (the CPU
    body: the selected rows only) == the op's old CUDA body ``F.linear(..) * mask``,
    outputs and the gradients of x, W and b."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=g, requires_grad=True)
    w = torch.randn(4, 6, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True)
    mask = torch.rand(10, generator=g) < 0.5
    new = _grads(lambda x, w, b: dense_masked_linear(x, w, b, mask), x, w, b)
    op = _grads(lambda x, w, b: torch.ops.sut.masked_linear(x, w, b, mask), x, w, b)
    old = _grads(lambda x, w, b: F.linear(x, w, b) * mask.unsqueeze(1).to(x.dtype), x, w, b)
    for n, o, c in zip(new, old, op):
        torch.testing.assert_close(n, o, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(n, c, atol=1e-6, rtol=1e-6)


@contextlib.contextmanager
def _patched(module, name, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


@pytest.mark.parametrize("rule", ["stick-breaking", "act"])
def test_model_with_dense_masked_linear_equals_the_custom_op(compiling_branch, rule):
    """A compiled step's branch (routers, halting unit, keys/values through
    ``masked_linear``) with every ``masked_linear`` dense, as on CUDA, against the
    custom op: outputs and every parameter's gradient."""
    model = make_model(encoder_halting=rule, decoder_halting=rule, halting_threshold=0.8,
                       encoder_layers=4, decoder_layers=4)
    randomise_halting(model, seed=3)
    src, prev = _sut_tiny_batch()
    with _patched(masked_linear_op, "_dense", lambda x: True):
        assert_same_as_old(model, src, prev,
                           lambda: _patched(masked_linear_op, "_dense", lambda x: False))


# ------------------------------------------------------------ the router's top-k as argmax passes

def test_top_k_by_argmax_equals_topk():
    from sut_fairseq.modules.router import top_k_by_argmax

    g = torch.Generator().manual_seed(0)
    for n, E, k in [(50, 24, 4), (7, 5, 5), (9, 4, 1), (3, 12, 2)]:
        probs = torch.randn(n, E, generator=g).softmax(-1)
        assert torch.equal(top_k_by_argmax(probs, k), probs.topk(k, dim=1).indices)


def test_the_router_picks_by_argmax_passes_only_in_a_compiled_step_on_cuda(monkeypatch):
    """``_argmax_top_k``: a CUDA tensor under tracing, nothing else (CPU tensors, eager
    CUDA); where it holds, ``_select`` picks by ``top_k_by_argmax`` (the same indices as
    ``topk``), otherwise by ``topk``."""
    from sut_fairseq.modules import router

    probs = torch.randn(6, 5).softmax(-1)
    for traced in (False, True):
        monkeypatch.setattr(router, "tracing", lambda: traced)
        assert router._argmax_top_k(probs.as_subclass(LooksCuda)) is traced
        assert router._argmax_top_k(probs) is False
    r = router.Router(8, 5, 2, hidden_dim=4)
    calls, by_argmax = [], router.top_k_by_argmax
    monkeypatch.setattr(router, "top_k_by_argmax", lambda p, k: calls.append(k) or by_argmax(p, k))
    for picks_by_argmax in (False, True):
        monkeypatch.setattr(router, "_argmax_top_k", lambda p: picks_by_argmax)
        got = r._select(probs.log(), probs)
        assert torch.equal(got, probs.topk(2, dim=1).indices)
        assert calls == ([2] if picks_by_argmax else [])


@pytest.mark.parametrize("compiled_branch", [False, True])
def test_model_with_argmax_top_k_equals_topk(request, compiled_branch):
    """The routers picking by argmax passes (as on CUDA) against ``topk``: the same model
    outputs and parameter gradients, eager and on a compiled step's branch."""
    from sut_fairseq.modules import router

    model = make_model(encoder_layers=4, decoder_layers=4)
    randomise_halting(model, seed=3)
    if compiled_branch:
        request.getfixturevalue("compiling_branch")
    src, prev = _sut_tiny_batch()
    with _patched(router, "_argmax_top_k", lambda probs: True):
        assert_same_as_old(model, src, prev, lambda: _patched(router, "_argmax_top_k", lambda p: False))


def test_masked_affine_takes_the_dense_form_exactly_where_asked(monkeypatch):
    """``masked_affine`` runs ``dense_masked_linear`` where ``_dense`` says so (CUDA) and the
    custom op elsewhere; both give x Wᵀ + b on the selected rows and 0 on the others, for
    (B, T, in) inputs."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    want = torch.where(mask[..., None], x @ w.T + b, 0.0)
    calls, dense = [], masked_linear_op.dense_masked_linear
    monkeypatch.setattr(masked_linear_op, "dense_masked_linear", lambda *a: calls.append(1) or dense(*a))
    for use_dense in (False, True):
        monkeypatch.setattr(masked_linear_op, "_dense", lambda t: use_dense)
        got = masked_linear_op.masked_affine(x, w, b, mask)
        assert got.shape == (2, 3, 5) and len(calls) == int(use_dense)
        torch.testing.assert_close(got, want)
