"""The ListOps recipe's classify setup (scripts/listops/table1.py --setup classify, issue
#52): the dry run's classification commands, the refused option, data-prep/listops/
classify.py's layout read back by the task, and a smoke run end to end (data -> train
3 updates -> fairseq-validate on every test split -> report) of GUT and TLB."""
import json
import os
import sys

from split_recipes import ROOT, check_smoke, commands, in_process, run, smoke, stages, value

TABLE1 = os.path.join(ROOT, "scripts", "listops", "table1.py")
GENERATE = os.path.join(ROOT, "data-prep", "listops", "generate.py")
CLASSIFY = os.path.join(ROOT, "data-prep", "listops", "classify.py")
MODELS = ["ut", "gut", "tlb", "gutlb", "sut-chunked", "transformer"]
#: options of the plugin's encoders (common.json's sut_flags), not given to fairseq's transformer
SUT_ONLY = ("--rel-pos", "--halting-threshold", "--att-heads", "--att-head-dim", "--ffd-hidden-dim")


def test_dry_run_classify_is_the_default(tmp_path):
    out = in_process([sys.executable, TABLE1, "--data-dir", tmp_path / "d", "--work-dir", tmp_path / "w",
                      "--dry-run"]).stdout
    assert stages(out) == ["data", "train", "evaluate", "report"]
    (prep,) = commands(out, "classify.py")
    assert value(prep, "--data") == str(tmp_path / "d") and value(prep, "--out") == str(tmp_path / "d" / "classify")
    trains = commands(out, "fairseq-train")
    assert [value(t, "--save-dir").split(os.sep)[-3] for t in trains] == MODELS
    for argv in trains:
        assert argv[1] == str(tmp_path / "d" / "classify")
        assert value(argv, "--save-dir").startswith(str(tmp_path / "w" / "classify"))
        arch = "transformer_classifier" if "transformer" in value(argv, "--save-dir") else "sut_classifier"
        assert (value(argv, "--task"), value(argv, "--arch"), value(argv, "--criterion")) == \
            ("sut_classification", arch, "sut_classification")
        assert all((flag in argv) == (arch == "sut_classifier") for flag in SUT_ONLY), argv
        assert (value(argv, "--batch-size"), value(argv, "--lr-scheduler"), value(argv, "--warmup-updates"),
                value(argv, "--encoder-embed-dim")) == ("256", "fixed", "4000", "64")
    by_model = dict(zip(MODELS, trains))
    assert value(by_model["gut"], "--encoder-halting-kv") == "state" and value(by_model["gut"], "--pooling") == "end"
    assert "--tlb-unshared" in by_model["tlb"] and value(by_model["tlb"], "--tlb-encoder-out") == "memory"
    assert (value(by_model["transformer"], "--encoder-layers"), value(by_model["transformer"], "--encoder-attention-heads"),
            value(by_model["transformer"], "--encoder-ffn-embed-dim")) == ("6", "4", "256")
    validates = commands(out, "fairseq-validate")
    assert len(validates) == 6 and not commands(out, "fairseq-generate")   # one per run
    assert value(validates[0], "--valid-subset") == ",".join(["test"] + [f"test{k}" for k in range(1, 6)])
    (report,) = commands(out, "summarize.py")
    assert report[2] == str(tmp_path / "w" / "classify")
    assert not (tmp_path / "d").exists()


def test_generate_args_are_refused_in_classify(tmp_path):
    proc = in_process([sys.executable, TABLE1, "--dry-run", "--generate-args", "--beam 2"], check=False)
    assert proc.returncode == 2 and "does not apply to --setup classify" in proc.stderr


def test_classify_layout_is_read_by_the_task(tmp_path):
    """data-prep/listops/classify.py over generated data: ten classes whatever train holds,
    the test splits named as in DATA/bin, every line of a split loaded with its label."""
    from fairseq.data import Dictionary

    from sut_fairseq.tasks.sut_classification import SUTClassificationConfig, SUTClassificationTask

    data = tmp_path / "data"
    run([sys.executable, GENERATE, "--train-size", 30, "--valid-size", 3, "--iid-test-size", 5,
         "--test-size", 3, "--splits", "test-args10", "--out", data, "--binarize", "--no-progress"])
    run([sys.executable, CLASSIFY, "--data", data])
    layout = json.loads((data / "classify" / "splits.json").read_text())
    assert layout["binarized_test_splits"] == json.loads((data / "stats.json").read_text())["binarized_test_splits"]
    task = SUTClassificationTask.setup_task(SUTClassificationConfig(data=str(data / "classify"), seed=1))
    assert task.num_classes == 10 and not task.pair
    dataset = task.load_dataset("test1")
    labels = (data / "test-args10.tgt").read_text().split()
    sources = (data / "test-args10.src").read_text().splitlines()
    for i in range(len(dataset)):
        item = dataset[i]
        k = int(item["id"])
        assert task.label_dictionary[int(item["target"]) + task.label_dictionary.nspecial] == labels[k]
        assert task.dictionary.string(item["net_input.src_tokens"]) == sources[k]
    assert isinstance(task.dictionary, Dictionary)
    again = run([sys.executable, CLASSIFY, "--data", data], check=False)
    assert again.returncode == 2                       # an existing layout is not replaced


def test_smoke_classify_gut_and_tlb(tmp_path):
    result = smoke(tmp_path, GENERATE, TABLE1, ["gut", "tlb"],
                   ["--train-size", 80, "--valid-size", 4, "--iid-test-size", 8, "--test-size", 4,
                    "--splits", "test-args10"])
    work = result["work"] / "classify"
    runs = check_smoke(result, ["gut", "tlb"], {"test-iid": 8, "test-args10": 4}, work)
    assert len(commands(result["second"], "fairseq-validate")) == 2
    for model, run_result in runs.items():
        assert run_result["setup"] == "classify"
        steps = run_result["splits"]["test-iid"]["mean_encoder_steps"]
        assert 1 <= steps <= 3 if model == "gut" else steps is not None
    table = (work / "table1.md").read_text()
    assert "| GUT |" in table and "| TLB |" in table and "paper: GUT" in table
