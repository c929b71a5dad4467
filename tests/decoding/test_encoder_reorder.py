"""Beam search's reorders of the encoder output (``decoder_cache.reorder_encoder_rows``) and
the incremental decoder's last position (``sut_transformer.last_position``) against the
plain computations they replace: ``index_select`` of every row, and the positional
embedding of the whole prefix."""
import pytest
import torch
from fairseq.modules import PositionalEmbedding

from sut_fairseq.models.sut_transformer import last_position
from sut_fairseq.modules.decoder_cache import first_beam_copies, reorder_encoder_rows, whole_groups

S, D = 5, 3


def encoder_out(rows: int, seed: int = 0) -> dict:
    """An encoder-out dict of ``rows`` distinct rows: (S, rows, D), padding, lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (rows,), generator=g)
    return {"encoder_out": [torch.randn(S, rows, D, generator=g)],
            "encoder_padding_mask": [torch.arange(S).unsqueeze(0) >= lengths.unsqueeze(1)],
            "src_lengths": [lengths], "halting": ["halting result"]}


def selected(out: dict, order: torch.Tensor) -> dict:
    """The reference: every entry's rows taken by ``index_select``."""
    return {"encoder_out": out["encoder_out"][0][:, order], "encoder_padding_mask":
            out["encoder_padding_mask"][0][order], "src_lengths": out["src_lengths"][0][order]}


def assert_rows(got: dict, want: dict):
    for name, tensor in want.items():
        assert torch.equal(got[name][0], tensor), name
    assert got["halting"] == ["halting result"]


def test_beam_search_reorders_equal_index_select_and_copy_nothing_within_the_sentences():
    """3 sentences, beam 4: the first reorder makes the copies; reorders within the
    sentences return the dict itself; dropping a finished sentence copies; a reorder
    within the remaining sentences copies nothing again. Every result equals index_select
    of the rows it stands for."""
    sentences, beam = 3, 4
    enc = encoder_out(sentences)
    first = torch.arange(sentences).repeat_interleave(beam)
    out = reorder_encoder_rows(enc, first)
    assert out["beam_copies"] == [beam]
    reference = selected(enc, first)
    assert_rows(out, reference)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # each beam continues a beam of its own sentence
        order = first * beam + torch.randint(0, beam, (sentences * beam,), generator=g)
        again = reorder_encoder_rows(out, order)
        assert again is out
        assert_rows(again, {k: v[order] if k != "encoder_out" else v[:, order] for k, v in reference.items()})
    # sentence 1 finished: its beams leave the batch
    keep = torch.tensor([0, 2]).repeat_interleave(beam) * beam + torch.randint(0, beam, (2 * beam,), generator=g)
    shrunk = reorder_encoder_rows(out, keep)
    assert shrunk is not out and shrunk["beam_copies"] == [beam]
    assert_rows(shrunk, selected(enc, keep // beam))
    order = torch.arange(2).repeat_interleave(beam) * beam + torch.randint(0, beam, (2 * beam,), generator=g)
    assert reorder_encoder_rows(shrunk, order) is shrunk
    # the last sentence finished: the rows left read their own groups, but fewer of them
    last = torch.arange(beam) + torch.randint(0, 1, (beam,), generator=g)
    fewer = reorder_encoder_rows(shrunk, last)
    assert fewer["encoder_out"][0].size(1) == beam and fewer["beam_copies"] == [beam]
    assert_rows(fewer, selected(enc, torch.zeros(beam, dtype=torch.long)))


def test_a_reorder_across_the_sentences_copies_and_forgets_the_copies():
    """A row asked for another sentence's row is copied (not skipped), and once a group
    mixes sentences the record of the copies is dropped."""
    sentences, beam = 2, 3
    enc = encoder_out(sentences, seed=2)
    out = reorder_encoder_rows(enc, torch.arange(sentences).repeat_interleave(beam))
    across = torch.tensor([0, 1, 3, 3, 4, 5])  # row 2 reads sentence 1's row 3
    moved = reorder_encoder_rows(out, across)
    assert_rows(moved, selected(enc, across // beam))
    assert "beam_copies" not in moved
    assert reorder_encoder_rows(moved, torch.arange(6)) is not moved  # no record: copied


@pytest.mark.parametrize("order,rows,copies", [
    ([0, 0, 1, 1], 2, 2), ([0, 1, 0, 1], 2, 0), ([0, 1, 2], 3, 0), ([1, 1, 0, 0], 2, 0),
    ([0, 0, 0], 1, 3), ([0, 0, 1], 2, 0), ([], 0, 0)])
def test_only_a_repeat_in_place_counts_as_beam_copies(order, rows, copies):
    assert first_beam_copies(torch.tensor(order), rows) == copies


def test_only_groups_of_rows_from_one_sentence_are_whole():
    assert whole_groups(torch.tensor([3, 2, 0, 1]), 2)  # groups (3, 2) -> sentence 1, (0, 1) -> 0
    assert not whole_groups(torch.tensor([3, 4, 0, 1]), 2)  # 3 and 4: two sentences
    assert not whole_groups(torch.tensor([3, 2, 1]), 2)  # not a whole number of groups


def test_reorders_without_beam_copies_equal_index_select():
    enc = encoder_out(4, seed=3)
    for order in ([3, 0, 0, 2], [1], [2, 2, 2, 2, 2]):
        order = torch.tensor(order)
        out = reorder_encoder_rows(enc, order)
        assert_rows(out, selected(enc, order))
        assert "beam_copies" not in out


@pytest.mark.parametrize("T", [1, 7, 40])
def test_the_last_position_equals_the_whole_prefixs_last_column(T):
    """Left- and right-padded prefixes, and a prefix longer than the table built at
    construction (the module grows it)."""
    pad, dim = 1, 8
    module = PositionalEmbedding(16, dim, pad)
    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(4, 20, (4, T), generator=g)
    tokens[0, : T // 2] = pad  # left padding
    tokens[1, T - T // 3:] = pad  # right padding
    tokens[2, :] = pad
    want = module(tokens)[:, -1:]
    got = last_position(module, tokens)
    assert got.shape == (4, 1, dim)
    assert torch.equal(got, want)
