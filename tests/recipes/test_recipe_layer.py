"""The shared recipe layer (sut_fairseq.recipes): stage selection, option lists, the
scorer's refusals, train-log parsing, run directories and the summary helpers. The task
recipes that use it are tested end to end in test_logic_recipe.py, test_cfq_pipeline.py
and test_wmt14_recipe.py."""
import argparse
import json
import os
import sys

import pytest

from sut_fairseq.recipes import (RecipeError, add_stage_arguments, flag_value, flag_values,
                                 load_json, load_results, merge_flags, run, run_stages,
                                 selected_stages, write_json_atomic)
from sut_fairseq.recipes import scoring
from sut_fairseq.recipes.runs import RunDir, resume_command
from sut_fairseq.recipes.split_grid import compare_models, report_main
from sut_fairseq.recipes.summary import (ahead_table, format_mean_std, line_plot, markdown_table, mean_std,
                                         ranks, spearman, summary_main)
from sut_fairseq.recipes.train_log import best_valid, parse_train_log, training_hours


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_stage_arguments(parser)
    return parser.parse_args(list(argv))


def test_stage_selection_by_name_and_number():
    assert selected_stages(parse()) == ["data", "train", "evaluate", "report"]
    assert selected_stages(parse("--stage", "2", "--stop-stage", "evaluate")) == ["train", "evaluate"]
    assert selected_stages(parse("--stage", "report")) == ["report"]
    with pytest.raises(SystemExit, match="--stage report comes after --stop-stage data"):
        selected_stages(parse("--stage", "4", "--stop-stage", "1"))
    with pytest.raises(SystemExit):
        parse("--stage", "5")


def test_run_stages_runs_the_range_in_order_and_turns_recipe_errors_into_exits(capsys):
    done = []
    handlers = {name: (lambda n=name: done.append(n)) for name in ("data", "train", "evaluate", "report")}
    assert run_stages(parse("--stage", "train", "--stop-stage", "evaluate"), handlers) == 0
    assert done == ["train", "evaluate"]
    out = capsys.readouterr().out
    assert "=== stage 2: train" in out and "=== stage 3: evaluate" in out and "stage 1" not in out

    def failing():
        raise RecipeError("no data here")

    with pytest.raises(SystemExit, match="error: no data here"):
        run_stages(parse(), dict(handlers, data=failing))
    with pytest.raises(ValueError, match="missing"):
        run_stages(parse(), {"data": failing})


def test_merged_options_keep_one_value_each():
    merged = merge_flags(["--lr", "1e-3", "--adam-betas", "(0.9, 0.98)", "--fp16"],
                         ["--lr", "7e-4", "--max-tokens=4096"])
    assert merged == ["--lr", "7e-4", "--adam-betas", "(0.9, 0.98)", "--fp16", "--max-tokens", "4096"]
    assert flag_value(merged, "--lr") == "7e-4" and flag_value(merged, "--fp16") == ""
    assert flag_value(merged, "--seed") is None
    assert flag_values(["--keys", "7", "8", "--x"], "--keys") == ["7", "8"]
    with pytest.raises(RecipeError, match="before any --option"):
        merge_flags(["7e-4", "--lr"])


def test_grid_gives_sut_flags_to_the_plugins_models_only(tmp_path):
    """A grid's run options in their order (common, its sut_flags, the configuration's and
    its sut_flags, the model's), the sut_flags left out for a model with "sut_options": false."""
    from sut_fairseq.recipes.grid import ModelGrid

    (tmp_path / "common.json").write_text(json.dumps({
        "task": ["--task", "t"], "flags": ["--lr", "1", "--dropout", "0.1"], "sut_flags": ["--rel-pos", "none"],
        "configs": {"small": {"flags": ["--encoder-embed-dim", "8"], "sut_flags": ["--att-heads", "2"],
                              "model_flags": {"tr": ["--encoder-attention-heads", "2"]}}}}))
    (tmp_path / "ut.json").write_text(json.dumps({"arch": "a", "model_flags": ["--lr", "2"], "loss_flags": []}))
    (tmp_path / "tr.json").write_text(json.dumps({"arch": "b", "sut_options": False, "model_flags": [],
                                                  "loss_flags": ["--criterion", "c"]}))
    grid = ModelGrid(str(tmp_path), ["ut", "tr"])
    assert grid.train_flags("ut", "small", seed=3) == [
        "--task", "t", "--lr", "2", "--dropout", "0.1", "--rel-pos", "none", "--encoder-embed-dim", "8",
        "--att-heads", "2", "--arch", "a", "--seed", "3"]
    assert grid.train_flags("tr", "small") == [
        "--task", "t", "--lr", "1", "--dropout", "0.1", "--encoder-embed-dim", "8", "--arch", "b",
        "--criterion", "c", "--encoder-attention-heads", "2", "--seed", "1"]


def test_run_prints_then_fails_with_the_log_tail(tmp_path, capsys):
    log = str(tmp_path / "logs" / "x.log")
    run([sys.executable, "-c", "print('hello')"], log)
    assert open(log).read() == "hello\n"
    run([sys.executable, "-c", "print('again')"], log, append=True)
    assert open(log).read() == "hello\nagain\n"
    with pytest.raises(RecipeError, match=r"failed \(exit 3\); log: .*x\.log"):
        run([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], log)
    out = capsys.readouterr().out
    assert out.startswith("+ ") and "boom" in out
    run(["/nonexistent/tool"], dry_run=True)  # a dry run only prints
    assert "+ /nonexistent/tool" in capsys.readouterr().out


def write_generate(path, rows):
    """fairseq-generate-like output for (id, T text, H text), in the given order."""
    with open(path, "w") as handle:
        for i, target, hyp in rows:
            handle.write(f"S-{i}\tsrc {i}\nT-{i}\t{target}\nH-{i}\t-0.1\t{hyp}\nD-{i}\t-0.1\t{hyp}\n")


def test_scorer_metrics_on_exact_small_examples(tmp_path):
    ref = tmp_path / "ref.tgt"
    ref.write_text("#\n<\n=\n")
    write_generate(tmp_path / "g.txt", [(2, "=", "= ="), (0, "#", "#"), (1, "<", ">")])
    r = scoring.relation_accuracy(str(tmp_path / "g.txt"), str(ref))
    assert (r["correct"], r["first_token_correct"], r["total"], r["lines"]) == (1, 2, 3, 3)
    assert r["accuracy"] == pytest.approx(100 / 3)
    ref.write_text("a b c\nx <rare> z\n")
    write_generate(tmp_path / "g.txt", [(0, "a b c", "a b c"), (1, "x <unk> z", "x <unk> z")])
    r = scoring.exact_match(str(tmp_path / "g.txt"), str(ref), canonical=lambda t: sorted(t.split()))
    # <unk> in T- agrees with the reference, but a hypothesis <unk> never matches it
    assert (r["correct"], r["order_insensitive_correct"]) == (1, 1)


def test_scorer_refuses_missing_examples_and_wrong_references(tmp_path):
    ref = tmp_path / "ref.tgt"
    ref.write_text("a\nb\nc\n")
    write_generate(tmp_path / "g.txt", [(0, "a", "a"), (1, "b", "b")])
    with pytest.raises(ValueError, match=r"scored 2 examples but .* has 3 lines; 1 missing, e.g. ids \[2\]"):
        scoring.relation_accuracy(str(tmp_path / "g.txt"), str(ref))
    write_generate(tmp_path / "g.txt", [(0, "a", "a"), (1, "q", "b"), (2, "c", "c")])
    with pytest.raises(ValueError, match="T-1 is 'q' but line 2 of .* is 'b'"):
        scoring.exact_match(str(tmp_path / "g.txt"), str(ref))
    # BLEU does not compare T- lines (BPE-joined), but still needs every sentence
    ref.write_text("")
    write_generate(tmp_path / "g.txt", [])
    with pytest.raises(ValueError, match="no examples scored"):
        scoring.aligned(str(tmp_path / "g.txt"), str(ref), check_targets=False)


def test_train_log_parsing(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "| num. shared model params: 1,000 (num. trained: 1,000)\n"
        "| num. expert model params: 234 (num. trained: 234)\n"
        "epoch 001:    100 / 50 loss=2, num_updates=100, lr=1\n"
        "epoch 001 | valid on 'valid' subset | loss 1.2 | nll_loss 0.9 | accuracy 77.5 | num_updates 100\n"
        "epoch 001 | valid on 'valid' subset | loss 1.1 | nll_loss 0.95 | accuracy 79.25 | num_updates 200 "
        "| best_accuracy 79.25\n"
        "Stopping training due to num_updates: 200 >= max_update: 200\n")
    parsed = parse_train_log(str(log))
    assert parsed == {"params": 1234, "updates": 200, "stop_reason": "num_updates: 200 >= max_update: 200"}
    assert best_valid(str(log), "accuracy") == 79.25
    assert best_valid(str(log), "nll_loss", maximize=False) == 0.9
    assert best_valid(str(log), "exact_match") is None


def _inner(updates, ups):
    return (f"2026-12-04 00:41:37 | INFO | train_inner | epoch 001:    {updates} / 1913 loss=1.6, "
            f"accuracy=57.7, wps=1275, ups={ups}, wpb=1843.8, bsz=64, num_updates={updates}, lr=0.0007\n")


def test_training_hours_sums_the_logged_intervals_once_each(tmp_path):
    """100 updates at 2/s, 100 at 1/s (a validation), then a restart from update 100 that
    logs 200 again at 0.5/s (its record replaces the first), 300 suspended (0.01/s, below a
    quarter of the median: counted at the median 0.5/s) and 50 more updates after the last
    record (at its rate): 50 + 200 + 200 + 100 seconds."""
    log = tmp_path / "train.log"
    log.write_text(_inner(100, 2) + _inner(200, 1) + "restart\n" + _inner(200, 0.5) + _inner(300, 0.01)
                   + "valid on 'valid' subset | accuracy 60 | num_updates 350\n")
    assert training_hours(str(log)) == pytest.approx((50 + 200 + 200 + 100) / 3600)
    (tmp_path / "empty.log").write_text("no interval logged\n")
    assert training_hours(str(tmp_path / "empty.log")) is None


def test_run_dir_skips_what_is_done_and_resumes(tmp_path, capsys):
    run_dir = RunDir(str(tmp_path / "m" / "p" / "seed1"), "== m | p | seed 1")
    command = [sys.executable, "-c", "print('trained')"]
    assert run_dir.train(command, dry_run=True) is None and not os.path.exists(run_dir.dir)
    with pytest.raises(RecipeError, match="no train.json: run the train stage first"):
        run_dir.needs_evaluation()
    assert run_dir.train(command) is not None
    write_json_atomic(run_dir.train_json, {"ok": 1})
    assert run_dir.train(command) is None and "trained before" in capsys.readouterr().out
    assert run_dir.needs_evaluation()
    write_json_atomic(run_dir.result, {"seed": 1})
    assert not run_dir.needs_evaluation() and run_dir.needs_evaluation(force=True)
    assert run_dir.train(command, force=True) is not None  # --force: the run from scratch
    assert not os.path.exists(run_dir.result) and open(run_dir.train_log).read() == "trained\n"


def test_a_resumed_run_continues_from_its_own_checkpoint(tmp_path, capsys):
    """A first call that starts from another run's checkpoint (--restore-file X and the
    resets) must not restart from X when the same command is run again: fairseq would load
    X in place of the run's own checkpoint_last.pt."""
    command = [sys.executable, "-c", "import sys; print(' '.join(sys.argv[1:]))",
               "--lr", "2e-4", "--restore-file", "other/checkpoint_last.pt", "--reset-optimizer",
               "--reset-lr-scheduler", "--finetune-from-model=x.pt", "--reset-dataloader",
               "--reset-meters", "--max-update", "20"]
    run_dir = RunDir(str(tmp_path / "run"), "== run")
    assert run_dir.train(command) is not None  # first call: everything passed on
    assert open(run_dir.train_log).read().split() == command[3:]
    os.makedirs(run_dir.save_dir)
    open(os.path.join(run_dir.save_dir, "checkpoint_last.pt"), "wb").close()
    assert run_dir.train(command) is not None  # resumed: the first call's options dropped
    assert open(run_dir.train_log).read().splitlines()[-1].split() == ["--lr", "2e-4", "--max-update", "20"]
    out = capsys.readouterr().out
    assert ("resuming from checkpoints/checkpoint_last.pt (dropped --restore-file "
            "other/checkpoint_last.pt --reset-optimizer --reset-lr-scheduler "
            "--finetune-from-model=x.pt --reset-dataloader --reset-meters") in out
    assert resume_command(["a", "--reset-meters-x", "b"]) == (["a", "--reset-meters-x", "b"], [])


def test_a_run_that_reached_its_update_budget_is_not_resumed(tmp_path, capsys):
    """fairseq-train resumed at --max-update trains one update more (and may replace a
    kept best checkpoint): a run whose log reached the budget is finished as it is, while
    a larger budget resumes it."""
    run_dir = RunDir(str(tmp_path / "run"), "== run")
    os.makedirs(run_dir.save_dir)
    open(os.path.join(run_dir.save_dir, "checkpoint_last.pt"), "wb").close()
    with open(run_dir.train_log, "w") as log:
        log.write("| train_inner | epoch 008: loss=4.7, num_updates=1000, lr=0.0007\n")
    command = [sys.executable, "-c", "print('trained on')", "--max-update", "1000"]
    assert run_dir.train(command) == 0.0
    assert "finished before: train.log reached --max-update 1000" in capsys.readouterr().out
    assert "trained on" not in open(run_dir.train_log).read()
    command[-1] = "2000"
    assert run_dir.train(command) > 0.0 and "trained on" in open(run_dir.train_log).read()


def test_results_and_summary_helpers(tmp_path):
    for seed, value in ((1, 70.0), (2, 74.0)):
        write_json_atomic(str(tmp_path / "v" / "s" / f"seed{seed}" / "result.json"),
                          {"variant": "v", "seed": seed, "score": value})
    results = load_results(str(tmp_path), ("variant", "seed", "score"))
    assert [r["seed"] for r in results] == [1, 2]
    with pytest.raises(RecipeError, match="no 'split'"):
        load_results(str(tmp_path), ("split",))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(RecipeError, match="malformed JSON"):
        load_json(str(tmp_path / "bad.json"))
    cell = mean_std([r["score"] for r in results])
    assert cell[0] == 72.0 and cell[1] == pytest.approx(2 ** 0.5 * 2) and cell[2] == 2
    assert format_mean_std(cell, 5) == "72.0 ± 2.8 (n=2)" and format_mean_std(None, 5) == "–"
    assert mean_std([]) is None and mean_std([3.0]) == (3.0, 0.0, 1)
    assert markdown_table(["Model", "A"], [["x", "1.0"]]) == "| Model | A |\n|---|---:|\n| x | 1.0 |"
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        markdown_table(["Model"], [["x", "y"]])
    png = tmp_path / "fig" / "p.png"
    line_plot(str(png), {"a": ([1, 2], [3.0, 4.0])}, "x", "y", "t", xticks=[1, 2])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and oct(png.stat().st_mode & 0o777) != "0o600"
    assert not [p for p in os.listdir(png.parent) if p.endswith(".tmp") or p.startswith(".")]
    assert json.loads((tmp_path / "v" / "s" / "seed1" / "result.json").read_text())["score"] == 70.0


def test_ahead_table_says_where_a_leads_b_beyond_both_standard_deviations():
    """A − B against max(sd_A, sd_B) per column both have; one seed of either: n/a."""
    a = {"7": (60.0, 1.0, 3), "8": (55.0, 2.0, 3), "9": (50.0, 1.0, 3), "11": (50.0, 0.0, 1), "12": (40.0, 0.5, 2)}
    b = {"7": (57.0, 1.5, 3), "8": (54.0, 1.0, 3), "10": (1.0, 0.0, 3), "11": (49.0, 0.5, 3), "12": (42.0, 0.1, 3)}
    table = ahead_table(("GUT", "UT"), (a, b), ["7", "8", "9", "10", "11", "12"])
    lines = table.splitlines()
    assert lines[0] == "|  | GUT | UT | GUT − UT | GUT ahead beyond one sd |"
    assert lines[2:] == ["| 7 | 60.0 ± 1.0 (n=3) | 57.0 ± 1.5 (n=3) | +3.0 | yes |",      # 3 > 1.5
                         "| 8 | 55.0 ± 2.0 (n=3) | 54.0 ± 1.0 (n=3) | +1.0 | no |",       # 1 < 2
                         "| 11 | 50.0 ± 0.0 (n=1) | 49.0 ± 0.5 (n=3) | +1.0 | n/a (one seed) |",
                         "| 12 | 40.0 ± 0.5 (n=2) | 42.0 ± 0.1 (n=3) | -2.0 | no |"]
    # a difference equal to the larger sd is not beyond it
    assert ahead_table(("A", "B"), ({"x": (3.0, 1.0, 2)}, {"x": (2.0, 1.0, 2)}), ["x"]).endswith("| +1.0 | no |")
    with pytest.raises(ValueError, match="A and B have no column in common"):
        ahead_table(("A", "B"), ({"x": (1.0, 0.0, 2)}, {"y": (1.0, 0.0, 2)}), ["x", "y"])


def test_split_grid_reports_compare_two_models_from_their_json(tmp_path, capsys):
    """``compare_models`` reads a written report (its splits and seed cells) and refuses a
    model without runs; ``summary_main`` offers ``--compare`` only with a compare function."""
    report = {"splits": ["test-iid", "test-len900-1000"],
              "models": {"gut": {"label": "GUT", "seeds": [1, 2], "accuracy": {"test-iid": [50.0, 1.0, 2],
                                                                               "test-len900-1000": None}},
                         "ut": {"label": "UT", "seeds": [1, 2], "accuracy": {"test-iid": [47.0, 0.5, 2],
                                                                             "test-len900-1000": [10.0, 1.0, 2]}}}}
    write_json_atomic(str(tmp_path / "table1.json"), report)
    text = compare_models(str(tmp_path / "table1.json"), "gut", "ut")
    assert text.startswith("GUT against UT, accuracy (%) per test split, seed mean ± sample sd (seeds [1, 2] and [1, 2]):")
    assert text.splitlines()[-1] == "| test-iid | 50.0 ± 1.0 (n=2) | 47.0 ± 0.5 (n=2) | +3.0 | yes |"
    with pytest.raises(SystemExit, match=r"--compare tlb: no runs of that model in the report \(models: gut, ut\)"):
        compare_models(str(tmp_path / "table1.json"), "tlb", "ut")
    calls = []
    summary_main("doc", "data", lambda work, data: f"report of {work}", ["t.md", "t.json"],
                 [str(tmp_path), "--compare", "gut", "ut"], compare=lambda work, a, b: calls.append((work, a, b)) or "cmp")
    out = capsys.readouterr().out
    assert calls == [(str(tmp_path), "gut", "ut")] and out.rstrip().endswith("cmp") and f"report of {tmp_path}" in out
    with pytest.raises(SystemExit):
        summary_main("doc", "data", lambda work, data: "r", ["t.md"], [str(tmp_path), "--compare", "gut", "ut"])
    assert "unrecognized arguments: --compare gut ut" in capsys.readouterr().err
    # a split-grid task's command line compares from the report its summariser just wrote
    (tmp_path / "table1.json").unlink()
    report_main("doc", "listops", lambda work, data: write_json_atomic(os.path.join(work, "table1.json"), report)
                or "written", "table1", [str(tmp_path), "--compare", "ut", "gut"])
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "| test-iid | 47.0 ± 0.5 (n=2) | 50.0 ± 1.0 (n=2) | -3.0 | no |"


def test_spearman_on_exact_examples():
    assert ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [1.0, 5.0, 7.0, 9.0]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [9.0, 5.0, 2.0, 1.0]) == pytest.approx(-1.0)
    # ranks (1, 2, 3) against (1, 3, 2): 1 - 6 * 2 / (3 * 8) = 0.5
    assert spearman([1, 2, 3], [1.0, 3.0, 2.0]) == pytest.approx(0.5)
    assert spearman([1, 2, 3], [2.0, 2.0, 2.0]) is None
    assert spearman([1], [2.0]) is None


def test_line_plot_draws_error_bars_for_the_series_that_have_them(tmp_path, monkeypatch):
    """``errors`` (label -> ± per point) gives that series error bars; the others plain lines."""
    import matplotlib.axes

    drawn = []
    errorbar = matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, x, y, yerr=None, **kw: drawn.append((kw["label"], list(yerr)))
                        or errorbar(self, x, y, yerr=yerr, **kw))
    png = tmp_path / "e.png"
    line_plot(str(png), {"a": ([0, 1], [3.0, 4.0]), "b": ([0, 1], [1.0, 2.0])}, "x", "y", "t",
              errors={"a": [0.5, 1.5]})
    assert drawn == [("a", [0.5, 1.5])]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
