"""The early-exit sweep on a checkpoint trained through fairseq-train with
``--decoder-halting pabee --exit-loss weighted``: fairseq-generate with the P / S
overrides, exits.csv, the three-curve exits.png; and the option parsing."""
import csv
import os
import struct
import subprocess

import pytest

from conftest import make_model
from sut_fairseq.analysis.exit_sweep import (exit_overrides, parse_entropy, parse_patience, require_offramps,
                                    with_overrides)


def test_parsing_and_overrides():
    assert parse_patience("3, 0,1,1") == [0, 1, 3]
    assert parse_entropy("0.5,0.01") == [0.01, 0.5]
    with pytest.raises(ValueError, match=r"--exit-patience=-1 is invalid"):
        parse_patience("1,-1")
    with pytest.raises(ValueError, match=r"--entropy: 'x' is not a number"):
        parse_entropy("0.1,x")
    assert exit_overrides("pabee", 2) == "{'decoder_halting': 'pabee', 'exit_patience': 2}"
    assert exit_overrides("entropy", 0.1) == "{'decoder_halting': 'entropy', 'exit_entropy': 0.1}"
    assert with_overrides(["g", "--model-overrides", "{}", "--beam", "1"], "{'a': 1}") == \
        ["g", "--model-overrides", "{'a': 1}", "--beam", "1"]


def test_a_checkpoint_without_offramps_is_refused():
    with pytest.raises(SystemExit, match="need a checkpoint with off-ramps"):
        require_offramps(make_model(), "plain.pt")
    require_offramps(make_model(decoder_halting="pabee"), "exits.pt")


@pytest.fixture(scope="module")
def trained_exits(tmp_path_factory):
    from fairseq import options
    from fairseq_cli import preprocess

    from sut_fairseq.data.reverse_task import write_reverse_task
    from sut_fairseq.demo import train_command

    root = tmp_path_factory.mktemp("exits")
    prefixes = write_reverse_task(str(root / "text"), seed=3, sizes={"train": 1500, "valid": 40, "test": 30})
    data_bin = str(root / "bin")
    preprocess.main(options.get_preprocessing_parser().parse_args([
        "--source-lang", "src", "--target-lang", "tgt", "--trainpref", prefixes["train"],
        "--validpref", prefixes["valid"], "--testpref", prefixes["test"], "--destdir", data_bin,
        "--joined-dictionary", "--workers", "1"]))
    save_dir = str(root / "ckpt")
    command = train_command(data_bin, save_dir, 60, seed=1, extra=[
        "--max-tokens", "1024", "--warmup-updates", "20", "--disable-validation",
        "--decoder-layers", "4", "--decoder-halting", "pabee", "--exit-loss", "weighted"])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "exit_loss_1" in log and "exit_loss_4" in log  # logged per step
    return data_bin, os.path.join(save_dir, "checkpoint_last.pt"), root


def test_sweep_decodes_each_patience_and_entropy_and_draws_three_curves(trained_exits):
    from sut_fairseq.analysis import sweep

    data_bin, ckpt, root = trained_exits
    out = root / "sweep"
    assert sweep.main(["--path", ckpt, "--data", data_bin, "--metric", "accuracy",
                       "--thresholds", "0.999", "--output-dir", str(out),
                       "--patience", "0,1", "--entropy", "5"]) == 0
    with open(out / "exits.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["rule"], float(r["value"])) for r in rows] == [("pabee", 0), ("pabee", 1), ("entropy", 5)]
    executed = {(r["rule"], float(r["value"])): float(r["decode_executed_decoder"]) for r in rows}
    assert executed[("pabee", 0)] == 1.0  # never exits: full depth
    assert 0.5 <= executed[("pabee", 1)] < 1.0  # P = 1: the earliest exit is after step 2 of 4
    assert executed[("entropy", 5)] == 0.25  # 5 > ln V: every position stops after step 1 of 4
    for r in rows:
        assert int(r["sentences"]) == 30 and 0 <= float(r["metric"]) <= 100
    with open(out / "exits.png", "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24])[0] > 300
    generated = open(out / "generate-pabee-1.txt").read()
    assert "decoder steps executed" in generated
