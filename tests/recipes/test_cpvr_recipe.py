"""The C-PVR recipe (scripts/cpvr/hops.py over the shared template): the dry-run grid,
Spearman's rho, the report on hand-made results, and a smoke run of two of the models end
to end (tiny data and models, a few updates) in two calls, stopped after training and
resumed at evaluation."""
import json
import os
import subprocess
import sys

import pytest

from cli_helpers import run_in_process

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(ROOT, "scripts", "cpvr")
HOPS = os.path.join(SCRIPTS, "hops.py")
sys.path.insert(0, SCRIPTS)
import summarize  # noqa: E402

TINY = ("--encoder-embed-dim 16 --decoder-embed-dim 16 --att-head-dim 4 --ffd-hidden-dim 16 "
        "--encoder-layers 3 --decoder-layers 3 --hyper-embed-dim 4 "
        "--max-tokens 512 --log-interval 1")


def run(command, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def in_process(command, check=True):
    """``run`` for a command that starts no tool (a dry run, an argument check):
    ``[sys.executable, SCRIPT, *args]`` called in the test's process (``run_in_process``),
    without the seconds a new interpreter spends importing torch and fairseq."""
    assert command[0] == sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_in_process(command[1], command[2:], env=env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def commands(out, name):
    """The printed command lines (``+ ...``) that run ``name``."""
    return [l[2:].split() for l in out.splitlines() if l.startswith("+ ") and name in l.split(" > ")[0]]


def value(command, option):
    return command[len(command) - 1 - command[::-1].index(option) + 1]


def test_dry_run_gives_every_model_the_same_budget_and_batches(tmp_path):
    out = in_process([sys.executable, HOPS, "--data-dir", tmp_path / "d", "--work-dir", tmp_path / "w",
                      "--dry-run", "--max-update", "1234"]).stdout
    stages = [l.split(":")[1].split()[0] for l in out.splitlines() if l.startswith("=== stage")]
    assert stages == ["data", "train", "evaluate", "report"]
    (gen,) = commands(out, "generate.py")
    assert value(gen, "--config") == "small" and "--binarize" in gen
    trains = commands(out, "fairseq-train")
    assert [value(t, "--arch") for t in trains] == ["ut_cpvr", "ut_cpvr", "hyper_ut_cpvr"]
    for option in ("--max-update", "--max-tokens", "--lr", "--seed", "--lr-scheduler", "--act-weight"):
        assert len({value(t, option) for t in trains}) == 1, option
    assert value(trains[0], "--max-update") == "1234"
    assert value(trains[1], "--att-experts") == "8" and value(trains[1], "--mim-weight") == "0.01"
    generates = commands(out, "fairseq-generate")
    assert len(generates) == 27  # 3 models x 9 hops
    assert [value(g, "--gen-subset") for g in generates[:9]] == ["test"] + [f"test{k}" for k in range(1, 9)]
    assert len(commands(out, "sut_fairseq.analysis.halting_depth")) == 3
    assert not os.path.exists(tmp_path / "d") and not os.path.exists(tmp_path / "w")


def test_stage_range_and_unknown_model(tmp_path):
    out = in_process([sys.executable, HOPS, "--data-dir", tmp_path / "d", "--work-dir", tmp_path / "w",
                      "--stage", "train", "--stop-stage", "train", "--models", "hyper-ut", "--dry-run"]).stdout
    assert len(commands(out, "fairseq-train")) == 1 and not commands(out, "fairseq-generate")
    proc = in_process([sys.executable, HOPS, "--models", "lstm", "--dry-run"], check=False)
    assert proc.returncode == 2 and "invalid choice: 'lstm'" in proc.stderr


def _result(work, model, label, seed, accuracy, depth, decoder_depth=None):
    path = work / model / f"seed{seed}"
    path.mkdir(parents=True)
    result = {"model": model, "label": label, "seed": seed, "params": 1000, "updates": 50, "max_steps": 16,
              "accuracy": {str(n): a for n, a in enumerate(accuracy, 1)},
              "encoder_depth": {str(n): d for n, d in enumerate(depth, 1)}}
    if decoder_depth is not None:
        result["decoder_depth"] = {str(n): d for n, d in enumerate(decoder_depth, 1)}
    (path / "result.json").write_text(json.dumps(result))


def test_report_averages_seeds_and_sets_models_beside_the_baselines(tmp_path):
    work, data = tmp_path / "w", tmp_path / "d"
    data.mkdir()
    hops = {str(n): {"size": 10, "copy_first": 1.0 if n == 1 else 0.1, "majority": 0.02,
                     "capped_4": 1.0 if n <= 4 else 0.01} for n in range(1, 10)}
    (data / "baselines.json").write_text(json.dumps({"majority_label": 17, "capped_hops": 4, "hops": hops}))
    rising = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 7.5, 8.0, 8.0]
    # the decoder's depth as Hyper-UT's at 10,000 updates: rising to hop 5, falling after
    decoder = [1.15, 2.28, 2.94, 3.25, 3.27, 3.17, 3.10, 3.04, 3.00]
    _result(work, "hyper-ut", "Hyper-UT", 1, [100.0] * 4 + [40.0] * 5, rising, decoder)
    _result(work, "hyper-ut", "Hyper-UT", 2, [98.0] * 4 + [20.0] * 5, rising, decoder)
    _result(work, "ut", "UT", 1, [90.0] * 9, [16.0] * 9)  # no decoder depth: no decoder row
    text = summarize.summarize(str(work), str(data))
    lines = text.splitlines()
    assert lines.index(next(l for l in lines if l.startswith("| UT |"))) < \
        lines.index(next(l for l in lines if l.startswith("| Hyper-UT |")))  # the grid's order
    assert "| Hyper-UT | 1,000 | 50/50 | 99.0 | 99.0 | 99.0 | 99.0 | 30.0 | 30.0 |" in text
    assert "| *solver capped at 4 hops* | – | – | *100.0* | *100.0* | *100.0* | *100.0* | *1.0* |" in text
    assert "| *copy a[0]* | – | – | *100.0* | *10.0* |" in text
    assert "| Hyper-UT | encoder | 16 | 2.00 | 3.00 |" in text
    depth_rows = [l for l in lines if l.startswith(("| UT |", "| Hyper-UT |")) and "| 16 |" in l]
    assert [l.split(" | ")[1] for l in depth_rows] == ["encoder", "encoder", "decoder"]
    assert depth_rows[1].endswith("| 1.00 |")
    # decoder ranks 1 2 3 5 6 4 over hops 1-6: rho = 1 - 6 * (1 + 1 + 4) / (6 * 35) = 0.829
    assert depth_rows[2].startswith("| Hyper-UT | decoder | 16 | 1.15 | 2.28 |") and depth_rows[2].endswith("| 0.83 |")
    summary = json.load(open(work / "hops.json"))
    assert summary["models"]["ut"]["encoder_depth_spearman_1_6"] is None  # constant depth
    assert summary["models"]["ut"]["decoder_depth_spearman_1_6"] is None  # not reported
    assert summary["models"]["hyper-ut"]["decoder_depth_spearman_1_6"] == pytest.approx(1 - 36 / 210)
    assert summary["models"]["hyper-ut"]["decoder_depth"]["3"][0] == pytest.approx(2.94)
    assert summary["models"]["hyper-ut"]["accuracy"]["5"][:2] == [30.0, pytest.approx(14.142, abs=1e-3)]
    for name in ("accuracy.png", "depth.png"):
        assert (work / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpvr")
    data, work = root / "data", root / "work"
    prep = run([sys.executable, os.path.join(ROOT, "data-prep", "cpvr", "generate.py"), "--config", "small",
                "--train-per-hop", "60", "--valid-per-hop", "10", "--test-per-hop", "8",
                "--test-hops", "1-2", "--out", data, "--binarize", "--no-progress"]).stdout
    # two of the three models (the SUT is the UT's model with experts: the same recipe path)
    command = [sys.executable, HOPS, "--data-dir", data, "--work-dir", work, "--max-update", "3",
               "--models", "ut", "hyper-ut", "--train-args", TINY]
    first = run(command + ["--stop-stage", "train"]).stdout
    second = run(command + ["--stage", "evaluate"]).stdout
    return {"data": data, "work": work, "first": first, "second": second, "prep": prep}


def test_smoke_trains_two_models_then_resumes_at_evaluation(smoke):
    first, second = smoke["first"], smoke["second"]
    assert "data is complete" in first and not commands(first, "generate.py")
    assert len(commands(first, "fairseq-train")) == 2 and not commands(first, "fairseq-generate")
    assert "stage 2" not in second and len(commands(second, "fairseq-generate")) == 2 * 2
    for model in ("ut", "hyper-ut"):
        result = json.load(open(smoke["work"] / model / "seed1" / "result.json"))
        assert result["updates"] == 3 and sorted(result["accuracy"], key=int) == ["1", "2"]
        assert all(1 <= d <= 3 for d in result["encoder_depth"].values())
        score = json.load(open(smoke["work"] / model / "seed1" / "score-hop2.json"))
        assert score["total"] == score["lines"] == 8  # every line of the split scored


def test_smoke_report(smoke):
    text = (smoke["work"] / "hops.md").read_text()
    assert all(f"| {label} |" in text for label in ("UT", "Hyper-UT"))
    assert "solver capped at 4 hops" in text and (smoke["work"] / "depth.png").exists()
