"""The ListOps recipe (scripts/listops/table1.py over sut_fairseq.recipes.split_grid): the
dry-run grid of both configurations, the report on hand-made results, and smoke runs on
tiny data: UT and GUT always, TLB and GUTLB once the model has its chunking options."""
import json
import os
import sys

import pytest

from split_recipes import (ROOT, check_smoke, commands, in_process, load_script,
                           smoke, stages, value)

SCRIPTS = os.path.join(ROOT, "scripts", "listops")
TABLE1 = os.path.join(SCRIPTS, "table1.py")
GENERATE = os.path.join(ROOT, "data-prep", "listops", "generate.py")
sys.path.insert(0, SCRIPTS)
import listops_recipe as recipe  # noqa: E402

summarize = load_script(os.path.join(SCRIPTS, "summarize.py"), "listops_summarize")

SPLITS = ["test-iid", "test-len200-300", "test-len500-600", "test-len900-1000", "test-args10",
          "test-args15"]


def test_dry_run_cpu_grid(tmp_path):
    out = in_process([sys.executable, TABLE1, "--setup", "seq2seq", "--data-dir", tmp_path / "d",
                      "--work-dir", tmp_path / "w", "--dry-run", "--seeds", "1", "2"]).stdout
    assert stages(out) == ["data", "train", "evaluate", "report"]
    assert value(commands(out, "generate.py")[0], "--config") == "small"
    trains = commands(out, "fairseq-train")
    assert len(trains) == 5 * 2 and [value(t, "--seed") for t in trains[:2]] == ["1", "2"]
    for option in ("--max-update", "--max-tokens", "--lr", "--lr-scheduler", "--encoder-embed-dim"):
        assert len({value(t, option) for t in trains}) == 1, option
    by_model = dict(zip(recipe.MODELS, trains[::2]))
    assert [value(by_model[m], "--encoder-layers") for m in recipe.MODELS] == ["10", "10", "2", "5", "5"]
    for model in ("tlb", "gutlb", "sut-chunked"):
        assert (value(by_model[model], "--encoder-chunk-size"), value(by_model[model], "--encoder-memory-slots"),
                value(by_model[model], "--encoder-memory-update-layers")) == ("20", "20", "1")
    generates = commands(out, "fairseq-generate")
    assert len(generates) == 5 * 2 * 6 and not any("--model-overrides" in g for g in generates)
    assert [value(g, "--gen-subset") for g in generates[:6]] == ["test"] + [f"test{k}" for k in range(1, 6)]
    assert "generate-test-len900-1000.txt" in out
    assert not os.path.exists(tmp_path / "d")


def test_dry_run_full_configuration_and_split_choice(tmp_path):
    out = in_process([sys.executable, TABLE1, "--setup", "seq2seq", "--data-dir", tmp_path / "d",
                      "--work-dir", tmp_path / "w", "--dry-run", "--config", "full", "--models", "ut", "sut-chunked",
                      "--splits", "test-iid", "test-args15"]).stdout
    assert value(commands(out, "generate.py")[0], "--config") == "paper"
    ut, sut = commands(out, "fairseq-train")
    assert value(ut, "--encoder-embed-dim") == "512" and value(ut, "--act-weight") == "0.1"
    assert value(ut, "--lr-scheduler") == "inverse_sqrt" and value(ut, "--batch-size") == "32"
    assert value(sut, "--att-heads") == "4" and value(sut, "--ffd-hidden-dim") == "512"
    assert [value(g, "--gen-subset") for g in commands(out, "fairseq-generate")] == ["test", "test5"] * 2
    bad = in_process([sys.executable, TABLE1, "--setup", "seq2seq", "--data-dir", tmp_path / "d", "--dry-run", "--stage",
                      "evaluate", "--splits", "test-len2"], check=False)
    assert bad.returncode != 0 and "no test split 'test-len2'" in bad.stderr + bad.stdout


def test_report_sets_models_beside_the_majority_and_the_paper(tmp_path):
    work, data = tmp_path / "w", tmp_path / "d"
    data.mkdir()
    (data / "stats.json").write_text(json.dumps({
        "config": {"train_max_length": 100},
        "binarized_test_splits": {s: ("test" if k == 0 else f"test{k}") for k, s in enumerate(SPLITS)},
        "splits": {s: {"majority": {"label": 9, "share": 0.17}} for s in SPLITS}}))
    for model, label, seed, acc in (("gut", "GUT", 1, 80.0), ("gut", "GUT", 2, 70.0), ("ut", "UT", 1, 60.0),
                                    ("transformer", "Transformer", 1, 50.0)):
        path = work / model / f"seed{seed}"
        path.mkdir(parents=True)
        steps = None if model == "transformer" else 4.0  # fairseq's encoder counts no steps
        (path / "result.json").write_text(json.dumps({
            "model": model, "label": label, "seed": seed, "params": 2000, "updates": 40, "max_steps": 10,
            "splits": {s: {"accuracy": acc if s == "test-iid" else 20.0, "mean_encoder_steps": steps}
                       for s in SPLITS}}))
    # GUT's train.logs: seed 1 at 1 update/s validating at 50 then 60 %, seed 2 at 0.5/s at 40 %
    for seed, ups, valids in ((1, 1.0, (50, 60)), (2, 0.5, (40,))):
        (work / "gut" / f"seed{seed}" / "train.log").write_text(
            f"| train_inner | epoch 001:  40 / 469 loss=1.6, ups={ups}, wpb=900, num_updates=40, lr=7e-4\n"
            + "".join(f"| valid on 'valid' subset | loss 1.3 | accuracy {v} | num_updates 40\n" for v in valids))
    text = summarize.summarize(str(work), str(data))
    # the training table: best validations 60 and 40 (50.0 ± 14.1), 40 s and 80 s of training
    assert "| GUT | 40/40 | 50.0 ± 14.1 | 0.02 | 0.03 |" in text and "| UT | 40 | – | – | – |" in text
    # two seeds: mean ± sample standard deviation (80 and 70: 75.0 ± 7.1; equal values: ± 0.0)
    assert "| GUT | 2,000 | 40/40 | 75.0 ± 7.1 | " + " | ".join(["20.0 ± 0.0"] * 5) + " |" in text
    assert "| UT | 2,000 | 40 | 60.0 | 20.0 |" in text  # one seed: the value alone
    assert text.index("| UT |") < text.index("| GUT |")
    # the classify setup's baseline, after the recurrent models, with no steps of its own
    assert "| Transformer | 2,000 | 40 | 50.0 | 20.0 |" in text
    assert text.index("| GUT |") < text.index("| Transformer |") < text.index("| *majority")
    steps = text[text.index("Mean executed encoder steps"):text.index("Training per run")]
    assert "| UT | 4.00 |" in steps and "Transformer" not in steps
    assert "| *majority label of the split* | – | – | *17.0* |" in text
    assert "| *paper: TLB* | – | – | *58.3* | *37.7* | *30.5* | *25.0* | *37.3* | *37.0* |" in text
    assert "| UT | 4.00 |" in text
    summary = json.load(open(work / "table1.json"))
    assert summary["models"]["gut"]["accuracy"]["test-iid"][:2] == [75.0, pytest.approx(7.0711, abs=1e-4)]
    assert (work / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke_gut(tmp_path_factory):
    """GUT (the depth-wise models' recipe path; UT differs by its configuration only, which
    the dry runs check)."""
    return smoke(tmp_path_factory.mktemp("listops"), GENERATE, TABLE1, ["gut"],
                 ["--train-size", 80, "--valid-size", 4, "--iid-test-size", 8, "--test-size", 4,
                  "--splits", "test-args10"], ["--setup", "seq2seq"])


def test_smoke_gut_trains_then_resumes_at_evaluation(smoke_gut):
    runs = check_smoke(smoke_gut, ["gut"], {"test-iid": 8, "test-args10": 4})
    for result in runs.values():
        assert result["max_steps"] == 3 and 1 <= result["splits"]["test-iid"]["mean_encoder_steps"] <= 3
    assert "| GUT |" in (smoke_gut["work"] / "table1.md").read_text()


@pytest.mark.slow  # 19 s; the chunk-wise path (TLB) trains by default in test_listops_classify.py,
# this recipe's smoke in test_smoke_gut_trains_then_resumes_at_evaluation
def test_smoke_gutlb(tmp_path):
    """GUTLB (the chunk-wise models' path; TLB differs by its configuration)."""
    result = smoke(tmp_path, GENERATE, TABLE1, ["gutlb"],
                   ["--train-size", 80, "--valid-size", 4, "--iid-test-size", 8, "--test-size", 4,
                    "--splits", "test-len200-300"], ["--setup", "seq2seq"])
    check_smoke(result, ["gutlb"], {"test-iid": 8, "test-len200-300": 4})
    assert "| GUTLB |" in (result["work"] / "table1.md").read_text()
