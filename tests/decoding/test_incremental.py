"""Incremental decoding equals the full teacher-forced decoder, with halting on and a
threshold low enough that positions halt at different steps (early exits included),
and stays equal after beam reordering."""
import pytest
import torch

from conftest import decoder_case, make_model, run_incremental


@pytest.mark.parametrize("threshold", [0.999, 0.6, 0.3])
def test_incremental_equals_full_forward(threshold):
    model, src, prev = decoder_case(threshold)
    with torch.no_grad():
        enc = model.encoder(src)
        full, extra = model.decoder(prev, enc)
        inc, steps, _ = run_incremental(model, enc, prev)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    assert torch.equal(steps, extra["halting_decoder"].steps)
    if threshold < 0.999:
        assert (steps < 4).any(), "the test needs positions that halt early"
    if threshold == 0.3:
        assert (steps.max(0).values < 4).any(), "the test needs whole-batch early exits"


@pytest.mark.parametrize("rule", ["stick-breaking", "global-mean", "act"])
def test_incremental_equals_full_forward_after_beam_reordering(rule):
    """Every cache follows the beams: the keys/values per step and, under global-mean
    halting, the causal prefix sums of the states its decisions read."""
    overrides = {} if rule == "stick-breaking" else {"decoder_halting": rule}
    model, src, prev = decoder_case(0.6, seed=1, **overrides)
    reorder = torch.tensor([2, 0, 0])
    with torch.no_grad():
        enc = model.encoder(src)
        inc, _, final_prev = run_incremental(model, enc, prev, reorder=reorder)
        # reference: the sequences that end up in each beam slot, decoded from scratch
        # (each slot's history follows the reorderings: composed index map)
        order = torch.arange(3)
        for _ in range(prev.size(1) - 1):
            order = order.index_select(0, reorder)
        enc_ref = model.encoder.reorder_encoder_out(enc, order)
        full, _ = model.decoder(final_prev, enc_ref)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def _padded(prev, pads: int, left: bool):
    """prev (B, T) with ``pads`` padding tokens (index 1) on the left or on the right."""
    pad = torch.full((prev.size(0), pads), 1, dtype=prev.dtype)
    return torch.cat([pad, prev], 1) if left else torch.cat([prev, pad], 1)


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
def test_padded_targets_decode_as_the_unpadded_sequence(left):
    """A target with padding (left: --left-pad-target; right: the default) gives, at its
    real positions, the decoder features of the same target alone: padding keys are
    masked in self-attention, in the full and in the incremental decoder."""
    model, src, prev = decoder_case(0.6)
    src, prev = src[2:3], prev[2:3]  # one sequence: nothing else sets its length
    padded = _padded(prev, 2, left)
    real = slice(2, None) if left else slice(0, prev.size(1))
    with torch.no_grad():
        enc = model.encoder(src)
        alone, _ = model.decoder(prev, enc, features_only=True)
        full, _ = model.decoder(padded, enc, features_only=True)
        torch.testing.assert_close(full[:, real], alone, atol=1e-5, rtol=1e-5)
        state, outs = {}, []
        for t in range(padded.size(1)):
            out, _ = model.decoder(padded[:, : t + 1], enc, incremental_state=state,
                                   features_only=True)
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, 1)[:, real], alone, atol=1e-5, rtol=1e-5)


def test_left_padded_batch_matches_each_sequence_alone():
    """A left-padded batch of targets of different lengths: every row's real positions
    equal that row decoded alone (with the halting state, which reads the features)."""
    model, src, prev = decoder_case(0.6, seed=2)
    lengths = [7, 4, 5]
    batch = prev.clone()
    for row, n in enumerate(lengths):
        batch[row] = torch.cat([torch.ones(7 - n, dtype=prev.dtype), prev[row, :n]])
    with torch.no_grad():
        enc = model.encoder(src)
        out, extra = model.decoder(batch, enc, features_only=True)
        for row, n in enumerate(lengths):
            enc_row = model.encoder.reorder_encoder_out(enc, torch.tensor([row]))
            alone, extra_alone = model.decoder(prev[row:row + 1, :n], enc_row, features_only=True)
            torch.testing.assert_close(out[row:row + 1, 7 - n:], alone, atol=1e-5, rtol=1e-5)
            assert torch.equal(extra["halting_decoder"].steps[row, 7 - n:],
                               extra_alone["halting_decoder"].steps[0])


@pytest.mark.parametrize("chunked", [False, True])
def test_the_encoder_out_keeps_the_source_lengths_and_reorders_every_entry(chunked):
    """``encoder_out["src_lengths"]`` is the lengths given, and ``reorder_encoder_out``
    reorders them with the rows (B along dim 1 of the outputs, dim 0 of the mask and the
    lengths), keeping the halting results; the chunk-wise encoder (memory slots, the
    default ``both``) too."""
    overrides = dict(encoder_chunk_size=2, encoder_memory_slots=2) if chunked else {}
    model = make_model(**overrides)
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1], [5, 2, 1, 1]])
    lengths = src.ne(1).sum(1)
    with torch.no_grad():
        out = model.encoder(src, src_lengths=lengths)
    assert len(out["src_lengths"]) == 1 and torch.equal(out["src_lengths"][0], lengths)
    order = torch.tensor([2, 0, 0, 1])
    moved = model.encoder.reorder_encoder_out(out, order)
    assert torch.equal(moved["src_lengths"][0], lengths[order])
    assert torch.equal(moved["encoder_out"][0], out["encoder_out"][0][:, order])
    assert torch.equal(moved["encoder_padding_mask"][0], out["encoder_padding_mask"][0][order])
    assert moved["halting"] is out["halting"]


@pytest.mark.parametrize("mode,rows", [("tokens", 4), ("memory", 2), ("both", 6)])
def test_the_chunked_encoder_out_holds_what_tlb_encoder_out_names(mode, rows):
    """``--tlb-encoder-out``: the chunk outputs (S = 4 rows, their padding), the memory's
    2 slots (never padding), or both, on the key axis."""
    model = make_model(encoder_chunk_size=2, encoder_memory_slots=2, tlb_encoder_out=mode)
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1]])
    with torch.no_grad():
        out = model.encoder(src, src_lengths=src.ne(1).sum(1))
    assert out["encoder_out"][0].shape[:2] == (rows, 2)
    mask = out["encoder_padding_mask"][0]
    token_mask = src.eq(1)
    want = {"tokens": token_mask, "memory": torch.zeros(2, 2, dtype=torch.bool),
            "both": torch.cat([token_mask, torch.zeros(2, 2, dtype=torch.bool)], 1)}[mode]
    assert torch.equal(mask, want)


@pytest.mark.parametrize("overrides", [{}, dict(decoder_chunk_size=2, decoder_memory_slots=2),
                                       dict(decoder_chunk_size=2, decoder_memory_slots=2,
                                            decoder_chunk_positions="global")],
                         ids=["plain", "chunked", "chunked-global-positions"])
def test_incremental_decoding_projects_the_encoder_keys_once(overrides, monkeypatch):
    """Incremental steps read the encoder's cross-attention keys and values from the decoder
    state: projected at the first position only, by the plain decoder and the chunk-wise
    one (its positions within each chunk or along the sentence); the logits equal the
    full forward's."""
    model = make_model(**overrides)
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1]])
    prev = torch.tensor([[2, 5, 9, 6, 7], [2, 8, 8, 5, 1]])
    block = model.decoder.side.block
    calls, cross_kv = [], block.cross_kv
    monkeypatch.setattr(block, "cross_kv", lambda enc: calls.append(1) or cross_kv(enc))
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src.ne(1).sum(1))
        full, _ = model.decoder(prev, encoder_out)
        calls.clear()
        state = {}
        steps = [model.decoder(prev[:, :t], encoder_out, incremental_state=state)[0] for t in range(1, 6)]
    assert len(calls) == 1
    got = torch.cat(steps, 1)
    torch.testing.assert_close(got[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, :4], full[1, :4], atol=1e-5, rtol=1e-5)  # its last is padding


def test_the_decoder_extra_follows_fairseq_and_reads_the_encoder_halting_when_there():
    """The decoder's extra output: ``attn`` [None] (no alignment), ``inner_states`` [S_L as
    (T, B, d)], both sides' halting results; an encoder output without ``halting`` (another
    encoder's) gives ``halting_encoder`` None."""
    model = make_model()
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1]])
    prev = torch.tensor([[2, 5, 9], [2, 8, 8]])
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src.ne(1).sum(1))
        features, extra = model.decoder(prev, encoder_out, features_only=True)
        _, bare = model.decoder(prev, {k: v for k, v in encoder_out.items() if k != "halting"}, features_only=True)
    assert extra["attn"] == [None]
    assert len(extra["inner_states"]) == 1 and torch.equal(extra["inner_states"][0], features.transpose(0, 1))
    assert extra["halting_encoder"] is encoder_out["halting"][0] and extra["halting_decoder"] is not None
    assert bare["halting_encoder"] is None


def test_under_beam_search_the_encoder_keys_are_kept_once_per_sentence():
    """``set_beam_size(2)`` (as fairseq's generator calls it): the incremental decoder keeps
    the cross-attention keys of each of the 2 sentences once, not once per beam row, and
    its first step equals the step without beam sharing."""
    model = make_model()
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1]]).repeat_interleave(2, 0)   # 2 sentences x 2 beams
    prev = torch.full((4, 1), 2)
    outs = []
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src.ne(1).sum(1))
        for beam in (1, 2):
            model.decoder.set_beam_size(beam)
            state = {}
            outs.append(model.decoder(prev, encoder_out, incremental_state=state)[0])
            kept = model.decoder.decoder_state(state).cross.k.size(0)
            assert kept == 4 // beam
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
