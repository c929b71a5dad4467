"""``sut::route_top_k`` (``ops/route_op.py``): its hand-written backward against autograd
through the PyTorch reference and a numerical gradient check, its layout against the
sorted layout of ``make_routing``, and the router's two paths against each other. The
Triton kernels behind it on CUDA: tests/kernels/test_routing_interpret.py."""
import pytest
import torch

from sut_fairseq.modules.router import Router
from sut_fairseq.ops.route_op import route_top_k_reference
from sut_fairseq.ops.routing import make_routing


def _case(N=9, E=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(N, E, generator=g)).to(dtype)
    active = torch.rand(N, generator=g) > 0.3
    return logits, active, g


@pytest.mark.parametrize("k", [1, 2, 5])
def test_backward_equals_autograd_through_the_reference(k):
    """A loss on the distribution (the routing statistics) and on the gates: the op's
    gradient of the logits equals autograd's through the reference's operations."""
    logits, active, g = _case()
    wp, wg = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randn(9, k, generator=g, dtype=torch.float64)
    grads = []
    for fn in (torch.ops.sut.route_top_k, route_top_k_reference):
        z = logits.clone().requires_grad_()
        probs, _, gates, *_ = fn(z, active, k)
        ((probs * wp).sum() + (gates * wg).sum()).backward()
        grads.append(z.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-13)
    assert grads[0][~active].abs().sum() > 0  # inactive rows: the distribution's term only


def test_gradcheck_of_the_gates_and_the_distribution():
    logits, active, _ = _case(N=5, E=4)

    def fn(z):
        probs, _, gates, *_ = torch.ops.sut.route_top_k(z, active, 2)
        return probs, gates

    assert torch.autograd.gradcheck(fn, (logits.clone().requires_grad_(),))


@pytest.mark.parametrize("N, E, k", [(9, 5, 2), (1, 3, 3), (16, 24, 4), (7, 2, 1)])
def test_layout_is_make_routings_of_the_masked_picks(N, E, k):
    logits, active, _ = _case(N, E, dtype=torch.float32)
    probs, top_idx, gates, expert_idxs, sorted_e, sorted_s, offsets = torch.ops.sut.route_top_k(logits, active, k)
    torch.testing.assert_close(probs, logits.softmax(1))
    assert torch.equal(top_idx, probs.topk(k, 1).indices)
    assert torch.equal(expert_idxs, top_idx.masked_fill(~active.unsqueeze(1), E))
    want = make_routing(expert_idxs, gates, E)
    assert torch.equal(sorted_e, want.sorted_expert_idxs) and torch.equal(sorted_s, want.sorted_scattered_idxs)
    assert torch.equal(offsets, want.expert_offsets)
    top = probs.gather(1, top_idx)
    torch.testing.assert_close(gates, top / top.sum(1, keepdim=True) * active.unsqueeze(1))


def test_router_takes_the_op_where_the_routed_ops_run_triton(monkeypatch):
    """``SUT_KERNELS=triton`` (as CUDA tensors): the op; the CPU default: the PyTorch
    path; a router that samples picks in training: the PyTorch path."""
    router = Router(8, 4, 2, 16)
    x = torch.randn(3, 8)
    monkeypatch.delenv("SUT_KERNELS", raising=False)
    assert not router._one_op(x)
    monkeypatch.setenv("SUT_KERNELS", "triton")
    assert router._one_op(x)
    sampling = Router(8, 4, 2, 16, sample_topk=1)
    assert not sampling._one_op(x) and sampling.eval()._one_op(x)
