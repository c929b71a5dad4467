"""Helpers of the tests of the split-grid recipes (scripts/flipflop/table3.py,
scripts/listops/table1.py): running a recipe, reading the commands it printed, and the
smoke run of a few models on tiny data stopped after training and resumed at evaluation."""
import importlib.util
import json
import os
import subprocess
import sys

from cli_helpers import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A tiny model and batch for the smoke runs (every model of the grids accepts these).
TINY_MODEL = ("--encoder-embed-dim 16 --att-head-dim 4 --ffd-hidden-dim 16 --encoder-layers 3 "
              "--max-tokens 512 --log-interval 1")


def load_script(path, name):
    """The module of a recipe script under a name of its own (the scripts of different
    tasks share file names such as summarize.py)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(command, check=True):
    """Run ``command`` from the repository root on one thread; its CompletedProcess."""
    proc = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def in_process(command, check=True):
    """``run`` for a command that starts no tool (a dry run, an argument check):
    ``[sys.executable, SCRIPT, *args]`` called in the test's process (``run_in_process``),
    without the seconds a new interpreter spends importing torch and fairseq."""
    assert command[0] == sys.executable
    proc = run_in_process(command[1], command[2:], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def commands(out, name):
    """The printed command lines (``+ ...``) whose program part names ``name``."""
    return [line[2:].split() for line in out.splitlines()
            if line.startswith("+ ") and name in line.split(" > ")[0]]


def value(command, option):
    """The token after the last ``option`` of a command."""
    return command[len(command) - 1 - command[::-1].index(option) + 1]


def stages(out):
    return [line.split(":")[1].split()[0] for line in out.splitlines() if line.startswith("=== stage")]


def smoke(root, generate, recipe, models, data_args, recipe_args=()):
    """Generate tiny data, train ``models`` for 3 updates (stop after training), then
    evaluate and report in a second call (``recipe_args``: more options of the recipe);
    the outputs and the directories."""
    data, work = root / "data", root / "work"
    run([sys.executable, generate, *data_args, "--out", data, "--binarize", "--no-progress"])
    command = [sys.executable, recipe, "--data-dir", data, "--work-dir", work, "--max-update", "3",
               "--models", *models, "--train-args", TINY_MODEL, "--batch-size", "64", *recipe_args]
    first = run(command + ["--stop-stage", "train"]).stdout
    second = run(command + ["--stage", "evaluate"]).stdout
    return {"data": data, "work": work, "first": first, "second": second,
            "splits": json.loads((data / "stats.json").read_text())["binarized_test_splits"]}


def check_smoke(result, models, sizes, work=None):
    """What every smoke run must show: one training per model in the first call and none
    in the second, every test split of every model generated and scored line for line
    (``sizes``: the lines of each split; ``work``: where the runs are, default WORK)."""
    first, second, splits = result["first"], result["second"], result["splits"]
    assert "data is complete" in first and not commands(first, "generate.py")
    assert len(commands(first, "fairseq-train")) == len(models) and not commands(first, "fairseq-generate")
    assert "stage 2" not in second and list(splits) == list(sizes)
    runs = {}
    for model in models:
        path = (work or result["work"]) / model / "seed1"
        run_result = json.loads((path / "result.json").read_text())
        assert run_result["updates"] == 3 and list(run_result["accuracy"]) == list(splits)
        for split in splits:
            score = json.loads((path / f"score-{split}.json").read_text())
            assert score["total"] == score["lines"] == sizes[split]     # every line scored
            assert 0 <= score["accuracy"] <= 100
        runs[model] = run_result
    return runs
