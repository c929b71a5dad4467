"""``--tlb-unshared`` (docs/chunked.md#unshared-steps): the chunked encoder's step l runs its
own block l (the TLB paper's Algorithm 2) instead of one block shared by the L steps.

Against a per-chunk, per-step loop (float64, every parameter perturbed) in which step l
uses block l; the parameter count grows by L - 1 blocks; without chunks the option is
refused; off (the default) the model is the shared one.
"""
import pytest
import torch

from conftest import make_model
from test_chunked import PAD, _layer_norm, _perturb, reference_memory_attention, reference_write, \
    token_rows, tokens
from sut_fairseq.models.standalone import _Task, model_args, synthetic_dictionary
from sut_fairseq.models.sut_transformer import SUTTransformerModel

L = 3


def unshared_model(arch="tlb_flipflop", layers=L, **options):
    """Chunks of 4 real tokens, k = 3 slots, U = 2 write blocks, L = ``layers`` steps;
    float64, every parameter of the encoder (each block, the memory) perturbed."""
    model = make_model(arch, encoder_chunk_size=4, encoder_memory_slots=3,
                       encoder_memory_update_layers=2, encoder_layers=layers, tlb_encoder_out="both",
                       tlb_unshared=True, **options).double()
    _perturb(model.encoder.side, seed=3)
    return model


def reference_unshared_encoder(model, src):
    """Example by example and chunk by chunk: the chunk's real tokens with their slot
    positions, then for l = 1 .. L with block l: [self-attention over the chunk, the memory
    read h ← h + MHA(LN_q(h), LN_m(M^c), LN_m(M^c)) (written out), the feed-forward
    sub-layer]; M^{c+1} = ``reference_write``. No halting (S_l = h_l). Returns per example
    the token rows (n, d) and LN_out(M^N) (k, d)."""
    enc = model.encoder
    blocks = [enc.side.block, *enc.side.later_blocks]
    memory = enc.side.memory
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
            for block in blocks:  # step l reads block l
                k, v = block.self_kv(h)
                a = block._sublayer(h, block.self_attn_norm,
                                    lambda q: block.self_attn(q, k, v, running, None, 0))
                a = a + reference_memory_attention(block.memory_attn, a[0], M)
                h = block._sublayer(a, block.ffd_norm, lambda q: block.ffd(q, running))
            M = reference_write(memory, M, h[0])
            rows.append(h[0] if enc.side.final_norm is None else enc.side.final_norm(h[0]))
        out.append((torch.cat(rows), _layer_norm(M, memory.out_norm)))
    return out


@pytest.mark.parametrize("arch,options,layers", [
    ("tlb_flipflop", {}, L),  # dense, pre-LN, clipped relative positions
    ("tlb_flipflop", {}, 2),  # two blocks: the smallest unshared step
    ("sut_tiny", dict(encoder_halting="none"), L),  # the SUT's experts, post-LN
], ids=["tlb", "tlb-two-steps", "sut-experts"])
def test_step_l_runs_block_l_as_a_per_step_loop(arch, options, layers):
    model = unshared_model(arch, layers, **options)
    blocks = [model.encoder.side.block, *model.encoder.side.later_blocks]
    assert len(blocks) == layers and len({id(b) for b in blocks}) == layers
    src = tokens(11, 6, seed=9)  # chunks of 4, 4, 3 and 4, 2 real tokens
    with torch.no_grad():
        enc = model.encoder(src)
        token_out, memory_out = token_rows(enc, model)
        expected = reference_unshared_encoder(model, src)
        # the same loop with the blocks in another order gives another result
        step = model.encoder.side.recurrence.step
        step.blocks = torch.nn.ModuleList(list(step.blocks)[::-1])
        swapped, _ = token_rows(model.encoder(src), model)
    for b, (rows, M) in enumerate(expected):
        real = src[b].ne(PAD)
        torch.testing.assert_close(token_out[b][real], rows, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(memory_out[b], M, atol=1e-9, rtol=1e-9)
    assert not torch.allclose(swapped, token_out, atol=1e-4)


def test_the_parameters_grow_by_the_later_steps_blocks():
    shared = make_model("tlb_flipflop", encoder_layers=L)
    unshared = make_model("tlb_flipflop", encoder_layers=L, tlb_unshared=True)

    def count(module):
        return sum(p.numel() for p in module.parameters())

    assert count(unshared) - count(shared) == (L - 1) * count(shared.encoder.side.block)
    names = {n for n, _ in unshared.named_parameters()} - {n for n, _ in shared.named_parameters()}
    assert {n.split(".")[3] for n in names} == {str(i) for i in range(L - 1)}
    assert all(n.startswith("encoder.side.later_blocks.") for n in names)
    assert not hasattr(shared.encoder.side, "later_blocks")  # off: the shared model as before
    assert not hasattr(unshared.decoder.side, "later_blocks")  # the decoder keeps its shared block


def test_halting_under_unshared_steps_runs_block_l_at_step_l():
    """GUTLB's halting over unshared blocks (global-mean, transition, gate): replacing
    block L changes a sequence exactly when one of its chunks ran step L."""
    model = unshared_model("gutlb_flipflop", halting_threshold=0.6)
    with torch.no_grad():  # â near sigmoid(-0.3) = 0.43: chunks stop after 2 or 3 steps
        model.encoder.side.halting.unit.fc2.weight.mul_(0.06)
        model.encoder.side.halting.unit.fc2.bias.fill_(-0.3)
    src = tokens(11, 6, 9, 4, 3, seed=9)
    with torch.no_grad():
        out = model.encoder(src)
        steps = out["halting"][0].steps
        blocks = model.encoder.side.recurrence.step.blocks
        last = blocks[-1]
        blocks[-1] = blocks[0]  # step L runs block 1
        changed = model.encoder(src)
        blocks[-1] = last
    ran_last = (steps == L).any(1)
    assert ran_last.any() and not ran_last.all(), \
        "the test needs sequences with and without a chunk that runs step L"
    S, S2 = out["encoder_out"][0].transpose(0, 1), changed["encoder_out"][0].transpose(0, 1)
    for b in range(src.size(0)):
        differs = not torch.allclose(S[b], S2[b], atol=1e-9)
        assert differs == bool(ran_last[b])


def test_without_chunks_the_option_is_refused():
    args = model_args("sut_tiny", share_all_embeddings=True, tlb_unshared=True)
    dictionary = synthetic_dictionary(40)
    with pytest.raises(ValueError, match=r"--tlb-unshared=True is invalid: needs "
                                         r"--encoder-chunk-size > 0"):
        SUTTransformerModel.build_model(args, _Task(dictionary, dictionary))


def test_an_old_checkpoints_arguments_build_the_shared_model():
    args = model_args("tlb_flipflop", share_all_embeddings=True)
    del args.tlb_unshared
    dictionary = synthetic_dictionary(40)
    model = SUTTransformerModel.build_model(args, _Task(dictionary, dictionary))
    assert args.tlb_unshared is False and not hasattr(model.encoder.side, "later_blocks")
