"""What a chunked side builds from its options (``models/recurrent_side.py``): the input
positions (``--{encoder,decoder}-chunk-positions``) against fairseq's sinusoid table
indexed by hand — ``local`` restarts at 0 in every chunk of g real tokens, ``global``
counts the real tokens of the sequence (fairseq's own positions), both zero on padding,
left padding included — and the memory (one slot is a memory; only the encoder's final
memory has the norm the decoder reads)."""
import pytest
import torch
from fairseq.modules.sinusoidal_positional_embedding import SinusoidalPositionalEmbedding

from conftest import make_model
from sut_fairseq.modules.chunked_recurrence import ChunkLayout

PAD, G = 1, 3


@pytest.mark.parametrize("kind", ["local", "global"])
def test_chunk_positions_are_the_sinusoids_of_the_slot_or_the_token_index(kind):
    model = make_model(encoder_chunk_size=G, encoder_memory_slots=2, encoder_normalize_before=True,
                       encoder_chunk_positions=kind)
    side = model.encoder.side
    tokens = torch.tensor([[PAD, PAD, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 11]])
    real = tokens.ne(PAD)
    got = side.chunk_positions(tokens, ChunkLayout(real, G).slot)
    d = got.size(-1)
    table = SinusoidalPositionalEmbedding.get_embedding(64, d, PAD)  # row PAD + 1 + i: position i
    for b in range(2):
        index = 0  # the token's index among the real tokens of its row
        for t in range(tokens.size(1)):
            if not real[b, t]:
                assert not got[b, t].any()
                continue
            position = index % G if kind == "local" else index
            torch.testing.assert_close(got[b, t], table[PAD + 1 + position])
            index += 1


def test_one_memory_slot_is_a_memory_and_only_the_encoder_reads_the_normed_one():
    """k = 1 slot is a memory (k = 0 is none), and the final-memory norm LN_out exists only
    where the decoder reads the final memory: the encoder's, with ``--tlb-encoder-out``
    ``memory`` / ``both``; a chunked decoder's memory has none (no unused parameters)."""
    model = make_model(encoder_chunk_size=G, encoder_memory_slots=1, decoder_chunk_size=G,
                       decoder_memory_slots=1, encoder_normalize_before=True,
                       decoder_normalize_before=True, tlb_encoder_out="both")
    enc, dec = model.encoder.side.memory, model.decoder.side.memory
    assert enc is not None and dec is not None and enc.slots == dec.slots == 1
    assert enc.out_norm is not None and dec.out_norm is None
    none = make_model(encoder_chunk_size=G, encoder_memory_slots=0, encoder_normalize_before=True,
                      tlb_encoder_out="tokens")
    assert none.encoder.side.memory is None
