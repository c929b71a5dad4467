"""Shared helpers of the WMT'14 scripts: the configs in ``configs/wmt14/``, flag merging,
the update-frequency arithmetic, tool lookup and printing commands before they run.
Standard library only (a ``--dry-run`` imports neither torch nor fairseq)."""
import importlib.util
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO, "configs", "wmt14")
MODELS = ("transformer", "ut_base", "sut_base", "ut_big", "sut_big")  # Table 1 order


class RecipeError(Exception):
    pass


def load_json(name: str, config_dir: str = CONFIG_DIR) -> dict:
    path = os.path.join(config_dir, name)
    if not os.path.isfile(path):
        raise RecipeError(f"missing config file: {path}")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def load_model(model: str, config_dir: str = CONFIG_DIR) -> dict:
    if model not in MODELS:
        raise RecipeError(f"unknown model {model!r}: choose from {', '.join(MODELS)}")
    return load_json(f"{model}.json", config_dir)


def load_ablations(config_dir: str = CONFIG_DIR) -> Dict[str, dict]:
    return load_json("ablations.json", config_dir)["ablations"]


# --------------------------------------------------------------------------- flags

def parse_flags(flags: Sequence[str]) -> "OrderedDict[str, List[str]]":
    """``["--a", "1", "--b", "--c", "x", "y"]`` -> {"--a": ["1"], "--b": [], "--c": ["x", "y"]}.
    A value is any token not starting with ``--`` (so ``-1`` and ``(0.9, 0.98)`` are values)."""
    parsed: "OrderedDict[str, List[str]]" = OrderedDict()
    current = None
    for token in flags:
        if token.startswith("--"):
            current = token.split("=", 1)[0]
            parsed[current] = [token.split("=", 1)[1]] if "=" in token else []
        elif current is None:
            raise RecipeError(f"value {token!r} before any --option in {list(flags)}")
        else:
            parsed[current].append(token)
    return parsed


def merge_flags(*groups: Sequence[str]) -> List[str]:
    """Concatenate option lists; an option given again replaces its earlier value in place,
    so the printed command has each option once."""
    merged: "OrderedDict[str, List[str]]" = OrderedDict()
    for group in groups:
        for option, values in parse_flags(group).items():
            merged[option] = values
    out: List[str] = []
    for option, values in merged.items():
        out.append(option)
        out.extend(values)
    return out


def flag_value(command: Sequence[str], option: str) -> Optional[List[str]]:
    """The values of the last ``option`` in a command line (None when absent)."""
    if option not in command:
        return None
    i = len(command) - 1 - list(reversed(command)).index(option)
    values = []
    for token in command[i + 1:]:
        if str(token).startswith("--"):
            break
        values.append(token)
    return values


# --------------------------------------------------------------------------- batch size

def update_freq(ngpus: int, max_tokens: int, paper_gpus: int = 32, paper_max_tokens: int = 8192) -> int:
    """ceil(paper_gpus * paper_max_tokens / (ngpus * max_tokens)): the gradient accumulation
    that makes the effective batch at least the paper's."""
    if ngpus < 1 or max_tokens < 1:
        raise RecipeError(f"--ngpus ({ngpus}) and --max-tokens ({max_tokens}) must be positive")
    return max(1, math.ceil(paper_gpus * paper_max_tokens / (ngpus * max_tokens)))


def batch_note(ngpus: int, max_tokens: int, freq: int, paper_gpus: int = 32,
               paper_max_tokens: int = 8192, explicit: bool = False) -> str:
    paper = paper_gpus * paper_max_tokens
    effective = ngpus * max_tokens * freq
    how = ("given" if explicit else
           f"ceil({paper_gpus}*{paper_max_tokens} / ({ngpus}*{max_tokens})) = {freq}")
    note = (f"update-freq {freq} ({how}): {ngpus} GPU(s) x {max_tokens} tokens x {freq} = "
            f"{effective:,} tokens per update (paper: {paper_gpus} x {paper_max_tokens} = {paper:,})")
    if effective != paper:
        note += f"; {effective / paper:.3f} x the paper's batch"
    return note


# --------------------------------------------------------------------------- tools

def user_dir() -> str:
    """The plugin directory for --user-dir, found without importing it (no torch needed)."""
    local = os.path.join(REPO, "sut_fairseq")
    if os.path.isfile(os.path.join(local, "__init__.py")):
        return local
    spec = importlib.util.find_spec("sut_fairseq")
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError("sut_fairseq is not installed and not next to this script")
    return list(spec.submodule_search_locations)[0]


def tool(name: str, required: bool = True) -> str:
    """A console script next to this interpreter (the venv's), else on PATH; with
    ``required=False`` the bare name when missing (for --dry-run)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found:
        return found
    if required:
        raise RecipeError(f"{name} not found next to {sys.executable} or on PATH "
                          "(install fairseq-fixed: make install)")
    return name


def format_command(command: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(c)) for c in command)


def run(command: Sequence[str], dry_run: bool = False, stdout_path: Optional[str] = None) -> int:
    """Print ``+ command`` (and ``> file``), then run it unless ``dry_run``."""
    shown = "+ " + format_command(command) + (f" > {shlex.quote(stdout_path)}" if stdout_path else "")
    print(shown, flush=True)
    if dry_run:
        return 0
    if stdout_path is None:
        return subprocess.run(list(command)).returncode
    os.makedirs(os.path.dirname(os.path.abspath(stdout_path)), exist_ok=True)
    with open(stdout_path, "w", encoding="utf-8") as out:
        return subprocess.run(list(command), stdout=out).returncode
