"""A checkpoint written by fairseq-train before the sides became modules and the options a
dataclass (``checkpoint_golden.py``) loads through fairseq's own loader and decodes to the
hypotheses and scores it gave then (tokens exactly, scores to 1e-5)."""
import json

from checkpoint_golden import GOLDEN, decode, load
from decoding_golden import assert_same_hypotheses

with open(GOLDEN) as f:
    RECORDED = json.load(f)


def test_the_old_checkpoint_loads_every_parameter():
    model, _ = load()  # fairseq loads with strict=True: a missing or unknown name fails here
    assert model.decoder.side.halting.rule == "global-mean"
    assert model.decoder.side.halting.threshold == 0.9


def test_the_old_checkpoint_decodes_as_recorded():
    got, want = decode(), RECORDED["sentences"]
    assert len(want) == 4
    assert_same_hypotheses(got, want)
