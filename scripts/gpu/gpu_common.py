"""Shared helpers of the GPU validation driver (``scripts/gpu/validate.py``): the
repository's paths, the node's limits, atomic writes into OUT, command formatting, the
environment of every step and what a finished recipe run left behind.

Standard library only: the driver runs before the package is installed. Where the recipe
template (``sut_fairseq/recipes``) has a standard-library module, it is loaded by path
(:func:`recipe_module`) rather than copied."""
import importlib.util
import json
import os
import re
import shlex
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

PASSED, FAILED, SKIPPED = "PASSED", "FAILED", "SKIPPED"

# ---------------------------------------------------------------------------------------
# The node's limits: the driver's options (``--time-limit``, ``--max-files``,
# ``--max-file-mib``), with the defaults of the time-limited node the driver was written
# for (one command ends after 10 minutes; at most 8 files of at most 16 MiB come back).

#: The longest one command may run on the node (seconds).
TIME_LIMIT_S = 600
#: A stage stops starting work and ends the step in progress this long before the time
#: limit (at most 10 s to end it), then may still run the logic stages' summarize.py (at
#: most 30 s) and writes summary.md and results.json: at the defaults it ends by about 580 s.
DEADLINE_MARGIN_S = 60
#: The stage deadline at the default time limit.
STAGE_DEADLINE_S = TIME_LIMIT_S - DEADLINE_MARGIN_S
#: --smoke on a (loaded) 2-core CPU machine: a safety net only.
SMOKE_DEADLINE_S = 600
#: How many files of OUT come back, and how large each may be (MiB). A log longer than
#: one MiB less is cut (its head and tail kept) when copied into OUT.
MAX_OUT_FILES = 8
MAX_FILE_MIB = 16
MAX_LOG_BYTES = (MAX_FILE_MIB - 1) * 2 ** 20


class UsageError(Exception):
    """A bad command line or environment: the driver exits 2 before OUT is made."""


class NodeOptions:
    """The node's limits and the Python with torch, as the command line gives them."""

    def __init__(self, time_limit_s=TIME_LIMIT_S, max_files=MAX_OUT_FILES, max_file_mib=MAX_FILE_MIB,
                 base_python=None):
        self.time_limit_s, self.max_files = time_limit_s, max_files
        self.max_file_mib, self.base_python = max_file_mib, base_python

    @property
    def max_log_bytes(self):
        return (self.max_file_mib - 1) * 2 ** 20

    def as_dict(self):
        return {"time_limit_s": self.time_limit_s, "max_files": self.max_files,
                "max_file_mib": self.max_file_mib, "base_python": self.base_python}


def deadline_s(smoke, time_limit_s=TIME_LIMIT_S):
    """The stage's deadline in seconds from its start: the time limit less
    DEADLINE_MARGIN_S (SMOKE_DEADLINE_S with --smoke), or less where SUT_GPU_DEADLINE_S
    says so. Lowering it lets one call chain two stages (e.g. `tests` then `bench` with
    what the first one left)."""
    default = SMOKE_DEADLINE_S if smoke else time_limit_s - DEADLINE_MARGIN_S
    text = os.environ.get("SUT_GPU_DEADLINE_S")
    if not text:
        return default
    try:
        value = int(float(text))
    except ValueError:
        value = None
    if value is None or not 0 < value <= default:
        raise UsageError(f"SUT_GPU_DEADLINE_S={text!r} is not a whole number of seconds in 1..{default}")
    return value


def recipe_module(name):
    """``sut_fairseq/recipes/NAME.py`` loaded by path. Only for the recipe modules that
    need nothing but the standard library: importing the package would import fairseq
    and torch, which this driver runs without (before the install)."""
    path = os.path.join(REPO, "sut_fairseq", "recipes", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_sut_recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- files

def write_atomic(path, data):
    """Write ``data`` (str or bytes) to ``path`` through a temporary file beside it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_capped(path, limit=MAX_LOG_BYTES):
    """A file's bytes; when longer than ``limit``, its head and tail with a marker between."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        if size <= limit:
            return handle.read()
        head = handle.read(limit // 8)
        handle.seek(size - (limit - limit // 8))
        tail = handle.read()
    return head + f"\n\n[... {size - len(head) - len(tail):,} bytes cut ...]\n\n".encode() + tail


def fmt_command(argv, env_prefix=None):
    """A command as a shell would read it, after ``NAME=value`` pairs when given."""
    text = " ".join(shlex.quote(str(a)) for a in argv)
    if env_prefix:
        text = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env_prefix.items()) + " " + text
    return text


# --------------------------------------------------------------------------- steps

def step_env(stage, python=None, extra=None):
    """The environment of every step: the checkout first on PYTHONPATH, the step Python's
    bin/ first on PATH (fairseq-train / -generate / -preprocess beside it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    if python:
        env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    if extra:
        env.update(extra)
    return env


def log_lines_of(stage, step):
    """The lines a step wrote into the stage log."""
    with open(stage.log_path, "rb") as log:
        log.seek(step.get("log_offset", 0))
        data = log.read(step["log_end"] - step.get("log_offset", 0)) if step.get("log_end") else log.read()
    return data.decode("utf-8", "replace").splitlines()


def last_matching(stage, step, pattern):
    found = [l for l in log_lines_of(stage, step) if pattern.search(l)]
    return found[-1].strip() if found else None


# --------------------------------------------------------------------------- recipe runs

UPS = re.compile(r"\bups[= ]([\d.]+)")
WALL = re.compile(r"\btrain_wall[= ](\d+)")


def collect_run(stage, model, protocol, run_dir, step, train_log):
    """One run's numbers (result.json or train.json), and its fairseq-train log appended
    to the stage's fairseq-train.log."""
    run = {"model": model, "protocol": protocol, "status": step["status"], "seconds": step["seconds"],
           "run_dir": run_dir}
    log = os.path.join(run_dir, "train.log")
    if os.path.exists(log):
        ups = walls = None
        with open(log, errors="replace") as handle, open(train_log, "a") as out:
            out.write(f"\n######## {model} / {protocol}: {log}\n")
            for line in handle:
                if len(line) > 4000:  # fairseq's config dump
                    line = line[:4000] + " [...]\n"
                out.write(line)
                m = UPS.findall(line)
                ups = float(m[-1]) if m else ups
                m = WALL.findall(line)
                walls = int(m[-1]) if m else walls
        run["updates_per_s"] = ups
        run["train_wall_s"] = walls
    for name in ("result.json", "train.json"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            with open(path) as handle:
                data = json.load(handle)
            train = data.get("train", data)
            run.update({"updates": data.get("updates"), "params": data.get("params"),
                        "stop_reason": data.get("stop_reason", train.get("stop_reason")),
                        "train_seconds": train.get("seconds_this_call")})
            if "accuracy" in data:
                run["accuracy"] = {k: v.get("accuracy") if isinstance(v, dict) else v  # logic / C-PVR
                                   for k, v in data["accuracy"].items()}
                depth = data.get("halting_depth") or {}
                run["encoder_mean_depth"] = {k: (v.get("encoder") or {}).get("mean_depth")
                                             for k, v in depth.items()} or None
            for side in ("encoder", "decoder"):  # C-PVR: {hop: mean executed steps}
                if f"{side}_depth" in data:
                    run[f"{side}_depth"] = data[f"{side}_depth"]
            break
    return run


def key_order(key):
    """Sort key: numbered buckets or hops first, in numeric order, then names."""
    return (0, int(key)) if key.isdigit() else (1, key)

