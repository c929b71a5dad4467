"""scripts/listops/accuracy_by_depth.py, a ListOps classifier's accuracy per tree depth,
length and root operator: the groups on hand-worked expressions, the per-group accuracy and
majority share against hand computations, and tiny random classifiers saved as fairseq
checkpoints whose scored examples must equal the model's prediction read one example at a
time, with the check against fairseq-validate's count."""
import json
import os
import subprocess
import sys

import pytest
import torch

from split_recipes import ROOT, load_script

acc = load_script(os.path.join(ROOT, "scripts", "listops", "accuracy_by_depth.py"), "listops_accuracy_by_depth")

GENERATE = os.path.join(ROOT, "data-prep", "listops", "generate.py")
CLASSIFY = os.path.join(ROOT, "data-prep", "listops", "classify.py")


@pytest.mark.parametrize("tree_depth,group", [(1, "1"), (2, "2"), (4, "4"), (5, "5-6"), (6, "5-6"),
                                              (7, "7-9"), (9, "7-9"), (10, "10+"), (19, "10+")])
def test_depth_groups_cover_every_depth_once(tree_depth, group):
    assert acc.depth_group(tree_depth) == group


def test_groups_of_hand_worked_expressions():
    assert acc.example_groups("[MAX 2 9 [MIN 4 7 ] 0 ]") == ("2", "<= 100 tokens", "MAX")
    assert acc.example_groups("[SM 1 [MED 2 [MIN 3 [MAX 4 5 ] ] ] ]") == ("4", "<= 100 tokens", "SM")
    long = "[MED " + " ".join(["[MIN 1 2 ]"] * 25) + " ]"      # 2 + 25 * 4 = 102 tokens
    assert acc.example_groups(long) == ("2", "> 100 tokens", "MED")
    with pytest.raises(ValueError, match="not >= 1"):
        acc.depth_group(0)


def test_group_accuracy_and_majority_share_by_hand():
    groups = [("1", "short", "MAX"), ("1", "short", "SM"), ("2", "short", "MAX"), ("2", "long", "MAX")]
    got = acc.group_accuracy([1, 0, 1, 1], groups)
    assert got == {"1": 50.0, "2": 100.0, "short": pytest.approx(200 / 3), "long": 100.0,
                   "MAX": 100.0, "SM": 0.0}
    shares = acc.majority_share(["3", "3", "7", "3"], groups)
    assert shares["1"] == (2, 100.0) and shares["2"] == (2, 50.0) and shares["MAX"] == (3, pytest.approx(200 / 3))


def run(command):
    subprocess.run([str(c) for c in command], check=True, capture_output=True, text=True)


def save_classifier(path, data_bin, seed):
    """A randomly initialised sut_classifier_tiny saved as fairseq-train saves one."""
    from sut_fairseq.models.standalone import model_args
    from sut_fairseq.tasks.sut_classification import SUTClassificationConfig, SUTClassificationTask

    args = model_args("sut_classifier_tiny", dropout=0.0, halting_threshold=0.5)
    args.data, args.task, args.seed = data_bin, "sut_classification", seed
    task = SUTClassificationTask.setup_task(SUTClassificationConfig(data=data_bin, seed=seed))
    torch.manual_seed(seed)
    model = task.build_model(args).eval()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"args": args, "model": model.state_dict(), "extra_state": {}, "last_optimizer_state": None,
                "optimizer_history": [{"criterion_name": "SUTClassificationCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}]}, path)
    return model, task


def alone(model, task, source):
    """The label the model predicts for one expression run by itself (no padding)."""
    tokens = task.source_dictionary.encode_line(source, add_if_not_exist=False, append_eos=True).long()[None]
    with torch.no_grad():
        logits, _ = model(tokens, torch.tensor([tokens.size(1)]))
    return task.label_dictionary[int(logits[0].argmax()) + task.label_dictionary.nspecial]


def test_main_scores_every_example_as_the_model_alone(tmp_path, capsys):
    data, work = tmp_path / "data", tmp_path / "work"
    run([sys.executable, GENERATE, "--train-size", 30, "--valid-size", 3, "--iid-test-size", 24,
         "--test-size", 3, "--splits", "test-args10", "--out", data, "--binarize", "--no-progress"])
    run([sys.executable, CLASSIFY, "--data", data])
    sources = (data / "test-iid.src").read_text().splitlines()
    labels = (data / "test-iid.tgt").read_text().split()
    hits = {}
    for seed in (1, 2):
        run_dir = work / "ut" / f"seed{seed}"
        model, task = save_classifier(str(run_dir / "checkpoints" / "checkpoint_best.pt"), str(data / "classify"), seed)
        hits[seed] = [int(alone(model, task, s) == y) for s, y in zip(sources, labels)]
        counted = sum(hits[seed]) + (0 if seed == 1 else 1)       # seed 2: fairseq-validate's count is off
        (run_dir / "result.json").write_text(json.dumps({"splits": {"test-iid": {"correct": counted}}}))
    out = str(tmp_path / "report" / "acc")
    summary = acc.main([str(work), "--data-dir", str(data), "--models", "ut", "--seeds", "1", "2", "3",
                        "--batch-size", "5", "--out", out])
    printed = capsys.readouterr().out
    assert "ut seed 3: no " in printed                              # left out, not an error
    for seed in (1, 2):
        cached = json.load(open(work / "ut" / f"seed{seed}" / "accuracy-test-iid.json"))
        assert cached["per_example"] == hits[seed]                  # padded batches == alone
    checks = [r["check"] for r in summary["runs"]["ut"]]
    assert checks[0].startswith("equal to fairseq-validate's count") and checks[1].startswith("MISMATCH")
    assert max(sum(h) for h in hits.values()) > 0 and min(sum(h) for h in hits.values()) < len(sources)

    # every group's cell is the seeds' mean of the hand-counted accuracy of its examples
    groups = [acc.example_groups(s) for s in sources]
    for name, cell in summary["accuracy"]["ut"].items():
        members = [i for i, g in enumerate(groups) if name in g]
        per_seed = [100.0 * sum(hits[s][i] for i in members) / len(members) for s in (1, 2)]
        assert cell[0] == pytest.approx(sum(per_seed) / 2) and cell[2] == 2
        assert summary["groups"][name]["examples"] == len(members)
    assert summary["all"]["ut"][0] == pytest.approx(50.0 * (sum(hits[1]) + sum(hits[2])) / len(sources))
    for suffix in (".md", ".json", ".png"):
        assert os.path.getsize(out + suffix) > 0
    assert "| tree depth 1 |" in open(out + ".md").read()

    again = acc.main([str(work), "--data-dir", str(data), "--models", "ut", "--seeds", "1", "--out", out])
    assert "done before" in capsys.readouterr().out and again["runs"]["ut"][0]["correct"] == sum(hits[1])
    with pytest.raises(SystemExit, match="--compare gut: no scored run"):
        acc.main([str(work), "--data-dir", str(data), "--models", "ut", "--compare", "gut", "ut", "--out", out])
    with pytest.raises(SystemExit, match="test-len200-300.src not found"):
        acc.main([str(work), "--data-dir", str(data), "--split", "test-len200-300", "--out", out])
