"""#48: the routers' and MoE-FFD's activations formed inside the kernels that read them
(``sut::route_top_k`` with ``pre_tanh``, ``sut::routed_linear`` with an input activation,
``sut::routed_linear_activated`` forming it), against the code they replace: the ops'
reference backend against autograd through the activation, its dropout and the plain op; the FFN module's fused branch (taken on CUDA)
against its own unfused path with one dropout mask; whole models against the unfused
branches (outputs and every parameter's gradient within 1e-4 in fp32). The Triton kernels
against the reference: tests/kernels/test_kernels_interpret.py and test_routing_interpret.py."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model, randomise_halting
from old_code import assert_same_as_old
from sut_fairseq.models.standalone import build_model
from sut_fairseq.modules import moe_ffd
from sut_fairseq.modules.dropout import keep_mask
from sut_fairseq.modules.moe_ffd import MoEFeedForward
from sut_fairseq.modules.router import Router
from sut_fairseq.ops.routed_linear import reference_routed_linear, routed_linear_activated
from sut_fairseq.ops.routing import make_routing


def _routing(N=9, E=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    idx[[1, 6]] = E  # halted tokens: the no-op expert
    gates = torch.rand(N, k, generator=g)
    gates = gates / gates.sum(1, keepdim=True) * (idx < E)
    return make_routing(idx, gates, E), g


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("with_keep", [False, True], ids=["no-dropout", "dropout"])
def test_the_input_activation_equals_autograd_through_it(activation, with_keep):
    """``routed_linear(x, ..., activation, pre=u, keep, scale)`` on the reference backend,
    x = act(u) ⊙ keep · scale without a gradient (its hand-written act'(u) gives u's) ==
    the plain op on x made by ``F.gelu`` (erf) / ``F.relu`` and autograd, float64: the
    output and the gradients of u, W, b, gates."""
    routing, g = _routing()
    M, D, d = routing.num_slots, 6, 5
    u0 = torch.randn(M, D, generator=g, dtype=torch.float64) * 2
    w0 = torch.randn(4, D, d, generator=g, dtype=torch.float64)
    b0 = torch.randn(4, d, generator=g, dtype=torch.float64)
    gates0 = routing.gates.double()
    keep = torch.rand(M, D, generator=g) >= 0.3 if with_keep else None
    scale = 1 / 0.7 if with_keep else 1.0
    outs = []
    for fused in (True, False):
        u, w, b, gates = (t.clone().requires_grad_() for t in (u0, w0, b0, gates0))
        x = {"gelu": F.gelu, "relu": F.relu}[activation](u)
        x = x * keep * scale if with_keep else x
        if fused:
            y = reference_routed_linear(x.detach(), w, b, routing, 1, grouped_in=True, gates=gates,
                                        activation=activation, pre=u, keep=keep, keep_scale=scale)
        else:
            y = reference_routed_linear(x, w, b, routing, 1, grouped_in=True, gates=gates)
        y.sin().sum().backward()
        outs.append((y, u.grad, w.grad, b.grad, gates.grad))
    for name, a, e in zip(("y", "du", "dW", "db", "dgates"), *outs):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=name)
    assert outs[0][1].abs().sum() > 0
    if with_keep:
        assert not outs[0][1][~keep].any()


def test_bad_activations_are_named():
    routing, g = _routing()
    u, w = torch.randn(routing.num_slots, 6), torch.randn(4, 6, 5)
    with pytest.raises(ValueError, match=r"an input activation is 'gelu' or 'relu' on grouped "
                                         r"rows \(grouped_in=True\); got 'tanh', grouped_in=True"):
        reference_routed_linear(u, w, None, routing, 1, grouped_in=True, activation="tanh", pre=u)
    with pytest.raises(ValueError, match=r"got 'gelu', grouped_in=False"):
        reference_routed_linear(u, w, None, routing, 1, activation="gelu", pre=u)
    with pytest.raises(ValueError, match=r"needs its pre-activations \(pre\) of x's shape "
                                         r"\(18, 6\); got \(18, 5\)"):
        reference_routed_linear(u, w, None, routing, 1, grouped_in=True, activation="gelu",
                                pre=u[:, :5])
    with pytest.raises(ValueError, match="keep must be a bool mask of x's shape"):
        reference_routed_linear(u, w, None, routing, 1, grouped_in=True, activation="gelu",
                                pre=u, keep=torch.ones(routing.num_slots, 6))


def test_keep_mask_of_a_shape():
    """``keep_mask(x, p, training, shape)``: bool of ``shape`` on x's device, about 1 - p
    kept, scale 1 / (1 - p); x's shape by default; p >= 1 keeps none (scale 0); evaluation
    and p = 0: no mask."""
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    keep, scale = keep_mask(x, 0.25, True, (400, 50))
    assert keep.shape == (400, 50) and keep.dtype == torch.bool and scale == pytest.approx(1 / 0.75)
    assert abs(keep.float().mean().item() - 0.75) < 0.01
    assert keep_mask(x, 0.25, True)[0].shape == (3, 5)
    keep, scale = keep_mask(x, 1.0, True, (4, 2))
    assert keep.shape == (4, 2) and not keep.any() and scale == 0.0
    for p, training in ((0.25, False), (0.0, True)):
        assert keep_mask(x, p, training, (4, 2)) == (None, 1.0)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("with_keep", [False, True], ids=["no-dropout", "dropout"])
def test_the_output_activation_equals_the_plain_map_then_the_activation(activation, with_keep):
    """``routed_linear_activated`` on the reference backend: u == the plain op's sorted rows;
    x' == act(u) ⊙ keep · scale (``F.gelu`` erf / ``F.relu``) with no gradient; u's
    gradient gives x's, W's and b's as the plain op's; the error names a bad activation
    and a bad mask."""
    routing, g = _routing()
    M, d, D = routing.num_slots, 5, 6
    x0 = torch.randn(routing.num_tokens, d, generator=g, dtype=torch.float64)
    w0 = torch.randn(4, d, D, generator=g, dtype=torch.float64)
    b0 = torch.randn(4, D, generator=g, dtype=torch.float64)
    keep = torch.rand(M, D, generator=g) >= 0.3 if with_keep else None
    scale = 1 / 0.7 if with_keep else 1.0
    outs = []
    for fused in (True, False):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        if fused:
            u, act = routed_linear_activated(x, w, b, routing, 2, activation, keep, scale,
                                             backend="reference")
            assert not act.requires_grad
        else:
            u = reference_routed_linear(x, w, b, routing, 2, grouped_out=True)
            act = {"gelu": F.gelu, "relu": F.relu}[activation](u.detach())
            act = act * keep * scale if with_keep else act
        u.sin().sum().backward()
        outs.append((u, act, x.grad, w.grad, b.grad))
    for name, a, e in zip(("u", "act", "dx", "dW", "db"), *outs):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=name)
    assert outs[0][1].abs().sum() > 0
    with pytest.raises(ValueError, match="an output activation is 'gelu' or 'relu'; got 'tanh'"):
        routed_linear_activated(x0, w0, b0, routing, 2, "tanh")
    with pytest.raises(ValueError, match=r"keep must be a bool mask of the output's shape \(18, 6\)"):
        routed_linear_activated(x0, w0, b0, routing, 2, "gelu", torch.ones(M, 5, dtype=torch.bool))


@contextlib.contextmanager
def _unfused(router_too=True):
    """The code before: MoE-FFD's activation and dropout as their own operations, the
    routers' hidden layer made by the router (``Router._one_op`` False: its PyTorch path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_ffd, "kernel_backend", lambda x: "reference")
        if router_too:
            mp.setattr(Router, "_one_op", lambda self, x: False)
        yield


@contextlib.contextmanager
def _fused():
    """The branches a CUDA run takes (the ops on their reference backend here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_ffd, "kernel_backend", lambda x: "triton")
        mp.setattr(Router, "_one_op", lambda self, x: True)
        yield


def test_the_ffd_module_with_activation_dropout_equals_its_unfused_path(monkeypatch):
    """Training, activation dropout 0.3, one mask for both (the unfused path's dropout
    replaced by it; its rows are the routed rows the reference path keeps): the output and
    the gradients of the input and of every parameter."""
    torch.manual_seed(0)
    ffd = MoEFeedForward(8, 12, 4, 2, 8, activation_fn="gelu", activation_dropout=0.3).train()
    x0 = torch.randn(10, 8)
    active = torch.rand(10, generator=torch.Generator().manual_seed(2)) > 0.2
    keep = torch.rand(10 * 2, 12, generator=torch.Generator().manual_seed(3)) >= 0.3

    def fixed_mask(x, p, training, shape):  # keep_mask with the one mask
        assert (p, training, shape) == (0.3, True, (20, 12))
        return keep, 1 / 0.7

    monkeypatch.setattr(moe_ffd, "keep_mask", fixed_mask)
    monkeypatch.setattr(ffd.activation_dropout, "forward", lambda h: h * keep[: h.size(0)] / 0.7)
    outs = []
    for branch in (_fused, lambda: _unfused(router_too=False)):
        ffd.zero_grad()
        x = x0.clone().requires_grad_()
        with branch():
            y = ffd(x, active)
        y.sin().sum().backward()
        outs.append((y, x.grad, [p.grad.clone() for p in ffd.parameters()]))
    (y1, dx1, dp1), (y0, dx0, dp0) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(dp1, dp0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not y1[~active].any()


def _batch(seed=0, vocab=40):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (3, 7), generator=g), torch.randint(4, vocab, (3, 6), generator=g)


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean", "act"])
def test_sut_tiny_with_the_fused_activations_equals_the_unfused(rule):
    """``sut_tiny`` (GELU experts) with the routers and MoE-FFD on the branches a CUDA run
    takes, against the unfused code: logits and every parameter's gradient."""
    model = make_model(encoder_halting=rule, decoder_halting=rule, halting_threshold=0.8,
                       encoder_layers=4, decoder_layers=4, activation_fn="gelu")
    randomise_halting(model, seed=3)
    with _fused():
        assert_same_as_old(model, *_batch(), _unfused)


def test_a_logic_sized_model_with_the_fused_activations_equals_the_unfused():
    """``sut_logic`` (d 128, E 12, k 4; ReLU, the logic recipe's), stick-breaking."""
    torch.manual_seed(0)
    model = build_model("sut_logic", dict_size=40, share_all_embeddings=True, dropout=0.0,
                        encoder_layers=3, decoder_layers=3, activation_fn="relu").eval()
    randomise_halting(model, seed=4)
    with _fused():
        assert_same_as_old(model, *_batch(), _unfused)
