"""The fused label-smoothed CE equals fairseq's log-softmax + label_smoothed_nll_loss."""
from types import SimpleNamespace

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    label_smoothed_nll_loss,
)

from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import SUTLabelSmoothedCrossEntropyCriterion
from sut_fairseq.ops import label_smoothed_ce
from sut_fairseq.ops.label_smoothed_ce import label_smoothed_cross_entropy
from sut_fairseq.models.standalone import build_model

PAD = 1


def reference(logits, target, eps):
    return label_smoothed_nll_loss(torch.log_softmax(logits, -1), target, eps, ignore_index=PAD)


def case(n=37, v=11, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, v, generator=g)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[::5] = PAD  # padding rows
    return logits, target


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_value_and_gradient_match_fairseq_in_float64(eps):
    logits, target = case()
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss_ref, nll_ref = reference(a, target, eps)
    loss, nll = label_smoothed_cross_entropy(b, target, eps, PAD)
    upstream = 0.37  # a non-unit upstream gradient (fairseq scales the loss)
    (upstream * loss_ref).backward()
    (upstream * loss).backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(nll, nll_ref, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12)
    assert b.grad[target == PAD].abs().max() == 0  # padding rows get no gradient


def test_blocks_cover_every_row(monkeypatch):
    """Rows split over many cache blocks (the last one partial) give the same result."""
    logits, target = case(n=23, v=7)
    whole = label_smoothed_cross_entropy(logits.clone().requires_grad_(), target, 0.1, PAD)
    monkeypatch.setattr(label_smoothed_ce, "_BLOCK_ELEMENTS", 3 * 7)  # 3 rows per block
    x = logits.clone().requires_grad_()
    blocked = label_smoothed_cross_entropy(x, target, 0.1, PAD)
    blocked[0].backward()
    y = logits.clone().requires_grad_()
    reference(y, target, 0.1)[0].backward()
    torch.testing.assert_close(blocked[0], whole[0])
    torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("device, blocks", [("cpu", 512), ("cuda", 8)])
def test_block_size_follows_the_device(device, blocks):
    """The PyTorch path on a WMT-size batch (4,096 rows x 32,768 logits): cache-sized blocks
    on a CPU, few large ones on a GPU (``SUT_KERNELS=reference``: each operation on a block
    is a kernel launch there); the slices are contiguous, in order and cover every row
    once; a row longer than a block is a block of its own."""
    slices = label_smoothed_ce._row_blocks(4096, 32768, torch.device(device))
    assert len(slices) == blocks
    assert [i for s in slices for i in range(s.start, s.stop)] == list(range(4096))
    assert label_smoothed_ce._row_blocks(3, 1 << 25, torch.device(device)) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def test_backend_follows_the_routed_ops_choice(monkeypatch):
    """CPU tensors take the PyTorch path, CUDA ones (or ``SUT_KERNELS=triton``) the Triton
    kernels, but fp64 logits (gradcheck) always the PyTorch path: the kernels accumulate in
    fp32 (their equality with this path: tests/kernels/test_cross_entropy_interpret.py)."""
    monkeypatch.delenv("SUT_KERNELS", raising=False)
    assert not label_smoothed_ce._uses_triton(torch.zeros(2, 3))
    monkeypatch.setenv("SUT_KERNELS", "triton")
    assert label_smoothed_ce._uses_triton(torch.zeros(2, 3))
    assert label_smoothed_ce._uses_triton(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert not label_smoothed_ce._uses_triton(torch.zeros(2, 3, dtype=torch.float64))


def test_gradcheck():
    logits, target = case(n=6, v=5)
    fn = lambda z: label_smoothed_cross_entropy(z, target, 0.2, PAD)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits.clone().requires_grad_(),))


def test_bfloat16_logits_accumulate_in_float32():
    logits, target = case(n=64, v=50, dtype=torch.float32)
    half = logits.bfloat16().requires_grad_()
    loss, _ = label_smoothed_cross_entropy(half, target, 0.1, PAD)
    loss.backward()
    assert loss.dtype == torch.float32 and half.grad.dtype == torch.bfloat16
    ref = logits.bfloat16().float().requires_grad_()
    loss_ref, _ = reference(ref, target, 0.1)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(half.grad.float(), ref.grad, rtol=2e-2, atol=2e-3)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"\(N, V\).*\(3, 4, 5\)"):
        label_smoothed_cross_entropy(torch.zeros(3, 4, 5), torch.zeros(3, dtype=torch.long), 0.1, PAD)
    # V = 1 has no other class to smooth onto; V = 2 is the smallest valid vocabulary
    with pytest.raises(ValueError, match=r"^label smoothing needs a vocabulary of at least 2; got 1$"):
        label_smoothed_cross_entropy(torch.zeros(3, 1), torch.zeros(3, dtype=torch.long), 0.1, PAD)
    two = torch.tensor([[0.5, -0.5], [1.0, 2.0]], dtype=torch.float64)
    target = torch.tensor([0, 1])
    torch.testing.assert_close(label_smoothed_cross_entropy(two, target, 0.1, PAD)[0],
                               reference(two, target, 0.1)[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("ignore_prefix_size", [0, 1])
def test_criterion_loss_and_accuracy_equal_fairseqs(ignore_prefix_size):
    """On a real model output the SUT criterion's CE part equals fairseq's criterion."""
    torch.manual_seed(0)
    model = build_model("sut_tiny", dict_size=40, share_all_embeddings=True).eval()
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 40, (3, 6), generator=g)
    tgt = torch.randint(4, 40, (3, 5), generator=g)
    tgt[0, 3:] = PAD
    prev = torch.cat([torch.full((3, 1), 2), tgt[:, :-1]], 1)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((3,), 6),
                            "prev_output_tokens": prev}, "target": tgt}
    ours = SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, ignore_prefix_size, True)
    fairseqs = LabelSmoothedCrossEntropyCriterion(task, False, 0.1, ignore_prefix_size, True)
    out = model(**sample["net_input"])
    loss, nll = ours.compute_loss(model, out, sample)
    loss_ref, nll_ref = fairseqs.compute_loss(model, out, sample)
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(nll, nll_ref)
    assert [int(v) for v in ours.compute_accuracy(model, out, sample)] == \
        [int(v) for v in fairseqs.compute_accuracy(model, out, sample)]
    # reduce=False (per-token losses) is fairseq's own path
    per_token, _ = ours.compute_loss(model, out, sample, reduce=False)
    torch.testing.assert_close(per_token.sum(), loss_ref)


def test_bfloat16_logits_match_a_float64_reference_at_float32_accuracy():
    """bf16 logits are accumulated in fp32: the loss and nll equal the float64 loss of the
    same bf16 values to fp32 accuracy (a bf16 accumulation is off by ~1e-3 relative), and
    the gradient is the float64 gradient rounded once to bf16."""
    logits, target = case(n=64, v=300, dtype=torch.float32, seed=3)
    half = logits.bfloat16().requires_grad_()
    loss, nll = label_smoothed_cross_entropy(half, target, 0.1, PAD)
    (0.37 * loss).backward()
    exact = logits.bfloat16().double().requires_grad_()
    loss_ref, nll_ref = reference(exact, target, 0.1)
    (0.37 * loss_ref).backward()
    torch.testing.assert_close(loss.double(), loss_ref, rtol=2e-6, atol=0)
    torch.testing.assert_close(nll.double(), nll_ref, rtol=2e-6, atol=0)
    rounded = exact.grad.bfloat16()
    differ = (half.grad != rounded).float().mean().item()
    assert half.grad.dtype == torch.bfloat16 and differ < 0.01, differ


def test_row_sums_of_shifted_bfloat16_logits_are_held_in_float32():
    """The smoothing term V · lse − Σ_j z_j does not change when every logit of a row moves
    by the same amount, but its two parts do: with bf16 logits near 100 and V = 300 each row
    sum Σ_j z_j is near 3·10^4, where bf16's spacing is 128 and fp32's 0.002. The row sums
    are held in fp32: the loss equals the float64 loss of the same bf16 values to 1e-5
    relative (a bf16 row sum is off by up to 64 per row, some 1e-4 of the loss), and with
    ε = 1 − 1/V (no weight on the target, loss = Σ_rows smooth / V) to 1e-5 as well."""
    logits, target = case(n=64, v=300, dtype=torch.float32, seed=4)
    half = (logits + 100).bfloat16()
    exact = half.double()
    for eps in (0.1, 1 - 1 / 300):
        loss, nll = label_smoothed_cross_entropy(half, target, eps, PAD)
        loss_ref, nll_ref = reference(exact, target, eps)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss.double(), loss_ref, rtol=1e-5, atol=0)
        torch.testing.assert_close(nll.double(), nll_ref, rtol=1e-5, atol=0)
    # the smoothing term written out in float64: Σ_rows (V · lse − Σ_j z_j) over kept rows
    keep = target != PAD
    smooth = (300 * torch.logsumexp(exact, 1) - exact.sum(1))[keep].sum()
    torch.testing.assert_close(loss.double(), smooth / 300, rtol=1e-5, atol=0)


def test_the_triton_branch_hands_the_kernels_their_arguments(monkeypatch):
    """``SUT_KERNELS=triton`` with the two kernels replaced by PyTorch stand-ins of their
    contract (``kernels/cross_entropy.py``; the kernels themselves are checked against it
    in tests/kernels/test_cross_entropy_interpret.py): the op's loss, nll and gradient are
    the PyTorch path's, so every argument reached the right place; the kernels get
    contiguous logits whatever the caller's layout."""
    from sut_fairseq.kernels import cross_entropy

    def forward(logits, target, ignore_index, on_target, eps_i):
        assert logits.is_contiguous() and target.is_contiguous()
        z, keep = logits.float(), target != ignore_index
        lse = torch.logsumexp(z, 1)
        nll = (lse - z.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1)) * keep
        smooth = (z.size(1) * lse - z.sum(1)) * keep
        return lse, torch.stack([on_target * nll + eps_i * smooth, nll])

    def backward(logits, lse, target, grad_loss, ignore_index, on_target, eps_i):
        assert logits.is_contiguous() and grad_loss.numel() == 1
        w = (target != ignore_index) * grad_loss
        V = logits.size(1)
        dz = torch.exp(logits.float() - lse.unsqueeze(1)) * (w * (on_target + V * eps_i)).unsqueeze(1) \
            - (w * eps_i).unsqueeze(1)
        return dz.scatter_add(1, target.unsqueeze(1), (-on_target * w).unsqueeze(1)).to(logits.dtype)

    logits, target = case(n=19, v=9, dtype=torch.float32)
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("SUT_KERNELS", backend)
        monkeypatch.setattr(cross_entropy, "ce_forward", forward)
        monkeypatch.setattr(cross_entropy, "ce_backward", backward)
        x = logits.t().contiguous().t().requires_grad_()  # column-major
        loss, nll = label_smoothed_cross_entropy(x, target, 0.2, PAD)
        (0.7 * loss).backward()
        out[backend] = (loss.detach(), nll, x.grad)
    for a, b in zip(out["triton"], out["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
