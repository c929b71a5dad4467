"""The chunk memory's parts (``modules/memory.py``) against plain references: the memory
attention per head with an explicit softmax, the write feed-forward, the U-block write
with its residuals and an example without a token, M^0, the read-out norm; construction,
initialisation and the refusal. The models that use them are ``test_chunked.py``'s."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import randomise_parameters as _randomise

from sut_fairseq.modules.memory import ChunkMemory, MemoryAttention, MemoryFeedForward

D_MODEL, H, D_HEAD = 8, 2, 3


def _ln(x, norm):
    return F.layer_norm(x, (x.size(-1),), norm.weight, norm.bias, 1e-5)


def attention_reference(attn, x, m, hidden=None):
    """MHA(LN_q(x), LN_kv(m), LN_kv(m)) head by head: softmax over the keys of
    q·k / sqrt(D) (hidden keys left out), then W_o."""
    B, T, _ = x.shape
    q = _ln(x, attn.q_norm) @ attn.q_proj.weight.t() + attn.q_proj.bias
    k = _ln(m, attn.kv_norm) @ attn.k_proj.weight.t() + attn.k_proj.bias
    v = _ln(m, attn.kv_norm) @ attn.v_proj.weight.t() + attn.v_proj.bias
    out = torch.zeros(B, T, H * D_HEAD, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            cols = slice(h * D_HEAD, (h + 1) * D_HEAD)
            for t in range(T):
                scores = torch.stack([q[b, t, cols] @ k[b, s, cols] / math.sqrt(D_HEAD)
                                      for s in range(m.size(1))])
                if hidden is not None:
                    scores = scores.masked_fill(hidden[b], float("-inf"))
                out[b, t, cols] = torch.softmax(scores, 0) @ v[b, :, cols]
    return out @ attn.out_proj.weight.t() + attn.out_proj.bias


def ffn_reference(ffn, x):
    return F.gelu(_ln(x, ffn.norm) @ ffn.fc1.weight.t() + ffn.fc1.bias) @ ffn.fc2.weight.t() + ffn.fc2.bias


def test_memory_attention_against_a_per_head_softmax():
    attn = _randomise(MemoryAttention(D_MODEL, H, D_HEAD))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, D_MODEL, generator=g, dtype=torch.float64)
    m = torch.randn(2, 4, D_MODEL, generator=g, dtype=torch.float64)
    k, v = attn.project_kv(m)
    assert k.shape == v.shape == (2, H, 4, D_HEAD)
    torch.testing.assert_close(attn(x, k, v), attention_reference(attn, x, m))
    hidden = torch.tensor([[False, True, False, True], [False, False, False, True]])
    torch.testing.assert_close(attn(x, k, v, key_padding_mask=hidden), attention_reference(attn, x, m, hidden))


def test_memory_attention_casts_the_keys_to_the_queries_dtype():
    """Keys/values projected in fp32 (a memory kept in fp32) read by bf16 queries."""
    attn = _randomise(MemoryAttention(D_MODEL, H, D_HEAD)).float()
    g = torch.Generator().manual_seed(2)
    x, m = torch.randn(1, 2, D_MODEL, generator=g), torch.randn(1, 3, D_MODEL, generator=g)
    k, v = attn.project_kv(m)
    got = attn.bfloat16()(x.bfloat16(), k, v, key_padding_mask=torch.tensor([[False, True, False]]))
    assert got.dtype == torch.bfloat16
    want = attention_reference(attn.double(), x.double(), m.double(), torch.tensor([[False, True, False]]))
    torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.1)


def test_memory_attention_dropout_only_in_training():
    attn = _randomise(MemoryAttention(D_MODEL, H, D_HEAD, attention_dropout=0.5))
    g = torch.Generator().manual_seed(3)
    x, m = torch.randn(2, 3, D_MODEL, generator=g, dtype=torch.float64), torch.randn(2, 5, D_MODEL, generator=g, dtype=torch.float64)
    k, v = attn.project_kv(m)
    torch.testing.assert_close(attn(x, k, v), attention_reference(attn, x, m))   # eval: none
    torch.manual_seed(0)
    assert not torch.allclose(attn.train()(x, k, v), attention_reference(attn, x, m))


def test_memory_feed_forward_is_w2_gelu_w1_ln():
    ffn = _randomise(MemoryFeedForward(D_MODEL))
    x = torch.randn(2, 3, D_MODEL, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    torch.testing.assert_close(ffn(x), ffn_reference(ffn, x))
    assert ffn.fc1.weight.shape == ffn.fc2.weight.shape == (D_MODEL, D_MODEL)
    dropped = _randomise(MemoryFeedForward(D_MODEL, activation_dropout=0.5)).train()
    torch.manual_seed(0)
    assert not torch.allclose(dropped(x), ffn_reference(dropped, x))


def test_the_write_runs_U_blocks_with_residuals_and_skips_examples_without_a_token():
    """M_u = A_u + FFN_u(A_u), A_u = M_{u-1} + Attn_u(M_{u-1}, S_real), u = 1..U (U = 2);
    example 1 has no real row and keeps M^c."""
    memory = _randomise(ChunkMemory(D_MODEL, slots=3, update_layers=2, num_heads=H, head_dim=D_HEAD))
    g = torch.Generator().manual_seed(5)
    M = torch.randn(3, 3, D_MODEL, generator=g, dtype=torch.float64)
    S = torch.randn(3, 4, D_MODEL, generator=g, dtype=torch.float64)
    real = torch.tensor([[True, True, False, True], [False, False, False, False], [False, True, True, True]])
    got = memory.update(M, S, real)
    for b in (0, 2):
        want = M[b:b + 1]
        for attn, ffn in zip(memory.write_attn, memory.write_ffn):
            want = want + attention_reference(attn, want, S[b:b + 1], ~real[b:b + 1])
            want = want + ffn_reference(ffn, want)
        torch.testing.assert_close(got[b:b + 1], want)
    assert torch.equal(got[1], M[1])


def test_the_write_dropout_only_in_training():
    memory = _randomise(ChunkMemory(D_MODEL, 2, 1, H, D_HEAD, dropout=0.5))
    g = torch.Generator().manual_seed(6)
    M, S = torch.randn(2, 2, D_MODEL, generator=g, dtype=torch.float64), torch.randn(2, 3, D_MODEL, generator=g, dtype=torch.float64)
    real = torch.ones(2, 3, dtype=torch.bool)
    evaluated = memory.update(M, S, real)
    torch.manual_seed(0)
    assert not torch.allclose(memory.train().update(M, S, real), evaluated)


def test_initial_memory_read_out_and_construction():
    memory = ChunkMemory(D_MODEL, slots=3, update_layers=2, num_heads=H, head_dim=D_HEAD)
    assert memory.slots == 3 and len(memory.write_attn) == len(memory.write_ffn) == 2
    assert memory.out_norm is None and torch.equal(memory.initial, torch.zeros(3, D_MODEL))
    like = torch.zeros(4, 7, D_MODEL, dtype=torch.bfloat16)
    with torch.no_grad():
        memory.initial.copy_(torch.randn(3, D_MODEL))
    m0 = memory.begin(like)
    assert m0.shape == (4, 3, D_MODEL) and m0.dtype == torch.bfloat16
    assert torch.equal(m0[2], memory.initial.bfloat16())
    read = _randomise(ChunkMemory(D_MODEL, 2, 1, H, D_HEAD, out_norm=True))
    M = torch.randn(2, 2, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(read.output(M), _ln(M, read.out_norm))
    attn = MemoryAttention(64, 4, 32)      # 8,192 weights a matrix: the largest is within 1 % of the bound
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):     # Xavier-uniform, gain 2^-1/2
        bound = 2 ** -0.5 * math.sqrt(6 / (64 + 128))
        assert 0.99 * bound < proj.weight.abs().max() <= bound
        assert torch.equal(proj.bias, torch.zeros(128))
    bound = math.sqrt(6 / (128 + 64))                          # gain 1
    assert 0.99 * bound < attn.out_proj.weight.abs().max() <= bound
    assert torch.equal(attn.out_proj.bias, torch.zeros(64))
    assert attn.attention_dropout == 0.0 and MemoryFeedForward(8).dropout.p == 0.0    # the defaults
    passed = ChunkMemory(D_MODEL, 2, 2, H, D_HEAD, attention_dropout=0.3, activation_dropout=0.4)
    assert [a.attention_dropout for a in passed.write_attn] == [0.3, 0.3]
    assert [f.dropout.p for f in passed.write_ffn] == [0.4, 0.4]


@pytest.mark.parametrize("slots, layers", [(0, 1), (2, 0)])
def test_a_memory_without_slots_or_write_blocks_is_refused(slots, layers):
    with pytest.raises(ValueError) as err:
        ChunkMemory(D_MODEL, slots, layers, H, D_HEAD)
    assert str(err.value) == ("a chunk memory needs slots >= 1 and update layers >= 1; "
                              f"got slots={slots}, update_layers={layers}")


def test_no_dropout_unless_asked_and_the_smallest_memory():
    """By default a memory drops nothing in training (its three dropouts default to 0);
    one slot and one write block are allowed."""
    memory = ChunkMemory(D_MODEL, slots=1, update_layers=1, num_heads=H, head_dim=D_HEAD)
    _randomise(memory)
    g = torch.Generator().manual_seed(7)
    M, S = torch.randn(2, 1, D_MODEL, generator=g, dtype=torch.float64), torch.randn(2, 3, D_MODEL, generator=g, dtype=torch.float64)
    real = torch.ones(2, 3, dtype=torch.bool)
    evaluated = memory.update(M, S, real)
    torch.testing.assert_close(memory.train().update(M, S, real), evaluated, rtol=0, atol=0)


def test_the_padding_bias_is_in_the_queries_dtype(monkeypatch):
    """The additive mask handed to ``scaled_dot_product_attention`` is in the queries'
    dtype (its fused kernels refuse another float dtype), -inf on the padding keys; an
    example with no key at all attends without the mask (finite, unused output)."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    attn = _randomise(MemoryAttention(D_MODEL, H, D_HEAD)).bfloat16()
    x, m = torch.randn(2, 3, D_MODEL).bfloat16(), torch.randn(2, 4, D_MODEL).bfloat16()
    k, v = attn.project_kv(m)
    out = attn(x, k, v, key_padding_mask=torch.tensor([[False, True, False, True], [True, True, True, True]]))
    (mask,) = seen
    assert mask.dtype == torch.bfloat16 and mask.shape == (2, 1, 1, 4)
    assert mask[0, 0, 0].tolist() == [0.0, float("-inf"), 0.0, float("-inf")]
    assert mask[1].eq(0).all() and out.isfinite().all()
