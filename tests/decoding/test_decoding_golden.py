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
