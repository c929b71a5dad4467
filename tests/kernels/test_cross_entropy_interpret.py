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
def test_forward_kernel_equals_the_rows_loss_and_nll(v):
    """Per row, in float64 by hand: lse = logsumexp z, nll = lse - z_t, smooth = V lse -
    Σ z; the kernel's rows are (a nll + b smooth, nll), 0 on a row whose target is the
    ignored index."""
    from sut_fairseq.kernels.cross_entropy import ce_forward

    z = _logits(7, v)
    target = torch.tensor([v - 1, 0, 1 % v, PAD, v // 2, 3 % v, v - 1])
    a, b = 0.83, 0.017
    lse, rows = ce_forward(z, target, PAD, a, b)
    assert lse.shape == (7,) and rows.shape == (2, 7) and rows.dtype == torch.float32
    zd = z.double()
    want_lse = torch.logsumexp(zd, 1)
    keep = target != PAD
    nll = (want_lse - zd[torch.arange(7), target.clamp(0, v - 1)]) * keep
    smooth = (v * want_lse - zd.sum(1)) * keep
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(rows[1], nll.float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(rows[0], (a * nll + b * smooth).float(), rtol=1e-5, atol=1e-4)
    assert rows[:, 3].abs().sum() == 0 and rows[1].abs().sum() > 0


@pytest.mark.parametrize("v", [5, 37])
def test_backward_kernel_equals_its_formula_row_by_row(v):
    """dz_j = w (exp(z_j - lse) (a + V b) - b) - a w [j = t], w the upstream gradient
    (0 on a row whose target is ignored), one row at a time."""
    from sut_fairseq.kernels.cross_entropy import ce_backward

    z = _logits(6, v)
    lse = torch.logsumexp(z, 1)
    target = torch.tensor([v - 1, 0, 3 % v, PAD, 2, v // 2])
    a, b, w = 0.83, 0.017, torch.tensor(0.37)
    dz = ce_backward(z, lse, target, w, PAD, a, b)
    for n in range(6):
        if target[n] == PAD:
            assert dz[n].abs().sum() == 0
            continue
        want = w * (torch.exp(z[n] - lse[n]) * (a + v * b) - b)
        want[target[n]] -= a * w
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
        ce_forward(torch.zeros(4, 5).t(), torch.zeros(5, dtype=torch.long), PAD, 0.9, 0.01)


if not IN_PROCESS:
    delegate_module(globals(), {"TRITON_INTERPRET": "1"})
