"""scripts/logic/gut_ablation.py (issue #52): each variant's GUT differs from the old
recipe's (``as-before``) in exactly the difference it undoes, the runs go one per
directory, and the report reads their results into one table."""
import json
import os
import sys

import pytest

from test_logic_recipe import commands, in_process, recipe

ABLATION = os.path.join(os.path.dirname(recipe.__file__), "gut_ablation.py")


def trains(tmp_path, *extra):
    out = in_process([sys.executable, ABLATION, "--dry-run", "--data-dir", str(tmp_path / "d"),
                      "--work-dir", str(tmp_path / "w"), *extra]).stdout
    found = {}
    for argv in commands(out, "fairseq-train"):
        save_dir = argv[argv.index("--save-dir") + 1]
        found[os.path.relpath(save_dir, tmp_path / "w").split(os.sep)[0]] = argv
    return found


def options(argv):
    """The command's options as {flag: value or True}, the save directory left out."""
    parsed, i = {}, 2
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            parsed[argv[i]] = argv[i + 1]
            i += 2
        else:
            parsed[argv[i]] = True
            i += 1
    parsed.pop("--save-dir")
    return parsed


def test_each_variant_differs_from_the_old_recipe_in_what_it_undoes(tmp_path):
    found = {name: options(argv) for name, argv in trains(tmp_path).items()}
    assert list(found) == ["as-before", "decoder-halting", "kv-state", "schedule", "setup", "paper"]
    before = found["as-before"]
    assert (before["--decoder-halting"], before["--encoder-halting"], before["--lr-scheduler"],
            before["--task"], before["--max-update"], before["--warmup-updates"]) == \
        ("global-mean", "global-mean", "inverse_sqrt", "translation", "2000", "500")
    assert "--encoder-halting-kv" not in before            # the default: the mixture

    def changed(name):
        return {k: v for k, v in found[name].items() if before.get(k) != v} | \
            {k: None for k in before if k not in found[name]}

    assert changed("decoder-halting") == {"--decoder-halting": "stick-breaking"}
    assert changed("kv-state") == {"--encoder-halting-kv": "state"}
    assert changed("schedule") == {"--lr-scheduler": "fixed"}
    setup, paper = found["setup"], found["paper"]
    assert setup["--task"] == paper["--task"] == "sut_classification"
    assert (setup["--encoder-halting-kv"], paper["--encoder-halting-kv"]) == ("mixture", "state")
    assert {k: v for k, v in paper.items() if setup.get(k) != v} == {"--encoder-halting-kv": "state"}
    assert setup["--batch-size"] == "64" and setup["--lr-scheduler"] == "fixed"


def test_the_report_tables_the_variants_with_results(tmp_path):
    work = tmp_path / "w"
    for variant, setup, accuracy in (("as-before", "", 50.0), ("paper", "classify", 60.0)):
        run = work / variant / setup / "gut" / "standard" / "seed1"
        run.mkdir(parents=True)
        scores = {str(k): {"accuracy": accuracy + k} for k in range(7, 13)}
        (run / "result.json").write_text(json.dumps({"accuracy": scores, "updates": 2000}))
    # the paper run's log: 1,000 updates at 0.5 update/s then 1,000 at 1 update/s: 0.83 hours
    (work / "paper" / "classify" / "gut" / "standard" / "seed1" / "train.log").write_text(
        "| train_inner | epoch 001:  10 / 20 loss=1, ups=0.5, num_updates=1000, lr=0.1\n"
        "| train_inner | epoch 001:  20 / 20 loss=1, ups=1, num_updates=2000, lr=0.1\n")
    out = in_process([sys.executable, ABLATION, "--work-dir", str(work), "--stage", "report",
                      "--variants", "as-before", "paper", "setup"]).stdout
    table = (work / "ablation.md").read_text()
    assert table in out
    assert "| as-before | none | 57.0 | 58.0 | 59.0 | 60.0 | 61.0 | 62.0 | 2000 | – |" in table, table
    assert "| paper | all | 67.0 | 68.0 | 69.0 | 70.0 | 71.0 | 72.0 | 2000 | 0.83 |" in table, table
    assert "| setup | (4) the setup | – | – | – | – | – | – | not run | – |" in table, table
    summary = json.loads((work / "ablation.json").read_text())
    assert list(summary["variants"]) == ["as-before", "paper"]
    assert summary["variants"]["as-before"]["core_hours"] is None
    assert abs(summary["variants"]["paper"]["core_hours"] - 2000 / 3600 * 1.5) < 1e-9


@pytest.mark.parametrize("flag", ["--max-update", "--warmup", "--interval"])
def test_a_budget_below_one_is_refused(tmp_path, flag):
    proc = in_process([sys.executable, ABLATION, "--dry-run", flag, "0"], check=False)
    assert proc.returncode == 2 and f"{flag} 0 is invalid: must be >= 1" in proc.stderr
