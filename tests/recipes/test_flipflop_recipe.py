"""The flip-flop recipe (scripts/flipflop/table3.py over sut_fairseq.recipes.split_grid):
the dry-run grid of both configurations, the subset helpers, the report on hand-made
results, and smoke runs on tiny data: UT and GUT always, TLB and GUTLB (with the
memory-reset control) once the model has its chunking options."""
import json
import os
import sys

import pytest

from split_recipes import (ROOT, check_smoke, commands, in_process, load_script,
                           smoke, stages, value)

SCRIPTS = os.path.join(ROOT, "scripts", "flipflop")
TABLE3 = os.path.join(SCRIPTS, "table3.py")
GENERATE = os.path.join(ROOT, "data-prep", "flipflop", "generate.py")
sys.path.insert(0, SCRIPTS)
import flipflop_recipe as recipe  # noqa: E402

summarize = load_script(os.path.join(SCRIPTS, "summarize.py"), "flipflop_summarize")

SPLITS = [f"test{n}-p{p:g}" for n in (64, 128) for p in (0.1, 0.8, 0.98)]
CHUNKED = ("tlb", "gutlb", "sut-chunked")


def test_dry_run_cpu_grid_gives_every_model_the_same_budget(tmp_path):
    out = in_process([sys.executable, TABLE3, "--data-dir", tmp_path / "d", "--work-dir", tmp_path / "w",
                      "--dry-run", "--max-update", "1234"]).stdout
    assert stages(out) == ["data", "train", "evaluate", "report"]
    (gen,) = commands(out, "generate.py")
    assert value(gen, "--config") == "small" and "--binarize" in gen
    trains = dict(zip(recipe.MODELS, commands(out, "fairseq-train")))
    assert list(trains) == ["ut", "gut", "tlb", "gutlb", "sut-chunked"]
    for option in ("--max-update", "--max-tokens", "--lr", "--seed", "--encoder-embed-dim",
                   "--decoder-layers", "--weight-decay", "--halting-threshold"):
        assert len({value(t, option) for t in trains.values()}) == 1, option
    assert value(trains["ut"], "--max-update") == "1234"
    assert value(trains["ut"], "--encoder-halting") == "stick-breaking"
    gut = trains["gut"]
    assert value(gut, "--encoder-halting") == "global-mean" and "--halting-transition" in gut and "--gated-ffn" in gut
    for model in CHUNKED:
        t = trains[model]
        assert (value(t, "--encoder-chunk-size"), value(t, "--encoder-memory-slots"),
                value(t, "--tlb-encoder-out")) == ("8", "4", "memory")
    for model in ("ut", "gut"):
        assert "--encoder-chunk-size" not in trains[model]
    assert [value(trains[m], "--arch") for m in recipe.MODELS] == \
        ["ut_cpvr", "ut_cpvr", "tlb_flipflop", "gutlb_flipflop", "tlb_flipflop"]
    assert [value(trains[m], "--encoder-layers") for m in recipe.MODELS] == ["8", "8", "2", "4", "4"]
    assert {(value(t, "--rel-pos"), value(t, "--rel-window")) for t in trains.values()} == {("clipped", "8")}
    assert value(trains["tlb"], "--encoder-halting") == "none"
    assert value(trains["sut-chunked"], "--att-experts") == "8" and value(trains["sut-chunked"], "--att-heads") == "2"
    generates = commands(out, "fairseq-generate")
    resets = [g for g in generates if "--model-overrides" in g]
    assert len(generates) == 5 * 6 + 3 * 6 and len(resets) == 3 * 6
    assert all("tlb_memory_reset" in " ".join(g) for g in resets)
    assert [value(g, "--gen-subset") for g in generates[:6]] == ["test"] + [f"test{k}" for k in range(1, 6)]
    assert "generate-test128-p0.98-reset.txt" in out
    assert not os.path.exists(tmp_path / "d") and not os.path.exists(tmp_path / "w")


def test_dry_run_full_configuration_scales_data_and_models(tmp_path):
    out = in_process([sys.executable, TABLE3, "--data-dir", tmp_path / "d", "--work-dir", tmp_path / "w",
                      "--dry-run", "--config", "full", "--stop-stage", "train"]).stdout
    assert value(commands(out, "generate.py")[0], "--config") == "paper"
    trains = dict(zip(recipe.MODELS, commands(out, "fairseq-train")))
    assert {value(t, "--encoder-embed-dim") for t in trains.values()} == {"512"}
    assert {value(t, "--batch-size") for t in trains.values()} == {"16"}
    assert [value(trains[m], "--encoder-layers") for m in recipe.MODELS] == ["10", "20", "3", "10", "10"]
    assert value(trains["ut"], "--act-weight") == "0.1" and value(trains["tlb"], "--act-weight") == "0"
    assert value(trains["tlb"], "--encoder-chunk-size") == "10" and value(trains["gutlb"], "--encoder-memory-slots") == "10"
    assert value(trains["sut-chunked"], "--att-heads") == "4" and value(trains["sut-chunked"], "--ffd-hidden-dim") == "1024"
    refused = in_process([sys.executable, TABLE3, "--config", "huge", "--dry-run"], check=False)
    assert refused.returncode == 2 and "unknown --config 'huge': choose from cpu, full" in refused.stderr


def test_subset_and_chunk_helpers():
    meta = [{"write": 0, "carrier": 0, "read": 62}, {"write": 60, "carrier": 60, "read": 62},
            {"write": 54, "carrier": 54, "read": 62}, {"write": 52, "carrier": 52, "read": 62},
            {"write": 0, "carrier": 58, "read": 62}]
    # answer bits at 1, 61, 55, 53, 59 against the read at 62: chunks of 8 -> 0, 7, 6, 6, 7 vs 7
    # (the last example's write is in chunk 0, but a read in the read's chunk repeats its bit)
    assert recipe.subset(meta, 8) == [True, False, True, True, False]
    assert recipe.subset(meta, 64) == [False] * 5
    with pytest.raises(Exception, match="no 'carrier' field"):
        recipe.subset([{"write": 0, "read": 62}], 8)
    assert recipe.subset_accuracy([True, True, False, False], [True, False, True, True]) == pytest.approx(100 / 3)
    assert recipe.subset_accuracy([True], [False]) is None
    with pytest.raises(Exception, match="2 scored examples but 1 meta records"):
        recipe.subset_accuracy([True, False], [True])
    assert recipe.chunk_size(["--encoder-chunk-size", "8"]) == 8 and recipe.chunk_size(["--lr", "1"]) == 0


def _stats(data_dir):
    data_dir.mkdir()
    settings = {s: {"length": int(s[4:].split("-")[0]), "p_ignore": float(s.split("-p")[1])} for s in SPLITS}
    splits = {s: {"baselines": {"previous_bit": 0.6, "majority": 0.5}} for s in SPLITS}
    (data_dir / "stats.json").write_text(json.dumps({
        "config": {"train_length": 64, "train_p_ignore": 0.8}, "settings": settings, "splits": splits}))


def _result(work, model, label, seed, accuracy, subset, reset=None, steps=None, max_steps=8,
            per_chunk=None, subset_size=100):
    path = work / model / f"seed{seed}"
    path.mkdir(parents=True)
    splits = {s: {"accuracy": accuracy, "subset_accuracy": subset, "reset_accuracy": reset,
                  "reset_subset_accuracy": reset, "mean_encoder_steps": steps, "subset_size": subset_size,
                  "mean_encoder_steps_per_chunk": per_chunk, "subset_chunk_size": 8} for s in SPLITS}
    (path / "result.json").write_text(json.dumps({
        "model": model, "label": label, "seed": seed, "params": 1000, "updates": 50,
        "max_steps": max_steps, "splits": splits}))


def test_report_sets_models_beside_baselines_and_checks_the_cpu_experiment(tmp_path):
    work, data = tmp_path / "w", tmp_path / "d"
    _stats(data)
    _result(work, "tlb", "TLB", 1, 99.0, 98.0, reset=50.0, max_steps=3)
    _result(work, "tlb", "TLB", 2, 97.0, 96.0, reset=54.0, max_steps=3)
    _result(work, "gutlb", "GUTLB", 1, 92.0, 90.0, reset=75.0, steps=2.5, per_chunk=3.0)
    _result(work, "ut", "UT", 1, 80.0, 70.0, steps=8.0)
    text = summarize.summarize(str(work), str(data))
    lines = text.splitlines()
    first = lambda prefix: next(k for k, l in enumerate(lines) if l.startswith(prefix))  # noqa: E731
    assert first("| UT |") < first("| TLB |") < first("| GUTLB |")   # the grid's order
    # two seeds (99 and 97 on every split): mean ± sample standard deviation (√2)
    assert "| TLB | 1,000 | 50/50 | " + " | ".join(["98.0 ± 1.4"] * 6) + " |" in text
    assert "| TLB | " + " | ".join(["97.0 ± 1.4"] * 6) + " |" in text  # subsets: 98 and 96
    assert "| GUTLB | 1,000 | 50 | 92.0 | " in text  # one seed: no ± (a spread of 0 is no measurement)
    assert "| *the bit before the final r* | – | – | *60.0* |" in text
    assert "| TLB, memory reset every chunk | 52.0 |" in text
    assert "| UT | 8 | 100 |" in text
    checks = {row[0]: row[2] for row in json.load(open(work / "table3.json"))["checks"]}
    assert checks["TLB: accuracy on test64-p0.8 ≥ 95%"] == "pass"
    assert checks["UT: accuracy on test128-p0.8 ≥ 90%"] == "FAIL"
    assert checks["GUTLB: memory reset, answer only before the read's chunk, test64-p0.8 ≤ 60%"] == "FAIL"
    assert checks["TLB: memory reset, answer only before the read's chunk, test128-p0.98 ≤ 60%"] == "pass"
    assert checks["GUTLB within 3 points of TLB on test64-p0.8"] == "FAIL"   # 92 against 98
    assert checks["GUTLB mean executed steps per chunk < L = 8 on test64-p0.8"] == "pass"
    assert "| GUTLB | 3.00 | 3.00 |" in text and "steps per chunk" in text   # the chunked models only
    assert "| GUTLB | 83.19 | 99.97 |" in text                    # the paper's Table 3
    assert (work / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_reset_control_is_not_judged_on_a_handful_of_examples(tmp_path):
    """A subset below the checks' minimum size (at p_i 0.1 it holds a few examples) gets
    no memory-reset check, whatever its accuracy; the accuracy checks stay."""
    work, data = tmp_path / "w", tmp_path / "d"
    _stats(data)
    _result(work, "tlb", "TLB", 1, 99.0, 98.0, reset=75.0, max_steps=3,
            subset_size=recipe.CHECKS["reset_subset_min_size"] - 1)
    summarize.summarize(str(work), str(data))
    checks = {row[0]: row[2] for row in json.load(open(work / "table3.json"))["checks"]}
    assert not any("memory reset" in name for name in checks)
    assert checks["TLB: accuracy on test64-p0.8 ≥ 95%"] == "pass"


@pytest.fixture(scope="module")
def smoke_gut(tmp_path_factory):
    """GUT (the depth-wise models' recipe path; UT differs by its configuration only, which
    the dry runs check)."""
    return smoke(tmp_path_factory.mktemp("flipflop"), GENERATE, TABLE3, ["gut"],
                 ["--train-length", 16, "--train-size", 60, "--valid-size", 2, "--test-size", 8,
                  "--test-lengths", 16, "--test-p-ignore", "0.5,0.9"])


def test_smoke_gut_trains_then_resumes_at_evaluation(smoke_gut):
    runs = check_smoke(smoke_gut, ["gut"], {"test16-p0.5": 8, "test16-p0.9": 8})
    assert len(commands(smoke_gut["second"], "fairseq-generate")) == 2   # no reset runs
    for model, result in runs.items():
        split = result["splits"]["test16-p0.9"]
        assert split["chunk_size"] == 0 and split["subset_chunk_size"] == 8
        assert split["reset_accuracy"] is None and 0 <= split["subset_size"] <= 8
        assert result["max_steps"] == 3 and 1 <= split["mean_encoder_steps"] <= 3
    text = (smoke_gut["work"] / "table3.md").read_text()
    assert "| GUT |" in text and (smoke_gut["work"] / "accuracy.png").exists()


@pytest.mark.slow  # 19 s; the recipe's smoke by default: test_smoke_gut_trains_then_resumes_at_evaluation
def test_smoke_gutlb_with_the_memory_reset_control(tmp_path):
    """GUTLB (the chunk-wise models' path with the step cap; TLB differs by configuration)."""
    result = smoke(tmp_path, GENERATE, TABLE3, ["gutlb"],
                   ["--train-length", 24, "--train-size", 60, "--valid-size", 2, "--test-size", 8,
                    "--test-lengths", 24, "--test-p-ignore", "0.9"])
    runs = check_smoke(result, ["gutlb"], {"test24-p0.9": 8})
    resets = [g for g in commands(result["second"], "fairseq-generate") if "--model-overrides" in g]
    assert len(resets) == 1
    for model, run_result in runs.items():
        split = run_result["splits"]["test24-p0.9"]
        assert split["chunk_size"] == 8 and split["subset_chunk_size"] == 8
        assert 0 <= split["reset_accuracy"] <= 100
        assert (split["reset_subset_accuracy"] is None) == (split["subset_size"] == 0)
    assert runs["gutlb"]["max_steps"] == 3 and 1 <= runs["gutlb"]["splits"]["test24-p0.9"]["mean_encoder_steps"] <= 3
    assert "memory reset every chunk" in (result["work"] / "table3.md").read_text()
