"""The logical-inference recipe (paper Table 5, Figure 4; scripts/logic/, configs/logic/):
the commands ``--dry-run`` prints for every model and configuration, the parameter
counts docs/logic.md quotes, the relation scorer's count check, and a smoke run end to end
on 3,000 generated pairs (prepare -> binarize -> fairseq-train -> fairseq-generate on
buckets 7..12 -> accuracy.py -> halting analysis -> table, JSON, PNG)."""
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest

from cli_helpers import run_in_process

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(REPO, "scripts", "logic")
TABLE5 = os.path.join(SCRIPTS, "table5.py")
TRAIN = os.path.join(SCRIPTS, "train.py")
EVALUATE = os.path.join(SCRIPTS, "evaluate.py")
ACCURACY = os.path.join(SCRIPTS, "accuracy.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
import logic_recipe as recipe  # noqa: E402

#: Tiny sut_logic for the smoke run (flags replace the preset's values).
TINY = ("--encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 32 --att-experts 4 --att-topk 2 "
        "--att-heads 2 --att-head-dim 8 --ffd-experts 4 --ffd-topk 2 --ffd-hidden-dim 32")


def load_script(name):
    """A script of scripts/logic/ as a module under a name of its own (scripts/cfq and
    scripts/wmt14 have modules called ``summarize`` and ``evaluate`` too)."""
    spec = importlib.util.spec_from_file_location(f"logic_script_{name}", os.path.join(SCRIPTS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(command, timeout=300, check=True):
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)
    if check:
        assert proc.returncode == 0, f"{command[:2]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def in_process(command, check=True):
    """``run`` for a command that starts no tool (a dry run, an argument check, a scorer):
    ``[sys.executable, SCRIPT, *args]`` called in the test's process (``run_in_process``),
    without the seconds a new interpreter spends importing torch and fairseq."""
    assert command[0] == sys.executable
    proc = run_in_process(command[1], command[2:], env=ENV)
    if check:
        assert proc.returncode == 0, f"{command[:2]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


HALTING_DEPTH = "sut_fairseq.analysis.halting_depth"  # python -m


def commands(out, tool):
    """The printed ``+ ...`` commands of ``tool``, as argument lists (redirect removed)."""
    found = []
    for line in out.splitlines():
        if line.startswith("+ "):
            argv = shlex.split(line[2:])
            if ">" in argv:
                argv = argv[:argv.index(">")]
            if os.path.basename(argv[0]) == tool or (len(argv) > 1 and os.path.basename(argv[1]) == tool) \
                    or argv[1:3] == ["-m", tool]:
                found.append(argv)
    return found


def value(argv, option):
    assert argv.count(option) == 1, f"{option} given {argv.count(option)} times"
    return argv[argv.index(option) + 1]


def line_count(path):
    with open(path, encoding="utf-8") as handle:
        return len(handle.read().splitlines())


# --------------------------------------------------------------------------- dry runs

def check_model_flags(model, argv):
    assert value(argv, "--user-dir").endswith("sut_fairseq")
    assert "--share-all-embeddings" in argv and value(argv, "--task") == "translation"
    # the recipe that learns, for every model alike: pre-LN, AdamW lr 7e-4, weight decay 0.1
    assert "--encoder-normalize-before" in argv and "--decoder-normalize-before" in argv
    assert value(argv, "--lr") == "7e-4" and value(argv, "--weight-decay") == "0.1"
    dense = ["--att-experts", "--att-topk", "--ffd-experts", "--ffd-topk"]
    if model == "sut":
        assert value(argv, "--arch") == "sut_logic"
        assert not any(f in argv for f in dense + ["--encoder-halting", "--encoder-embed-dim"])
        assert value(argv, "--criterion") == "sut_label_smoothed_cross_entropy"
        assert value(argv, "--mim-weight") == "0.01" and value(argv, "--act-weight") == "0"
    elif model.startswith("ut-"):
        assert value(argv, "--arch") == "sut_logic"
        assert all(value(argv, f) == "1" for f in dense)
        assert "--encoder-embed-dim" not in argv and "--encoder-layers" not in argv  # d, steps kept
        if model == "ut-halting":
            assert "--encoder-halting" not in argv and value(argv, "--act-weight") == "0"
        else:
            assert value(argv, "--encoder-halting") == value(argv, "--decoder-halting") == "none"
            assert value(argv, "--act-weight") == "0"
    else:
        assert value(argv, "--arch") == "transformer"
        assert value(argv, "--criterion") == "label_smoothed_cross_entropy" and "--mim-weight" not in argv
        for side in ("encoder", "decoder"):
            assert value(argv, f"--{side}-embed-dim") == "128"
            assert value(argv, f"--{side}-ffn-embed-dim") == "256"
            assert value(argv, f"--{side}-attention-heads") == "4"
            assert value(argv, f"--{side}-layers") == "6"


def test_dry_run_prints_the_whole_full_grid_and_creates_nothing(tmp_path):
    data, work = tmp_path / "data", tmp_path / "work"
    out = in_process([sys.executable, TABLE5, "--setup", "seq2seq", "--dry-run", "--data-dir", str(data),
                      "--work-dir", str(work)]).stdout
    assert not data.exists() and not work.exists()
    # data: generated when missing, then each protocol prepared and binarized
    (gen,) = commands(out, "generate.py")
    assert value(gen, "--pairs") == "500000" and value(gen, "--out") == str(data / "original")
    prepared = {value(c, "--protocol"): c for c in commands(out, "prepare.py")}
    assert set(prepared) == {"standard", "A", "B", "C"} and all("--binarize" in c for c in prepared.values())
    trains = commands(out, "fairseq-train")
    assert len(trains) == 4 * 4  # models x protocols
    seen = set()
    for argv in trains:
        model, protocol = value(argv, "--save-dir").split(os.sep)[-4:-2]
        seen.add((model, protocol))
        assert argv[1] == str(data / protocol / "bin")
        check_model_flags(model, argv)
        # full configuration: the same wall-clock budget and update cap for everyone
        assert value(argv, "--stop-time-hours") == "12" and value(argv, "--max-update") == "50000"
        assert value(argv, "--max-tokens") == "4096" and value(argv, "--warmup-updates") == "4000"
        assert "--max-valid-steps" not in argv and "--cpu" not in argv
        assert value(argv, "--best-checkpoint-metric") == "accuracy"
    assert seen == {(m, p) for m in recipe.MODELS for p in recipe.PROTOCOLS}
    generates = commands(out, "fairseq-generate")
    for argv in generates:
        assert value(argv, "--beam") == "1" and value(argv, "--required-batch-size-multiple") == "1"
        assert value(argv, "--batch-size") == "256"
        assert value(argv, "--path").endswith("checkpoint_best.pt")
    standard = [value(a, "--gen-subset") for a in generates if a[1].endswith(os.path.join("standard", "bin"))]
    assert standard == [f"test{k}" for k in range(7, 13)] * 4
    compositional = [value(a, "--gen-subset") for a in generates if not a[1].endswith(os.path.join("standard", "bin"))]
    assert compositional == ["test"] * 12
    assert len(commands(out, "accuracy.py")) == len(generates)
    # halting analysis: standard protocol, the plugin's three models (not the transformer)
    halting = commands(out, HALTING_DEPTH)
    assert sorted(value(a, "--path").split(os.sep)[-5] for a in halting) == ["sut", "ut-halting", "ut-no-halting"]
    assert all(a[a.index("--subsets") + 1:a.index("--keys")] == [f"test{k}" for k in range(7, 13)] for a in halting)
    assert commands(out, "summarize.py")


def test_dry_run_reduced_gives_every_model_the_same_update_budget(tmp_path):
    out = in_process([sys.executable, TABLE5, "--setup", "seq2seq", "--dry-run", "--reduced",
                      "--data-dir", str(tmp_path / "d"), "--work-dir", str(tmp_path / "w"),
                      "--protocols", "standard", "--buckets", "all"]).stdout
    trains = commands(out, "fairseq-train")
    assert len(trains) == 4
    for argv in trains:
        check_model_flags(value(argv, "--save-dir").split(os.sep)[-4], argv)
        # the budget is the update count (the same batches for every model); one hour caps it
        assert value(argv, "--max-update") == "10000" and value(argv, "--stop-time-hours") == "8"
        assert value(argv, "--max-tokens") == "2048" and value(argv, "--lr") == "7e-4"
        assert value(argv, "--warmup-updates") == "1000" and value(argv, "--validate-interval-updates") == "1000"
    subsets = [value(a, "--gen-subset") for a in commands(out, "fairseq-generate")]
    assert subsets[:13] == ["test"] + [f"test{k}" for k in range(1, 13)]  # bucket 0 is split "test"
    # one budget override applies to every model
    out = in_process([sys.executable, TABLE5, "--setup", "seq2seq", "--dry-run", "--reduced",
                      "--data-dir", str(tmp_path / "d"), "--work-dir", str(tmp_path / "w"), "--protocols", "A",
                      "--stop-time-hours", "0.25", "--max-update", "777"]).stdout
    assert [(value(a, "--stop-time-hours"), value(a, "--max-update")) for a in commands(out, "fairseq-train")] \
        == [("0.25", "777")] * 4
    assert not (tmp_path / "d").exists()


def test_dry_run_replaces_incomplete_data_directories_and_only_those(tmp_path):
    """prepare.py / generate.py refuse a non-empty --out unless --overwrite: table5.py asks
    for it only when the directory exists without a complete binarization (never trusted)."""
    data = tmp_path / "d"
    (data / "original").mkdir(parents=True)
    (data / "original" / "train0").write_text("# ( a ) ( b )\n")  # 1 of 26 files
    (data / "A").mkdir()
    (data / "A" / "train.src").write_text("a #SEP# b\n")  # text only, no bin/
    out = in_process([sys.executable, TABLE5, "--setup", "seq2seq", "--dry-run", "--reduced", "--data-dir", str(data),
                      "--work-dir", str(tmp_path / "w"), "--protocols", "standard", "A"]).stdout
    (gen,) = commands(out, "generate.py")
    assert "--overwrite" in gen
    prepared = {value(c, "--protocol"): c for c in commands(out, "prepare.py")}
    assert "--overwrite" in prepared["A"] and "--overwrite" not in prepared["standard"]
    assert sorted(os.listdir(data)) == ["A", "original"]  # a dry run changes nothing


@pytest.mark.parametrize("model", recipe.MODELS)
def test_train_py_dry_run(model, tmp_path):
    for reduced in (False, True):
        # one of the eight as a real ``python train.py`` (its entry point), the rest in process
        runner = run if (model, reduced) == (recipe.MODELS[0], False) else in_process
        out = runner([sys.executable, TRAIN, model, "--data", "BIN", "--save-dir", str(tmp_path / "ck"),
                   "--dry-run"] + (["--reduced"] if reduced else [])
                  + ["--", "--encoder-layers", "2", "--patience", "3"]).stdout
        (argv,) = commands(out, "fairseq-train")
        assert argv[1] == "BIN"
        assert value(argv, "--stop-time-hours") == ("8" if reduced else "12")
        assert value(argv, "--max-update") == ("10000" if reduced else "50000")
        assert value(argv, "--encoder-layers") == "2" and value(argv, "--patience") == "3"  # extra wins
        assert value(argv, "--log-file") == str(tmp_path / "ck" / "train.log")
        assert ("reduced" if reduced else "full") + " configuration" in out
    assert not (tmp_path / "ck").exists()


def test_parameter_counts_quoted_in_the_docs():
    params = load_script("params")
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for i in range(params.LOGIC_DICT_SIZE - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    counts = {m: params.count_parameters(m, dictionary) for m in recipe.MODELS}
    # pre-LN (common.json) as fairseq-train builds them: what train.log reports
    assert counts == {"sut": 1_563_906, "ut-halting": 204_354, "ut-no-halting": 170_560,
                      "transformer": 1_991_168}
    docs = open(os.path.join(REPO, "docs", "logic.md"), encoding="utf-8").read()
    assert all(f"{n:,}" in docs for n in counts.values())


def test_bucket_names():
    assert recipe.parse_buckets("7..12") == list(range(7, 13)) == recipe.parse_buckets("7-12")
    assert recipe.parse_buckets("all") == list(range(13)) and recipe.parse_buckets("0,12") == [0, 12]
    with pytest.raises(recipe.RecipeError):
        recipe.parse_buckets("11..13")
    splits = recipe.eval_splits("standard", [0, 7])
    assert [(s["subset"], s["text"], s["key"]) for s in splits] == [("test", "test0", "0"), ("test7", "test7", "7")]
    assert [(s["subset"], s["text"], s["key"]) for s in recipe.eval_splits("B")] == [("test", "test", "B")]


def test_evaluate_dry_run_threshold_and_analysis(tmp_path):
    base = ["--data", "D", "--checkpoint", "C.pt", "--out-dir", str(tmp_path / "e"), "--dry-run"]
    out = in_process([sys.executable, EVALUATE, "sut", *base, "--threshold", "0.8", "--buckets", "0,12"]).stdout
    generates = commands(out, "fairseq-generate")
    assert [value(a, "--gen-subset") for a in generates] == ["test", "test12"]
    assert all(value(a, "--model-overrides") == "{'halting_threshold': 0.8}" for a in generates)
    assert [value(a, "--reference") for a in commands(out, "accuracy.py")] == [os.path.join("D", "test0.tgt"),
                                                                                os.path.join("D", "test12.tgt")]
    (halting,) = commands(out, HALTING_DEPTH)
    assert value(halting, "--threshold") == "0.8" and halting[3] == os.path.join("D", "bin")
    out = run([sys.executable, EVALUATE, "transformer", *base, "--threshold", "0.8"]).stdout  # a real process
    assert not any("--model-overrides" in a for a in commands(out, "fairseq-generate"))
    assert not commands(out, HALTING_DEPTH)
    out = in_process([sys.executable, EVALUATE, "ut-halting", *base, "--protocol", "C"]).stdout
    assert [value(a, "--gen-subset") for a in commands(out, "fairseq-generate")] == ["test"]
    assert not commands(out, HALTING_DEPTH)  # Figure 4 is per operator count: standard only
    assert not (tmp_path / "e").exists()


def fake_result(work, model, protocol, seed, accuracy, depth=None, config="reduced", params=1000,
                expected=None, totals=None):
    run_dir = work / model / protocol / f"seed{seed}"
    run_dir.mkdir(parents=True)
    result = {"model": model, "protocol": protocol, "seed": seed, "config": config, "params": params,
              "accuracy": {k: {"accuracy": v, "correct": round(v * (totals or {}).get(k, 100) / 100),
                               "total": (totals or {}).get(k, 100)} for k, v in accuracy.items()},
              "halting_depth": None if depth is None else
              {k: {"encoder": {"mean_depth": d, **({"mean_expected_depth": expected[k]} if expected else {})},
                   "decoder": {"mean_depth": 1.0}} for k, d in depth.items()}}
    (run_dir / "result.json").write_text(json.dumps(result))


def test_summary_averages_seeds_and_fills_every_column(tmp_path):
    summarize = load_script("summarize")
    buckets = [str(k) for k in range(13)]
    # seed 1: bucket 0 (10 pairs) at 0 %, the other in-distribution buckets (100 each) at
    # 90 %: pooled 540 / 610 = 88.52 %; seed 2: 80 % everywhere; the mean 84.26 %
    fake_result(tmp_path, "sut", "standard", 1, {k: 0.0 if k == "0" else 90.0 for k in buckets},
                {k: 5.0 + int(k) / 4 for k in buckets}, expected={k: 4.0 for k in buckets}, totals={"0": 10})
    fake_result(tmp_path, "sut", "standard", 2, {k: 80.0 for k in buckets}, {k: 6.0 + int(k) / 4 for k in buckets},
                expected={k: 5.0 for k in buckets})
    for letter, acc in (("A", 70.0), ("B", 60.0), ("C", 50.0)):
        fake_result(tmp_path, "sut", letter, 1, {letter: acc})
    fake_result(tmp_path, "transformer", "standard", 1, {"7": 42.0, "12": 10.0}, params=2000)
    fake_result(tmp_path, "ut-no-halting", "standard", 1, {"7": 1.0}, {"7": 12.0})
    text = summarize.summarize(str(tmp_path))
    # mean ± sample sd of 90 and 80: 85.0 ± 7.1
    assert "| SUT (ours, reduced) | 1,000 | 85.0 ± 7.1 (n=2) | 85.0 ± 7.1 (n=2) | 85.0 ± 7.1 (n=2) " \
           "| 85.0 ± 7.1 (n=2) | 85.0 ± 7.1 (n=2) | 85.0 ± 7.1 (n=2) | 70.0 | 60.0 | 50.0 |" in text
    assert "| Transformer (ours, reduced) | 2,000 | 42.0 | – | – | – | – | 10.0 | – | – | – |" in text
    assert "In-distribution buckets" in text and "| SUT (ours, reduced) | 40.0 ± 56.6 (n=2) | 85.0 ± 7.1 (n=2) |" in text
    assert "| 85.0 ± 7.1 (n=2) | 84.3 ± 6.0 (n=2) |" in text  # bucket 6, then the pooled 0-6 (88.5, 80)
    summary = json.load(open(tmp_path / "table5.json"))
    assert summary["rows"]["sut"]["cells"]["0-6"]["accuracy"] == pytest.approx((540 / 610 * 100 + 80) / 2)
    assert summary["halting_depth"]["sut"]["12"]["encoder"] == pytest.approx(8.5)
    # the expected depth (seeds averaged) where every result has it; none for the UT's older one
    assert summary["halting_depth"]["sut"]["12"]["encoder_expected"] == pytest.approx(4.5)
    assert summary["halting_depth"]["ut-no-halting"]["7"]["encoder_expected"] is None
    assert "| SUT | encoder, expected | 4.50 |" in text
    # the rows of Figure 4 with Spearman's rho over buckets 1..12: the executed encoder depth
    # rises (5.5 + k/4: 1.00), the expected is constant (undefined), the decoder's constant 1.0
    # (undefined), and no decoder expected row (no result has it)
    rows = {l.split(" | ")[1]: l for l in text.splitlines() if l.startswith("| SUT | ")}
    assert rows["encoder, executed"].startswith("| SUT | encoder, executed | 5.50 | 5.75 |")
    assert rows["encoder, executed"].endswith("| 8.50 | 1.00 |")
    assert rows["encoder, expected"].endswith("| 4.50 | – |")
    assert rows["decoder, executed"].endswith("| 1.00 | – |") and "decoder, expected" not in rows
    assert summary["halting_depth_spearman"]["sut"] == {
        "encoder": pytest.approx(1.0), "encoder_expected": None, "decoder": None, "decoder_expected": None}
    assert summary["halting_depth"]["sut"]["3"]["decoder_expected"] is None
    assert summary["rows"]["ut-no-halting"]["halting"] is False and summary["rows"]["sut"]["halting"] is True
    assert (tmp_path / "figure4.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "accuracy.png").read_bytes()[:4] == b"\x89PNG" and "accuracy.png" in text
    # no model with halting: no figure, still a table
    other = tmp_path / "other"
    fake_result(other, "transformer", "standard", 1, {"7": 42.0})
    assert "figure4" not in summarize.summarize(str(other)) and not (other / "figure4.png").exists()


def test_classify_summary_states_what_each_run_cost_and_reached(tmp_path):
    """The training table of the classify setup, from each run's train.log beside its
    result.json: seed 1 logs 2,000 updates at 1 per second and validates at 70 then 60 %,
    seed 2 at 0.5 per second and 60 %: the best validations 70 and 60 (65.0 ± 7.1), hours
    2000/3600 and 4000/3600 (0.83 per run, 1.67 for both), steps at 7 and 12 averaged."""
    summarize = load_script("summarize")
    for seed, ups, valids, steps in ((1, 1.0, (70, 60), (4.0, 3.0)), (2, 0.5, (60,), (6.0, 5.0))):
        fake_result(tmp_path, "ut", "standard", seed, {"7": 50.0, "12": 40.0})
        run_dir = tmp_path / "ut" / "standard" / f"seed{seed}"
        result = json.load(open(run_dir / "result.json"))
        result["updates"] = 2000
        result["accuracy"]["7"]["mean_encoder_steps"], result["accuracy"]["12"]["mean_encoder_steps"] = steps
        (run_dir / "result.json").write_text(json.dumps(result))
        (run_dir / "train.log").write_text(
            f"| train_inner | epoch 001:    2000 / 1913 loss=1.6, ups={ups}, wpb=1843.8, num_updates=2000, lr=7e-4\n"
            + "".join(f"valid | epoch 001 | valid on 'valid' subset | loss 1.3 | accuracy {v} | num_updates 2000\n"
                      for v in valids))
    fake_result(tmp_path, "transformer", "standard", 1, {"7": 42.0})  # no train.log: "–"
    fake_result(tmp_path, "ut", "A", 1, {"A": 55.0})  # another protocol: not in the training table
    (tmp_path / "ut" / "A" / "seed1" / "train.log").write_text(
        "| train_inner | epoch 001:  2000 / 1913 loss=1.6, ups=0.1, wpb=1843.8, num_updates=2000, lr=7e-4\n"
        "valid | epoch 001 | valid on 'valid' subset | loss 1.3 | accuracy 99 | num_updates 2000\n")
    text = summarize.summarize(str(tmp_path), setup="classify")
    assert "| UT (ours, reduced) | 2,000 | 65.0 ± 7.1 (n=2) | 5.0 | 4.0 | 0.83 | 1.67 |" in text
    assert "| Transformer (ours, reduced) | – | – | – | – | – | – |" in text
    training = json.load(open(tmp_path / "table5.json"))["rows"]["ut"]["training"]
    assert training["hours"]["accuracy"] == pytest.approx(3000 / 3600)
    assert training["hours_all_runs"] == pytest.approx(6000 / 3600)


def test_compare_puts_gut_against_the_ut_per_bucket(tmp_path, capsys):
    """``summarize.py WORK --setup classify --compare gut ut``: per reported bucket the two
    models' seed means ± sd and whether GUT is ahead beyond both sds (7: +3.5 against sds 1.4
    and 0.7; 8: +1 against 1.4); a model without results is refused by name."""
    summarize = load_script("summarize")
    for seed, (g7, g8, u7, u8) in ((1, (61.0, 51.0, 56.0, 50.0)), (2, (59.0, 53.0, 57.0, 52.0))):
        fake_result(tmp_path, "gut", "standard", seed, {"7": g7, "8": g8})
        fake_result(tmp_path, "ut", "standard", seed, {"7": u7, "8": u8})
    summarize.main([str(tmp_path), "--setup", "classify", "--compare", "gut", "ut"])
    out = capsys.readouterr().out
    comparison = out[out.index("GUT against UT"):].splitlines()
    assert comparison[0] == ("GUT against UT, accuracy (%) per number of operators, seed mean ± sample sd "
                             "(seeds [1, 2] and [1, 2]):")
    assert comparison[-2:] == ["| 7 | 60.0 ± 1.4 (n=2) | 56.5 ± 0.7 (n=2) | +3.5 | yes |",
                               "| 8 | 52.0 ± 1.4 (n=2) | 51.0 ± 1.4 (n=2) | +1.0 | no |"]
    with pytest.raises(SystemExit, match=r"--compare tlb: no results of that model \(models: ut, gut\)"):
        summarize.main([str(tmp_path), "--setup", "classify", "--compare", "tlb", "ut"])


# --------------------------------------------------------------------------- the scorer

def write_generate_output(path, items):
    """fairseq-generate-like output for (id, reference, hypothesis), in the given order."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("INFO:fairseq_cli.generate:some log line\n")
        for i, ref, hyp in items:
            f.write(f"S-{i}\ta #SEP# b\nT-{i}\t{ref}\nH-{i}\t-0.1\t{hyp}\nD-{i}\t-0.1\t{hyp}\nP-{i}\t-0.1 -0.2\n")


def test_scorer_counts_the_relation_token(tmp_path):
    accuracy = load_script("accuracy")
    refs = ["=", "<", ">", "^", "|", "v", "#"]
    (tmp_path / "ref.tgt").write_text("\n".join(refs) + "\n")
    hyps = ["=", "<", "<", "^ ^", "", "v", "#"]  # 4 exact; "^ ^" has the right first token only
    write_generate_output(tmp_path / "gen.txt", [(i, r, h) for i, (r, h) in reversed(list(enumerate(zip(refs, hyps))))])
    result = accuracy.score(str(tmp_path / "gen.txt"), str(tmp_path / "ref.tgt"))
    assert (result["total"], result["lines"], result["correct"], result["first_token_correct"]) == (7, 7, 4, 5)
    assert result["accuracy"] == pytest.approx(400 / 7)
    # a T- line that is not the reference file's line
    write_generate_output(tmp_path / "bad.txt", [(i, "#" if i == 2 else r, r) for i, r in enumerate(refs)])
    with pytest.raises(ValueError, match="T-2"):
        accuracy.score(str(tmp_path / "bad.txt"), str(tmp_path / "ref.tgt"))


def test_scorer_fails_loudly_when_fewer_examples_were_scored_than_the_split_has(tmp_path):
    accuracy = load_script("accuracy")
    refs = ["#"] * 10
    (tmp_path / "test12.tgt").write_text("\n".join(refs) + "\n")
    # what fairseq-generate without --required-batch-size-multiple 1 does: drops a few
    write_generate_output(tmp_path / "gen.txt", [(i, "#", "#") for i in range(8)])
    with pytest.raises(ValueError, match=r"scored 8 examples but .*test12.tgt has 10 lines.*missing.*\[8, 9\]"):
        accuracy.score(str(tmp_path / "gen.txt"), str(tmp_path / "test12.tgt"))
    proc = in_process([sys.executable, ACCURACY, str(tmp_path / "gen.txt"), "--reference",
                       str(tmp_path / "test12.tgt"), "--json", str(tmp_path / "s.json")], check=False)
    assert proc.returncode != 0 and "has 10 lines" in proc.stderr and "--required-batch-size-multiple 1" in proc.stderr
    assert not (tmp_path / "s.json").exists()
    # complete output passes and writes the JSON
    write_generate_output(tmp_path / "gen.txt", [(i, "#", "#") for i in range(10)])
    proc = in_process([sys.executable, ACCURACY, str(tmp_path / "gen.txt"), "--reference",
                       str(tmp_path / "test12.tgt"), "--json", str(tmp_path / "s.json")])
    assert "all 10 lines" in proc.stdout and json.load(open(tmp_path / "s.json"))["accuracy"] == 100.0


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke grid run in two calls, as a resumed recipe is: stages 1-2 (data, train),
    then stages 3-4 (evaluate, report) on the same work directory."""
    from sut_fairseq.data import logic_inference as li

    root = tmp_path_factory.mktemp("logic")
    original = root / "original"
    li.write_original(str(original), li.split_buckets(li.generate_buckets(3000, seed=1)))
    data, work = root / "data", root / "work"
    command = [sys.executable, TABLE5, "--setup", "seq2seq", "--original", str(original), "--data-dir", str(data),
               "--work-dir", str(work), "--protocols", "standard", "--models", "sut", "--reduced",
               "--max-update", "3", "--train-args", TINY, "--buckets", "11..12"]
    first = run(command + ["--stop-stage", "train"]).stdout
    run_dir = work / "sut" / "standard" / "seed1"
    after_train = sorted(os.listdir(run_dir))
    second = run(command + ["--stage", "evaluate"]).stdout
    return {"data": data, "work": work, "out": first + second, "first": first, "second": second,
            "after_train": after_train, "command": command, "run": run_dir}


def test_smoke_stages_stop_after_train_and_resume_at_evaluate(smoke):
    first, second = smoke["first"], smoke["second"]
    assert "=== stage 1: data" in first and "=== stage 2: train" in first
    assert "stage 3" not in first and not commands(first, "fairseq-generate")
    assert "train.json" in smoke["after_train"] and "result.json" not in smoke["after_train"]
    assert "stage 1" not in second and "stage 2" not in second
    assert "=== stage 3: evaluate" in second and "=== stage 4: report" in second
    assert not commands(second, "fairseq-train") and len(commands(second, "fairseq-generate")) == 2


def test_stage_options_are_checked(tmp_path):
    proc = in_process([sys.executable, TABLE5, "--setup", "seq2seq", "--data-dir", str(tmp_path), "--stage", "report",
                       "--stop-stage", "train", "--dry-run"], check=False)
    assert proc.returncode != 0 and "--stage report comes after --stop-stage train" in proc.stderr
    proc = in_process([sys.executable, TABLE5, "--setup", "seq2seq", "--stage", "decode", "--dry-run"], check=False)
    assert proc.returncode == 2 and "unknown stage 'decode'" in proc.stderr
    out = in_process([sys.executable, TABLE5, "--setup", "seq2seq", "--data-dir", str(tmp_path / "d"), "--work-dir",
                      str(tmp_path / "w"), "--stage", "2", "--stop-stage", "3", "--models", "sut",
                      "--protocols", "A", "--dry-run"]).stdout
    assert len(commands(out, "fairseq-train")) == 1 and len(commands(out, "fairseq-generate")) == 1
    assert not commands(out, "prepare.py") and not commands(out, "summarize.py")


def test_smoke_trains_the_reduced_sut_and_scores_every_line_of_the_buckets_asked_for(smoke):
    """--buckets 11..12 (two of the default 7..12: every bucket is one more generate run)."""
    out, run_dir, data = smoke["out"], smoke["run"], smoke["data"]
    (prep,) = commands(out, "prepare.py")
    assert value(prep, "--protocol") == "standard" and "--binarize" in prep
    assert not commands(out, "generate.py")  # --original given: nothing generated
    (train,) = commands(out, "fairseq-train")
    assert value(train, "--arch") == "sut_logic" and value(train, "--stop-time-hours") == "8"
    assert value(train, "--max-update") == "3" and value(train, "--encoder-embed-dim") == "32"
    assert [value(a, "--gen-subset") for a in commands(out, "fairseq-generate")] == [f"test{k}" for k in range(11, 13)]
    result = json.load(open(run_dir / "result.json"))
    assert result["model"] == "sut" and result["protocol"] == "standard" and result["config"] == "reduced"
    assert result["updates"] == 3 and result["params"] > 0 and "max_update" in result["stop_reason"]
    assert sorted(result["accuracy"], key=int) == [str(k) for k in range(11, 13)]
    for k in range(11, 13):
        scored = result["accuracy"][str(k)]
        n = line_count(data / "standard" / f"test{k}.tgt")
        assert n > 0 and scored["total"] == scored["lines"] == n  # every line scored
        assert scored["accuracy"] == pytest.approx(100.0 * scored["correct"] / n)
        assert (run_dir / f"generate-test{k}.txt").exists() and (run_dir / f"score-test{k}.json").exists()
        depth = result["halting_depth"][str(k)]
        assert depth["sentences"] == n and 1 <= depth["encoder"]["mean_depth"] <= 3
        assert 1 <= depth["encoder"]["mean_expected_depth"] <= depth["encoder"]["mean_depth"] + 1e-6
        assert depth["encoder"]["max_steps"] == 3


def test_smoke_writes_table_json_and_figure(smoke):
    out, work = smoke["out"], smoke["work"]
    assert "| SUT (paper) | – | 98 | 97 | 94 | 90 | 88 | 81 | 97 | 94 | 52 |" in out
    assert "| LSTM (paper) | – | 88 | 84 | 80 | 78 | 71 | 69 | 80 | 60 | 59 |" in out
    assert "| Transformer (paper) | – | 51 | 52 | 51 | 51 | 51 | 48 | 53 | 51 | 51 |" in out
    assert "| SUT (ours, reduced) |" in out
    assert (work / "table5.md").read_text().strip() in out
    summary = json.load(open(work / "table5.json"))
    assert summary["runs"] == 1 and summary["columns"] == [str(k) for k in range(7, 13)] + ["A", "B", "C"]
    assert set(summary["rows"]["sut"]["cells"]) == {str(k) for k in range(11, 13)}
    assert set(summary["halting_depth"]["sut"]) == {str(k) for k in range(11, 13)}
    assert summary["paper"]["SUT"]["12"] == 81 and summary["paper"]["LSTM"]["7"] == 88
    png = (work / "figure4.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert not [p for p in os.listdir(work) if p.endswith(".tmp")]


def test_smoke_rerun_skips_the_finished_run(smoke):
    out = in_process(smoke["command"]).stdout  # every run done: no tool started
    assert "done before" in out and not commands(out, "fairseq-train") and not commands(out, "prepare.py")


def test_dropped_examples_in_a_real_generate_output_fail_the_evaluation(smoke, tmp_path):
    """accuracy.py on the smoke run's own fairseq-generate output with its last example
    removed, as a dropped batch remainder would leave it."""
    gen = smoke["run"] / "generate-test11.txt"
    text = gen.read_text()
    last = max(int(l.split("\t")[0][2:]) for l in text.splitlines() if l.startswith("H-"))
    kept = [l for l in text.splitlines() if not l.split("\t")[0].endswith(f"-{last}")]
    (tmp_path / "gen.txt").write_text("\n".join(kept) + "\n")
    reference = smoke["data"] / "standard" / "test11.tgt"
    proc = run([sys.executable, ACCURACY, str(tmp_path / "gen.txt"), "--reference", str(reference)], check=False)
    n = line_count(reference)
    assert proc.returncode == 1 and f"scored {n - 1} examples but {reference} has {n} lines" in proc.stderr
