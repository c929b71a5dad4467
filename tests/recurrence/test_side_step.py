"""A side's eager step (``modules/side_step.py``): its variants are objects chosen when
the model is built, one step object serves every forward, halted rows are not projected
again in a full forward (counted against the halting rule's own decisions), the
incremental cache puts the earlier positions' keys first, and the early-exit hook fills
the skipped steps with the keys/values of the frozen state (against an independent
projection of ``S + E_l``)."""
import pytest
import torch

from conftest import make_model, randomise_halting, run_incremental
from sut_fairseq.modules.side_step import (
    ExampleMixture,
    HyperKV,
    NoMixture,
    PlainQuery,
    PrefixMixture,
    SideStep,
    StateKV,
    StepKeyCache,
)
from sut_fairseq.modules.step_embedding import SteppedKV, SteppedPreNormKV, SteppedQuery, sinusoid
from sut_fairseq.modules.sut_block import EveryRowKV, HaltedStateKV

HYPER = dict(encoder_embed_dim=32, decoder_embed_dim=32, att_heads=2, att_head_dim=8,
             ffd_hidden_dim=48, encoder_layers=3, decoder_layers=3, hyper_modules=4,
             hyper_embed_dim=6, hyper_key_dim=12)

# name -> (preset, options, encoder (source, query, mixture), decoder (source, query, mixture))
VARIANTS = {
    "plain": ("sut_tiny", {}, (StateKV, PlainQuery, NoMixture), (StateKV, PlainQuery, NoMixture)),
    "step-embedding": ("sut_tiny", dict(encoder_step_embedding="timestep",
                                        decoder_step_embedding="coordinate",
                                        decoder_normalize_before=True),
                       (SteppedKV, SteppedQuery, NoMixture),
                       (SteppedPreNormKV, SteppedQuery, NoMixture)),
    "hyper-qkv": ("hyper_ut_cpvr", dict(HYPER, hyper_components="qkv,out,ffn"),
                  (HyperKV, PlainQuery, ExampleMixture), (HyperKV, PlainQuery, PrefixMixture)),
    "hyper-ffn": ("hyper_ut_cpvr", dict(HYPER, hyper_components="ffn"),
                  (StateKV, PlainQuery, ExampleMixture), (StateKV, PlainQuery, PrefixMixture)),
    "chunked": ("sut_tiny", dict(encoder_chunk_size=3, encoder_memory_slots=2,
                                 decoder_chunk_size=2, decoder_memory_slots=2),
                (StateKV, PlainQuery, NoMixture), (StateKV, PlainQuery, NoMixture)),
}


def batch(seed=0, B=3, S=7, T=6):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    src[0, :2] = 1  # left padding
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    prev[1, T - 2:] = 1  # right padding
    return src, prev


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_variants_are_objects_chosen_at_build_time(name):
    """Each side's step is built once with the model, from the objects its options call
    for, and every forward (full or incremental) runs that same object."""
    arch, options, enc_parts, dec_parts = VARIANTS[name]
    model = make_model(arch, **options)
    steps = []
    for side, parts in ((model.encoder, enc_parts), (model.decoder, dec_parts)):
        assert isinstance(side.step, SideStep) and side.step.block is side.block
        assert tuple(type(p) for p in (side.step.source, side.step.query, side.step.mixture)) == parts
        steps.append(side.step)
    src, prev = batch()
    with torch.no_grad():
        enc = model.encoder(src)
        model.decoder(prev, enc)
        run_incremental(model, enc, prev)
    assert model.encoder.step is steps[0] and model.decoder.step is steps[1]


def test_the_compiled_step_builds_its_queries_with_the_eager_query_object():
    model = make_model(compile_step=True, encoder_step_embedding="coordinate",
                       decoder_step_embedding="none")
    for side in (model.encoder, model.decoder):
        assert type(side.compiled_step.step.query) is type(side.step.query)
    h, te = torch.randn(2, 3, 64), torch.randn(64)
    coords = torch.randn(2, 3, 64)
    query = model.encoder.compiled_step.step.query
    assert torch.equal(query.apply(h, te, coords), (h + coords) + te)
    assert model.decoder.compiled_step.step.query.apply(h, None, None) is h


def test_a_full_forward_projects_only_the_rows_whose_state_changed():
    """Keys/values: every row at step 1, then exactly the rows that ran the step before
    (the halting rule's own decisions, recorded independently of the step)."""
    model = make_model(halting_threshold=0.6, encoder_layers=4)
    randomise_halting(model)
    enc = model.encoder
    projected, decided = [], []
    self_kv, decide = enc.block.self_kv, enc.halting.decide

    def counting_kv(S, *z):
        projected.append(S.shape[0] * S.shape[1])
        return self_kv(S, *z)

    def recording_decide(h, running, state, step):
        out = decide(h, running, state, step)
        decided.append(out)
        return out

    enc.block.self_kv, enc.halting.decide = counting_kv, recording_decide
    src, _ = batch()
    with torch.no_grad():
        out = enc(src)
    real = src.ne(1)
    running = [real] + [r for r in decided if bool(r.any())]  # the masks of the executed steps
    assert len(projected) == len(running) > 2
    expected = [real.numel()] + [int(r.sum()) for r in running[:-1]]
    assert projected == expected
    steps = out["halting"][0].steps
    assert int(steps.max()) == len(running) and bool((steps[real] < len(running)).any())


def test_the_key_cache_puts_the_earlier_positions_first_and_records_the_new():
    L, B, H, t, D = 3, 2, 2, 4, 5
    past_k, past_v = torch.randn(L, B, H, t, D), torch.randn(L, B, H, t, D)
    cache = StepKeyCache(L, past_k, past_v)
    k, v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    got_k, got_v = cache.extend(2, k, v)
    assert torch.equal(got_k[:, :, :t], past_k[1]) and torch.equal(got_k[:, :, t:], k)
    assert torch.equal(got_v[:, :, :t], past_v[1]) and torch.equal(got_v[:, :, t:], v)
    assert cache.new_k[1] is k and cache.new_v[1] is v and cache.new_k[0] is None
    first = StepKeyCache(L)  # the first position: nothing cached yet
    assert first.extend(1, k, v) == (k, v) and first.new_k[0] is k


@pytest.mark.parametrize("mode", ["none", "timestep", "coordinate"])
def test_the_early_exit_hook_caches_the_frozen_state_for_the_skipped_steps(mode):
    """Entropy exits with S above ln V: every position leaves after step 1, so steps
    2..L of the cache hold the keys/values of the frozen S_1 + E_l, computed here
    independently as ``self_kv(S_1 + TE(l) (+ PE(i)))`` (float64)."""
    model = make_model(decoder_halting="entropy", exit_entropy=10.0, decoder_layers=4,
                       decoder_step_embedding=mode).double()
    dec = model.decoder
    src, prev = batch(seed=3)
    prev = prev[:, :4]
    with torch.no_grad():
        enc = model.encoder(src)
        state = {}
        for t in range(prev.size(1)):
            S, extra = dec(prev[:, : t + 1], enc, incremental_state=state, features_only=True)
            assert bool((extra["halting_decoder"].steps[prev[:, t:t + 1].ne(1)] == 1).all())
            buffer = dec.decoder_state(state).kv
            d = S.size(-1)
            coords = 0
            if mode == "coordinate":
                index = (prev[:, : t + 1].ne(1).long().cumsum(1) * prev[:, : t + 1].ne(1))[:, -1:]
                coords = sinusoid(index, d)
            for l in range(2, dec.num_steps + 1):
                E = (sinusoid(torch.tensor(float(l)), d) + coords) if mode != "none" else 0
                ref_k, ref_v = dec.block.self_kv(S + E)
                k, v = buffer.read(l, t + 1)
                torch.testing.assert_close(k[:, :, -1:], ref_k, rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(v[:, :, -1:], ref_v, rtol=1e-9, atol=1e-9)


def test_incremental_decoding_projects_every_new_row_and_carries_nothing():
    model = make_model()
    step = model.decoder.step
    assert isinstance(step.context(self_padding_mask=None, real=None).rows, HaltedStateKV)
    ctx = step.context(StepKeyCache(2), self_padding_mask=None, real=None)
    assert isinstance(ctx.rows, EveryRowKV)
    S = torch.randn(2, 1, 64)
    with torch.no_grad():
        k, v = ctx.rows(S, None)
        ref_k, ref_v = model.decoder.block.self_kv(S)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_frozen_prefix_sums_continue_the_sums_of_the_steps_still_to_decide():
    """Every new position halted before step 3 of L = 4: the decisions of steps 4 and 5
    (l + 1 for l = 3, 4) read prefix sums continued with the frozen h where the position is
    a token (row 0), unchanged for padding (row 1); the keys before step 4 and after
    L + 1 = 5 are not touched, nor a step missing from the sums; the counts keep their dtype."""
    from sut_fairseq.modules.side_step import frozen_prefix_sums

    g = torch.Generator().manual_seed(0)
    B, d = 2, 3
    h = torch.randn(B, 1, d, generator=g, dtype=torch.float64)
    real = torch.tensor([[True], [False]])
    prefix = {l: (torch.randn(B, d, generator=g, dtype=torch.float64), torch.tensor([l, 2 * l]))
              for l in range(1, 7)}
    out = frozen_prefix_sums(prefix, h, real, 3, 4)
    assert sorted(out) == [4, 5]
    for l in (4, 5):
        sums, counts = out[l]
        torch.testing.assert_close(sums[0], prefix[l][0][0] + h[0, 0], rtol=0, atol=0)
        torch.testing.assert_close(sums[1], prefix[l][0][1], rtol=0, atol=0)
        assert counts.dtype == prefix[l][1].dtype and counts.tolist() == [l + 1, 2 * l]
    gap = {l: prefix[l] for l in (1, 2, 3, 5)}             # no sums for step 4
    assert sorted(frozen_prefix_sums(gap, h, real, 2, 4)) == [3, 5]
    assert frozen_prefix_sums(None, h, real, 2, 4) == {}


def test_global_mean_decoding_continues_the_prefix_through_frozen_positions():
    """Decoder global-mean halting, one sentence at a time: each new position that halts
    before L freezes (the early-exit hook), and the later positions' prefix means read the
    sums it continued. Incremental == full, with frozen positions among the earlier ones."""
    model = make_model(encoder_halting="global-mean", decoder_halting="global-mean",
                       halting_threshold=0.6, encoder_layers=4, decoder_layers=4)
    randomise_halting(model, seed=2)             # steps 1, 2, 2, 2, 2, 2, 3 of 4
    g = torch.Generator().manual_seed(5)
    src, prev = torch.randint(4, 40, (1, 7), generator=g), torch.randint(4, 40, (1, 7), generator=g)
    prev[0, 0] = 2
    with torch.no_grad():
        enc = model.encoder(src)
        full, extra = model.decoder(prev, enc)
        inc, steps, _ = run_incremental(model, enc, prev)
    assert torch.equal(steps, extra["halting_decoder"].steps)
    assert (steps[0, :-1] < model.decoder.num_steps).any(), "want a frozen position before the last"
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def test_the_step_hands_the_block_every_field_it_reads():
    """``SideStep.__call__`` gives the block the query, the source's keys/values (through
    the cache), the running mask and each context field the block reads: the padding
    masks, the query offset, the cross-attention keys/values and the chunk memory's."""
    from sut_fairseq.modules.side_step import StepContext

    seen = {}

    def block(q, k, v, running, **kw):
        seen.update(kw, q=q, k=k, v=v, running=running)
        return q

    h, S = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    keys, values = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    fields = dict(self_padding_mask=torch.zeros(2, 3, dtype=torch.bool), q_start=5,
                  cross_k=torch.randn(2, 1, 6, 4), cross_v=torch.randn(2, 1, 6, 4),
                  cross_padding_mask=torch.zeros(2, 6, dtype=torch.bool),
                  memory_kv=(torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4)))
    ctx = StepContext(rows=lambda S_, running_: (keys, values), real=torch.ones(2, 3, dtype=torch.bool),
                      **fields)
    running = torch.tensor([[True, False, True], [True, True, True]])
    assert SideStep(block, PlainQuery(), StateKV(), NoMixture())(h, S, running, 2, ctx) is h
    assert seen.pop("q") is h and seen.pop("k") is keys and seen.pop("v") is values
    assert seen.pop("running") is running and seen.pop("hyper_z") is None
    assert seen == fields
