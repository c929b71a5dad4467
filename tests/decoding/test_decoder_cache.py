"""Incremental decoding's caches (``modules/decoder_cache.py``) against the plain
computation they replace: keys/values grown by concatenation and reordered by
``index_select``; cross-attention keys/values of every decoder row; MoMHA over shared keys
equal to MoMHA over each row's own copy."""
import pytest
import torch

from conftest import make_model
from sut_fairseq.modules import chunk_cache
from sut_fairseq.modules.decoder_cache import (CAPACITY_STEP, BufferedKeyCache, CrossKV, DecoderState,
                                               KeyValueBuffer)

L, B, H, D = 3, 4, 2, 5


def test_the_buffer_equals_concatenation_and_reordering_through_growth_and_shrinking():
    """Positions past two capacity steps, a reorder after every position, and a reorder
    that drops rows (finished sentences): every step's keys/values equal the reference's."""
    g = torch.Generator().manual_seed(0)
    buffer = KeyValueBuffer(L)
    ref_k = ref_v = None  # (L, B, H, t, D)
    rows = B
    for t in range(2 * CAPACITY_STEP + 3):
        new_k = torch.randn(L, rows, H, 1, D, generator=g)
        new_v = torch.randn(L, rows, H, 1, D, generator=g)
        cache = BufferedKeyCache(buffer, t)
        for l in range(1, L + 1):
            k, v = cache.extend(l, new_k[l - 1], new_v[l - 1])
            want_k = new_k[l - 1] if ref_k is None else torch.cat([ref_k[l - 1], new_k[l - 1]], 2)
            want_v = new_v[l - 1] if ref_v is None else torch.cat([ref_v[l - 1], new_v[l - 1]], 2)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
        ref_k = new_k if ref_k is None else torch.cat([ref_k, new_k], 3)
        ref_v = new_v if ref_v is None else torch.cat([ref_v, new_v], 3)
        if t == CAPACITY_STEP + 5:  # a sentence finished: 4 rows -> 3
            order = torch.tensor([3, 0, 0])
        else:
            order = torch.randint(0, rows, (rows,), generator=g)
        buffer.reorder(order)
        ref_k, ref_v = ref_k.index_select(1, order), ref_v.index_select(1, order)
        rows = order.numel()
    assert buffer.buf.size(0) == 3 * CAPACITY_STEP  # grown in steps, not doubled


def test_the_buffer_refuses_a_call_out_of_order():
    buffer = KeyValueBuffer(L)
    BufferedKeyCache(buffer, 0).record(1, torch.zeros(B, H, 1, D), torch.zeros(B, H, 1, D))
    with pytest.raises(ValueError, match="holds 1 positions; the decoder was called at position 3"):
        BufferedKeyCache(buffer, 3)


def _block():
    return make_model(decoder_layers=2).decoder.side.block


def test_cross_keys_are_projected_once_per_sentence_when_the_rows_repeat_per_beam():
    block = _block()
    g = torch.Generator().manual_seed(1)
    enc = torch.randn(2, 6, 64, generator=g).repeat_interleave(3, 0)  # 2 sentences x 3 beams
    pad = torch.zeros(6, 6, dtype=torch.bool)
    pad[3:, :2] = True
    with torch.no_grad():
        cross = CrossKV.project(block, enc, pad, beam_size=3)
        ref_k, ref_v = block.cross_kv(enc[::3])
    assert cross.beams == 3 and torch.equal(cross.k, ref_k) and torch.equal(cross.v, ref_v)
    assert torch.equal(cross.padding, pad[::3])
    k = cross.k
    cross.reorder(torch.tensor([2, 2, 0, 4, 3, 3]))  # within the sentences: nothing moves
    assert cross.k is k
    cross.reorder(torch.tensor([4, 5, 3]))  # the first sentence finished
    assert torch.equal(cross.k, ref_k[1:]) and torch.equal(cross.padding, pad[3:4])


def test_cross_keys_of_rows_that_differ_are_projected_row_by_row():
    """Rows that are not beam copies (a caller other than beam search) keep one row each,
    and a reorder selects rows."""
    block = _block()
    enc = torch.randn(6, 4, 64)
    with torch.no_grad():
        cross = CrossKV.project(block, enc, None, beam_size=3)
        ref_k, _ = block.cross_kv(enc)
    assert cross.beams == 1 and torch.equal(cross.k, ref_k)
    cross.reorder(torch.tensor([5, 0, 0, 1, 2, 3]))
    assert torch.equal(cross.k, ref_k[[5, 0, 0, 1, 2, 3]])


def test_momha_over_shared_keys_equals_momha_over_each_rows_copy():
    """Cross-attention of 2 sentences x 3 beams (different queries, some rows halted) over
    one key row per sentence equals the attention over the keys repeated per row."""
    attn = _block().cross_attn
    g = torch.Generator().manual_seed(2)
    query = torch.randn(6, 1, 64, generator=g)
    active = torch.tensor([[True], [False], [True], [True], [True], [False]])
    k, v = torch.randn(2, attn.num_heads, 7, attn.head_dim, generator=g), torch.randn(2, attn.num_heads, 7, attn.head_dim, generator=g)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, :3] = True
    with torch.no_grad():
        shared = attn(query, k, v, active, pad)
        copied = attn(query, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), active,
                      pad.repeat_interleave(3, 0))
    torch.testing.assert_close(shared, copied, rtol=1e-6, atol=1e-6)


def test_shared_keys_are_refused_for_causal_attention():
    attn = _block().self_attn
    k = torch.randn(1, attn.num_heads, 3, attn.head_dim)
    with pytest.raises(ValueError, match="2 query rows over 1 key rows"):
        attn(torch.randn(2, 1, 64), k, k, torch.ones(2, 1, dtype=torch.bool))


def test_the_decoder_state_reorders_every_part_with_one_order():
    """``DecoderState.reorder``: the buffer, the cross-attention keys/values, both prefix
    sums and a chunked cache each end up as ``index_select`` of what they held (rows
    dropped and repeated); a part that is absent stays absent."""
    g = torch.Generator().manual_seed(1)
    state = DecoderState(L)
    k, v = torch.randn(L, B, H, 1, D, generator=g), torch.randn(L, B, H, 1, D, generator=g)
    for l in range(1, L + 1):
        state.kv.write(l, 0, k[l - 1], v[l - 1])
    cross = [torch.randn(B, H, 6, D, generator=g), torch.randn(B, H, 6, D, generator=g),
             torch.rand(B, 6, generator=g) < 0.3]
    state.cross = CrossKV(*[t.clone() for t in cross], beams=1)
    sums = {l: (torch.randn(B, D, generator=g), torch.rand(B, generator=g)) for l in range(1, L + 1)}
    state.prefix = dict(sums)
    chunk = chunk_cache.start(torch.randn(B, 1, D, generator=g), L, H, D, 4)
    chunk["count"] = torch.arange(B)
    state.chunk = dict(chunk)
    order = torch.tensor([2, 0, 0])
    state.reorder(order)
    for l in range(1, L + 1):
        got_k, got_v = state.kv.read(l, 1)
        assert torch.equal(got_k, k[l - 1][order]) and torch.equal(got_v, v[l - 1][order])
        assert torch.equal(state.prefix[l][0], sums[l][0][order])
        assert torch.equal(state.prefix[l][1], sums[l][1][order])
    for got, want in zip((state.cross.k, state.cross.v, state.cross.padding), cross):
        assert torch.equal(got, want[order])
    assert torch.equal(state.chunk["count"], torch.tensor([2, 0, 0]))
    assert torch.equal(state.chunk["self_k"], chunk["self_k"][:, order])
    assert state.hyper_prefix is None


def test_the_buffer_refuses_two_positions_in_one_call():
    with pytest.raises(ValueError) as err:
        KeyValueBuffer(L).write(1, 0, torch.zeros(B, H, 2, D), torch.zeros(B, H, 2, D))
    assert str(err.value) == "the buffer takes one position per call; got 2"


def test_the_buffer_grows_only_past_its_capacity_and_reorders_into_its_spare():
    """Writes within the capacity keep the buffer (no copy); a reorder of the same row
    count gathers into the spare buffer and the two swap, so two reorders come back to the
    first storage; a reorder that drops rows allocates anew, and its old buffer is no spare."""
    buffer = KeyValueBuffer(L)
    kv = torch.randn(B, H, 1, D)
    BufferedKeyCache(buffer, 0).record(1, kv, kv)
    first = buffer.buf.data_ptr()
    for t in range(1, CAPACITY_STEP):
        BufferedKeyCache(buffer, t).record(1, kv, kv)
        assert buffer.buf.data_ptr() == first
    buffer.reorder(torch.tensor([1, 0, 3, 2]))
    second = buffer.buf.data_ptr()
    assert second != first and buffer.spare.data_ptr() == first
    buffer.reorder(torch.tensor([1, 0, 3, 2]))
    assert buffer.buf.data_ptr() == first and buffer.spare.data_ptr() == second
    k, _ = buffer.read(1, CAPACITY_STEP)
    assert torch.equal(k, kv.expand(B, H, CAPACITY_STEP, D))
    buffer.reorder(torch.tensor([0, 2]))
    assert buffer.buf.data_ptr() not in (first, second) and buffer.spare is None
    assert buffer.buf.shape[3] == 2


def test_cross_keys_of_two_beams_over_an_odd_source_length():
    """Beam size 2 (3 sentences x 2 beams), no padding, 7 source positions (not a multiple
    of the beam size): one key row per sentence; a reorder within the sentences moves
    nothing; when the second sentence finishes, row groups take sentences 0 and 2."""
    block = _block()
    g = torch.Generator().manual_seed(4)
    enc = torch.randn(3, 7, 64, generator=g).repeat_interleave(2, 0)
    with torch.no_grad():
        cross = CrossKV.project(block, enc, None, beam_size=2)
        ref_k, ref_v = block.cross_kv(enc[::2])
    assert cross.beams == 2 and cross.padding is None
    assert torch.equal(cross.k, ref_k) and torch.equal(cross.v, ref_v)
    k = cross.k
    cross.reorder(torch.tensor([1, 1, 2, 3, 5, 4]))
    assert cross.k is k
    cross.reorder(torch.tensor([1, 0, 5, 5]))
    assert torch.equal(cross.k, ref_k[[0, 2]]) and torch.equal(cross.v, ref_v[[0, 2]])


def test_cross_keys_of_rows_that_are_not_a_multiple_of_the_beam_size():
    """5 rows with beam size 3 (not groups of beams): every row is projected."""
    block = _block()
    enc = torch.randn(1, 4, 64).repeat(5, 1, 1)
    with torch.no_grad():
        cross = CrossKV.project(block, enc, None, beam_size=3)
        ref_k, _ = block.cross_kv(enc)
    assert cross.beams == 1 and torch.equal(cross.k, ref_k)


def test_the_decoder_state_reorders_the_hyper_prefix_sums():
    """Hyper-UT's prefix sums (Σ h_{l-1}, count) per step are reordered with the rest."""
    g = torch.Generator().manual_seed(2)
    state = DecoderState(L)
    sums = {l: (torch.randn(B, D, generator=g), torch.rand(B, generator=g)) for l in range(1, L + 1)}
    state.hyper_prefix = dict(sums)
    order = torch.tensor([3, 3, 1])
    state.reorder(order)
    for l in range(1, L + 1):
        assert torch.equal(state.hyper_prefix[l][0], sums[l][0][order])
        assert torch.equal(state.hyper_prefix[l][1], sums[l][1][order])
    assert state.prefix is None
