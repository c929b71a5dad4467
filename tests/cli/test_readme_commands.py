"""The README's commands still work, so that the front door cannot rot.

* The worked example runs end to end on its generated data, every command of its block as
  written except two cuts for time: 20 updates instead of 800, and fairseq-generate capped
  at 12 output tokens (the barely trained model would otherwise decode every test pair to
  the maximum length).
* Every task shell script (``scripts/TASK/*.sh``) is named in the README and runs with
  ``--dry-run``: it prints the four stages' commands and creates nothing. The WMT'14
  scripts are limited to one run (``--runs sut_base``): each run's dry run starts two
  more Python processes.
* Every other command of a README ``bash`` block is checked as far as it can be without
  data, a GPU or many minutes: ``make`` targets exist in the Makefile, the GPU driver
  prints its ``--help`` with the stages named, ``python -m sut_fairseq.user_dir`` prints the
  package directory, and every option of the README's Options table and of its commands
  is in ``fairseq-train --help`` or ``fairseq-generate --help``. A command this file does
  not know fails :func:`test_every_readme_command_is_checked`.
* Every ``python -m MODULE`` the README names can be found, and every repository path it
  names exists.

(Links, anchors and the length of table cells: ``tests/cli/test_repository.py``.)
"""
import importlib.util
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from typing import List

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = os.path.join(ROOT, "README.md")
BIN = os.path.dirname(sys.executable)

#: The worked example's cuts for time: (text in the README, what the test runs instead).
WORKED_EXAMPLE_CUTS = [("--max-update 800", "--max-update 20"),
                       ("fairseq-generate example/bin", "fairseq-generate --max-len-a 0 --max-len-b 12 example/bin")]
#: The options of the WMT'14 scripts' dry runs in this test (one run instead of five).
DRY_RUN_EXTRA = {"wmt14": ["--runs", "sut_base"], "multi30k": ["--local-dir", "multi30k-raw"]}
#: The architecture and criterion whose --help lists the README's model and criterion options.
HELP_ARGS = ["--task", "translation", "--arch", "sut_base", "--criterion", "sut_label_smoothed_cross_entropy"]


def readme() -> str:
    with open(README, encoding="utf-8") as handle:
        return handle.read()


def bash_blocks(text: str) -> List[List[str]]:
    """The README's ```bash blocks, each as its commands (continuation lines joined,
    comments kept in the text)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [[c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()] for block in blocks]


def step_env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHON=sys.executable, MPLBACKEND="Agg")
    env.update(extra)
    return env


def run(argv, cwd, timeout=300, **env):
    return subprocess.run(argv, cwd=cwd, env=step_env(**env), capture_output=True, text=True, timeout=timeout)


def help_text(tool: str) -> str:
    """``fairseq-train --help`` / ``fairseq-generate --help`` with the plugin's options."""
    extra = HELP_ARGS if tool == "fairseq-train" else HELP_ARGS[:2]
    proc = run([os.path.join(BIN, tool), "/tmp", "--user-dir", os.path.join(ROOT, "sut_fairseq"), *extra,
                "--help"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def fairseq_help():
    return {"fairseq-train": help_text("fairseq-train"), "fairseq-generate": help_text("fairseq-generate")}


def task_scripts() -> List[str]:
    """``scripts/TASK/*.sh`` (the GPU driver's wrapper is not a task script)."""
    found = []
    for task in sorted(os.listdir(os.path.join(ROOT, "scripts"))):
        folder = os.path.join(ROOT, "scripts", task)
        if task != "gpu" and os.path.isdir(folder):
            found += [f"scripts/{task}/{name}" for name in sorted(os.listdir(folder)) if name.endswith(".sh")]
    return found


# --------------------------------------------------------------------------- the worked example

def worked_example() -> List[str]:
    block = next(b for b in bash_blocks(readme()) if any("fairseq-preprocess" in c for c in b))
    assert block[0] == "source .venv/bin/activate", block[0]
    return block[1:]  # the venv's bin/ is put first on PATH instead


def test_worked_example_runs_end_to_end(tmp_path):
    commands = worked_example()
    script = "\n".join(commands)
    for written, cut in WORKED_EXAMPLE_CUTS:
        assert written in script, f"the README's worked example no longer holds {written!r}"
        script = script.replace(written, cut)
    os.symlink(os.path.join(ROOT, "sut_fairseq"), tmp_path / "sut_fairseq")  # --user-dir sut_fairseq
    proc = run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert re.search(r"exact match [\d.]+% on 1000 examples", proc.stdout), proc.stdout[-2000:]
    assert (tmp_path / "example" / "checkpoints" / "checkpoint_last.pt").is_file()


# --------------------------------------------------------------------------- task scripts

def test_every_task_script_is_in_the_readme():
    text = readme()
    missing = [s for s in task_scripts() if f"`{s}" not in text]
    assert not missing, f"task scripts the README's task table does not show: {missing}"
    assert len(task_scripts()) >= 7


@pytest.mark.parametrize("script", task_scripts())
def test_task_script_dry_run(script, tmp_path):
    extra = DRY_RUN_EXTRA.get(script.split("/")[1], [])
    proc = run(["bash", os.path.join(ROOT, script), "--dry-run", *extra], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("+ "), proc.stdout[:500]  # the recipe's command, printed first
    for number, stage in enumerate(("data", "train", "evaluate", "report"), 1):
        assert f"=== stage {number}: {stage} (dry run)" in proc.stdout, (stage, proc.stdout[-2000:])
    assert "fairseq-train " in proc.stdout
    assert not os.listdir(tmp_path), f"--dry-run created {os.listdir(tmp_path)}"


# --------------------------------------------------------------------------- the other commands

def check_make(argv, _help):
    with open(os.path.join(ROOT, "Makefile")) as handle:
        targets = set(re.findall(r"^([\w-]+):", handle.read(), re.M))
    assert argv[1] in targets, f"make {argv[1]}: no such target"


def check_validate(argv, _help):
    assert argv[:2] == ["sh", "scripts/gpu/validate.sh"]
    proc = run(["sh", os.path.join(ROOT, "scripts", "gpu", "validate.sh"), "--help"], cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "usage: scripts/gpu/validate.sh STAGE OUT" in proc.stdout, proc.stderr
    stages = re.search(r"STAGE: one of (.+)", proc.stdout).group(1).split(", ")
    named = [w.strip(",") for w in argv[2:] if re.match(r"^[a-z-]+,?$", w)]
    assert named and set(named) <= set(stages), (named, stages)


def check_options(argv, help_texts):
    tool = argv[0]
    options = [a.split("=")[0] for a in argv if a.startswith("--")]
    missing = [o for o in options if o not in help_texts[tool]]
    assert not missing, f"{tool} --help does not list {missing}"


#: How each command of a README bash block (other than the worked example) is checked,
#: by its first words.
CHECKS = {"make": check_make, "sh": check_validate, "fairseq-train": check_options,
          "fairseq-generate": check_options}


def other_commands() -> List[List[str]]:
    example = set(worked_example())
    return [shlex.split(c, comments=True) for block in bash_blocks(readme()) for c in block
            if c not in example and c != "source .venv/bin/activate"]


def test_every_readme_command_is_checked(fairseq_help):
    commands = other_commands()
    assert commands, "no command outside the worked example: the parser is broken"
    for argv in commands:
        assert argv[0] in CHECKS, f"README command {' '.join(argv)!r}: add a check for it to this file"
        CHECKS[argv[0]](argv, fairseq_help)


def test_user_dir_prints_the_package_directory(capsys):
    """``python -m sut_fairseq.user_dir``, run in this process (the package is imported
    already: a subprocess would only add the import's seconds)."""
    assert '"$(python -m sut_fairseq.user_dir)"' in readme()
    with warnings.catch_warnings():  # "found in sys.modules ... prior to execution": expected
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module("sut_fairseq.user_dir", run_name="__main__")
    printed = capsys.readouterr().out.strip()
    assert os.path.isfile(os.path.join(printed, "__init__.py")), printed


def test_options_table_matches_fairseq_help(fairseq_help):
    section = readme().split("## Options", 1)[1].split("\n## ", 1)[0]
    options = set(re.findall(r"`(--[a-z][\w-]*)", section))
    assert len(options) > 10, options
    missing = sorted(o for o in options if o not in fairseq_help["fairseq-train"]
                     and o not in fairseq_help["fairseq-generate"])
    assert not missing, f"options of the README not in fairseq-train/-generate --help: {missing}"


# --------------------------------------------------------------------------- names

def test_modules_and_paths_named_exist():
    text = readme()
    modules = set(re.findall(r"python -m ([\w.]+)", text))
    assert "sut_fairseq.selftest" in modules
    assert not [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    paths = set(re.findall(r"`((?:scripts|docs|benchmarks|data-prep|sut_fairseq|configs|tests|\.ci)/[\w./-]*)", text))
    missing = [p for p in sorted(paths) if "TASK" not in p and not os.path.exists(os.path.join(ROOT, p))]
    assert len(paths) > 10 and not missing, missing
