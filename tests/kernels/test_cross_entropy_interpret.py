"""The label-smoothed cross entropy's Triton kernels against independent computations, on
CPU in Triton's interpreter (``sut_fairseq/kernels/cross_entropy.py``).

The kernels walk each row in blocks of ``INTERPRET_BLOCK_V`` = 16 columns here, so the
vocabularies below span one partial block, several blocks with a partial last one, and
exact multiples; rows whose maximum sits in a late block exercise the online logsumexp's
rescaling. Like ``test_kernels_interpret.py``, the tests run in a child pytest process
with ``TRITON_INTERPRET=1`` when this one lacks it (``sut_fairseq/kernels/testing.py``).
"""
import pytest
import torch

from sut_fairseq.kernels.testing import delegate_module, interpreter_active

IN_PROCESS = interpreter_active()
PAD = 1


def _logits(n, v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(n, v, generator=g)
    z[0, -1] = 40.0  # a row whose maximum is in its last block (rescaled sums)
    z[1, 0] = -30.0
    return z.to(dtype)


@pytest.mark.parametrize("v", [5, 16, 37, 64])
def test_forward_kernel_equals_logsumexp_row_sum_and_the_target_logit(v):
    from sut_fairseq.kernels.cross_entropy import ce_forward

    z = _logits(7, v)
    target = torch.tensor([v - 1, 0, 1 % v, 2 % v, v // 2, 3 % v, v - 1])
    lse, row_sum, z_target = ce_forward(z, target)
    assert torch.equal(z_target, z[torch.arange(7), target])
    torch.testing.assert_close(lse, torch.logsumexp(z.double(), 1).float(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(row_sum, z.double().sum(1).float(), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("v", [5, 37])
def test_backward_kernel_equals_its_formula_row_by_row(v):
    """dz_j = exp(z_j - lse) scale - shift (+ term at the target), one row at a time."""
    from sut_fairseq.kernels.cross_entropy import ce_backward

    z = _logits(6, v)
    g = torch.Generator().manual_seed(1)
    lse = torch.logsumexp(z, 1)
    scale, shift, term = torch.rand(6, generator=g), torch.rand(6, generator=g), -torch.rand(6, generator=g)
    target = torch.tensor([v - 1, 0, 3 % v, 2, 1, v // 2])
    dz = ce_backward(z, lse, scale, shift, target, term)
    for n in range(6):
        want = torch.exp(z[n] - lse[n]) * scale[n] - shift[n]
        want[target[n]] += term[n]
        torch.testing.assert_close(dz[n], want, rtol=1e-6, atol=1e-7)


# fp32: lse from an online sum differs from torch.logsumexp by an ulp or two; bf16: one
# rounding of the gradient
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("v", [5, 37])
def test_op_with_triton_equals_the_pytorch_path(monkeypatch, dtype, tol, v):
    """``label_smoothed_cross_entropy`` under ``SUT_KERNELS=triton`` (the CUDA path) and
    ``reference`` (the CPU path): loss, nll and the logits' gradient, with padding rows
    and an upstream scale; the gradient comes back in the logits' dtype."""
    from sut_fairseq.ops.label_smoothed_ce import label_smoothed_cross_entropy

    z = _logits(23, v, dtype)
    target = torch.randint(0, v, (23,), generator=torch.Generator().manual_seed(2))
    target[::4] = PAD
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("SUT_KERNELS", backend)
        x = z.clone().requires_grad_()
        loss, nll = label_smoothed_cross_entropy(x, target, 0.1, PAD)
        (0.37 * loss).backward()
        out[backend] = (loss.detach(), nll, x.grad)
    (loss_r, nll_r, grad_r), (loss_t, nll_t, grad_t) = out["reference"], out["triton"]
    assert grad_t.dtype == dtype and loss_t.dtype == torch.float32
    torch.testing.assert_close(loss_t, loss_r, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(nll_t, nll_r, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(grad_t.float(), grad_r.float(), rtol=tol, atol=tol * 1e-2)
    assert grad_t[target == PAD].abs().max() == 0


def test_non_contiguous_rows_are_refused_by_the_launcher():
    from sut_fairseq.kernels.cross_entropy import ce_forward

    with pytest.raises(ValueError, match=r"contiguous rows; got shape \(5, 4\)"):
        ce_forward(torch.zeros(4, 5).t(), torch.zeros(5, dtype=torch.long))


if not IN_PROCESS:
    delegate_module(globals(), {"TRITON_INTERPRET": "1"})
