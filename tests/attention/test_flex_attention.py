"""MoMHA's FlexAttention form (``--flex-attention``, ``modules/flex_attention.py``) against a
per-(query, key) loop of the logits and against the default path, forward on the CPU
(FlexAttention has no CPU backward; the gradients are checked on a GPU,
``tests/gpu/test_gpu.py::test_flex_attention_forward_and_gradients_match_the_default_path``):
every relative term, causal and not, padding with a query that sees no key, k picks per
position, and queries that start after the first key (a decoder's later positions)."""
import math

import pytest
import torch

from conftest import LooksCuda
from sut_fairseq.modules.momha import MixtureOfMultiHeadAttention
from sut_fairseq.modules.relative_position import ClippedRelativePosition, T5RelativeBias, t5_bucket

H, D, W = 2, 8, 2


def _attention(relative, causal):
    torch.manual_seed(0)
    attn = MixtureOfMultiHeadAttention(16, 16, 3, 2, H, D, 16, relative=relative, window=W,
                                       causal=causal, flex=True)
    if isinstance(attn.relative, T5RelativeBias):
        torch.nn.init.normal_(attn.relative.bias.weight)  # zeros at initialisation
    return attn


def _loop_reference(attn, q, k, v, T, q_start, hidden):
    """softmax_j(q_m·k_j/√D + rel(m, j), -inf where hidden) v, one logit at a time."""
    B, _, M, _ = q.shape
    S, picks = k.size(2), M // T
    logits = torch.empty(B, H, M, S, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for m in range(M):
                i = q_start + m // picks
                for j in range(S):
                    x = float(q[b, h, m] @ k[b, h, j]) / math.sqrt(D)
                    if isinstance(attn.relative, ClippedRelativePosition):
                        off = min(max(j - i, -W), W)
                        x += float(q[b, h, m] @ attn.relative.embeddings[off + W, h]) / math.sqrt(D)
                    elif isinstance(attn.relative, T5RelativeBias):
                        bucket = t5_bucket(torch.tensor(j - i), attn.relative.bidirectional, 32, 128)
                        x += float(attn.relative.bias.weight[bucket, h])
                    if hidden is not None and bool(hidden[b if hidden.size(0) > 1 else 0, 0,
                                                          m if hidden.size(2) > 1 else 0, j]):
                        x = -math.inf
                    logits[b, h, m, j] = x
    return (logits.softmax(-1) @ v.double()).float()


CASES = [  # (T, q_start, S, picks)
    (5, 0, 5, 1),
    (4, 0, 4, 2),
    (1, 6, 7, 2),   # one new position after six cached ones (incremental decoding)
    (3, 4, 7, 1),   # three positions after four (a chunk's queries)
    (2, 8, 10, 1),  # more keys than the head dimension D = 8 (S read from the keys' dim 2)
]


@pytest.mark.parametrize("relative", [None, "clipped", "t5"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,q_start,S,picks", CASES)
def test_flex_forward_equals_a_loop_and_the_default_path(relative, causal, T, q_start, S, picks):
    if not causal and q_start > 0:
        pytest.skip("an encoder's queries are its keys")
    attn = _attention(relative, causal)
    torch.manual_seed(1)
    B = 2
    q, k, v = (torch.randn(B, H, T * picks, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D))
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    if causal:
        pad[0, 0] = True  # row 0's first position sees only padding: its keys stay unmasked
    hidden = attn._hidden_keys(q, T, q_start, S, pad)
    with torch.no_grad():
        got = attn._attend_flex(q, k, v, T, q_start, hidden)
        want = _loop_reference(attn, q, k, v, T, q_start, hidden)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        bias = attn._attention_bias(q, T, q_start, S, hidden)  # the default path (CUDA's)
        default = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        torch.testing.assert_close(got, default, atol=1e-5, rtol=1e-5)
        if isinstance(attn.relative, ClippedRelativePosition):  # the CPU's own path
            torch.testing.assert_close(got, attn._attend_clipped(q, k, v, T, q_start, hidden),
                                       atol=1e-5, rtol=1e-5)


def test_flex_attention_refuses_attention_dropout():
    with pytest.raises(ValueError, match="FlexAttention has no dropout: attention_dropout must be 0, got 0.1"):
        MixtureOfMultiHeadAttention(16, 16, 3, 2, H, D, 16, attention_dropout=0.1, flex=True)


def test_a_cpu_forward_with_flex_runs_the_default_path():
    """On a CPU the option changes nothing (FlexAttention has no CPU backward): the module's
    output and gradients are those of the same module without it."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    outs = []
    for flex in (False, True):
        torch.manual_seed(0)
        attn = MixtureOfMultiHeadAttention(16, 16, 3, 2, H, D, 16, relative="clipped", window=W,
                                           causal=True, flex=flex)
        k, v = attn.project_kv(x)
        out = attn(x, k, v, torch.ones(2, 5, dtype=torch.bool))
        out.sum().backward()
        outs.append((out, attn.relative.embeddings.grad))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_flex_attend_broadcasts_the_hidden_keys_over_a_batch_larger_than_the_heads():
    """``attend`` with no relative term: B = 3 sentences over H = 2 heads, the hidden keys
    given once for the batch (1, 1, 1, S) or not at all, against SDPA with the same mask."""
    from sut_fairseq.modules import flex_attention

    torch.manual_seed(2)
    q, k, v = torch.randn(3, H, 4, D), torch.randn(3, H, 6, D), torch.randn(3, H, 6, D)
    hidden = torch.zeros(1, 1, 1, 6, dtype=torch.bool)
    hidden[..., 1] = hidden[..., 4] = True
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        torch.testing.assert_close(flex_attention.attend(q, k, v, 1, 0, hidden, None, 0, 0, None),
                                   sdpa(q, k, v, attn_mask=~hidden), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(flex_attention.attend(q, k, v, 1, 0, None, None, 0, 0, None),
                                   sdpa(q, k, v), atol=1e-5, rtol=1e-5)


def test_on_cuda_attend_runs_the_compiled_flex_attention(monkeypatch):
    """CUDA tensors go through ``compiler.fused(flex_attention)`` (FlexAttention's fused
    kernel needs torch.compile), CPU tensors through the eager function."""
    from sut_fairseq import compiler
    from sut_fairseq.modules import flex_attention

    calls = []

    def eager(q, key, value, score_mod):
        calls.append("eager")
        return q

    def fused(fn):
        assert fn is eager
        return lambda *args, **kwargs: (calls.append("fused"), fn(*args, **kwargs))[1]

    monkeypatch.setattr(flex_attention, "flex_attention", eager)
    monkeypatch.setattr(compiler, "fused", fused)
    q = torch.zeros(1, H, 2, D)
    flex_attention.attend(q, q, q, 1, 0, None, None, 0, 0, None)
    assert calls == ["eager"]
    flex_attention.attend(q.as_subclass(LooksCuda), q, q, 1, 0, None, None, 0, 0, None)
    assert calls == ["eager", "fused", "eager"]


def test_flex_applies_on_cuda_where_asked_one_query_row_per_key_row():
    on, off = (MixtureOfMultiHeadAttention(16, 16, 3, 2, H, D, 16, flex=f) for f in (True, False))
    q = torch.zeros(2, H, 3, D)
    assert on._flex_applies(q.as_subclass(LooksCuda), groups=1)
    assert not on._flex_applies(q, groups=1)                            # CPU
    assert not on._flex_applies(q.as_subclass(LooksCuda), groups=2)     # beams over shared keys
    assert not off._flex_applies(q.as_subclass(LooksCuda), groups=1)    # not asked


@pytest.mark.parametrize("relative", [None, "clipped", "t5"])
def test_where_flex_applies_the_forward_is_the_default_paths(relative, monkeypatch):
    """The forward with FlexAttention's branch taken (on the CPU: ``_flex_applies`` made
    true) gives the default path's output: the branch hands ``_attend_flex`` the queries,
    keys, values, positions and hidden keys it has."""
    torch.manual_seed(3)
    x = torch.randn(2, 5, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, -2:] = True
    attn = _attention(relative, causal=True)
    attn.eval()
    active = ~pad
    with torch.no_grad():  # FlexAttention has no CPU backward
        k, v = attn.project_kv(x)
        want = attn(x[:, 2:], k, v, active[:, 2:], key_padding_mask=pad, q_start=2)
        calls = []
        attend_flex = attn._attend_flex
        monkeypatch.setattr(attn, "_flex_applies", lambda q, groups: groups == 1)
        monkeypatch.setattr(attn, "_attend_flex", lambda *a: calls.append(a) or attend_flex(*a))
        got = attn(x[:, 2:], k, v, active[:, 2:], key_padding_mask=pad, q_start=2)
    assert len(calls) == 1 and calls[0][3:5] == (3, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_default_form_takes_attention_dropout():
    """FlexAttention is asked for (``flex=True``), never the default: without it attention
    dropout is accepted."""
    attn = MixtureOfMultiHeadAttention(16, 16, 3, 2, H, D, 16, attention_dropout=0.1)
    assert attn.flex is False and attn.attention_dropout == 0.1


def test_the_t5_table_enters_the_scores_in_the_queries_dtype():
    """bf16 queries with the layer's parameters in fp32 (autocast's case): the T5 table is
    rounded to bf16 before it is added, as the default path's additive bias is; an fp32
    table would move the output by up to a bf16 step."""
    from sut_fairseq.modules import flex_attention

    attn = _attention("t5", causal=True)
    torch.manual_seed(4)
    T, S = 4, 4
    q, k, v = (torch.randn(1, H, T * 2, D, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        got = attn._attend_flex(q, k[:, :, :S], v[:, :, :S], T, 0, None)
        table = attn.relative(T, 0, S).to(torch.bfloat16)
        want = flex_attention.attend(q, k[:, :, :S], v[:, :, :S], 2, 0, None, None, 0, 0, table)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
