"""The WMT'14 training/evaluation recipe: the --dry-run commands of every model and Table 2
ablation, the update-frequency arithmetic, and one tiny end-to-end run
(prep -> fairseq-preprocess -> fairseq-train 20 updates of sut_tiny -> average ->
fairseq-generate beam 8 lenpen 0.4 -> both BLEU scores)."""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from cli_helpers import run_in_process

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(REPO, "scripts", "wmt14")
FIXTURE = os.path.join(REPO, "tests", "fixtures", "wmt14")
sys.path.insert(0, SCRIPTS)

import wmt14_recipe as recipe  # noqa: E402


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"wmt14_{name}", os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = load_script("train")
evaluate = load_script("evaluate")


def dry_run(capsys, *argv):
    argv = list(argv)
    at = argv.index("--") if "--" in argv else len(argv)
    assert train.main(argv[:at] + ["--dry-run"] + argv[at:]) == 0
    out = capsys.readouterr().out
    note = [l for l in out.splitlines() if l.startswith("# ")]
    command = [l for l in out.splitlines() if l.startswith("+ ")]
    assert len(note) == 1 and len(command) == 1, out
    return note[0], shlex.split(command[0][2:])


def value(command, option):
    values = recipe.flag_values(command, option)
    return None if values is None else " ".join(values)


COMMON = {"--lr": "7e-4", "--lr-scheduler": "inverse_sqrt", "--warmup-updates": "4000",
          "--optimizer": "adam", "--adam-betas": "(0.9, 0.98)", "--label-smoothing": "0.1",
          "--max-epoch": "100", "--keep-best-checkpoints": "5", "--max-tokens": "8192",
          "--best-checkpoint-metric": "nll_loss", "--task": "translation",
          "--source-lang": "en", "--target-lang": "de"}
SUT_LOSSES = {"--criterion": "sut_label_smoothed_cross_entropy", "--mim-weight": "0.1",
              "--act-weight": "1", "--aux-loss-scale": "reference"}


@pytest.mark.parametrize("model,arch", [("sut_base", "sut_base"), ("sut_big", "sut_big"),
                                        ("ut_base", "ut_base"), ("ut_big", "ut_big"),
                                        ("transformer", "transformer_wmt_en_de")])
def test_dry_run_flags_of_every_model(capsys, model, arch):
    _, command = dry_run(capsys, model, "--data", "DATA", "--ngpus", "8")
    assert os.path.basename(command[0]) == "fairseq-train" and command[1] == "DATA"
    assert value(command, "--arch") == arch
    assert value(command, "--user-dir") == os.path.join(REPO, "sut_fairseq")
    for option, expected in COMMON.items():
        assert value(command, option) == expected, option
    assert value(command, "--share-all-embeddings") == ""
    assert value(command, "--update-freq") == "4" and value(command, "--fp16") == ""
    assert value(command, "--save-dir") == os.path.join("checkpoints", "wmt14", model)
    options = [t for t in command if t.startswith("--")]
    assert len(options) == len(set(options)), "an option is given twice"
    if model == "transformer":
        assert value(command, "--criterion") == "label_smoothed_cross_entropy"
        for option in ("--dropout", "--attention-dropout", "--activation-dropout"):
            assert value(command, option) == "0.2"
        assert value(command, "--mim-weight") is None
    else:
        for option, expected in SUT_LOSSES.items():
            assert value(command, option) == expected, option
        assert value(command, "--dropout") is None  # the presets set the WMT dropouts


ABLATIONS = {
    "no-mim": {"--mim-weight": "0", "--switch-weight": "0.01"},
    "no-momha": {"--att-heads": "1", "--att-head-dim": "256"},
    "no-act": {"--act-weight": "0"},
    "no-halting": {"--encoder-halting": "none", "--decoder-halting": "none"},
}


@pytest.mark.parametrize("ablation", sorted(ABLATIONS))
def test_dry_run_flags_of_every_ablation(capsys, ablation):
    _, command = dry_run(capsys, "sut_base", "--ablation", ablation, "--data", "DATA")
    for option, expected in ABLATIONS[ablation].items():
        assert value(command, option) == expected
    for option, expected in SUT_LOSSES.items():   # the rest of sut_base's recipe is kept
        if option not in ABLATIONS[ablation]:
            assert value(command, option) == expected
    assert value(command, "--arch") == "sut_base"
    assert value(command, "--save-dir") == os.path.join("checkpoints", "wmt14", f"sut_base-{ablation}")
    options = [t for t in command if t.startswith("--")]
    assert len(options) == len(set(options))


def test_ablations_are_refused_outside_sut_base_and_unknown_names(capsys):
    assert train.main(["ut_big", "--ablation", "no-mim", "--data", "D", "--dry-run"]) == 2
    assert train.main(["sut_base", "--ablation", "no-such", "--data", "D", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "applies to sut_base" in err and "no-mim, no-momha, no-act, no-halting" in err


@pytest.mark.parametrize("ngpus,max_tokens,freq", [(32, 8192, 1), (8, 8192, 4), (1, 8192, 32),
                                                   (3, 4096, 22), (4, 3584, 19), (64, 8192, 1)])
def test_update_freq_arithmetic(capsys, ngpus, max_tokens, freq):
    assert recipe.update_freq(ngpus, max_tokens) == freq
    note, command = dry_run(capsys, "sut_base", "--data", "D", "--ngpus", str(ngpus),
                            "--max-tokens", str(max_tokens))
    assert value(command, "--update-freq") == str(freq)
    assert value(command, "--max-tokens") == str(max_tokens)
    assert f"ceil(32*8192 / ({ngpus}*{max_tokens})) = {freq}" in note
    assert f"{ngpus * max_tokens * freq:,} tokens per update" in note
    if ngpus > 1:
        assert value(command, "--distributed-world-size") == str(ngpus)


def test_extra_options_replace_the_recipe_and_update_freq_can_be_given(capsys):
    note, command = dry_run(capsys, "sut_base", "--data", "D", "--update-freq", "2", "--cpu",
                            "--", "--lr", "1e-3", "--max-update", "10")
    assert value(command, "--lr") == "1e-3" and value(command, "--max-update") == "10"
    assert value(command, "--update-freq") == "2" and "(given)" in note
    assert value(command, "--cpu") == "" and value(command, "--fp16") is None


@pytest.mark.parametrize("model,options,compiled", [
    ("sut_base", ["--precision", "bf16"], True), ("ut_big", ["--precision", "bf16"], True),
    ("sut_base", ["--precision", "bf16", "--eager"], False),
    ("sut_base", ["--precision", "bf16", "--cpu"], False),
    ("sut_base", [], False), ("sut_base", ["--precision", "fp32"], False),
    ("transformer", ["--precision", "bf16"], False)])
def test_compiled_step_only_for_the_plugin_models_in_bf16_on_a_gpu(capsys, model, options, compiled):
    """--compile-step where it was measured faster (the SUT/UT, bf16, a GPU), not with
    --eager, on a CPU, in fp16 (the default) or fp32, nor for fairseq's transformer."""
    _, command = dry_run(capsys, model, "--data", "D", *options)
    assert (value(command, "--compile-step") == "") is compiled
    assert (value(command, "--bf16") == "") is ("bf16" in options and "--cpu" not in options)


def test_every_command_parses_with_fairseq(capsys):
    """fairseq-train's own parser accepts every recipe command (no unknown options)."""
    from fairseq import options

    runs = [(m, None) for m in recipe.MODELS] + [("sut_base", a) for a in ABLATIONS]
    for model, ablation in runs:
        argv = [model, "--data", "DATA", "--ngpus", "8"] + (["--ablation", ablation] if ablation else [])
        _, command = dry_run(capsys, *argv)
        args = options.parse_args_and_arch(options.get_training_parser(), input_args=command[1:])
        assert args.update_freq == [4] and args.lr == [7e-4] and args.max_epoch == 100
        if ablation == "no-momha":
            assert (args.att_heads, args.att_head_dim) == (1, 256)
        if ablation == "no-mim":
            assert (args.mim_weight, args.switch_weight) == (0.0, 0.01)
    _, command = dry_run(capsys, "sut_base", "--data", "DATA", "--precision", "bf16")
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=command[1:])
    assert args.compile_step is True and args.arch == "sut_base"


def test_no_momha_keeps_the_parameter_count():
    """Table 2 lists 66M for both SUT base and '- MoMHA': single-head experts of width 256."""
    from sut_fairseq.models.standalone import build_model

    def count(**overrides):
        model = build_model("sut_base", dict_size=64, share_all_embeddings=True, **overrides)
        return sum(p.numel() for p in model.parameters())

    assert count(att_heads=1, att_head_dim=256) == count()


TABLES = os.path.join(SCRIPTS, "tables.py")


def test_tables_dry_run_prints_every_stage():
    # dry runs start no tool: tables.py's main, and the train.py / evaluate.py --dry-run it
    # runs, in the test's process (run_in_process); the end-to-end fixture below runs them
    # as real processes
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = run_in_process(TABLES, ["2", "--prep", "/prep", "--ngpus", "16", "--dry-run"], env=env,
                         children_in_process=True)
    assert out.returncode == 0, out.stderr
    stages = [l for l in out.stdout.splitlines() if l.startswith("=== stage")]
    assert [s.split(":")[1].split()[0] for s in stages] == ["data", "train", "evaluate", "report"]
    assert "prepare.py --workdir /prep" in out.stdout  # /prep/data-bin is missing
    trains = [l for l in out.stdout.splitlines() if l.startswith("+ ") and "fairseq-train" in l]
    generates = [l for l in out.stdout.splitlines() if "fairseq-generate" in l]
    assert len(trains) == 5 and len(generates) == 5
    assert all("--update-freq 2" in l for l in trains)
    assert all("--beam 8 --lenpen 0.4" in l for l in generates)
    out = run_in_process(TABLES, ["1", "--prep", "/prep", "--ngpus", "16", "--stage", "train",
                                  "--stop-stage", "train", "--dry-run"], env=env, children_in_process=True)
    assert out.returncode == 0, out.stderr
    archs = re.findall(r"--arch (\S+)", out.stdout)
    assert archs == ["transformer_wmt_en_de", "ut_base", "sut_base", "ut_big", "sut_big"]
    assert "fairseq-generate" not in out.stdout and "prepare.py" not in out.stdout
    out = run_in_process(TABLES, ["1", "--prep", "/p", "--runs", "sut_tiny", "--dry-run"], env=env,
                         children_in_process=True)
    assert out.returncode == 2 and "'sut_tiny' is not a run of Table 1" in out.stderr


def test_tables_with_sentencepiece_prepare_train_and_evaluate_data_bin_spm():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = run_in_process(TABLES, ["1", "--prep", "/prep", "--runs", "sut_base", "--subword", "spm",
                                  "--stop-stage", "train", "--dry-run"], env=env, children_in_process=True)
    assert out.returncode == 0, out.stderr
    assert "prepare.py --workdir /prep --subword spm" in out.stdout
    train = [l for l in out.stdout.splitlines() if l.startswith("+ ") and "fairseq-train" in l]
    assert len(train) == 1 and "fairseq-train /prep/data-bin-spm " in train[0]
    assert "/prep/data-bin " not in out.stdout


# --------------------------------------------------------------------------- end to end

def _run(command, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # small models: threads only contend
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{command[:3]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """Table 1's recipe (scripts/wmt14/tables.py) for one run on the fixture corpus, a tiny
    model: stages data and train in one call, evaluate and report in a second one."""
    root = tmp_path_factory.mktemp("wmt14_e2e")
    prep, ckpt = root / "prep", root / "ckpt"
    recipe_command = [sys.executable, os.path.join(SCRIPTS, "tables.py"), "1", "--prep", str(prep),
                      "--ckpt", str(ckpt), "--runs", "sut_base",
                      "--prep-args", f"--local-dir {FIXTURE} --no-download --workers 1 --bpe-merges 200",
                      "--eval-args", "--num-best 3 --cpu"]
    train_out = _run(recipe_command + [
        "--stop-stage", "train", "--", "--arch", "sut_tiny", "--cpu", "--update-freq", "1",
        "--max-tokens", "256", "--", "--max-update", "20", "--warmup-updates", "10", "--lr", "2e-3",
        "--num-workers", "0", "--required-batch-size-multiple", "1"])
    eval_out = _run(recipe_command + ["--stage", "evaluate"])
    return prep, ckpt / "sut_base", train_out, eval_out


def test_end_to_end_prep_train_average_generate_score(e2e):
    prep, ckpt, train_out, out = e2e
    assert "[run ] binarize" in train_out and "fairseq-preprocess" in train_out
    assert "=== stage 2: train" in train_out and "stage 3" not in train_out
    assert "--arch sut_tiny" in train_out and "--mim-weight 0.1" in train_out
    log = (ckpt / "train.log").read_text()
    assert "num_updates 20" in log or "num_updates=20" in log
    best = sorted(p for p in os.listdir(ckpt) if p.startswith("checkpoint.best_nll_loss_"))
    assert len(best) >= 3, best
    assert "stage 2" not in out and "=== stage 3: evaluate" in out and "=== stage 4: report" in out
    assert "sut_fairseq.eval.average_checkpoints" in out and "--beam 8 --lenpen 0.4" in out
    assert re.search(r"tokenised BLEU \(compound-split, multi-bleu equivalent\): \d+\.\d\d", out)
    assert re.search(r"SacreBLEU \(detokenised vs raw reference\): \d+\.\d\d", out)
    assert "signature: nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in out
    # the MACs column: mean executed MACs per test pair from python -m sut_fairseq.analysis.macs
    row = r"\| sut_base \| 0\.\dM \([\d,]+\) \| \d+\.\d\d \| \d+\.\d\d \| [\d.,]+ ?[KMG]? \|"
    assert re.search(row, out), out[-1500:]
    result = json.loads((ckpt / "eval.json").read_text())
    assert result["sentences"] == 8 and result["beam"] == 8 and result["lenpen"] == 0.4
    assert len((ckpt / "hyp.tok.de").read_text().splitlines()) == 8
    table = (ckpt.parent / "table1.md").read_text()
    assert table.startswith("| model | params |") and re.search(row, table)

    # the parameter count comes from the checkpoint and equals the model's
    from fairseq.data import Dictionary
    from sut_fairseq.models.standalone import build_model

    dict_size = len(Dictionary.load(str(prep / "data-bin" / "dict.en.txt")))
    model = build_model("sut_tiny", dict_size=dict_size, share_all_embeddings=True)
    assert result["params"] == sum(p.numel() for p in model.parameters())


def test_average_of_two_real_checkpoints(e2e, tmp_path):
    from sut_fairseq.eval import average_checkpoints as avg

    _, ckpt, _, _ = e2e
    paths = avg.best_checkpoints(str(ckpt), 2)
    out = str(tmp_path / "avg2.pt")
    assert avg.main(["--inputs", *paths, "--output", out]) == 0
    a, b = (torch.load(p, map_location="cpu", weights_only=True)["model"] for p in paths)
    averaged = torch.load(out, map_location="cpu", weights_only=True)
    assert set(averaged["model"]) == set(a)
    changed = 0
    for key, tensor in averaged["model"].items():
        if torch.is_floating_point(tensor):
            expected = (a[key].double() + b[key].double()) / 2
            torch.testing.assert_close(tensor.double(), expected, rtol=0, atol=1e-7)
            changed += not torch.equal(a[key], b[key])
    assert changed > 10  # the two checkpoints differ: training moved the weights
    assert averaged["cfg"]["model"].arch == "sut_tiny"
