"""The UT step embedding (``--encoder-step-embedding`` / ``--decoder-step-embedding``):
the interleaved sinusoid against a float64 reference, the changed-rows key/value cache
with the per-step bias against recomputation, a straightforward encoder loop, and
incremental decoding against the full decoder."""
import math

import pytest
import torch

from conftest import make_model, randomise_halting, run_incremental
from sut_fairseq.models.validation import validate_args
from sut_fairseq.modules.recurrence import KeyValueCarry, RecurrenceStep, StepInputs
from sut_fairseq.modules.step_embedding import StepEmbedding, sinusoid
from sut_fairseq.models.standalone import model_args


def reference_sinusoid(t: float, d: int):
    """TE(t) in float64 with Python's math: [2j] = sin(t / 10000^(2j/d)), [2j+1] = cos(...)."""
    out = []
    for i in range(d):
        two_j = i - (i % 2)
        angle = t / 10000 ** (two_j / d)
        out.append(math.sin(angle) if i % 2 == 0 else math.cos(angle))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("d", [1, 7, 8, 64])
def test_timestep_embedding_matches_float64_reference(d):
    emb = StepEmbedding("timestep", d)
    like = torch.zeros((), dtype=torch.float32)
    for t in [0, 1, 2, 3, 6, 12, 100, 1023]:
        ref = reference_sinusoid(t, d)
        torch.testing.assert_close(sinusoid(torch.tensor(t), d), ref, atol=1e-12, rtol=0)
        got = emb.timestep(t, like)
        assert got.dtype == torch.float32 and got.shape == (d,)
        # exact up to the float32 rounding of the float64 value
        torch.testing.assert_close(got.double(), ref, atol=6e-8, rtol=0)


def test_coordinate_positions_count_real_tokens_only():
    """PE(i) with i = 1, 2, ... over the real tokens: left padding does not shift i."""
    emb = StepEmbedding("coordinate", 6)
    pad = 1
    tokens = torch.tensor([[5, 6, 7, 8], [1, 1, 5, 6]])
    pos = emb.positions(tokens, pad, torch.zeros(()))
    for b, t, i in [(0, 0, 1), (0, 3, 4), (1, 2, 1), (1, 3, 2)]:
        torch.testing.assert_close(pos[b, t].double(), reference_sinusoid(i, 6), atol=6e-8, rtol=0)
    assert StepEmbedding("timestep", 6).positions(tokens, pad, torch.zeros(())) is None


@pytest.mark.parametrize("mode", ["timestep", "coordinate"])
@pytest.mark.parametrize("pre_ln", [False, True], ids=["post-LN", "pre-LN"])
def test_cached_kv_with_step_embedding_equals_recomputation(mode, pre_ln):
    """Over a recurrence where rows freeze step by step, the cached keys/values (post-LN:
    kept rows + W TE(l); pre-LN: all rows again) equal self_kv(S + E_l) of every row
    (float64, so that only the arithmetic's association differs)."""
    model = make_model(encoder_normalize_before=pre_ln).double()
    block = model.encoder.side.block
    emb = StepEmbedding(mode, 64)
    g = torch.Generator().manual_seed(0)
    B, T, d = 3, 5, 64
    tokens = torch.randint(4, 40, (B, T), generator=g)
    tokens[0, :2] = 1
    positions = emb.positions(tokens, 1, torch.zeros((), dtype=torch.float64))
    # the key/value source of the side's step over one full forward (the rows of S that did
    # not change keep their keys: KeyValueCarry)
    side_step = RecurrenceStep([block], model.encoder.side.halting, emb, False, False)
    inputs = StepInputs(self_padding_mask=tokens.eq(1), real=tokens.ne(1), coords=positions)
    carry = KeyValueCarry()
    S = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    running = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        for step in range(1, 6):
            te = emb.table(5, S)[step - 1]
            k, v = side_step.source(block, S, None, te, inputs, carry, running)
            base = S if positions is None else S + positions
            ref_k, ref_v = block.self_kv(base + reference_sinusoid(step, d))
            torch.testing.assert_close(k, ref_k, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(v, ref_v, atol=1e-6, rtol=1e-6)
            # the rows that ran this step change; then some rows halt for good
            S = torch.where(running.unsqueeze(-1), torch.randn(B, T, d, generator=g, dtype=torch.float64), S)
            running = running & (torch.rand(B, T, generator=g) > 0.35)
    assert not running.all(), "the test needs frozen rows"


def reference_encoder(model, src):
    """A plain loop for ``--encoder-halting none``: h_0 = scaled embedding (+ positions
    unless coordinate); h_l = Block(h_{l-1} + E_l, keys/values of h_{l-1} + E_l)."""
    enc = model.encoder
    emb = enc.side.step_embedding
    pad = src.eq(enc.padding_idx)
    h = enc.side.embed_scale * enc.side.embed_tokens(src)
    if emb.mode == "timestep":
        h = h + enc.side.embed_positions(src)
    d = h.size(-1)
    index = (torch.cumsum(~pad, 1) * ~pad).tolist()
    for step in range(1, enc.side.num_steps + 1):
        E = torch.stack([torch.stack([
            (reference_sinusoid(step, d) + (reference_sinusoid(i, d) if emb.mode == "coordinate" else 0)).float()
            for i in row]) for row in index])
        k, v = enc.side.block.self_kv(h + E)
        h = enc.side.block(h + E, k, v, ~pad, self_padding_mask=pad)
    return h


@pytest.mark.parametrize("mode", ["timestep", "coordinate"])
@pytest.mark.parametrize("pre_ln", [False, True], ids=["post-LN", "pre-LN"])
def test_encoder_equals_a_plain_loop(mode, pre_ln):
    model = make_model(encoder_step_embedding=mode, encoder_halting="none",
                       encoder_normalize_before=pre_ln)
    g = torch.Generator().manual_seed(2)
    src = torch.randint(4, 40, (3, 6), generator=g)
    src[1, :2] = 1
    with torch.no_grad():
        out = model.encoder(src)["encoder_out"][0].transpose(0, 1)
        if pre_ln:
            ref = model.encoder.side.final_norm(reference_encoder(model, src))
        else:
            ref = reference_encoder(model, src)
    real = src.ne(1)
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)




def reference_decoder(model, prev, enc):
    """A plain loop for ``--decoder-halting none``: h_0 = scaled embedding (+ fairseq's
    positions unless coordinate); h_l = Block(h_{l-1} + E_l, causal keys/values of
    h_{l-1} + E_l, the encoder output) with E_l = TE(l) (+ PE(i), i the 1-based index among
    the real target tokens, for coordinate). Returns the logits (B, T, V)."""
    dec = model.decoder
    emb = dec.side.step_embedding
    pad = prev.eq(dec.padding_idx)
    h = dec.side.embed_scale * dec.side.embed_tokens(prev)
    if emb.mode == "timestep":
        h = h + dec.side.embed_positions(prev)
    d = h.size(-1)
    index = (torch.cumsum(~pad, 1) * ~pad).tolist()
    enc_out = enc["encoder_out"][0].transpose(0, 1)
    cross_k, cross_v = dec.side.block.cross_kv(enc_out)
    for step in range(1, dec.side.num_steps + 1):
        E = torch.stack([torch.stack([
            (reference_sinusoid(step, d) + (reference_sinusoid(i, d) if emb.mode == "coordinate" else 0)).float()
            for i in row]) for row in index])
        k, v = dec.side.block.self_kv(h + E)
        h = dec.side.block(h + E, k, v, ~pad, self_padding_mask=pad, cross_k=cross_k, cross_v=cross_v,
                      cross_padding_mask=enc["encoder_padding_mask"][0])
    if dec.side.final_norm is not None:
        h = dec.side.final_norm(h)
    return dec.output_layer(h)


@pytest.mark.parametrize("mode", ["timestep", "coordinate"])
@pytest.mark.parametrize("pre_ln", [False, True], ids=["post-LN", "pre-LN"])
def test_decoder_equals_a_plain_loop(mode, pre_ln):
    """The decoder's step embedding against an independent loop, teacher-forced and
    incremental (both paths share the decoder's code, so they cannot check each other);
    a left-padded target row shifts fairseq's positions but not the coordinate index."""
    model = make_model(decoder_step_embedding=mode, decoder_halting="none",
                       decoder_normalize_before=pre_ln)
    assert model.encoder.side.step_embedding is None and model.decoder.side.step_embedding.mode == mode
    g = torch.Generator().manual_seed(4)
    src = torch.randint(4, 40, (3, 6), generator=g)
    src[1, :2] = 1
    prev = torch.randint(4, 40, (3, 7), generator=g)
    prev[:, 0] = 2
    prev[2, :3] = 1  # --left-pad-target
    with torch.no_grad():
        enc = model.encoder(src)
        full, _ = model.decoder(prev, enc)
        inc, _, _ = run_incremental(model, enc, prev)
        ref = reference_decoder(model, prev, enc)
    real = prev.ne(1)
    torch.testing.assert_close(full[real], ref[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inc[real], ref[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["timestep", "coordinate"])
@pytest.mark.parametrize("pre_ln", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("threshold", [0.999, 0.3])
def test_incremental_equals_full_with_step_embedding(mode, pre_ln, threshold):
    model = make_model(encoder_step_embedding=mode, halting_threshold=threshold,
                       encoder_layers=4, decoder_layers=4, encoder_normalize_before=pre_ln,
                       decoder_normalize_before=pre_ln)
    randomise_halting(model, seed=3)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 40, (3, 6), generator=g)
    src[1, :2] = 1
    prev = torch.randint(4, 40, (3, 7), generator=g)
    prev[:, 0] = 2
    with torch.no_grad():
        enc = model.encoder(src)
        full, extra = model.decoder(prev, enc)
        inc, steps, _ = run_incremental(model, enc, prev)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    assert torch.equal(steps, extra["halting_decoder"].steps)
    if threshold < 0.999:
        assert (steps > 1).any() and (steps < 4).any(), "the test needs rows frozen at several steps"
        assert (steps.max(0).values < 4).any(), "the test needs whole-batch early exits"
    # after beam reordering: equal to decoding each final history from scratch
    reorder = torch.tensor([2, 0, 0])
    with torch.no_grad():
        inc, _, final_prev = run_incremental(model, enc, prev, reorder=reorder)
        order = torch.arange(3)
        for _ in range(prev.size(1) - 1):
            order = order.index_select(0, reorder)
        full, _ = model.decoder(final_prev, model.encoder.reorder_encoder_out(enc, order))
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def test_step_embedding_reaches_the_output_and_decoder_follows_encoder():
    base = make_model()
    timestep = make_model(encoder_step_embedding="timestep")
    assert timestep.decoder.side.step_embedding.mode == "timestep"
    assert make_model(decoder_step_embedding="coordinate").encoder.side.step_embedding is None
    assert base.encoder.side.step_embedding is None and base.decoder.side.step_embedding is None
    assert [n for n, _ in base.named_parameters()] == [n for n, _ in timestep.named_parameters()]
    src = torch.randint(4, 40, (2, 5))
    prev = torch.randint(4, 40, (2, 4))
    with torch.no_grad():
        assert not torch.allclose(base(src, None, prev)[0], timestep(src, None, prev)[0])


def test_unknown_step_embedding_is_rejected_with_its_value():
    args = model_args("sut_tiny", share_all_embeddings=True)
    args.decoder_step_embedding = "learned"
    with pytest.raises(ValueError, match=r"--decoder-step-embedding='learned' is invalid"):
        validate_args(args)
    with pytest.raises(ValueError, match="'timestep' or 'coordinate'"):
        StepEmbedding("none", 8)
