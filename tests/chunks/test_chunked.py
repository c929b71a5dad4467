"""Chunk-wise recurrence, TLB and GUTLB (docs/chunked.md): causality across chunks, chunks
on real tokens (padding and batch-mates change nothing), one chunk without memory is the
unchunked model, incremental decoding across chunk boundaries with beam reordering,
GUTLB's one decision per chunk and step cap, the memory-reset control, experts, the ACT
loss per chunk, the accounting, MACs, option checks and fairseq-train end to end."""
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import make_model, randomise_halting, run_incremental  # noqa: E402

PAD = 1
# name -> (preset, overrides): a dense TLB, the SUT's experts (E = 4, k = 2) with per-token
# stick-breaking, and a GUTLB (global-mean + transition + gate); encoder chunks of 4,
# decoder chunks of 3, both sides with a memory
CONFIGS = {
    "tlb": ("tlb_flipflop", dict(decoder_layers=2, tlb_encoder_out="both")),
    "sut-experts": ("sut_tiny", dict(halting_threshold=0.6)),
    "gutlb": ("gutlb_flipflop", dict(decoder_layers=3, tlb_encoder_out="both",
                                     halting_threshold=0.8)),
}
CHUNKS = dict(encoder_chunk_size=4, encoder_memory_slots=3, decoder_chunk_size=3,
              decoder_memory_slots=2)


def build(name, seed=0, **overrides):
    arch, options = CONFIGS[name]
    model = make_model(arch, seed=seed, **{**options, **CHUNKS, **overrides})
    randomise_halting(model, seed=seed + 4)
    randomise_memory(model, seed=seed + 5)
    return model


def randomise_memory(model, seed):
    """A non-zero M^0 (it starts at zero), so that reading it is not trivially constant."""
    g = torch.Generator().manual_seed(seed)
    for side in (model.encoder.side, model.decoder.side):
        if side.memory is not None:
            with torch.no_grad():
                side.memory.initial.copy_(torch.randn(side.memory.initial.shape, generator=g))


def tokens(*lengths, seed=0, left=True, start=None):
    """(B, max length) random symbols, padded on the left (fairseq's source default) or
    on the right; ``start`` puts that symbol first (eos starts every decoder input)."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    out = torch.full((len(lengths), T), PAD, dtype=torch.long)
    for row, n in enumerate(lengths):
        seq = torch.randint(4, 40, (n,), generator=g)
        if start is not None:
            seq[0] = start
        if left:
            out[row, T - n:] = seq
        else:
            out[row, :n] = seq
    return out


def token_rows(enc, model):
    """The encoder's token rows (B, S, d) of ``encoder_out`` (the memory rows come last)."""
    out = enc["encoder_out"][0].transpose(0, 1)
    memory = model.encoder.side.memory
    k = memory.slots if memory is not None and model.encoder.tlb_encoder_out == "both" else 0
    return out[:, : out.size(1) - k], out[:, out.size(1) - k:]


# ---- (1) causality across chunks --------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_later_chunk_leaves_earlier_outputs_bit_identical_and_a_chunk_writes_the_next_memory(name):
    model = build(name)
    src = tokens(14, 11)  # row 1 left-padded by 3; chunks of 4 real tokens
    first = {0: 0, 1: 3}  # index of each row's real token 0

    def changed(rank):
        out = src.clone()
        for row, start in first.items():
            out[row, start + rank] = 4 + (out[row, start + rank] - 3) % 36  # another symbol
        return out

    with torch.no_grad():
        base = model.encoder(src)
        later = model.encoder(changed(9))  # chunk 2
        this = model.encoder(changed(5))  # chunk 1
    rows_base, rows_later = token_rows(base, model)[0], token_rows(later, model)[0]
    for row, start in first.items():
        assert torch.equal(rows_base[row, start:start + 8], rows_later[row, start:start + 8])
        assert not torch.equal(rows_base[row, start + 8:start + 12], rows_later[row, start + 8:start + 12])
    M_base, M_later, M_this = (e["halting"][0].memories for e in (base, later, this))
    assert len(M_base) == 4
    for c in range(3):  # M^0..M^2 read chunks 0..2; M^{c+1} depends on chunks <= c only
        assert torch.equal(M_base[c], M_later[c])
    # changing chunk 1 changes M^2 (and what follows), not M^1
    assert torch.equal(M_base[1], M_this[1]) and not torch.equal(M_base[2], M_this[2])


# ---- (2) chunks on real tokens -----------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_example_alone_equals_it_left_and_right_padded_in_a_batch(name):
    model = build(name).double()
    lengths, tgt_lengths = [11, 6, 15], [8, 5, 10]
    with torch.no_grad():
        alone = model.encoder(tokens(11, seed=1))
        alone_tokens, alone_memory = token_rows(alone, model)
        prev_alone = tokens(8, seed=2, start=2)
        dec_alone, _ = model.decoder(prev_alone, alone, features_only=True)
        for left in (True, False):
            src = tokens(*lengths, seed=1, left=left)
            enc = model.encoder(src)
            rows, memory = token_rows(enc, model)
            real = slice(4, 15) if left else slice(0, 11)
            torch.testing.assert_close(rows[0:1, real], alone_tokens, atol=1e-6, rtol=0)
            torch.testing.assert_close(memory[0:1], alone_memory, atol=1e-6, rtol=0)
            assert torch.equal(enc["halting"][0].steps[0:1, real], alone["halting"][0].steps)
            prev = tokens(*tgt_lengths, seed=2, left=left, start=2)
            dec, _ = model.decoder(prev, enc, features_only=True)
            real_t = slice(2, 10) if left else slice(0, 8)
            torch.testing.assert_close(dec[0:1, real_t], dec_alone, atol=1e-6, rtol=0)


# ---- (3) one chunk without memory is the unchunked model --------------------------------

def test_one_chunk_without_memory_is_the_unchunked_model():
    """g >= n with ``--encoder-memory-slots 0 --decoder-memory-slots 0``: the same
    parameters and the same outputs as ``sut_tiny`` (with halting at 0.6): bit for bit in
    the full forward; the incremental decoder (another cache layout) to rounding."""
    def model(**options):
        m = make_model("sut_tiny", halting_threshold=0.6, seed=0, **options)
        randomise_halting(m, seed=4)
        return m

    plain = model()
    chunked = model(encoder_chunk_size=64, decoder_chunk_size=64, encoder_memory_slots=0,
                    decoder_memory_slots=0, tlb_encoder_out="tokens")
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in chunked.named_parameters()]
    for (_, p), (_, q) in zip(plain.named_parameters(), chunked.named_parameters()):
        assert torch.equal(p, q)
    src = tokens(7, 5, 7, seed=3)
    prev = tokens(6, 6, 4, seed=4, left=False, start=2)
    with torch.no_grad():
        outs = []
        for m in (plain, chunked):
            enc = m.encoder(src)
            logits, extra = m.decoder(prev, enc)
            inc, inc_steps, _ = run_incremental(m, enc, prev)
            outs.append((enc, logits, extra, inc, inc_steps))
    (e0, l0, x0, i0, s0), (e1, l1, x1, i1, s1) = outs
    assert torch.equal(e1["encoder_out"][0], e0["encoder_out"][0])  # bit for bit
    assert torch.equal(e1["encoder_padding_mask"][0], e0["encoder_padding_mask"][0])
    assert torch.equal(e1["halting"][0].steps, e0["halting"][0].steps)
    assert torch.equal(l1, l0)
    assert torch.equal(x1["halting_decoder"].steps, x0["halting_decoder"].steps)
    torch.testing.assert_close(i1, i0, atol=1e-5, rtol=1e-5)
    assert torch.equal(s1, s0)
    assert (s0 < 3).any(), "the test needs positions that halt early"


def test_explicit_off_values_give_the_fixture_of_the_model_before_chunks():
    from options_off_reference import FIXTURE, compare, current_name, reference_outputs

    expected = torch.load(FIXTURE, weights_only=True)
    got = reference_outputs(encoder_chunk_size=0, decoder_chunk_size=0, encoder_memory_slots=10,
                            encoder_memory_update_layers=1, encoder_chunk_positions="local",
                            tlb_encoder_out="both")
    assert got["param_names"] == [current_name(n) for n in expected["param_names"]]
    compare(got, expected, ["encoder_out", "encoder_steps", "decoder_logits", "decoder_steps",
                             "incremental_logits", "train_logits"])


# ---- (4) incremental decoding across chunk boundaries -----------------------------------

@pytest.mark.parametrize("name,reset", [("tlb", False), ("sut-experts", False), ("gutlb", False),
                                        ("gutlb", True)])
def test_incremental_equals_teacher_forced_across_chunk_boundaries_with_beam_reordering(name, reset):
    """Targets of 11 and 9 real tokens (the second left-padded) in chunks of 3: boundaries
    after 3, 6 and 9 real tokens; the two beam slots swap their histories before every
    step. The rows' per-row counters (slot in the chunk, most steps in the chunk) differ
    at every step (11 - 9 is not a multiple of 3), so a counter left out of the reorder
    shows."""
    model = build(name, seed=1, tlb_memory_reset=reset)
    src = tokens(9, 7, seed=5)
    prev = tokens(11, 9, seed=6, start=2)
    reorder = torch.tensor([1, 0])
    with torch.no_grad():
        enc = model.encoder(src)
        inc, inc_steps, final_prev = run_incremental(model, enc, prev, reorder=reorder)
        order = torch.arange(2)
        for _ in range(prev.size(1) - 1):
            order = order.index_select(0, reorder)
        full, extra = model.decoder(final_prev, model.encoder.reorder_encoder_out(enc, order))
    real = final_prev.ne(PAD)
    torch.testing.assert_close(inc[real], full[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(inc_steps, extra["halting_decoder"].steps)
    assert extra["halting_decoder"].chunk_real.sum() == 4 + 3
    if name != "tlb":
        assert (inc_steps < model.decoder.side.num_steps).any(), "the test needs early halting"


# ---- (5) GUTLB ----------------------------------------------------------------------------

def _chunk_of_each_token(src, g):
    """For each row, {chunk: [token indices]} of the real tokens."""
    out = []
    for row in src:
        idx = row.ne(PAD).nonzero().squeeze(1).tolist()
        chunks = {}
        for rank, i in enumerate(idx):
            chunks.setdefault(rank // g, []).append(i)
        out.append(chunks)
    return out


def test_gutlb_decides_once_per_chunk_caps_steps_and_follows_the_threshold():
    model = make_model("gutlb_flipflop", encoder_chunk_size=4, encoder_layers=5, seed=0)
    assert model.encoder.side.halting.rule == "global-mean" and model.encoder.side.cap_steps
    src = tokens(9, 6, seed=7)  # chunks of 4, 4, 1 and 4, 2 real tokens
    L = 5
    with torch.no_grad():
        h = model.encoder(src)["halting"][0]
    # at initialisation â = 0.5: c_4 = 0.9375 < 0.999, so only the cap stops a chunk
    for row, chunks in enumerate(_chunk_of_each_token(src, 4)):
        for c, idx in chunks.items():
            assert h.steps[row, idx].tolist() == [min(L, len(idx) + 1)] * len(idx)
            assert h.chunk_steps[row, c] == min(L, len(idx) + 1)

    randomise_halting(model, seed=3)
    steps = {}
    for threshold in (0.999, 0.5):
        model.set_halting_threshold(threshold)
        with torch.no_grad():
            h = model.encoder(src)["halting"][0]
        for row, chunks in enumerate(_chunk_of_each_token(src, 4)):
            for c, idx in chunks.items():  # one decision per (sequence, chunk)
                s, w = h.steps[row, idx], h.weights[row, idx]
                assert (s == s[0]).all() and (w == w[0]).all()
                assert s[0] <= min(L, len(idx) + 1)
        steps[threshold] = h.steps.sum().item()
    assert steps[0.5] < steps[0.999], steps


def test_the_step_cap_applies_to_every_chunked_global_mean_side_and_only_to_those():
    """docs/chunked.md: GUTLB's cap min(L, n_c + 1) applies whenever the rule is
    ``global-mean`` on a chunked side, GUTLB's transition and gate or not (here the SUT's
    experts with plain global-mean), and not to per-token stick-breaking. At α_thresh = 1 no
    position halts by its cumulative probability, so the cap (or L) alone stops it."""
    src = tokens(9, 6, seed=7)  # chunks of 4, 4, 1 and 4, 2 real tokens
    L = 5
    for halting, capped in (("global-mean", True), ("stick-breaking", False)):
        model = make_model("sut_tiny", encoder_halting=halting, encoder_layers=L,
                           encoder_chunk_size=4, encoder_memory_slots=2, halting_threshold=1.0)
        assert not model.encoder.side.block.gate and not getattr(model.encoder.side.halting, "transition", False)
        assert model.encoder.side.cap_steps is capped
        with torch.no_grad():
            h = model.encoder(src)["halting"][0]
        for row, chunks in enumerate(_chunk_of_each_token(src, 4)):
            for c, idx in chunks.items():
                expected = min(L, len(idx) + 1) if capped else L
                assert h.steps[row, idx].tolist() == [expected] * len(idx), (halting, row, c)


# ---- the memory against a per-chunk loop ------------------------------------------------

def _perturb(module, seed, scale=0.3):
    """Every parameter moved by N(0, scale²): LayerNorm gains away from 1 and biases away
    from 0, so that the query's and the memory's LayerNorms differ and every bias counts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _layer_norm(x, norm):
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def reference_memory_attention(attn, x, m):
    """MHA(LN_q(x), LN_kv(m), LN_kv(m)) of one example, head by head: x (T, d) queries,
    m (S, d) the rows read -> (T, d) (no residual)."""
    H, D = attn.num_heads, attn.head_dim
    q = _layer_norm(x, attn.q_norm) @ attn.q_proj.weight.T + attn.q_proj.bias
    mm = _layer_norm(m, attn.kv_norm)
    k = mm @ attn.k_proj.weight.T + attn.k_proj.bias
    v = mm @ attn.v_proj.weight.T + attn.v_proj.bias
    heads = []
    for head in range(H):
        cols = slice(head * D, (head + 1) * D)
        weights = torch.softmax(q[:, cols] @ k[:, cols].T / math.sqrt(D), -1)
        heads.append(weights @ v[:, cols])
    return torch.cat(heads, -1) @ attn.out_proj.weight.T + attn.out_proj.bias


def reference_write(memory, M, rows):
    """M^{c+1} of one example from M^c (k, d) and the chunk's real final rows (n, d): U
    pre-LN blocks, A_u = M_{u-1} + MHA(LN_q(M_{u-1}), LN_s(rows)), M_u = A_u +
    W_2 GELU(W_1 LN(A_u) + b_1) + b_2; no row leaves M^c."""
    if rows.size(0) == 0:
        return M
    for attn, ffn in zip(memory.write_attn, memory.write_ffn):
        A = M + reference_memory_attention(attn, M, rows)
        hidden = F.gelu(_layer_norm(A, ffn.norm) @ ffn.fc1.weight.T + ffn.fc1.bias)
        M = A + hidden @ ffn.fc2.weight.T + ffn.fc2.bias
    return M


def test_memory_write_equals_a_per_example_loop():
    """``ChunkMemory.update`` (k = 3 slots, U = 2 write blocks) against the loop, float64:
    rows of different real counts, one row with none (its memory is kept)."""
    from sut_fairseq.modules.memory import ChunkMemory

    torch.manual_seed(0)
    memory = ChunkMemory(16, 3, 2, num_heads=2, head_dim=4).double().eval()
    _perturb(memory, seed=1)
    g = torch.Generator().manual_seed(2)
    M = torch.randn(3, 3, 16, generator=g, dtype=torch.float64)
    S = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    real = torch.tensor([[True] * 5, [True, False, True, False, False], [False] * 5])
    with torch.no_grad():
        got = memory.update(M, S, real)
        for b in range(3):
            expected = reference_write(memory, M[b], S[b][real[b]])
            torch.testing.assert_close(got[b], expected, atol=1e-10, rtol=1e-10)
    assert torch.equal(got[2], M[2]) and not torch.allclose(got[0], M[0])


def reference_chunked_encoder(model, src):
    """The chunked encoder of a model without halting (S_l = h_l), example by example and
    chunk by chunk: the chunk's real tokens with their slot positions, L steps of
    [self-attention over the chunk (the block's sub-layer), the memory read
    h ← h + MHA(LN_q(h), LN_m(M^c), LN_m(M^c)) (written out), the feed-forward sub-layer],
    then M^{c+1} = ``reference_write``. Returns per example the token rows (n, d) and
    LN_out(M^N) (k, d)."""
    enc = model.encoder
    block, memory, L = enc.side.block, enc.side.memory, enc.side.num_steps
    out = []
    for row in src:
        real_tokens = row[row.ne(PAD)]
        M = memory.initial
        rows = []
        for start in range(0, real_tokens.numel(), enc.side.chunk_size):
            chunk = real_tokens[start:start + enc.side.chunk_size].unsqueeze(0)  # (1, n_c)
            n = chunk.size(1)
            slots = enc.side.embed_positions(torch.full((1, n), 4))  # positions 0 .. n_c-1
            h = enc.side.embed_scale * enc.side.embed_tokens(chunk) + slots
            running = torch.ones(1, n, dtype=torch.bool)
            for _ in range(L):
                k, v = block.self_kv(h)
                a = block._sublayer(h, block.self_attn_norm,
                                    lambda q: block.self_attn(q, k, v, running, None, 0))
                a = a + reference_memory_attention(block.memory_attn, a[0], M)
                h = block._sublayer(a, block.ffd_norm, lambda q: block.ffd(q, running))
            M = reference_write(memory, M, h[0])
            rows.append(h[0] if enc.side.final_norm is None else enc.side.final_norm(h[0]))
        out.append((torch.cat(rows), _layer_norm(M, memory.out_norm)))
    return out


@pytest.mark.parametrize("arch,options", [
    ("tlb_flipflop", {}),  # dense, pre-LN, clipped relative positions
    ("sut_tiny", dict(encoder_halting="none")),  # the SUT's experts, post-LN
], ids=["tlb", "sut-experts"])
def test_memory_read_and_write_in_the_encoder_equal_a_per_chunk_loop(arch, options):
    """Token rows and LN_out(M^N) of a chunked encoder with a memory (chunks of 4, k = 3,
    U = 2) against ``reference_chunked_encoder``, float64, every memory parameter and
    LayerNorm perturbed: a write block without its residual, or the memory keys/values
    normalised by the query's LayerNorm, change the result."""
    model = make_model(arch, encoder_chunk_size=4, encoder_memory_slots=3,
                       encoder_memory_update_layers=2, encoder_layers=2, tlb_encoder_out="both",
                       **options).double()
    _perturb(model.encoder.side.memory, seed=3)
    _perturb(model.encoder.side.block.memory_attn, seed=4)
    src = tokens(11, 6, seed=9)  # chunks of 4, 4, 3 and 4, 2 real tokens
    with torch.no_grad():
        enc = model.encoder(src)
        token_out, memory_out = token_rows(enc, model)
        expected = reference_chunked_encoder(model, src)
    for b, (rows, M) in enumerate(expected):
        real = src[b].ne(PAD)
        torch.testing.assert_close(token_out[b][real], rows, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(memory_out[b], M, atol=1e-9, rtol=1e-9)


# ---- the memory-reset control -----------------------------------------------------------

def test_memory_reset_makes_every_chunk_read_the_initial_memory():
    src = tokens(14, 9, seed=8)
    outs = {}
    for reset in (False, True):
        model = build("tlb", tlb_memory_reset=reset)
        assert model.encoder.side.memory_reset is reset
        with torch.no_grad():
            outs[reset] = model.encoder(src)
    M0 = model.encoder.side.memory.begin(src.unsqueeze(-1).float())
    read = outs[True]["halting"][0].memories
    assert len(read) == 4 and all(torch.equal(M, M0) for M in read)
    assert not torch.equal(outs[False]["halting"][0].memories[2], M0)
    # chunk 0 reads M^0 either way; later chunks see a different memory
    (a, _), (b, _) = token_rows(outs[False], model), token_rows(outs[True], model)
    assert torch.equal(a[0, :4], b[0, :4]) and not torch.allclose(a[0, 4:8], b[0, 4:8])
    # the final memory still reads the last chunk: written from M^0
    final = outs[True]["halting"][0].final_memory
    assert final is not None and not torch.equal(final, M0)


def test_memory_reset_is_refused_in_training_mode():
    """A test-time control: a training step with it would train a model whose chunks
    pass nothing on, so the first training forward stops, naming the option."""
    model = build("tlb", tlb_memory_reset=True).train()
    with pytest.raises(ValueError, match=r"--tlb-memory-reset is a test-time control and the "
                                         r"model is in training mode"):
        model(tokens(9, 5, seed=8), None, tokens(4, 4, seed=9, start=2))
    model.eval()
    with torch.no_grad():
        model(tokens(9, 5, seed=8), None, tokens(4, 4, seed=9, start=2))


# ---- experts, gradients, the ACT loss per chunk ------------------------------------------

def _criterion(model, act_weight=0.1, mim_weight=0.01):
    from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
        SUTLabelSmoothedCrossEntropyCriterion,
    )

    return SUTLabelSmoothedCrossEntropyCriterion(
        SimpleNamespace(target_dictionary=model.decoder.dictionary), False, 0.1,
        mim_weight=mim_weight, act_weight=act_weight)


def _sample(src, prev):
    target = torch.cat([prev[:, 1:], torch.full((prev.size(0), 1), 2)], 1)
    target[prev.eq(PAD)] = PAD
    return {"net_input": {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1),
                          "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(PAD).sum())}


def test_experts_train_with_chunks_on_both_sides():
    model = build("sut-experts", dropout=0.1)
    assert model.encoder.side.block.self_attn.router.top_k == 2 and model.encoder.side.block.ffd.router.num_experts == 4
    sample = _sample(tokens(13, 9, seed=9), tokens(8, 8, seed=10, left=False, start=2))
    model.train()
    loss, _, log = _criterion(model)(model, sample)
    loss.backward()
    params = dict(model.named_parameters())
    for name in ("encoder.side.memory.initial", "encoder.side.memory.write_attn.0.q_proj.weight",
                 "encoder.side.memory.write_ffn.0.fc1.weight", "encoder.side.block.memory_attn.k_proj.weight",
                 "encoder.side.block.ffd.up.weight", "encoder.side.block.self_attn.q_proj.weight",
                 "decoder.side.memory.initial", "decoder.side.memory.write_attn.0.v_proj.weight",
                 "decoder.side.block.memory_attn.out_proj.weight", "decoder.side.block.cross_attn.q_proj.weight"):
        grad = params[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert log["mim"] != 0 and log["chunks_enc"] == 4 + 3 and log["chunks_dec"] == 3 + 3


def test_act_loss_per_chunk_equals_a_loop_over_chunks():
    model = build("gutlb", halting_threshold=0.7)
    src = tokens(14, 9, seed=11)
    prev = tokens(7, 5, seed=12, left=False, start=2)
    with torch.no_grad():
        h = model.encoder(src)["halting"][0]
    depths = []
    L = h.max_steps
    for row, chunks in enumerate(_chunk_of_each_token(src, 4)):
        for idx in chunks.values():
            per_token = [sum(l * h.weights[row, i, l - 1].item() for l in range(1, L + 1)) for i in idx]
            depths.append(sum(per_token) / len(per_token))
    expected = sum(depths) / len(depths)
    assert len(depths) == 4 + 3 and h.act_units() == 7
    assert h.act_loss().item() == pytest.approx(expected, rel=1e-6)
    assert len(set(h.steps[h.real].tolist())) > 1, "the test needs chunks of different depths"
    model.train()
    _, _, log = _criterion(model)(model, _sample(src, prev))
    assert log["act_units_enc"] == 7 and log["act_units_dec"] == 3 + 2
    assert log["act_enc"] / log["act_units_enc"] >= 1.0


def test_generate_summary_reports_steps_per_position_and_per_chunk():
    from sut_fairseq.modules.accounting import StepMeter

    model = build("gutlb")
    src = tokens(14, 9, seed=13)
    prev = tokens(7, 7, seed=14, start=2)
    with torch.no_grad():
        full = model.decoder(prev, model.encoder(src))[1]["halting_decoder"]
        model.step_meter.reset()
        enc = model.encoder(src)
        run_incremental(model, enc, prev)
    h = enc["halting"][0]
    meter: StepMeter = model.step_meter
    assert meter.chunks["enc"] == 7 and meter.chunk_steps["enc"] == int(h.chunk_steps.sum())
    # decoded one token at a time, the decoder's chunks and block applications per chunk
    # add up to those of the teacher-forced forward (7 positions in chunks of 3, per row)
    assert meter.chunks["dec"] == 2 * 3 == int(full.chunk_real.sum())
    assert meter.chunk_steps["dec"] == int(full.chunk_steps.sum())
    assert meter.executed["dec"] == int(full.steps.sum())
    assert len(set(full.chunk_steps.flatten().tolist())) > 1, "the test needs varied chunk depths"
    summary = meter.summary()
    per_position = h.steps.sum().item() / 23
    per_chunk = h.chunk_steps.sum().item() / 7
    assert f"{per_position:.2f} steps per position, {per_chunk:.2f} per chunk over 7 chunks" in summary
    assert "decoder steps executed" in summary and "over 6 chunks" in summary


# ---- MACs ---------------------------------------------------------------------------------

def test_macs_of_a_small_chunked_model_match_a_hand_count():
    from sut_fairseq.analysis.macs import count_call

    d, H, D, L, k_enc, k_dec, U_enc, U_dec = 16, 2, 4, 2, 2, 2, 2, 1
    HD = H * D
    model = make_model("tlb_flipflop", encoder_embed_dim=16, decoder_embed_dim=16, att_heads=H,
                       att_head_dim=D, ffd_hidden_dim=8, encoder_layers=L, decoder_layers=L,
                       rel_pos="none", encoder_chunk_size=4, encoder_memory_slots=k_enc,
                       encoder_memory_update_layers=U_enc, decoder_chunk_size=3,
                       decoder_memory_slots=k_dec, decoder_memory_update_layers=U_dec,
                       tlb_encoder_out="both")
    src = torch.randint(4, 40, (1, 10))  # chunks of 4, 4, 2 real tokens (width w = 4)
    prev = torch.randint(4, 40, (1, 5))  # chunks of 3, 2 (w = 3)

    def attention(q_rows, kv_rows, S_keys):  # LN_q + q + core + out; LN_kv + k, v
        return (q_rows * (d + d * HD + HD + H * (S_keys * D + S_keys + S_keys * D) + HD * d + d)
                + kv_rows * (d + 2 * (d * HD + HD)))

    def read(w, k):  # one chunk: L steps over all w rows; keys/values of M once
        return L * attention(w, 0, k) + attention(0, k, k)

    def write(w, k, U):  # U blocks: k slots read the chunk's w rows, then the FFN
        return U * (attention(k, w, w) + k * (d + 2 * (d * d + d)))

    def core(real, S_keys):
        return real * H * (S_keys * D + S_keys + S_keys * D)

    enc = count_call(model, lambda: model.encoder(src))
    assert enc.parts["memory"] == 3 * read(4, k_enc) + 3 * write(4, k_enc, U_enc)  # M^3 too
    assert enc.parts["att_core"] == L * (core(4, 4) + core(4, 4) + core(2, 4))
    with torch.no_grad():
        enc_out = model.encoder(src)
    dec = count_call(model, lambda: model.decoder(prev, enc_out))
    assert dec.parts["memory"] == 2 * read(3, k_dec) + write(3, k_dec, U_dec)  # no M^2
    S_enc = 10 + k_enc  # cross-attention over [tokens; LN(M^3)]
    assert dec.parts["att_core"] == L * (core(3, 3) + core(2, 3) + core(5, S_enc))


# ---- option checks ----------------------------------------------------------------------

_NO_MEMORY = ("--tlb-encoder-out='both' is invalid: 'both' needs --encoder-memory-slots > 0 "
              "(--encoder-chunk-size 4 with --encoder-memory-slots 0 has no memory: the decoder "
              "would read the tokens only; say --tlb-encoder-out tokens)")


@pytest.mark.parametrize("options,message", [
    (dict(encoder_chunk_size=-1), "--encoder-chunk-size=-1 is invalid: must be an integer >= 0 (0 = off)"),
    (dict(decoder_memory_slots=-2),
     "--decoder-memory-slots=-2 is invalid: must be an integer >= 0 (0 = no memory: the chunks are independent)"),
    (dict(encoder_chunk_size=4, encoder_memory_update_layers=0),
     "--encoder-memory-update-layers=0 is invalid: must be a positive integer"),
    (dict(tlb_encoder_out="memory"),
     "--tlb-encoder-out='memory' is invalid: 'memory' needs --encoder-chunk-size > 0 (without chunks "
     "there is no memory)"),
    (dict(encoder_chunk_size=4, encoder_memory_slots=0, tlb_encoder_out="memory"),
     "--tlb-encoder-out='memory' is invalid: 'memory' needs --encoder-memory-slots > 0"),
    (dict(decoder_chunk_size=4, decoder_halting="pabee"),
     "--decoder-halting='pabee' is invalid: --decoder-chunk-size 4 supports ('stick-breaking', "
     "'global-mean', 'act', 'none') (no early exits)"),
    (dict(encoder_chunk_size=4, encoder_step_embedding="timestep"),
     "--encoder-step-embedding='timestep' is invalid: --encoder-chunk-size 4 supports only 'none'"),
    (dict(decoder_chunk_size=3, decoder_step_embedding="coordinate"),
     "--decoder-step-embedding='coordinate' is invalid: --decoder-chunk-size 3 supports only 'none'"),
    (dict(encoder_chunk_size=4, hyper_modules=2, att_experts=1, att_topk=1, ffd_experts=1,
          ffd_topk=1, rel_pos="none"),
     "--hyper-modules=2 is invalid: --encoder-chunk-size 4 supports only 0 (no hyper-modules)"),
    (dict(tlb_memory_reset=True),
     "--tlb-memory-reset=True is invalid: needs a side with a memory (--encoder-chunk-size or "
     "--decoder-chunk-size > 0 and memory slots > 0)"),
    (dict(encoder_chunk_size=4, encoder_memory_slots=0, tlb_encoder_out="tokens", tlb_memory_reset=True),
     "--tlb-memory-reset=True is invalid: needs a side with a memory (--encoder-chunk-size or "
     "--decoder-chunk-size > 0 and memory slots > 0)"),
    (dict(encoder_chunk_size=4, encoder_memory_slots=0), _NO_MEMORY),  # 'both': sut_tiny's default
    (dict(encoder_chunk_size=4, encoder_memory_slots=0, tlb_encoder_out="both"), _NO_MEMORY),
    (dict(encoder_chunk_size=1, encoder_memory_slots=0), _NO_MEMORY.replace("chunk-size 4", "chunk-size 1")),
    (dict(tlb_unshared=True),
     "--tlb-unshared=True is invalid: needs --encoder-chunk-size > 0: it gives each step of the "
     "chunked encoder its own block (TLB); without chunks the encoder is a Universal Transformer, "
     "one block shared by its steps"),
])
def test_invalid_chunk_options_are_refused_with_the_option_and_what_is_allowed(options, message):
    with pytest.raises(ValueError) as err:
        make_model("sut_tiny", **options)
    assert str(err.value) == message


def test_presets():
    from sut_fairseq.models.architectures import PRESETS
    from sut_fairseq.models.standalone import model_args

    for arch, L, halting in (("tlb_logic", 2, "none"), ("gutlb_logic", 5, "global-mean"),
                             ("tlb_flipflop", 2, "none"), ("gutlb_flipflop", 4, "global-mean")):
        a = model_args(arch, share_all_embeddings=True)
        PRESETS[arch](a)
        assert (a.att_experts, a.att_topk, a.ffd_experts, a.ffd_topk) == (1, 1, 1, 1)
        assert (a.encoder_layers, a.encoder_halting) == (L, halting)
        assert a.halting_transition == a.gated_ffn == (halting == "global-mean")
        assert a.encoder_normalize_before and a.decoder_chunk_size == 0
        if "logic" in arch:
            assert (a.encoder_embed_dim, a.encoder_chunk_size, a.encoder_memory_slots,
                    a.encoder_memory_update_layers, a.decoder_layers) == (128, 10, 10, 1, L)
            assert a.tlb_encoder_out == "both"
        else:
            assert (a.encoder_embed_dim, a.encoder_chunk_size, a.encoder_memory_slots,
                    a.decoder_layers, a.tlb_encoder_out) == (64, 8, 4, 1, "memory")


# ---- fairseq-train end to end ------------------------------------------------------------

def _flipflop_lines(n, length, seed):
    """Flip-flop strings (w b: write bit b, i b: ignore, r: read) ending with a read; the
    target is the last written bit."""
    import random

    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words, last = ["w", str(rng.randint(0, 1))], None
        last = words[1]
        while len(words) < length - 1:
            op = rng.choice(["w", "i", "i", "i"])
            bit = str(rng.randint(0, 1))
            words += [op, bit]
            last = bit if op == "w" else last
        src.append(" ".join(words + ["r"]))
        tgt.append(last)
    return src, tgt


def test_tlb_flipflop_trains_end_to_end(tmp_path):
    from sut_fairseq.demo import fairseq_tool, generate_command, train_command

    prefixes = {}
    for split, n in (("train", 200), ("valid", 20)):
        src, tgt = _flipflop_lines(n, 21, seed=len(split))
        prefix = str(tmp_path / split)
        for lang, lines in (("src", src), ("tgt", tgt)):
            with open(f"{prefix}.{lang}", "w") as f:
                f.write("\n".join(lines) + "\n")
        prefixes[split] = prefix
    data_bin = str(tmp_path / "bin")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(command):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    run([fairseq_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", prefixes["train"], "--validpref", prefixes["valid"], "--destdir", data_bin,
         "--joined-dictionary", "--workers", "1"])
    log = run(train_command(data_bin, str(tmp_path / "ckpt"), 3, seed=1, arch="tlb_flipflop",
                            extra=["--log-interval", "1", "--mim-weight", "0", "--act-weight", "0.1",
                                   "--max-tokens", "512"]))
    inner = [line for line in log.splitlines() if "train_inner" in line]
    assert len(inner) == 3, log[-2000:]
    for line in inner:  # TLB: every chunk runs L = 2 steps; ACT = 2 per chunk
        assert re.search(r"\bchunk_steps_enc=2\b", line) and re.search(r"\bact_enc=2\b", line), line
    valid = [line for line in log.splitlines() if "valid on 'valid' subset" in line]
    assert valid and "| chunk_steps_enc 2 |" in valid[-1], log[-2000:]
    ckpt = str(tmp_path / "ckpt" / "checkpoint_last.pt")
    out = run(generate_command(data_bin, ckpt, subset="valid"))
    assert out.count("\nH-") == 20
    # 20 sources of 21 tokens + eos: 3 chunks of 8 each, 2 steps per position and chunk
    assert ("encoder steps executed 100.0% (880/880; 1760 expert rows; 2.00 steps per "
            "position, 2.00 per chunk over 60 chunks)") in out, out[-1000:]

    from fairseq import checkpoint_utils

    models, _ = checkpoint_utils.load_model_ensemble([ckpt], arg_overrides={"tlb_memory_reset": True})
    assert models[0].encoder.side.memory_reset is True


def test_chunked_scaling_benchmark_prints_the_table_and_both_ratios():
    import sut_fairseq

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    # the benchmark imports the sut_fairseq this test imports (under mutmut: the work
    # directory's mutated copy), not the checkout the editable install points at, which
    # may be another tree, or one being edited
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(sut_fairseq.__file__)))
    pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "chunked_scaling.py"),
                          "--lengths", "32", "64", "--repeats", "1", "--chunk", "16"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath))
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"^ +64 +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", out.stdout, re.M), out.stdout
    assert re.search(r"^UT per-token\(64\)/per-token\(32\): \d+\.\d\d$", out.stdout, re.M), out.stdout
    assert re.search(r"^TLB per-token\(64\)/per-token\(32\): \d+\.\d\d \(goal <= 1\.5\)$",
                     out.stdout, re.M), out.stdout
