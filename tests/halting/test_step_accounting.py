"""StepMeter's executed-step accounting and the exit summary of the generation tools.

Every expected figure below is worked out by hand from the counts fed to the meter.
"""
import math

import pytest
import torch

from sut_fairseq.modules import accounting
from sut_fairseq.modules.accounting import StepMeter
from sut_fairseq.modules.chunked_recurrence import ChunkedHaltingResult
from sut_fairseq.modules.halting import HaltingResult


def _halting(real, steps, max_steps, chunk_real=None, chunk_steps=None):
    """A HaltingResult (a ChunkedHaltingResult when chunk counts are given) with only the
    fields the meter reads filled in meaningfully."""
    real = torch.tensor(real, dtype=torch.bool)
    steps = torch.tensor(steps, dtype=torch.long)
    common = dict(weights=torch.zeros(*real.shape, max_steps), expected_depth=torch.zeros(real.shape),
                  steps=steps, real=real, max_steps=max_steps)
    if chunk_real is None:
        return HaltingResult(**common)
    return ChunkedHaltingResult(**common, chunk_real=torch.tensor(chunk_real, dtype=torch.bool),
                                chunk_steps=torch.tensor(chunk_steps, dtype=torch.long))


def _two_sided_meter():
    """enc (k-sum 3): two batches, 6+7 = 13 executed of (3+3 real) x L=4 = 24;
    dec (k-sum 2): one batch, 6 executed of 5 real x L=2 = 10."""
    meter = StepMeter({"enc": 3, "dec": 2})
    meter.add("enc", _halting([[True, True, True, False]], [[2, 3, 1, 0]], 4))
    meter.add("enc", _halting([[True, True, False, False], [True, False, False, False]],
                              [[4, 2, 0, 0], [1, 0, 0, 0]], 4))
    meter.add("dec", _halting([[True] * 5], [[1, 1, 2, 1, 1]], 2))
    return meter


def _chunked_meter():
    """enc only (k-sum 2), chunked: batch 1 has 4 real tokens, 9 steps, L=3, 2 real chunks
    with 3+3 block applications; batch 2 has 2 real tokens, 3 steps, 1 real chunk with 2.
    Totals: 12 executed of 18, 6 positions, 3 chunks, 8 chunk steps."""
    meter = StepMeter({"enc": 2, "dec": 1})
    meter.add("enc", _halting([[True] * 4], [[2, 3, 3, 1]], 3,
                              chunk_real=[[True, True]], chunk_steps=[[3, 3]]))
    meter.add("enc", _halting([[True, True, False, False]], [[1, 2, 0, 0]], 3,
                              chunk_real=[[True, False]], chunk_steps=[[2, 0]]))
    return meter


def test_add_accumulates_every_count_over_batches():
    """Each add sums into the side's executed steps, maximum (real positions x L), real
    positions, chunks and chunk steps; a plain HaltingResult adds no chunks."""
    meter = _two_sided_meter()
    assert meter.executed == {"enc": 13, "dec": 6}
    assert meter.maximum == {"enc": 24, "dec": 10}
    assert meter.positions == {"enc": 6, "dec": 5}
    assert meter.chunks == {"enc": 0, "dec": 0}
    assert meter.chunk_steps == {"enc": 0, "dec": 0}

    chunked = _chunked_meter()
    assert chunked.executed == {"enc": 12, "dec": 0}
    assert chunked.maximum == {"enc": 18, "dec": 0}
    assert chunked.positions == {"enc": 6, "dec": 0}
    assert chunked.chunks == {"enc": 3, "dec": 0}
    assert chunked.chunk_steps == {"enc": 8, "dec": 0}


def test_a_new_meter_starts_from_zero_and_reset_returns_there():
    """All five counters start at 0 for every side, and reset() zeroes them again."""
    meter = StepMeter({"enc": 1, "dec": 4})
    zeros = {"enc": 0, "dec": 0}
    for counts in (meter.executed, meter.maximum, meter.positions, meter.chunks, meter.chunk_steps):
        assert counts == zeros
    meter = _chunked_meter()
    meter.reset()
    for counts in (meter.executed, meter.maximum, meter.positions, meter.chunks, meter.chunk_steps):
        assert counts == zeros


def test_fraction_is_executed_over_maximum_and_nan_before_any_count():
    """fraction = executed / maximum (13/24, 6/10); a side with no counts yet gives NaN
    rather than dividing by zero."""
    meter = _two_sided_meter()
    assert meter.fraction("enc") == pytest.approx(13 / 24)
    assert meter.fraction("dec") == pytest.approx(0.6)
    empty = StepMeter({"enc": 1, "dec": 1})
    assert math.isnan(empty.fraction("enc")) and math.isnan(empty.fraction("dec"))


def test_summary_line_of_two_unchunked_sides():
    """Exact line: percentage to one decimal (13/24 = 54.17%, 6/10 = 60%), executed/maximum,
    expert rows = executed x Σk (13 x 3, 6 x 2), no chunk part, sides joined by ' | '."""
    assert _two_sided_meter().summary() == (
        "| encoder steps executed 54.2% (13/24; 39 expert rows)"
        " | decoder steps executed 60.0% (6/10; 12 expert rows)")


def test_summary_line_of_a_chunked_side_ends_with_the_per_position_and_per_chunk_means():
    """Chunked side: 12/18 = 66.7%, 12 x 2 = 24 expert rows, 12 steps / 6 positions = 2.00
    per position, 8 chunk steps / 3 chunks = 2.67 per chunk; the side without counts
    (decoder) is left out."""
    assert _chunked_meter().summary() == (
        "| encoder steps executed 66.7% (12/18; 24 expert rows; "
        "2.00 steps per position, 2.67 per chunk over 3 chunks)")


def test_summary_is_empty_without_counts_and_names_only_the_sides_with_counts():
    """No counts at all: an empty string (nothing is printed); only the decoder counted:
    the line holds the decoder part alone."""
    meter = StepMeter({"enc": 1, "dec": 1})
    assert meter.summary() == ""
    meter.add("dec", _halting([[True, True, True, True]], [[1, 0, 1, 1]], 2))
    assert meter.summary() == "| decoder steps executed 37.5% (3/8; 3 expert rows)"


def test_no_registration_when_argv_is_empty(monkeypatch):
    """An embedding interpreter may leave sys.argv empty: that is no generation tool, and
    registering must neither fail nor register."""
    registered = []
    monkeypatch.setattr(accounting, "_METERS", [])
    monkeypatch.setattr(accounting.atexit, "register", registered.append)
    monkeypatch.setattr(accounting.sys, "argv", [])
    accounting.register_for_exit_summary(StepMeter({"enc": 1, "dec": 1}))
    assert accounting._METERS == [] and registered == []


def test_generate_registers_one_exit_hook_that_prints_each_meter_with_counts(monkeypatch, capsys):
    """Under fairseq-generate, the first meter registers _print_summaries with atexit (once
    for all meters); at exit it prints one line per meter with counts, in registration
    order, and nothing for a meter without counts."""
    registered = []
    monkeypatch.setattr(accounting, "_METERS", [])
    monkeypatch.setattr(accounting.atexit, "register", registered.append)
    monkeypatch.setattr(accounting.sys, "argv", ["/venv/bin/fairseq-generate"])
    for meter in (_two_sided_meter(), StepMeter({"enc": 1, "dec": 1}), _chunked_meter()):
        accounting.register_for_exit_summary(meter)
    assert registered == [accounting._print_summaries]
    registered[0]()
    out, err = capsys.readouterr()
    assert out == (
        "| encoder steps executed 54.2% (13/24; 39 expert rows)"
        " | decoder steps executed 60.0% (6/10; 12 expert rows)\n"
        "| encoder steps executed 66.7% (12/18; 24 expert rows; "
        "2.00 steps per position, 2.67 per chunk over 3 chunks)\n")
    assert err == ""


def test_print_summaries_flushes_the_line_at_once(monkeypatch):
    """The summary is flushed right after it is written (at exit the line must not sit in a
    pipe's buffer behind fairseq's own output)."""
    events = []

    class Recorder:
        def write(self, text):
            events.append(("write", text))
            return len(text)

        def flush(self):
            events.append(("flush", None))

    monkeypatch.setattr(accounting, "_METERS", [_two_sided_meter()])
    monkeypatch.setattr(accounting.sys, "stdout", Recorder())
    accounting._print_summaries()
    assert events and events[-1] == ("flush", None)
    written = "".join(text for kind, text in events if kind == "write")
    assert written == ("| encoder steps executed 54.2% (13/24; 39 expert rows)"
                       " | decoder steps executed 60.0% (6/10; 12 expert rows)\n")
