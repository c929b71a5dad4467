"""The logical-inference recipe (paper Table 5, Figure 4): models, configurations, command
lines, split names, the paper's numbers and small helpers.

Imported by the scripts in ``scripts/logic/`` and by the tests; standard library only, so
importing it (and any ``--dry-run``) needs neither torch nor fairseq.

Models (``configs/logic/MODEL.json``, over ``configs/logic/common.json``):

* ``sut`` -- SUT, ``--arch sut_logic`` (MoMHA (12, 4, 2, 32, W=1), FFD (12, 4, 128), d 128,
  12/12 steps, stick-breaking halting);
* ``ut-halting`` -- UT with halting: ``sut_logic`` with E = k = 1 for attention and FFD;
* ``ut-no-halting`` -- the same with ``--encoder-halting none --decoder-halting none``;
* ``transformer`` -- fairseq's ``--arch transformer`` at d 128, 4 heads, FFN 512, 6+6 layers.

Configurations (``common.json`` ``configs``): ``full`` (paper scale, one GPU) and
``reduced`` (2 CPU cores, under an hour of training per model on one core). Every model
gets the same ``--max-update`` budget (the same batches); ``--stop-time-hours`` caps the
wall-clock time.

Data layout (``data-prep/logic/prepare.py --binarize``): for the standard protocol, test
bucket 0 is the binarized split ``test`` and bucket k (1..12) is ``test{k}``, with text
files ``test{k}.src/.tgt``; for the compositional protocols A/B/C the one test file
``test.src/.tgt`` is split ``test``.
"""
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO, "configs", "logic")
DATA_PREP = os.path.join(REPO, "data-prep", "logic")

MODELS = ("sut", "ut-halting", "ut-no-halting", "transformer")
CONFIGS = ("full", "reduced")
PROTOCOLS = ("standard", "A", "B", "C")
COMPOSITIONAL = ("A", "B", "C")
#: Buckets (operator counts) of the standard protocol's test files.
ALL_BUCKETS = tuple(range(13))
#: The buckets paper Table 5 reports (trained on 0..6).
REPORT_BUCKETS = tuple(range(7, 13))

#: Paper Table 5 (accuracy %): operator counts 7..12 and compositional splits A/B/C.
#: The LSTM row is Bowman et al. (2015), the Transformer row Shen et al. (2019), as the
#: paper quotes them.
PAPER_TABLE5 = OrderedDict([
    ("SUT", {7: 98, 8: 97, 9: 94, 10: 90, 11: 88, 12: 81, "A": 97, "B": 94, "C": 52}),
    ("LSTM", {7: 88, 8: 84, 9: 80, 10: 78, 11: 71, 12: 69, "A": 80, "B": 60, "C": 59}),
    ("Transformer", {7: 51, 8: 52, 9: 51, 10: 51, 11: 51, 12: 48, "A": 53, "B": 51, "C": 51}),
])

#: fairseq-generate for the relation token: greedy, every example of the split
#: (``--required-batch-size-multiple 1``: otherwise this fairseq drops up to 7 per split),
#: at most 2 output tokens before the forced </s> (the reference is one token; a second
#: token makes the answer wrong; an untrained model would otherwise decode up to 200).
GENERATE_FLAGS = ["--beam", "1", "--required-batch-size-multiple", "1",
                  "--max-len-a", "0", "--max-len-b", "2", "--num-workers", "0"]
DEFAULT_GENERATE_BATCH = 256


class RecipeError(Exception):
    pass


# --------------------------------------------------------------------------- configs

def load_json(name: str, config_dir: str = CONFIG_DIR) -> dict:
    path = os.path.join(config_dir, name)
    if not os.path.isfile(path):
        raise RecipeError(f"missing config file: {path}")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def load_common(config_dir: str = CONFIG_DIR) -> dict:
    return load_json("common.json", config_dir)


def load_model(model: str, config_dir: str = CONFIG_DIR) -> dict:
    if model not in MODELS:
        raise RecipeError(f"unknown model {model!r}: choose from {', '.join(MODELS)}")
    return load_json(f"{model}.json", config_dir)


def label(model: str) -> str:
    try:
        return load_model(model)["label"]
    except RecipeError:
        return model


def has_halting(model: str) -> bool:
    return bool(load_model(model).get("halting"))


def is_sut_transformer(model: str) -> bool:
    """Whether the model is one of the plugin's (the halting analysis applies)."""
    return load_model(model)["arch"] != "transformer"


# --------------------------------------------------------------------------- flags

def parse_flags(flags: Sequence[str]) -> "OrderedDict[str, List[str]]":
    """``["--a", "1", "--b", "--c", "x"]`` -> {"--a": ["1"], "--b": [], "--c": ["x"]}.
    A value is any token not starting with ``--`` (so ``(0.9, 0.98)`` is a value)."""
    parsed: "OrderedDict[str, List[str]]" = OrderedDict()
    current = None
    for token in flags:
        token = str(token)
        if token.startswith("--"):
            current = token.split("=", 1)[0]
            parsed[current] = [token.split("=", 1)[1]] if "=" in token else []
        elif current is None:
            raise RecipeError(f"value {token!r} before any --option in {list(flags)}")
        else:
            parsed[current].append(token)
    return parsed


def merge_flags(*groups: Sequence[str]) -> List[str]:
    """Concatenate option lists; an option given again replaces its earlier value in
    place, so a printed command holds each option once."""
    merged: "OrderedDict[str, List[str]]" = OrderedDict()
    for group in groups:
        for option, values in parse_flags(group).items():
            merged[option] = values
    out: List[str] = []
    for option, values in merged.items():
        out.append(option)
        out.extend(values)
    return out


def flag_value(command: Sequence[str], option: str) -> Optional[str]:
    """The value following the last ``option`` in a command (None when absent)."""
    command = [str(c) for c in command]
    if option not in command:
        return None
    i = len(command) - 1 - command[::-1].index(option)
    return command[i + 1] if i + 1 < len(command) and not command[i + 1].startswith("--") else ""


# --------------------------------------------------------------------------- tools

def user_dir() -> str:
    """``--user-dir``: the ``sut_fairseq`` package directory of this checkout."""
    return os.path.join(REPO, "sut_fairseq")


def tool(name: str, required: bool = True) -> str:
    """A console script next to this interpreter (the venv's), else on PATH; with
    ``required=False`` the bare name when missing (for ``--dry-run``)."""
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


def format_command(command: Sequence[str], stdout: Optional[str] = None) -> str:
    text = " ".join(shlex.quote(str(c)) for c in command)
    return text + (f" > {shlex.quote(stdout)} 2>&1" if stdout else "")


def show(command: Sequence[str], stdout: Optional[str] = None) -> None:
    print("+ " + format_command(command, stdout), flush=True)


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ".tmp"):
    """Yield a temporary path beside ``path``; on success it is renamed to ``path`` with
    the mode a plain ``open`` would give (not mkstemp's 0600), on failure removed."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json_atomic(path: str, obj) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and ``os.replace``."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        json.dump(obj, handle, indent=2)
        handle.write("\n")


def write_text_atomic(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)


def load_generate_output_module():
    """``sut_fairseq/generate_output.py`` loaded by file path (standard library only),
    without importing the ``sut_fairseq`` package (which imports torch and fairseq)."""
    name = "_sut_generate_output"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(user_dir(), "generate_output.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# --------------------------------------------------------------------------- splits

def parse_buckets(text: str) -> List[int]:
    """``"7..12"``, ``"0-12"``, ``"7,9,12"`` or ``"all"`` -> sorted bucket numbers."""
    text = text.strip()
    if text == "all":
        return list(ALL_BUCKETS)
    buckets = set()
    for part in text.split(","):
        part = part.strip()
        for sep in ("..", "-"):
            if sep in part:
                low, high = part.split(sep, 1)
                buckets.update(range(int(low), int(high) + 1))
                break
        else:
            buckets.add(int(part))
    bad = sorted(b for b in buckets if b not in ALL_BUCKETS)
    if bad or not buckets:
        raise RecipeError(f"buckets must lie in 0..12, got {text!r}")
    return sorted(buckets)


def eval_splits(protocol: str, buckets: Sequence[int] = REPORT_BUCKETS) -> List[Dict]:
    """What to score for ``protocol``: ``[{"key", "subset", "text", "bucket"}]`` where
    ``subset`` is the binarized split name, ``text`` the prefix of its text files in
    prepare.py's ``--out`` and ``key`` the name it has in results (the bucket number as a
    string, or the protocol letter)."""
    if protocol == "standard":
        return [{"key": str(k), "subset": "test" if k == 0 else f"test{k}", "text": f"test{k}",
                 "bucket": k} for k in buckets]
    if protocol in COMPOSITIONAL:
        return [{"key": protocol, "subset": "test", "text": "test", "bucket": None}]
    raise RecipeError(f"unknown protocol {protocol!r}: choose from {', '.join(PROTOCOLS)}")


# --------------------------------------------------------------------------- commands

def train_flags(model: str, config: str, seed: int = 1, save_dir: Optional[str] = None,
                stop_time_hours: Optional[float] = None, max_update: Optional[int] = None,
                cpu: bool = False, extra: Sequence[str] = ()) -> List[str]:
    """Every fairseq-train option after ``DATA`` for one run (merged: later wins)."""
    if config not in CONFIGS:
        raise RecipeError(f"unknown configuration {config!r}: choose from {', '.join(CONFIGS)}")
    common, spec = load_common(), load_model(model)
    groups = [common["task"], common["flags"], common["configs"][config]["flags"],
              ["--arch", spec["arch"]], spec["model_flags"], spec["loss_flags"],
              ["--seed", str(seed)]]
    if save_dir is not None:
        groups.append(["--save-dir", save_dir])
    if stop_time_hours is not None:
        groups.append(["--stop-time-hours", f"{stop_time_hours:g}"])
    if max_update is not None:
        groups.append(["--max-update", str(max_update)])
    if cpu:
        groups.append(["--cpu"])
    groups.append(list(extra))
    return merge_flags(*groups)


def train_command(model: str, data_bin: str, config: str, seed: int = 1,
                  save_dir: Optional[str] = None, stop_time_hours: Optional[float] = None,
                  max_update: Optional[int] = None, cpu: bool = False,
                  extra: Sequence[str] = (), required: bool = True) -> List[str]:
    """fairseq-train for one model and configuration."""
    flags = train_flags(model, config, seed, save_dir, stop_time_hours, max_update, cpu, extra)
    return [tool("fairseq-train", required), data_bin, "--user-dir", user_dir(), *flags]


def generate_command(data_bin: str, checkpoint: str, subset: str,
                     batch_size: int = DEFAULT_GENERATE_BATCH, cpu: bool = False,
                     extra: Sequence[str] = (), required: bool = True) -> List[str]:
    """Greedy fairseq-generate over one whole split."""
    flags = merge_flags(["--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
                         "--path", checkpoint, "--gen-subset", subset,
                         "--batch-size", str(batch_size)], GENERATE_FLAGS,
                        ["--cpu"] if cpu else [], list(extra))
    return [tool("fairseq-generate", required), data_bin, "--user-dir", user_dir(), *flags]


def generate_data_command(out: str, pairs: int = 500_000, seed: int = 1,
                          overwrite: bool = False) -> List[str]:
    return [sys.executable, os.path.join(DATA_PREP, "generate.py"), "--out", out,
            "--pairs", str(pairs), "--seed", str(seed), "--no-progress",
            *(["--overwrite"] if overwrite else [])]


def prepare_command(original: str, out: str, protocol: str, overwrite: bool = False) -> List[str]:
    return [sys.executable, os.path.join(DATA_PREP, "prepare.py"), "--data", original,
            "--out", out, "--protocol", protocol, "--binarize",
            *(["--overwrite"] if overwrite else [])]


#: Options of common.json that shape the model (the rest is optimisation and logging).
MODEL_SHAPING_COMMON = ("--share-all-embeddings", "--encoder-normalize-before",
                        "--decoder-normalize-before")


def model_arch_flags(model: str) -> List[str]:
    """``--arch``, the model's architecture options and the shared ones of common.json
    (embedding sharing, pre-LN): what builds the model, no optimisation."""
    spec = load_model(model)
    shared = [f for f in load_common()["flags"] if f in MODEL_SHAPING_COMMON]
    return ["--arch", spec["arch"], *spec["model_flags"], *shared]
