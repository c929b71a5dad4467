"""The relative-position terms (``modules/relative_position.py``) against independent
references: T5's bucket formula written per offset in Python, the clipped offsets' range
by hand, shapes, devices and dtypes."""
import math

import pytest
import torch

from sut_fairseq.modules.relative_position import ClippedRelativePosition, T5RelativeBias, t5_bucket


def _bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's bucket of the offset rel = j - i, one offset at a time; returns (bucket, the
    log-spaced value before flooring or None)."""
    base = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:  # a key after the query: the second half
            base = num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)  # keys after the query share bucket 0
    exact = num_buckets // 2
    if n < exact:
        return base + n, None
    value = math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    return base + min(exact + int(value), num_buckets - 1), value


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance",
                         [(True, 32, 128), (False, 32, 128), (True, 16, 64), (False, 8, 20)])
def test_t5_bucket_against_the_formula_per_offset(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-300, 301)
    got = t5_bucket(rel, bidirectional, num_buckets, max_distance)
    assert got.dtype == torch.long
    for r, g in zip(rel.tolist(), got.tolist()):
        want, value = _bucket(r, bidirectional, num_buckets, max_distance)
        if value is not None and abs(value - round(value)) < 1e-4:
            continue  # float32 and float64 may floor a near-integer differently
        assert g == want, (r, g, want)


def test_t5_bucket_worked_examples():
    """Bidirectional 32 / 128: 16 buckets per direction, 8 exact; unidirectional: 16
    exact, the future in bucket 0."""
    rel = torch.tensor([0, -1, 1, -8, -127, -500, 7, 500])
    assert t5_bucket(rel, True, 32, 128).tolist() == [0, 1, 17, 8, 15, 15, 23, 31]
    rel = torch.tensor([0, 5, -1, -15, -16, -127, -1000])
    assert t5_bucket(rel, False, 32, 128).tolist() == [0, 0, 1, 15, 16, 31, 31]


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_relative_bias_reads_the_bucket_of_each_query_key_pair(bidirectional):
    torch.manual_seed(0)
    bias = T5RelativeBias(3, bidirectional)
    assert (bias.num_buckets, bias.max_distance) == (32, 128)
    torch.nn.init.normal_(bias.bias.weight)
    T, q_start, S = 4, 3, 9
    out = bias(T, q_start, S)
    assert out.shape == (1, 3, T, S)
    for t in range(T):
        for j in range(S):
            b, _ = _bucket(j - (q_start + t), bidirectional, 32, 128)
            torch.testing.assert_close(out[0, :, t, j], bias.bias.weight[b])
    meta = T5RelativeBias(3, True).to("meta")
    lookup, seen = meta.bias.forward, []
    meta.bias.forward = lambda idx: seen.append(idx.device.type) or lookup(idx)
    assert meta(T, q_start, S).device.type == "meta" and seen == ["meta"]  # the buckets too


def test_t5_relative_bias_starts_at_zero():
    assert torch.equal(T5RelativeBias(2, True).bias.weight, torch.zeros(32, 2))


@pytest.mark.parametrize("W,T,q_start,S", [(2, 3, 0, 3), (4, 1, 6, 7), (3, 2, 0, 9), (5, 2, 1, 3), (0, 3, 0, 3)])
def test_clipped_offsets_are_exactly_the_ones_that_occur(W, T, q_start, S):
    """``offsets`` returns r_lo .. r_hi for the smallest and largest clipped offset j - i
    between queries q_start..q_start+T-1 and keys 0..S-1 (no more)."""
    rel = ClippedRelativePosition(2, 3, W)
    occurring = {max(-W, min(W, j - i)) for i in range(q_start, q_start + T) for j in range(S)}
    lo, r = rel.offsets(T, q_start, S)
    assert lo == min(occurring) and r.size(0) == max(occurring) - min(occurring) + 1
    torch.testing.assert_close(r, rel.embeddings[lo + W: max(occurring) + W + 1])


def test_clipped_term_against_a_loop_in_another_dtype_and_device():
    """q_m · r_{clip(j - i_m)} for query rows m = t·k + j' (k = 2 picks) at q_start 2, with
    fp64 queries against fp32 embeddings (cast to the queries' dtype); the gather index is
    made on the queries' device (meta)."""
    torch.manual_seed(1)
    W, H, D, T, k, q_start, S = 2, 2, 3, 3, 2, 2, 6
    rel = ClippedRelativePosition(H, D, W)
    q = torch.randn(2, H, T * k, D, dtype=torch.float64)
    out = rel(q, T, q_start, S)
    assert out.dtype == torch.float64 and out.shape == (2, H, T * k, S)
    for m in range(T * k):
        i = q_start + m // k
        for j in range(S):
            r = rel.embeddings[max(-W, min(W, j - i)) + W].double()  # (H, D)
            torch.testing.assert_close(out[:, :, m, j], (q[:, :, m] * r).sum(-1))
    meta = rel.to("meta")
    assert meta(q.to("meta"), T, q_start, S).device.type == "meta"
    assert meta.index(T, q_start, S, k, meta.offsets(T, q_start, S)[0]).device.type == "meta"


@pytest.mark.parametrize("W,T,q_start,S", [(31, 40, 0, 40), (2, 3, 0, 3), (4, 1, 6, 7), (8, 16, 0, 16)])
def test_clipped_term_pads_its_offsets_to_an_aligned_count(W, T, q_start, S):
    """The scores are computed for a multiple of 16 offsets (zero vectors after the O that
    occur: 63 -> 64 at W = 31), and the term and its gradients equal those over the O
    offsets alone (fp32)."""
    torch.manual_seed(2)
    rel = ClippedRelativePosition(2, 8, W)
    lo, padded = rel.aligned_offsets(T, q_start, S)
    _, r = rel.offsets(T, q_start, S)
    assert padded.size(0) % 16 == 0 and padded.size(0) - r.size(0) < 16
    assert torch.equal(padded[: r.size(0)], r) and not padded[r.size(0):].any()
    q = torch.randn(2, 2, T * 3, 8, requires_grad=True)
    out = rel(q, T, q_start, S)
    direct = torch.einsum("bhmd,ohd->bhmo", q, r).gather(
        3, rel.index(T, q_start, S, 3, lo).expand(2, 2, -1, -1))
    torch.testing.assert_close(out, direct, rtol=0, atol=1e-6)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, rel.embeddings), grad)
    want = torch.autograd.grad(direct, (q, rel.embeddings), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("W,T,q_start,S,k", [(8, 3, 2, 6, 3), (2, 3, 0, 3, 1), (40, 17, 0, 17, 2),
                                             (6, 1, 5, 6, 4), (31, 32, 0, 32, 4)])
def test_unclipped_term_and_its_gradients_equal_autograds_gather(W, T, q_start, S, k, monkeypatch):
    """Where no offset is clipped (``clipped`` False) the term's shifted gathers (the
    branch a compiled graph takes), forward and backward, equal autograd's gather and
    scatter-add over the same scores (float64), and ``gradcheck`` passes."""
    from sut_fairseq.modules import relative_position

    calls = []
    gather = relative_position._UnclippedGather.apply
    monkeypatch.setattr(relative_position, "tracing", lambda: True)
    monkeypatch.setattr(relative_position._UnclippedGather, "apply",
                        lambda *args: calls.append(1) or gather(*args))
    torch.manual_seed(3)
    rel = ClippedRelativePosition(2, 4, W).double()
    assert not rel.clipped(T, q_start, S)
    q = torch.randn(3, 2, T * k, 4, dtype=torch.float64, requires_grad=True)
    out = rel(q, T, q_start, S)
    lo, scores = rel.offset_scores(q, T, q_start, S)
    direct = scores.gather(3, rel.index(T, q_start, S, k, lo).expand(3, 2, -1, -1))
    torch.testing.assert_close(out, direct, rtol=0, atol=0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, rel.embeddings), grad)
    want = torch.autograd.grad(direct, (q, rel.embeddings), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(lambda q_: rel(q_, T, q_start, S), (q,))
    assert calls


def test_the_compiled_term_takes_the_shifted_gathers_and_equals_eager():
    """Compiled (AOT autograd, ``aot_eager``), an unclipped term runs ``_UnclippedGather``
    and its output and gradients equal the eager term's (the gather and its scatter-add)."""
    from sut_fairseq.modules import relative_position

    torch.manual_seed(4)
    rel = ClippedRelativePosition(2, 4, 16)
    q0 = torch.randn(2, 2, 6 * 2, 4)
    calls = []
    forward = relative_position._UnclippedGather.forward

    def counted(ctx, *args):
        calls.append(1)
        return forward(ctx, *args)

    outs = []
    for compiled in (False, True):
        q = q0.clone().requires_grad_()
        fn = torch.compile(rel, backend="aot_eager", fullgraph=True) if compiled else rel
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(relative_position._UnclippedGather, "forward", staticmethod(counted))
            out = fn(q, 6, 0, 6)
        grads = torch.autograd.grad((out * torch.arange(6.0)).sum(), (q, rel.embeddings))
        outs.append((out, *grads))
        assert bool(calls) == compiled
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("W,T,q_start,S,clipped", [(2, 3, 0, 3, False), (2, 4, 0, 3, True),
                                                   (2, 3, 0, 4, True), (4, 1, 4, 5, False),
                                                   (4, 1, 5, 5, True)])
def test_clipped_says_whether_an_offset_is_clipped(W, T, q_start, S, clipped):
    """``clipped`` against the offsets by hand: some j - i outside [-W, W]."""
    offsets = [j - i for i in range(q_start, q_start + T) for j in range(S)]
    assert any(abs(o) > W for o in offsets) == clipped
    assert ClippedRelativePosition(1, 1, W).clipped(T, q_start, S) == clipped


def test_clipped_construction():
    """2W + 1 embeddings of (H, D), N(0, 1/D) at start; W = 0 (one shared vector) is
    allowed, a negative W refused by name."""
    torch.manual_seed(0)
    rel = ClippedRelativePosition(8, 64, 3)
    assert rel.embeddings.shape == (7, 8, 64)
    assert abs(rel.embeddings.std().item() - 64 ** -0.5) < 0.01
    assert ClippedRelativePosition(2, 4, 0).embeddings.shape == (1, 2, 4)
    with pytest.raises(ValueError) as err:
        ClippedRelativePosition(2, 4, -1)
    assert str(err.value) == "relative window W must be >= 0; got -1"
