"""A side's recurrence step (``modules/recurrence.py``): one ``RecurrenceStep`` per side,
its variants chosen when the model is built, run by every forward (full, incremental,
compiled); halted rows are not projected again in a full forward (counted against the
halting rule's own decisions), the incremental cache puts the earlier positions' keys
first, and the early-exit hook fills the skipped steps with the keys/values of the frozen
state (against an independent projection of ``S + E_l``)."""
import pytest
import torch

from conftest import make_model, randomise_halting, run_incremental
from sut_fairseq.modules import recurrence
from sut_fairseq.modules.chunk_cache import StepKeyCache
from sut_fairseq.modules.halting import NoHalting
from sut_fairseq.modules.recurrence import (
    KeyValueCarry,
    RecurrenceStep,
    StepInputs,
    carried_kv,
    example_mixture,
    frozen_prefix_sums,
    hyper_kv,
    no_mixture,
    prefix_mixture,
    prenorm_stepped_kv,
)
from sut_fairseq.modules.step_embedding import sinusoid

HYPER = dict(encoder_embed_dim=32, decoder_embed_dim=32, att_heads=2, att_head_dim=8,
             ffd_hidden_dim=48, encoder_layers=3, decoder_layers=3, hyper_modules=4,
             hyper_embed_dim=6, hyper_key_dim=12)

# name -> (preset, options, encoder (source, mixture), decoder (source, mixture))
VARIANTS = {
    "plain": ("sut_tiny", {}, (carried_kv, no_mixture), (carried_kv, no_mixture)),
    "step-embedding": ("sut_tiny", dict(encoder_step_embedding="timestep",
                                        decoder_step_embedding="coordinate",
                                        decoder_normalize_before=True),
                       (carried_kv, no_mixture), (prenorm_stepped_kv, no_mixture)),
    "hyper-qkv": ("hyper_ut_cpvr", dict(HYPER, hyper_components="qkv,out,ffn"),
                  (hyper_kv, example_mixture), (hyper_kv, prefix_mixture)),
    "hyper-ffn": ("hyper_ut_cpvr", dict(HYPER, hyper_components="ffn"),
                  (carried_kv, example_mixture), (carried_kv, prefix_mixture)),
    "chunked": ("sut_tiny", dict(encoder_chunk_size=3, encoder_memory_slots=2,
                                 decoder_chunk_size=2, decoder_memory_slots=2),
                (carried_kv, no_mixture), (carried_kv, no_mixture)),
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
    """Each side's step is built once with the model, from the parts its options call for,
    and every forward (full or incremental) runs that same object; the step's modules are
    registered under the side's own names only (the checkpoint's keys)."""
    arch, options, enc_parts, dec_parts = VARIANTS[name]
    model = make_model(arch, **options)
    steps = []
    for side, parts in ((model.encoder.side, enc_parts), (model.decoder.side, dec_parts)):
        step = side.recurrence.step
        assert isinstance(step, RecurrenceStep) and step.blocks[0] is side.block
        assert step.halting is side.halting
        assert (step.source, step.mixture) == parts
        steps.append(step)
    assert not any(".recurrence." in key or key.startswith("recurrence") for key in model.state_dict())
    ran = []
    forward = RecurrenceStep.forward

    def recording(self, *args, **kwargs):
        ran.append(self)
        return forward(self, *args, **kwargs)

    src, prev = batch()
    RecurrenceStep.forward = recording
    try:
        with torch.no_grad():
            enc = model.encoder(src)
            model.decoder(prev, enc)
            run_incremental(model, enc, prev)
    finally:
        RecurrenceStep.forward = forward
    assert set(map(id, ran)) == set(map(id, steps))


def test_the_compiled_step_is_the_eager_step():
    """``--compile-step`` wraps the side's own step (its tensor form), so the eager and the
    compiled recurrence cannot compute different things."""
    model = make_model(compile_step=True, encoder_step_embedding="coordinate",
                       decoder_step_embedding="none")
    for side in (model.encoder.side, model.decoder.side):
        assert recurrence.step_module(side.compiled_step) is side.recurrence.step


def test_a_full_forward_projects_only_the_rows_whose_state_changed():
    """Keys/values: every row at step 1, then exactly the rows that ran the step before
    (the halting rule's own decisions, recorded independently of the step)."""
    model = make_model(halting_threshold=0.6, encoder_layers=4)
    randomise_halting(model)
    enc = model.encoder
    projected, decided = [], []
    decide = enc.side.halting.decide

    def counting(module, inputs, output):  # the rows the projection computes
        x, mask = inputs[0], inputs[3]
        projected.append(x.shape[0] * x.shape[1] if mask is None else int(mask.sum()))

    def recording_decide(h, running, state, step, threshold=None):
        out = decide(h, running, state, step, threshold)
        decided.append(out)
        return out

    enc.side.halting.decide = recording_decide
    enc.side.block.kv_rows.register_forward_hook(counting)
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
    independently as ``self_kv(S_1 + TE(l) (+ PE(i)))`` (float64). The block runs once
    per position (step 2 is not run for positions that all left), and the frozen keys
    are projected once for all the skipped steps where they do not depend on the step
    (no step embedding), else once per skipped step."""
    model = make_model(decoder_halting="entropy", exit_entropy=10.0, decoder_layers=4,
                       decoder_step_embedding=mode).double()
    dec = model.decoder
    step = dec.side.recurrence.step
    source, projections, blocks = step.source, [], []
    step.source = lambda *args: projections.append(args) or source(*args)
    dec.side.block.register_forward_hook(lambda *_: blocks.append(1))
    L = dec.side.num_steps
    src, prev = batch(seed=3)
    prev = prev[:, :4]
    with torch.no_grad():
        enc = model.encoder(src)
        state = {}
        for t in range(prev.size(1)):
            projections.clear(), blocks.clear()
            S, extra = dec(prev[:, : t + 1], enc, incremental_state=state, features_only=True)
            assert bool((extra["halting_decoder"].steps[prev[:, t:t + 1].ne(1)] == 1).all())
            assert len(blocks) == 1  # step 1 only
            assert len(projections) == 1 + (1 if mode == "none" else L - 1)  # step 1, then the frozen keys
            buffer = dec.decoder_state(state).kv
            d = S.size(-1)
            coords = 0
            if mode == "coordinate":
                index = (prev[:, : t + 1].ne(1).long().cumsum(1) * prev[:, : t + 1].ne(1))[:, -1:]
                coords = sinusoid(index, d)
            for l in range(2, dec.side.num_steps + 1):
                E = (sinusoid(torch.tensor(float(l)), d) + coords) if mode != "none" else 0
                ref_k, ref_v = dec.side.block.self_kv(S + E)
                k, v = buffer.read(l, t + 1)
                torch.testing.assert_close(k[:, :, -1:], ref_k, rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(v[:, :, -1:], ref_v, rtol=1e-9, atol=1e-9)


def test_incremental_decoding_projects_every_new_row_and_carries_nothing():
    """A full forward carries keys/values (``KeyValueCarry``); incremental decoding projects
    its new rows (no carry), which is the block's own projection of them."""
    model = make_model()
    carries = []
    forward = RecurrenceStep.forward

    def recording(self, h, S, running, step, state, rule, carry, *args, **kwargs):
        carries.append(carry)
        return forward(self, h, S, running, step, state, rule, carry, *args, **kwargs)

    src, prev = batch()
    RecurrenceStep.forward = recording
    try:
        with torch.no_grad():
            enc = model.encoder(src)
            full = len(carries)
            run_incremental(model, enc, prev)
    finally:
        RecurrenceStep.forward = forward
    assert full > 0 and all(isinstance(c, KeyValueCarry) for c in carries[:full])
    assert len(carries) > full and all(c is None for c in carries[full:])
    S = torch.randn(2, 1, 64)
    inputs = StepInputs(self_padding_mask=None, real=None)
    with torch.no_grad():
        k, v = carried_kv(model.decoder.side.block, S, None, None, inputs, None, None)
        ref_k, ref_v = model.decoder.side.block.self_kv(S)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_frozen_prefix_sums_continue_the_sums_of_the_steps_still_to_decide():
    """Every new position halted before step 3 of L = 4: the decisions of steps 4 and 5
    (l + 1 for l = 3, 4) read prefix sums continued with the frozen h where the position is
    a token (row 0), unchanged for padding (row 1); the keys before step 4 and after
    L + 1 = 5 are not touched, nor a step missing from the sums; the counts keep their dtype."""
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
    assert (steps[0, :-1] < model.decoder.side.num_steps).any(), "want a frozen position before the last"
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def test_the_step_hands_the_block_every_field_it_reads():
    """``RecurrenceStep.forward`` gives the block the query, the source's keys/values
    (through the cache), the running mask and each input field the block reads: the
    padding masks, the query offset, the cross-attention keys/values and the chunk
    memory's; the block's output becomes h_l on the running rows only."""
    seen = {}
    keys, values = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)

    class Block(torch.nn.Module):
        hyper = hyper_kv = normalize_before = False

        def self_kv(self, x):
            seen["kv_in"] = x
            return keys, values

        def forward(self, q, k, v, running, **kw):
            seen.update(kw, q=q, k=k, v=v, running=running)
            return q + 1

    h, S = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    fields = dict(self_padding_mask=torch.zeros(2, 3, dtype=torch.bool), q_start=5,
                  cross_k=torch.randn(2, 1, 6, 4), cross_v=torch.randn(2, 1, 6, 4),
                  cross_padding_mask=torch.zeros(2, 6, dtype=torch.bool),
                  memory_kv=(torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4)))
    real = torch.ones(2, 3, dtype=torch.bool)
    inputs = StepInputs(real=real, **fields)
    running = torch.tensor([[True, False, True], [True, True, True]])
    rule = NoHalting()
    state = rule.begin(h, real)
    h_l, S_l, running_l = RecurrenceStep([Block()], rule, None, False, False)(
        h, S, running, 2, state, rule, None, inputs, None, decide_next=False)
    assert seen.pop("kv_in") is S and seen.pop("q") is h
    assert seen.pop("k") is keys and seen.pop("v") is values
    assert seen.pop("running") is running and seen.pop("hyper_z") is None
    assert seen == fields
    torch.testing.assert_close(h_l, torch.where(running.unsqueeze(-1), h + 1, h), rtol=0, atol=0)
    assert S_l is h_l and running_l is running and state.steps.tolist() == running.long().tolist()

