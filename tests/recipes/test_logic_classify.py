"""The logic recipe's classify setup (scripts/logic/table5.py --setup classify, issue #52):
the commands its dry run prints (prepare.py --format classify, fairseq-train with the
Siamese classifier, fairseq-validate per bucket), the options it refuses, and a smoke run
end to end on 3,000 generated pairs (data -> train 3 updates -> accuracy per bucket 7..12
-> report)."""
import json
import os
import sys

import pytest

from test_logic_recipe import TABLE5, commands, in_process, line_count, recipe, run, value

#: A tiny classifier for the smoke run (flags replace the config's sizes and steps).
TINY = ("--encoder-layers 3 --encoder-embed-dim 32 --att-heads 2 --att-head-dim 8 "
        "--ffd-hidden-dim 32 --batch-size 64 --log-interval 1")


def dry_run(tmp_path, *extra):
    return in_process([sys.executable, TABLE5, "--dry-run", "--data-dir", str(tmp_path / "d"),
                       "--work-dir", str(tmp_path / "w"), *extra]).stdout


def test_classify_is_the_default_and_prints_the_classification_commands(tmp_path):
    out = dry_run(tmp_path, "--reduced")
    data = tmp_path / "d"
    prepared = {value(c, "--protocol"): c for c in commands(out, "prepare.py")}
    assert set(prepared) == set(recipe.PROTOCOLS)
    for protocol, argv in prepared.items():
        assert value(argv, "--format") == "classify" and "--binarize" in argv
        assert value(argv, "--out") == str(data / "classify" / protocol)
    trains = commands(out, "fairseq-train")
    assert len(trains) == len(recipe.CLASSIFY_MODELS) * len(recipe.PROTOCOLS)
    seen = set()
    for argv in trains:
        model, protocol = value(argv, "--save-dir").split(os.sep)[-4:-2]
        seen.add((model, protocol))
        assert value(argv, "--save-dir").startswith(str(tmp_path / "w" / "classify" / model))
        assert argv[1] == str(data / "classify" / protocol / "bin")
        arch = "transformer_classifier" if model == "transformer" else "sut_classifier"
        assert value(argv, "--task") == "sut_classification" and value(argv, "--arch") == arch
        assert value(argv, "--criterion") == "sut_classification"
        assert (value(argv, "--batch-size"), value(argv, "--lr"), value(argv, "--weight-decay"),
                value(argv, "--lr-scheduler"), value(argv, "--warmup-updates")) == \
            ("256", "7e-4", "0.1", "fixed", "4000")
        assert value(argv, "--max-update") == "10000"
        assert "--share-all-embeddings" not in argv and "--decoder-layers" not in argv
        pooling = "end" if model in ("gut", "gutlb") else "mean"
        assert value(argv, "--pooling") == pooling
    assert seen == {(m, p) for m in recipe.CLASSIFY_MODELS for p in recipe.PROTOCOLS}
    assert not commands(out, "fairseq-generate") and not commands(out, "accuracy.py")
    validates = commands(out, "fairseq-validate")   # one per run: every split, one process
    standard = [value(a, "--valid-subset") for a in validates if a[1].endswith(os.path.join("standard", "bin"))]
    assert standard == [",".join(f"test{k}" for k in range(7, 13))] * len(recipe.CLASSIFY_MODELS)
    assert all(value(a, "--required-batch-size-multiple") == "1" for a in validates)
    (report,) = commands(out, "summarize.py")
    assert report[2] == str(tmp_path / "w" / "classify") and value(report, "--setup") == "classify"
    assert not data.exists() and not (tmp_path / "w").exists()


def test_seq2seq_still_prints_the_translation_commands(tmp_path):
    out = dry_run(tmp_path, "--setup", "seq2seq", "--reduced", "--protocols", "standard")
    (prep,) = commands(out, "prepare.py")
    assert "--format" not in prep and value(prep, "--out") == str(tmp_path / "d" / "standard")
    trains = commands(out, "fairseq-train")
    assert [value(a, "--save-dir").split(os.sep)[-4] for a in trains] == list(recipe.MODELS)
    assert all(value(a, "--task") == "translation" for a in trains)
    assert len(commands(out, "fairseq-generate")) == 6 * 4 and not commands(out, "fairseq-validate")


@pytest.mark.parametrize("extra, message", [
    (["--models", "tlb-memory"], "--models tlb-memory is not available with --setup classify"),
    (["--models", "ut-halting"], "the classify setup's UT is 'ut'"),
    (["--generate-args", "--beam 2"], "does not apply to --setup classify"),
    (["--setup", "seq2seq", "--models", "ut"], "--models ut is not available with --setup seq2seq"),
])
def test_what_a_setup_cannot_run_is_refused(tmp_path, extra, message):
    proc = in_process([sys.executable, TABLE5, "--dry-run", "--data-dir", str(tmp_path / "d"), *extra],
                      check=False)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """GUT (the pair path with global halting, keys/values from the states, END pooling)
    in two calls: data and train, then evaluate and report."""
    from sut_fairseq.data import logic_inference as li

    root = tmp_path_factory.mktemp("logic_classify")
    original = root / "original"
    li.write_original(str(original), li.split_buckets(li.generate_buckets(3000, seed=1)))
    data, work = root / "data", root / "work"
    command = [sys.executable, TABLE5, "--original", str(original), "--data-dir", str(data),
               "--work-dir", str(work), "--protocols", "standard", "--models", "gut", "--reduced",
               "--max-update", "3", "--train-args", TINY]
    first = run(command + ["--stop-stage", "train"]).stdout
    second = run(command + ["--stage", "evaluate"]).stdout
    return {"data": data, "work": work, "first": first, "second": second,
            "run": work / "classify" / "gut" / "standard" / "seed1"}


def test_smoke_classify_trains_and_scores_every_bucket(smoke):
    first, second, run_dir = smoke["first"], smoke["second"], smoke["run"]
    (prep,) = commands(first, "prepare.py")
    assert value(prep, "--format") == "classify"
    (train,) = commands(first, "fairseq-train")
    assert value(train, "--encoder-halting-kv") == "state" and value(train, "--encoder-layers") == "3"
    assert not commands(second, "fairseq-train")
    assert [value(a, "--valid-subset") for a in commands(second, "fairseq-validate")] == \
        [",".join(f"test{k}" for k in range(7, 13))]
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["model"], result["protocol"], result["setup"], result["updates"]) == \
        ("gut", "standard", "classify", 3)
    assert list(result["accuracy"]) == [str(k) for k in range(7, 13)]
    for k in range(7, 13):
        scored = result["accuracy"][str(k)]
        n = line_count(smoke["data"] / "classify" / "standard" / f"test{k}.label")
        assert scored["total"] == scored["lines"] == n > 0       # every pair scored
        assert 0 <= scored["accuracy"] <= 100 and 1 <= scored["mean_encoder_steps"] <= 3
        assert scored["correct"] == round(scored["accuracy"] * n / 100)


def test_smoke_classify_report(smoke):
    table = (smoke["work"] / "classify" / "table5.md").read_text()
    assert "Classify setup" in table and "| GUT (ours, reduced) |" in table
    assert "| GUT (paper) | – | 96.36 | 84.84 | 74.8 | 66.81 | 58.99 | 51.97 |" in table
    assert json.loads((smoke["work"] / "classify" / "table5.json").read_text())["setup"] == "classify"
    assert not (smoke["work"] / "table5.md").exists()       # the seq2seq report is apart


def test_a_split_scored_short_is_refused(smoke, tmp_path):
    """score_validate_output against a reference with one line more than was scored."""
    from sut_fairseq.recipes import RecipeError
    from sut_fairseq.recipes.classify import score_validate_output

    reference = smoke["data"] / "classify" / "standard" / "test7.label"
    longer = tmp_path / "test7.label"
    longer.write_text(reference.read_text() + "#\n")
    with pytest.raises(RecipeError, match="scored .* examples of test7 but .* has"):
        score_validate_output(str(smoke["run"] / "validate.txt"), "test7", str(longer))


def test_one_fairseq_validate_scores_a_list_of_splits():
    from sut_fairseq.recipes import RecipeError

    command = recipe.validate_command("BIN", "ckpt.pt", ["test7", "test8"], required=False)
    assert value(command, "--valid-subset") == "test7,test8" and command[1] == "BIN"
    for bad in ("test7", ["test7,test8"], []):
        with pytest.raises(RecipeError, match="is not a list of split names"):
            recipe.validate_command("BIN", "ckpt.pt", bad, required=False)


def test_threshold_becomes_a_model_override_of_fairseq_validate(tmp_path):
    out = dry_run(tmp_path, "--models", "ut", "--protocols", "B", "--threshold", "0.8", "--stage", "evaluate",
                  "--stop-stage", "evaluate")
    (validate,) = commands(out, "fairseq-validate")
    assert value(validate, "--model-overrides") == "{'halting_threshold': 0.8}"
    assert value(validate, "--valid-subset") == "test" and validate[1].endswith(os.path.join("classify", "B", "bin"))
