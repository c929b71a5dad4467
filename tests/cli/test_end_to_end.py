"""End to end through the stock fairseq command-line tools with ``--user-dir``:
fairseq-preprocess -> fairseq-train (SUT and UT variants) -> checkpoint -> fairseq-generate
with a post-training halting threshold."""
import os
import re
import subprocess
import sys

import pytest
import torch

from sut_fairseq.checkpoint_safety import CHECKPOINT_GLOBALS
from sut_fairseq.data.reverse_task import write_reverse_task
from sut_fairseq.demo import fairseq_tool, generate_command, train_command
from sut_fairseq.eval.generate_output import read_generate_output

N_TEST = 60


def _run(command, timeout=300):
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    prefixes = write_reverse_task(str(root / "text"), seed=3,
                                  sizes={"train": 1500, "valid": 80, "test": N_TEST})
    dest = str(root / "bin")
    _run([fairseq_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
          "--trainpref", prefixes["train"], "--validpref", prefixes["valid"],
          "--testpref", prefixes["test"], "--destdir", dest, "--joined-dictionary",
          "--workers", "1"])
    return dest


def _losses(log):
    return [float(m) for m in re.findall(r"train_inner \|.* loss=([\d.]+)", log)]


def _train(data_bin, save_dir, arch_args, updates=60):
    command = train_command(data_bin, str(save_dir), updates, seed=1,
                            extra=["--log-interval", "10", "--max-tokens", "1024",
                                   "--warmup-updates", "20", *arch_args])
    # train_command already gives --log-interval 100; the later value wins in argparse
    return _run(command)


@pytest.fixture(scope="module")
def sut_run(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("ckpt_sut")
    return save_dir, _train(data_bin, save_dir, ["--arch", "sut_tiny"])


def test_sut_training_lowers_loss_and_logs_aux_terms(sut_run):
    _, log = sut_run
    losses = _losses(log)
    assert len(losses) >= 5
    assert losses[-1] < 0.8 * losses[0], losses
    valid = [l for l in log.splitlines() if "valid on 'valid' subset" in l][-1]
    for key in ("mim", "act_enc", "act_dec", "steps_enc", "steps_dec"):
        assert f"| {key} " in valid, (key, valid)
    assert float(re.search(r"\| mim (-?[\d.]+)", valid).group(1)) < 0


@pytest.mark.parametrize("halting", ["stick-breaking", pytest.param("none", marks=pytest.mark.slow)])
def test_dense_ut_trains(data_bin, tmp_path, halting):
    log = _train(data_bin, tmp_path, ["--arch", "sut_tiny", "--att-experts", "1", "--att-topk", "1",
                                      "--ffd-experts", "1", "--ffd-topk", "1",
                                      "--encoder-halting", halting, "--decoder-halting", halting],
                 updates=40)
    losses = _losses(log)
    assert losses[-1] < 0.85 * losses[0], losses
    if halting == "none":
        valid = [l for l in log.splitlines() if "valid on 'valid' subset" in l][-1]
        assert "| steps_enc 3 |" in valid and "| act_enc 3 |" in valid


def test_checkpoint_needs_only_allow_listed_globals(sut_run):
    save_dir, _ = sut_run
    path = os.path.join(save_dir, "checkpoint_last.pt")
    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in CHECKPOINT_GLOBALS}
    assert unsafe <= allowed, unsafe - allowed


def _executed(out, side):
    return float(re.search(side + r" steps executed ([\d.]+)%", out).group(1))


def test_generate_scores_every_example_and_reports_executed_steps(data_bin, sut_run):
    """A checkpoint written by fairseq-train loads in stock fairseq-generate (torch >= 2.6
    weights_only loading); the run ends with the executed-steps summary, and a lower
    halting threshold given with --model-overrides executes fewer steps."""
    save_dir, _ = sut_run
    ckpt = os.path.join(save_dir, "checkpoint_last.pt")
    figures = {}
    for overrides in (None, "{'halting_threshold': 0.5}"):
        out = _run(generate_command(data_bin, ckpt, overrides=overrides))
        path = os.path.join(save_dir, f"gen-{overrides is not None}.txt")
        with open(path, "w") as f:
            f.write(out)
        examples = read_generate_output(path)
        assert len(examples) == N_TEST
        assert all(e.hypothesis for e in examples)
        figures[overrides] = (_executed(out, "encoder"), _executed(out, "decoder"))
    high, low = figures[None], figures["{'halting_threshold': 0.5}"]
    assert low[0] < high[0] and low[1] < high[1], figures


def test_model_override_changes_the_threshold(data_bin, sut_run):
    from fairseq import checkpoint_utils

    save_dir, _ = sut_run
    path = os.path.join(save_dir, "checkpoint_last.pt")
    models, _ = checkpoint_utils.load_model_ensemble([path], arg_overrides={"halting_threshold": 0.3})
    assert models[0].encoder.side.halting.threshold == 0.3
    assert models[0].decoder.side.halting.threshold == 0.3


def test_fairseq_train_help_lists_the_plugin_options():
    out = _run([fairseq_tool("fairseq-train"), "/dev/null", "--user-dir",
                os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")) + "/sut_fairseq",
                "--task", "translation", "--arch", "sut_tiny",
                "--criterion", "sut_label_smoothed_cross_entropy", "--help"])
    for option in ("--att-experts", "--ffd-hidden-dim", "--rel-window", "--encoder-halting",
                   "--halting-threshold", "--sample-topk", "--gating-dropout",
                   "--mim-weight", "--act-weight", "--switch-weight", "--aux-loss-scale"):
        assert f"\n  {option}" in out, option


def test_teacher_forced_halting_analysis(data_bin, sut_run, tmp_path):
    from sut_fairseq.analysis.halting_analysis import analyse, load

    save_dir, _ = sut_run
    model, task = load(data_bin, os.path.join(save_dir, "checkpoint_last.pt"), subset="test")
    high = analyse(model, task, "test", threshold=0.999)
    low = analyse(model, task, "test", threshold=0.5)
    assert len(high["sentences"]) == N_TEST
    for side in ("encoder", "decoder"):
        assert low[side]["executed_fraction"] < high[side]["executed_fraction"]
        per_step = high[side]["positions_per_step"]
        assert per_step[0] == high[side]["positions"] and per_step == sorted(per_step, reverse=True)
    s = low["sentences"][0]
    assert len(s["encoder_steps"]) == len(s["source"].split()) + 1  # + eos
    assert all(abs(sum(w) - 1) < 1e-5 for w in s["decoder_weights"])
    out = subprocess.run([sys.executable, "-m", "sut_fairseq.analysis.halting_analysis", data_bin,
                          "--path", os.path.join(save_dir, "checkpoint_last.pt"),
                          "--threshold", "0.5", "--output", str(tmp_path / "a.json")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "encoder steps executed" in out.stdout and (tmp_path / "a.json").stat().st_size > 0


COMPILE_ENV = {"SUT_COMPILE_BACKEND": "eager"}


def _train_with_compile_step(data_bin, tmp_path):
    """fairseq-train with ``--compile-step``: both sides' steps compiled, training and
    validation; it learns. (The ``eager`` backend: dynamo's full-graph trace of the same
    steps, without AOTAutograd or C++, to keep the test short; both are tested on the model
    in tests/recurrence/test_compiled_step.py.)"""
    env = {**os.environ, **COMPILE_ENV}
    command = train_command(data_bin, str(tmp_path), 30, seed=1,
                            extra=["--log-interval", "5", "--max-tokens", "1024",
                                   "--warmup-updates", "10", "--arch", "sut_tiny", "--compile-step"])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "--compile-step" not in log, "a fallback to the eager step was reported:\n" + log[-3000:]
    losses = _losses(log)
    assert len(losses) >= 5 and losses[-1] < 0.9 * losses[0], losses
    assert "valid on 'valid' subset" in log


def test_fairseq_train_with_compile_step(data_bin, tmp_path):
    _train_with_compile_step(data_bin, tmp_path)


@pytest.mark.slow  # a second process compiling the encoder's step again: about 20 s more
def test_fairseq_train_and_generate_with_compile_step(data_bin, tmp_path):
    """Then fairseq-generate compiles the encoder's step and decodes incrementally with the
    eager decoder step, every test sentence. (The default suite's beam search with
    --compile-step: test_benchmarks_smoke.py::test_generate_throughput_compiled_rows.)"""
    _train_with_compile_step(data_bin, tmp_path)
    env = {**os.environ, **COMPILE_ENV}
    proc = subprocess.run(generate_command(data_bin, str(tmp_path / "checkpoint_last.pt")),
                          capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "--compile-step" not in out, out[-3000:]
    path = tmp_path / "gen.txt"
    path.write_text(out)
    assert len(read_generate_output(str(path))) == N_TEST
