"""scripts/logic/learning_curves.py: validation points from fairseq-train logs, the table
and the PNG."""
import os
import subprocess
import sys

from cli_helpers import run_in_process

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "logic", "learning_curves.py")
sys.path.insert(0, os.path.join(ROOT, "scripts", "logic"))

LOG = """\
2026-11-23 14:16:00 | INFO | fairseq_cli.train | Start iterating over samples
2026-11-23 14:17:00 | INFO | train_inner | epoch 001:    100 / 1741 loss=1.9, accuracy=70.1, num_updates=100
2026-11-23 14:21:30 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 1.671 | nll_loss 1.028 | accuracy 77.756 | wps 1656.4 | num_updates 1000
2026-11-23 14:30:00 | INFO | fairseq_cli.train | Start iterating over samples
2026-11-23 14:31:00 | INFO | valid | epoch 002 | valid on 'valid' subset | loss 1.57 | nll_loss 0.909 | accuracy 80.16 | num_updates 2000 | best_accuracy 80.16
"""


def test_points_count_the_running_time_without_the_pause_before_a_resume(tmp_path):
    import learning_curves

    log = tmp_path / "train.log"
    log.write_text(LOG)
    points = learning_curves.parse_log(str(log))
    # segment 1: 14:16:00 to its last line 14:21:30 (330 s); the pause to 14:30:00 is left
    # out; segment 2: 60 s to the second validation
    assert [(p["updates"], p["seconds"], p["accuracy"]) for p in points] == [
        (1000, 330.0, 77.756), (2000, 390.0, 80.16)]
    text = learning_curves.table({"A": points, "B": points[:1]})
    assert "| 1,000 | 77.76 (6) | 77.76 (6) |" in text and "| 2,000 | 80.16 (6) | – |" in text
    # a progress line after the validation extends segment 1; an unstamped line does not
    saved = "2026-11-23 14:25:00 | INFO | fairseq.checkpoint_utils | Saved checkpoint c.pt\nno stamp\n"
    log.write_text(LOG.replace("2026-11-23 14:30:00", saved + "2026-11-23 14:30:00"))
    assert [p["seconds"] for p in learning_curves.parse_log(str(log))] == [330.0, 600.0]
    # the resumed process's start-up lines (hours after the stop) do not
    startup = ("2026-11-23 18:29:18 | INFO | fairseq.tasks.text_to_speech | Please install tensorboardX\n"
               "2026-11-23 18:29:20 | INFO | fairseq_cli.train | begin dry-run validation on \"valid\" subset\n"
               "2026-11-23 18:29:21 | INFO | fairseq.trainer | begin training epoch 2\n")
    resumed = LOG.replace("2026-11-23 14:30:00", saved + startup + "2026-11-23 18:29:21").replace(
        "2026-11-23 14:31:00", "2026-11-23 18:30:21")
    log.write_text(resumed)
    assert [p["seconds"] for p in learning_curves.parse_log(str(log))] == [330.0, 600.0]


def test_script_writes_png_and_table_and_refuses_a_log_without_validation(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(LOG)
    out, table = tmp_path / "curves.png", tmp_path / "curves.md"
    done = subprocess.run([sys.executable, SCRIPT, f"SUT={log}", f"Transformer={log}",
                           "--out", str(out), "--table", str(table)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SUT (acc. %, minutes)" in table.read_text()
    classify = run_in_process(SCRIPT, [f"GUT={log}", "--out", str(tmp_path / "c.png"), "--setup", "classify"])
    assert classify.returncode == 0, classify.stderr
    wrong = run_in_process(SCRIPT, [f"GUT={log}", "--out", str(tmp_path / "w.png"), "--setup", "pairs"])
    assert wrong.returncode != 0 and "'pairs'" in wrong.stderr and "classify" in wrong.stderr
    empty = tmp_path / "empty.log"
    empty.write_text(LOG.splitlines()[0] + "\n")
    # the first call above is a real process (the script's entry point); the others run its
    # main in the test's process (run_in_process): they start no tool
    bad = run_in_process(SCRIPT, [f"X={empty}", "--out", str(tmp_path / "x.png")])
    assert bad.returncode != 0 and "no validation" in bad.stderr
    assert not (tmp_path / "x.png").exists()


def test_saved_curves_round_trip_and_points_without_time_are_drawn_by_updates_only(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(LOG)
    curves = tmp_path / "curves"
    done = run_in_process(SCRIPT, [f"SUT bias -3={log}", "--out", str(tmp_path / "a.png"),
                                   "--save-curves", str(curves)])
    assert done.returncode == 0, done.stderr
    saved = curves / "SUT_bias_-3.json"
    import json

    data = json.loads(saved.read_text())
    assert data["source"] == str(log)
    assert [(p["updates"], p["seconds"], p["accuracy"]) for p in data["points"]] == [
        (1000, 330.0, 77.756), (2000, 390.0, 80.16)]
    untimed = tmp_path / "old.json"
    untimed.write_text(json.dumps({"label": "old", "source": "docs table", "points": [
        {"updates": 1000, "accuracy": 77.5, "seconds": None}]}))
    table = tmp_path / "t.md"
    done = run_in_process(SCRIPT, [f"SUT={saved}", f"Old={untimed}", "--out", str(tmp_path / "b.png"),
                                   "--table", str(table)])
    assert done.returncode == 0, done.stderr
    assert "| 1,000 | 77.76 (6) | 77.50 (–) |" in table.read_text()
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_malformed_curve_file_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"points": [{"updates": "1k", "accuracy": 80, "seconds": null}]}')
    done = run_in_process(SCRIPT, [f"X={bad}", "--out", str(tmp_path / "x.png")])
    assert done.returncode != 0 and "bad.json is not a curve file" in done.stderr
    assert not (tmp_path / "x.png").exists()
