"""fairseq-generate's hypotheses and scores on small seeded models, one per decoder code
path (stick-breaking, global-mean, ACT, no halting, early exits, the chunked decoder,
Hyper-UT), equal those recorded before the incremental decoder was rewritten for speed
(``decoding_golden.py``; tokens exactly, scores to 1e-5)."""
import json

import pytest

from decoding_golden import CASES, GOLDEN, decode_case

with open(GOLDEN) as f:
    RECORDED = json.load(f)


@pytest.mark.parametrize("name", sorted(CASES))
def test_beam_search_matches_the_recorded_decoding(name):
    got, want = decode_case(name), RECORDED["cases"][name]
    assert len(got) == len(want)
    for sentence, (g, w) in enumerate(zip(got, want)):
        assert [h["tokens"] for h in g] == [h["tokens"] for h in w], f"sentence {sentence}"
        for h, r in zip(g, w):
            assert h["score"] == pytest.approx(r["score"], abs=1e-5)
            assert h["positional_scores"] == pytest.approx(r["positional_scores"], abs=1e-5)
