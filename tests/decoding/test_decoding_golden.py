"""fairseq-generate's hypotheses and scores on small seeded models, one per decoder code
path (stick-breaking, global-mean, ACT, no halting, early exits, the chunked decoder,
Hyper-UT), equal those recorded before the incremental decoder was rewritten for speed
(``decoding_golden.py``; tokens exactly, scores to 1e-5)."""
import json

import pytest

from decoding_golden import CASES, GOLDEN, assert_same_hypotheses, decode_case

with open(GOLDEN) as f:
    RECORDED = json.load(f)


@pytest.mark.parametrize("name", sorted(CASES))
def test_beam_search_matches_the_recorded_decoding(name):
    assert_same_hypotheses(decode_case(name), RECORDED["cases"][name])


@pytest.mark.parametrize("cross", ["grid", "gathered"])
@pytest.mark.parametrize("name", ["stick-breaking", "global-mean", "act"])
def test_steps_on_the_running_rows_alone_keep_the_recorded_decoding(name, cross, monkeypatch):
    """With ``COMPACT_HALTED_SHARE`` 0 every decoder step with a halted row runs its block on
    the running rows alone (their keys, values and prefix padding gathered; beam search's
    rows share one cross row per sentence, which they read from their places in the beam
    grid, ``GRID_CROSS_SHARE`` 0, or gathered per row, ``GRID_CROSS_SHARE`` 2): the same
    hypotheses and scores, and the compacted steps did run, with grouped beams."""
    from sut_fairseq.modules import recurrence

    from sut_fairseq.modules.momha import MixtureOfMultiHeadAttention

    monkeypatch.setattr(recurrence, "GRID_CROSS_SHARE", 0.0 if cross == "grid" else 2.0)
    grid_calls = []  # MoMHA calls with the rows at their places in the beam grid
    attention = MixtureOfMultiHeadAttention.forward

    def counting(self, *args, grid_rows=None, **kwargs):
        if grid_rows is not None:
            grid_calls.append(grid_rows[0].numel())
        return attention(self, *args, grid_rows=grid_rows, **kwargs)

    monkeypatch.setattr(MixtureOfMultiHeadAttention, "forward", counting)

    compacted = []
    block_on_rows = recurrence.block_on_rows

    def spy(block, rows, query, k, v, running, inputs):
        compacted.append((rows.numel(), query.size(0), query.size(0) // inputs.cross_k.size(0)))
        return block_on_rows(block, rows, query, k, v, running, inputs)

    monkeypatch.setattr(recurrence, "COMPACT_HALTED_SHARE", 0.0)
    monkeypatch.setattr(recurrence, "block_on_rows", spy)
    assert_same_hypotheses(decode_case(name), RECORDED["cases"][name])
    assert compacted and all(0 < rows < batch for rows, batch, _ in compacted)
    assert any(groups > 1 for *_, groups in compacted), compacted
    # the grid form: one cross-attention call per compacted step, on its rows; gathered: none
    assert grid_calls == ([rows for rows, *_ in compacted] if cross == "grid" else []), grid_calls
