"""What ``RecurrentSide`` (``models/recurrent_side.py``) builds from the options and hands on:
the halting rule of a one-step side, the halting unit's input norm, the chunk memory's
slots and output norm per side, a chunked side's global positions, and the compiled step
it passes to the recurrence. The recurrence's arithmetic is tested in its own files; here,
that every option reaches the right place."""
import pytest
import torch

from conftest import make_model
from sut_fairseq.modules.halting import LearnedHalting, NoHalting
from sut_fairseq.modules.recurrence import SideRecurrence


@pytest.mark.parametrize("layers,halting", [(1, NoHalting), (2, LearnedHalting)])
def test_a_side_of_one_step_has_no_halting_unit(layers, halting):
    """With a single step nothing is decided: no halting unit (its parameters would get no
    gradient, which DDP refuses), whatever the configured rule."""
    model = make_model(encoder_layers=layers, decoder_layers=layers, encoder_halting="stick-breaking",
                       decoder_halting="stick-breaking")
    for side in (model.encoder.side, model.decoder.side):
        assert isinstance(side.halting, halting)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_the_halting_unit_normalises_its_input_under_pre_ln_only(pre_ln):
    model = make_model(encoder_normalize_before=pre_ln, decoder_normalize_before=pre_ln)
    for side in (model.encoder.side, model.decoder.side):
        assert isinstance(side.halting.unit.norm, torch.nn.LayerNorm) is pre_ln
        assert (side.final_norm is not None) is pre_ln


def test_chunk_memory_of_one_slot_and_its_output_norm_on_the_encoder_only():
    """A memory of k = 1 slot is a memory; LN_out of the final memory belongs to an
    encoder whose decoder reads the memory (``--tlb-encoder-out`` memory or both), never to
    a chunked decoder."""
    model = make_model(encoder_chunk_size=3, decoder_chunk_size=3, encoder_memory_slots=1,
                       decoder_memory_slots=1, tlb_encoder_out="both")
    enc, dec = model.encoder.side.memory, model.decoder.side.memory
    assert enc is not None and dec is not None and enc.slots == dec.slots == 1
    assert enc.out_norm is not None and dec.out_norm is None
    tokens = make_model(encoder_chunk_size=3, encoder_memory_slots=2, tlb_encoder_out="tokens")
    assert tokens.encoder.side.memory.out_norm is None
    none = make_model(encoder_chunk_size=3, encoder_memory_slots=0, tlb_encoder_out="tokens")
    assert none.encoder.side.memory is None


def test_global_chunk_positions_are_fairseqs_own():
    """``--encoder-chunk-positions global``: the chunked side's input positions are the
    real tokens' indices (fairseq's sinusoidal embedding of the tokens), not the slots."""
    model = make_model(encoder_chunk_size=2, encoder_chunk_positions="global")
    side = model.encoder.side
    tokens = torch.tensor([[1, 5, 6, 7, 8], [1, 1, 5, 6, 7]])  # 1 = padding
    slot = torch.zeros_like(tokens)
    torch.testing.assert_close(side.chunk_positions(tokens, slot), side.embed_positions(tokens))
    local = make_model(encoder_chunk_size=2).encoder.side
    assert not torch.equal(local.chunk_positions(tokens, torch.tensor([[0, 0, 1, 0, 1], [0, 0, 0, 1, 0]])),
                           local.embed_positions(tokens))


def test_a_full_forward_hands_the_compiled_step_to_the_recurrence(monkeypatch):
    """``--compile-step``: the side passes its compiled step to every full forward's
    recurrence (recorded here, then run eagerly: no compilation in this test)."""
    model = make_model(compile_step=True)
    given = []
    run = SideRecurrence.run

    def recording_run(self, h0, inputs, rule=None, compiled=None, **options):
        given.append(compiled)
        return run(self, h0, inputs, rule, compiled=None, **options)

    monkeypatch.setattr(SideRecurrence, "run", recording_run)
    tokens = torch.tensor([[5, 6, 7, 2]])
    model(tokens, torch.tensor([4]), torch.tensor([[2, 5, 6, 7]]))
    assert given == [model.encoder.side.compiled_step, model.decoder.side.compiled_step]
    assert all(c is not None for c in given)


def test_an_encoder_outside_the_seq2seq_model_counts_no_steps():
    """The classifier's encoder (``SUTEncoder`` alone, no ``SUTTransformerModel`` to give it
    the model's ``StepMeter``) evaluates without counting: its side's meter is None."""
    from sut_fairseq.models.architectures import base_architecture
    from sut_fairseq.models.config import SUTConfig
    from sut_fairseq.models.standalone import model_args, synthetic_dictionary
    from sut_fairseq.models.sut_transformer import SUTEncoder, build_embedding

    args = model_args("sut_tiny", dropout=0.0)
    base_architecture(args)
    cfg = SUTConfig.from_namespace(args)
    dictionary = synthetic_dictionary(40)
    encoder = SUTEncoder(cfg, dictionary, build_embedding(dictionary, cfg.encoder.embed_dim)).eval()
    assert encoder.side.step_meter is None
    out = encoder(torch.tensor([[5, 6, 7, 2]]), torch.tensor([4]))
    assert out["encoder_out"][0].shape == (4, 1, cfg.encoder.embed_dim)


def test_the_chunk_memory_gets_each_dropout_of_its_own():
    """The memory's residual dropout is ``--dropout``, its write attention's
    ``--attention-dropout`` and its feed-forward's ``--activation-dropout`` (three distinct
    rates, so a shifted argument shows)."""
    model = make_model(encoder_chunk_size=3, encoder_memory_slots=2, dropout=0.125,
                       attention_dropout=0.25, activation_dropout=0.375)
    memory = model.encoder.side.memory
    assert memory.dropout.p == 0.125
    assert [a.attention_dropout for a in memory.write_attn] == [0.25]
    assert [f.dropout.p for f in memory.write_ffn] == [0.375]


@pytest.mark.parametrize("option", ["compile_step", "compile_loop"])
def test_compile_step_compiles_one_step_and_compile_loop_all_of_them(option):
    from sut_fairseq.modules.recurrence import TensorLoop, TensorStep

    model = make_model(**{option: True})
    for side in (model.encoder.side, model.decoder.side):
        body = side.compiled_step.step
        if option == "compile_step":
            assert isinstance(body, TensorStep)
        else:
            assert isinstance(body, TensorLoop) and body.max_steps == side.num_steps == 3
