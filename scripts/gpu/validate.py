#!/usr/bin/env python3
"""Staged validation of sut_fairseq on one GPU node, one command per stage.

    scripts/gpu/validate.sh STAGE OUT [--smoke]
    python3 scripts/gpu/validate.py STAGE OUT [--smoke]

STAGE is one of

* ``tests``           ``pytest -m gpu -q tests/test_gpu.py``: the Triton kernels and the expert
                      layers against the reference, incremental decoding, no host syncs;
* ``tests-train``     ``pytest -m gpu -q tests/test_gpu_train.py`` (fairseq-train in fp32, fp16
                      and bf16) and ``python -m sut_fairseq.selftest``;
* ``bench``           ``benchmarks/moe_gpu.py`` (bf16, 4096 8192 16384 tokens) and
                      ``benchmarks/train_step.py --device cuda --bf16`` (sut_base, ut_base,
                      transformer_wmt_en_de on the same batch: tokens/s and peak memory);
* ``logic-sut``       the logic Table 5 recipe (``scripts/logic/table5.py``, the ``full``
                      configuration under a wall-clock cap) for ``sut`` on the standard
                      protocol (buckets 0-12) and compositional split A;
* ``logic-baselines`` the same for ``transformer`` and ``ut-halting`` (and more when time
                      is left: see LOGIC_BASELINE_RUNS);
* ``cpvr``            the C-PVR recipe (``scripts/cpvr/hops.py``, the ``gpu`` configuration)
                      for ``ut``, ``sut`` and ``hyper-ut`` trained side by side under one
                      wall-clock cap, evaluated on hops 1-9, reported (``hops.md``,
                      ``accuracy.png``, ``depth.png``). A later call on the same (warm)
                      machine continues the same runs with a new cap (CPVR_* constants).

Written for a time-limited, air-gapped GPU node (one H100-class GPU, 16 cores, torch and
triton in the site Python, no fairseq, no network, at most 10 minutes per command, at most
8 result files of at most 16 MiB brought back from OUT). Each stage:

1. makes sure ``python -c "import fairseq, sut_fairseq"`` works. If no Python on hand passes
   that check, it creates a venv with ``--system-site-packages`` over the Python that has
   torch (``SUT_GPU_VENV``, default ``/tmp/sut-gpu/venv``; outside the repository) and runs
   ``make install-offline WHEELHOUSE=${WHEELHOUSE:-wheelhouse} PY=<venv python>``; the
   install time is recorded. A venv made from a Python that is itself a venv (the node's
   ``python3`` is) does not see that venv's packages, so the venv gets a ``.pth`` file that
   adds them (the check that torch imports says whether it is needed);
2. runs its steps; every command is printed (``+ ...``) before it runs, and the output of
   every step goes to ``OUT/STAGE.log``;
3. writes ``OUT/summary.md`` (device, versions, commands, timings, and which steps PASSED,
   FAILED or were SKIPPED) and ``OUT/results.json`` -- also when a step fails, and again
   after every step, so a command killed at the node's limit still leaves them.

Every file in OUT is written atomically (a temporary file in OUT, then ``os.replace``), and
the stage never leaves more than 8 files there. The exit status is 0 when every required
step passed, 1 otherwise, 2 for a usage error.

``--smoke`` runs the same stage on the CPU with tiny sizes (a check of this script and of
the commands, not of the GPU): pytest -m gpu skips every test (recorded), moe_gpu.py runs
through Triton's interpreter (``TRITON_INTERPRET=1 --device cpu``), train_step.py on a
2 x 4 batch, and the logic stages on 3,000 generated pairs with a tiny model trained for
3 updates. With ``--smoke`` too the install is skipped when the package is importable.

Environment: ``PYTHON`` (the Python to run the steps with; default: the first of
``.venv/bin/python``, the stage venv, ``python3``, ``python`` that imports fairseq and
sut_fairseq), ``WHEELHOUSE`` (default ``wheelhouse`` in the repository), ``SUT_GPU_VENV``,
``SUT_GPU_WORK`` (data and runs of the logic stages; default ``/tmp/sut-gpu``, with
``--smoke`` a directory beside OUT), ``SUT_LOGIC_MODELS`` / ``SUT_LOGIC_PROTOCOLS``
(space-separated: replace the stage's plan; every run they name is required),
``SUT_LOGIC_TRAIN_ARGS`` (extra fairseq-train options for every logic run), ``NODE_HAS``
(passed to make install-offline when set, e.g. ``NODE_HAS='$(CUDA_IMAGE_HAS)'`` with a
wheelhouse made with the same). Every step runs
with the repository first on ``PYTHONPATH``, so the checkout's ``sut_fairseq`` is the one
imported even where an installed copy exists.
"""
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STAGES = ("tests", "tests-train", "bench", "logic-sut", "logic-baselines", "cpvr")
USAGE = ("usage: scripts/gpu/validate.sh STAGE OUT [--smoke]\n"
         f"  STAGE: one of {', '.join(STAGES)}\n"
         "  OUT:   directory for summary.md, results.json, STAGE.log (created; must hold no "
         "other files)\n"
         "  --smoke: the same stage on the CPU with tiny sizes")

#: The device tool brings back at most 8 files from OUT.
MAX_OUT_FILES = 8
#: The largest file the device tool brings back is 16 MiB; a log longer than this is cut
#: (its head and tail kept) when copied into OUT.
MAX_LOG_BYTES = 15 * 2 ** 20
#: While a step runs, its log and summary.md in OUT are refreshed this often (seconds),
#: so a command killed at the node's 10-minute limit still brings back recent ones.
REFRESH_S = 20

# ---------------------------------------------------------------------------------------
# Time budget (seconds).
#
# These are ESTIMATES, not measurements: this script was written on a 2-core CPU machine
# without a GPU. Where a number comes from a measurement on that machine it says so; the
# rest are guesses for a 16-core H100 node. summary.md lists the estimate beside the
# measured time of every step: correct the constants after the first GPU run.
#
# The device tool kills a command after 10 minutes (600 s). A stage stops starting work
# and ends the step in progress at STAGE_DEADLINE_S (at most 10 s to end it), then may
# still run the logic stages' summarize.py (at most 30 s) and writes summary.md and
# results.json: it ends by about 580 s.
STAGE_DEADLINE_S = 540
#: --smoke on a (loaded) 2-core CPU machine: a safety net only.
SMOKE_DEADLINE_S = 600


def deadline_s(smoke):
    """The stage's deadline in seconds from its start: STAGE_DEADLINE_S (SMOKE_DEADLINE_S
    with --smoke), or less where SUT_GPU_DEADLINE_S says so. Lowering it lets one device
    call chain two stages (e.g. `tests` then `bench` with what the first one left)."""
    default = SMOKE_DEADLINE_S if smoke else STAGE_DEADLINE_S
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


#: make install-offline on a fresh node: fairseq-fixed is built from its sdist (its C++,
#: Cython and torch extensions took about 2 of the 4.5 minutes of a fresh `make install`
#: on the 2-core machine; the build is mostly serial, the node's cores are faster), then
#: wheels from the local wheelhouse. 0 when the venv of an earlier stage on the same
#: (still warm) machine is found. Measured (2026-11-26): 122.5 and 124.5 s on an H200 node,
#: 177.4 s on an H100 node.
INSTALL_ESTIMATE_S = 180
#: versions and device query (imports torch, fairseq and sut_fairseq once); measured 6-7 s.
ENV_ESTIMATE_S = 10

#: tests stage: tests/test_gpu.py (Triton kernels and expert layers vs the reference,
#: incremental decoding, host syncs; Triton compiles and autotuning included). Measured on
#: an H100 node (2026-11-26): its 60 kernel and layer tests within 261 s, the 9 others 27 s.
TESTS_PYTEST_ESTIMATE_S = 300
#: tests-train stage: tests/test_gpu_train.py (fairseq-train of sut_tiny in fp32, fp16,
#: bf16, each compiling the kernels afresh) then the selftest. Measured on an H100 node:
#: 34 + 65 + 58 + 8 s (plus 8 s building the data); the selftest 45 and 62 s on an H200,
#: more than 75 s on an H100 right after the kernel tests.
TESTS_TRAIN_ESTIMATE_S = 190
TESTS_SELFTEST_ESTIMATE_S = 90
#: The two test stages: (test file, its pytest estimate, whether the selftest follows).
TEST_STAGES = {"tests": ("tests/test_gpu.py", TESTS_PYTEST_ESTIMATE_S, False),
               "tests-train": ("tests/test_gpu_train.py", TESTS_TRAIN_ESTIMATE_S, True)}

#: bench stage: moe_gpu.py (Triton autotuning, then 3 sizes x 2 passes x 3 implementations
#: x 23 runs) and train_step.py (three WMT-size models, 3 rounds of 2 steps each).
#: Measured on an H200 node: 17.6 s and 51.4 s.
BENCH_MOE_ESTIMATE_S = 40
BENCH_TRAIN_STEP_ESTIMATE_S = 75

#: logic stages. generate.py --pairs 500000: measured 16.4 s on an H100 node (8 s on the
#: 2-core machine: the node's cores are slower one by one).
LOGIC_GENERATE_ESTIMATE_S = 20
#: prepare.py --binarize (one fairseq-preprocess): measured 50.5 s for the standard
#: protocol and 40.7 s for A on an H100 node; B and C binarize about as much as A.
LOGIC_PREPARE_ESTIMATE_S = {"standard": 55, "A": 45, "B": 45, "C": 45}
#: The training budget of every run: fairseq-train --stop-time-hours LOGIC_TRAIN_CAP_S/3600.
#: The same for every model (rows compare at an equal GPU-time budget); the full
#: configuration's --max-update 50,000 is never reached at this cap, and its 4,000 warm-up
#: updates are not finished either: these runs check the recipe on the GPU and measure
#: its speed (updates/s in fairseq-train.log); they do not reproduce Table 5. 40 s (60 until
#: the H100 install measured 177 s) keeps both required runs of each logic stage within
#: the deadline after a fresh install.
LOGIC_TRAIN_CAP_S = 40
#: fairseq-train beyond the cap: start-up (imports, data, CUDA), the final validation on
#: the whole valid split and the checkpoint save. Measured on an H100 node: 33 s from the
#: step's start to fairseq's "begin training" (the first process after the install also
#: compiles the installed modules' bytecode).
LOGIC_TRAIN_OVERHEAD_S = 35
#: One fairseq-generate call: measured about 19 s on an H100 node (imports, CUDA, the
#: checkpoint, the Triton kernels' compilation for the inference launches, greedy decoding
#: of a test bucket 256 pairs at a time). The standard protocol makes one call per bucket
#: evaluated, a compositional split one.
LOGIC_GENERATE_CALL_S = 20
#: Teacher-forced halting analysis on the CPU (the recipe keeps it there) of the buckets
#: evaluated: a guess sized for all 13 (about 37,500 pairs; buckets 7-12 alone are about
#: 13,500), not yet measured on a node.
LOGIC_ANALYSIS_ESTIMATE_S = 30
#: summarize.py (Table 5, table5.json, Figure 4 into OUT).
LOGIC_SUMMARY_ESTIMATE_S = 10
#: What the logic stages evaluate on the standard protocol (table5.py --buckets): the
#: first and the last of Table 5's out-of-distribution columns. All 13 buckets ("all") took
#: 13 calls, about 250 s per model, more than a stage can spend.
LOGIC_BUCKETS = "7,12"
LOGIC_PAIRS = 500_000
#: The runs of each logic stage, in order: (model, protocol, required). Optional runs are
#: started only when their estimate fits in the time left. With the estimates above
#: (install + environment + data + runs + summary; required_estimate() adds them up):
#: logic-sut ~ 180 + 10 + 20 + 10 + 55 + (35 + 40 + 2 x 20 + 30) = 420 s with its required
#: run; split A (45 + 35 + 40 + 20 = 140 s more) runs only when the install was skipped (a
#: warm machine) or the estimates prove pessimistic. logic-baselines' required runs ~ 180
#: + 10 + 20 + 10 + 55 + (35 + 40 + 40) + (35 + 40 + 40 + 30) = 535 s, so its A runs and
#: ut-no-halting run only on a warm machine. With 40 s of training per run there is no
#: room for more in one 10-minute command: call the stage again with SUT_LOGIC_MODELS /
#: SUT_LOGIC_PROTOCOLS (e.g. SUT_LOGIC_PROTOCOLS=A) for the rest. (Until the H100 lease
#: of checkout 6ec6c85 measured the data steps and fairseq-generate calls, split A was
#: required too and every bucket was evaluated: the standard run then spent its time in
#: its 13 fairseq-generate calls and neither run finished.)
LOGIC_SUT_RUNS = [("sut", "standard", True), ("sut", "A", False)]
LOGIC_BASELINE_RUNS = [("transformer", "standard", True), ("ut-halting", "standard", True),
                       ("transformer", "A", False), ("ut-halting", "A", False),
                       ("ut-no-halting", "standard", False), ("ut-no-halting", "A", False)]

# --smoke sizes
SMOKE_PAIRS = 3000
SMOKE_BUCKETS = "0,12"            # bucket 0 is the split named `test`, 12 is `test12`
SMOKE_MAX_UPDATE = 3
SMOKE_STOP_TIME_HOURS = 0.05      # a cap only; the 3 updates take seconds
#: tiny models (the flags replace the recipe's values; fairseq-train runs with --cpu)
SMOKE_TRAIN_ARGS = {
    "sut": "--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 32 --att-experts 4 "
           "--att-topk 2 --att-heads 2 --att-head-dim 8 --ffd-experts 4 --ffd-topk 2 "
           "--ffd-hidden-dim 32 --max-tokens 1024",
    "ut-halting": "--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 32 --att-heads 2 "
                  "--att-head-dim 8 --ffd-hidden-dim 32 --max-tokens 1024",
    "ut-no-halting": "--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 32 "
                     "--att-heads 2 --att-head-dim 8 --ffd-hidden-dim 32 --max-tokens 1024",
    "transformer": "--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 "
                   "--decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 "
                   "--encoder-attention-heads 2 --decoder-attention-heads 2 --max-tokens 1024",
}
#: cpvr stage: the C-PVR recipe (``scripts/cpvr/hops.py``, the ``gpu`` configuration of
#: configs/cpvr/common.json) for the UT, the SUT and Hyper-UT, trained side by side on the
#: one GPU (three processes: the models are small, so a single one leaves the GPU idle
#: between its kernel launches), every model under the same wall-clock cap; then their
#: evaluation side by side, then the report (hops.md, accuracy.png, depth.png).
CPVR_MODELS = ("ut", "sut", "hyper-ut")
#: generate.py --config small --binarize (100,000 + 4,000 + 18,000 sequences by the exact
#: sampler, standard library, then one fairseq-preprocess).
CPVR_GENERATE_ESTIMATE_S = 60
#: fairseq-train beyond the cap: start-up, the final validation, the checkpoint save.
CPVR_TRAIN_OVERHEAD_S = 30
#: The least training time worth a call: below it the train step is not started.
CPVR_MIN_TRAIN_S = 120
#: 9 fairseq-generate calls and the teacher-forced depth analysis (on the CPU) per model,
#: the three models side by side.
CPVR_EVALUATE_ESTIMATE_S = 120
#: summarize.py (the table and the two figures).
CPVR_REPORT_ESTIMATE_S = 15
#: OMP/MKL threads of each of the three processes (the node has 16 cores).
CPVR_THREADS = 4

SMOKE_CPVR_DATA_ARGS = ["--train-per-hop", "50", "--valid-per-hop", "10", "--test-per-hop", "10"]
SMOKE_CPVR_HOPS = "1,9"
SMOKE_CPVR_TRAIN_ARGS = "--encoder-layers 2 --decoder-layers 2 --max-tokens 256"
SMOKE_MOE_ARGS = ["--device", "cpu", "--tokens", "32", "--dim", "16", "--hidden", "16",
                  "--experts", "4", "--topk", "2", "--repeats", "1", "--dtype", "bf16"]
SMOKE_TRAIN_STEP_ARGS = ["--batch", "2", "--len", "4", "--vocab", "64", "--repeats", "1", "--profile", "5"]
GPU_MOE_ARGS = ["--tokens", "4096", "8192", "16384", "--dtype", "bf16"]
GPU_TRAIN_STEP_ARGS = ["--device", "cuda", "--bf16", "--profile", "25"]
#: "== profile ARCH: W ms wall under the profiler, L kernel launches, O aten operator calls[, device busy D ms (P%)]"
PROFILE_ROW = re.compile(r"^== profile (\S+): ([\d.]+) ms wall under the profiler, (\d+) kernel launches, "
                         r"(\d+) aten operator calls(?:, device busy ([\d.]+) ms)?")

PASSED, FAILED, SKIPPED = "PASSED", "FAILED", "SKIPPED"


class UsageError(Exception):
    pass


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
    text = " ".join(shlex.quote(str(a)) for a in argv)
    if env_prefix:
        text = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env_prefix.items()) + " " + text
    return text


# --------------------------------------------------------------------------- the stage

class Stage:
    """Runs steps, logs them, keeps OUT's summary.md / results.json / STAGE.log current."""

    def __init__(self, name, out, smoke):
        self.name, self.out, self.smoke = name, os.path.abspath(out), smoke
        self.start = time.time()
        self.deadline_s = deadline_s(smoke)   # read from the environment once
        self.deadline = self.start + self.deadline_s
        self.steps = []
        self.info = {}            # environment: device, versions
        self.install = {"status": "not checked"}
        self.results = {}         # stage-specific numbers
        self.budget = {}          # stage-specific plan
        self.extra_sections = []  # (title, markdown) for summary.md
        self.python = None
        self.estimate = None      # the required steps' estimated seconds (GPU runs)
        self.out_files = {"summary.md", "results.json", f"{name}.log"}
        self.work = self._work_root()
        os.makedirs(self.work, exist_ok=True)
        self.log_path = os.path.join(self.work, f"{name}.log")
        self.extra_logs = {}      # OUT name -> work path
        with open(self.log_path, "w") as log:
            log.write(f"# validate.py {name}{' --smoke' if smoke else ''}: {time.ctime(self.start)}\n")
        self.current = None

    def _work_root(self):
        root = os.environ.get("SUT_GPU_WORK")
        if not root:
            if self.smoke:  # beside OUT, so that parallel smoke runs never share it
                root = os.path.join(os.path.dirname(self.out), os.path.basename(self.out) + ".work")
            else:
                root = os.path.join(tempfile.gettempdir(), "sut-gpu")
        return os.path.abspath(root)

    # ---- time
    def elapsed(self):
        return time.time() - self.start

    def remaining(self):
        return self.deadline - time.time()

    # ---- logging
    def say(self, text):
        print(text, flush=True)
        with open(self.log_path, "a") as log:
            log.write(text + "\n")

    def show(self, argv, env_prefix=None):
        """Print a command before it runs (also for the small queries that are no step)."""
        self.say("+ " + fmt_command(argv, env_prefix))

    def query(self, argv, env=None, timeout=120):
        """A small command whose output this script reads (printed, not a step)."""
        self.show(argv)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO,
                                  timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as err:
            self.say(f"  -> {type(err).__name__}: {err}")
            return None
        with open(self.log_path, "a") as log:
            log.write(proc.stdout + proc.stderr + f"[exit {proc.returncode}]\n")
        return proc

    # ---- steps
    def add_out_file(self, name):
        self.out_files.add(name)
        if len(self.out_files) > MAX_OUT_FILES - 1:  # one more for a temporary at any time
            raise RuntimeError(f"more than {MAX_OUT_FILES - 1} files planned for OUT: {sorted(self.out_files)}")

    def skip(self, name, reason, required=True, status=SKIPPED):
        """Record a step that runs no command: SKIPPED, or FAILED (a check that failed)."""
        step = {"name": name, "status": status, "required": required, "reason": reason,
                "command": None, "seconds": 0.0, "estimate_s": None}
        self.steps.append(step)
        self.say(f"== {name}: {status} ({reason})")
        self.flush()
        return step

    def fail(self, name, reason):
        return self.skip(name, reason, status=FAILED)

    def run(self, name, argv, env=None, env_prefix=None, estimate=None, timeout=None,
            required=True, check=None, overrun=False):
        """Run one step: output into the stage log, PASSED when the exit status is 0 (and
        ``check(step)`` returns None rather than a reason to fail). The step is ended at
        the stage deadline, or after ``timeout`` seconds when ``overrun`` (a short last
        step that may run past the deadline: the 600 s limit leaves room for it)."""
        if timeout is None:
            timeout = self.remaining()
        elif not overrun:
            timeout = min(timeout, self.remaining())
        step = {"name": name, "status": "RUNNING", "required": required,
                "command": fmt_command(argv, env_prefix), "argv": [str(a) for a in argv],
                "seconds": 0.0, "estimate_s": estimate, "timeout_s": round(timeout),
                "returncode": None, "reason": None}
        self.steps.append(step)
        self.current = step
        self.say(f"\n== {name} (estimate {estimate if estimate is not None else '?'} s, "
                 f"limit {timeout:.0f} s)")
        self.show(argv, env_prefix)
        log_start = os.path.getsize(self.log_path)
        step["log_offset"] = log_start
        started = time.time()
        if timeout <= 1:
            step.update(status=FAILED, reason="no time left before the stage deadline")
        else:
            try:
                with open(self.log_path, "ab") as log:
                    proc = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, cwd=REPO,
                                            start_new_session=True)
                    step["pid"] = proc.pid
                    self._wait(proc, step, started, timeout)
            except OSError as err:
                step.update(status=FAILED, reason=f"could not start: {err}")
        step["seconds"] = round(time.time() - started, 1)
        step["log_end"] = os.path.getsize(self.log_path)
        step.pop("pid", None)
        if step["status"] == "RUNNING":
            reason = check(step) if check else None
            step["status"] = FAILED if reason else PASSED
            step["reason"] = reason
        self.current = None
        if step["status"] == FAILED:  # the output's tail where the caller sees it
            lines = log_lines_of(self, step)
            print("   ... " + "\n   ... ".join(lines[-30:]), flush=True)
        self.say(f"== {name}: {step['status']} in {step['seconds']:.1f} s"
                 + (f" ({step['reason']})" if step["reason"] else ""))
        self.flush()
        return step

    def _wait(self, proc, step, started, timeout):
        while True:
            left = timeout - (time.time() - started)
            try:
                rc = proc.wait(timeout=max(0.1, min(REFRESH_S, left)))
                step["returncode"] = rc
                if rc != 0:
                    step.update(status=FAILED, reason=f"exit status {rc}")
                return
            except subprocess.TimeoutExpired:
                step["seconds"] = round(time.time() - started, 1)
                if time.time() - started >= timeout:
                    self._kill(proc)
                    step.update(status=FAILED, returncode=proc.returncode,
                                reason=f"stopped after {timeout:.0f} s (stage deadline)")
                    return
                self.flush()

    @staticmethod
    def _kill(proc):
        """End the step's process group (the step and the processes it started)."""
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def interrupt(self, signum):
        step = self.current
        if step is not None and step.get("pid"):
            try:
                os.killpg(step["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            step.update(status=FAILED, reason=f"interrupted by signal {signum}")
        self.say(f"== interrupted by signal {signum}")
        self.flush(final=True)

    # ---- status
    def failed_steps(self):
        return [s for s in self.steps if s["required"] and s["status"] != PASSED]

    def ok(self):
        return not self.failed_steps() and any(s["status"] == PASSED for s in self.steps)

    # ---- OUT
    def flush(self, final=False):
        """summary.md, results.json and the logs into OUT (atomically)."""
        try:
            write_atomic(os.path.join(self.out, f"{self.name}.log"), read_capped(self.log_path))
            for out_name, path in self.extra_logs.items():
                if os.path.exists(path):
                    write_atomic(os.path.join(self.out, out_name), read_capped(path))
            write_atomic(os.path.join(self.out, "results.json"),
                         json.dumps(self.results_json(final), indent=2) + "\n")
            write_atomic(os.path.join(self.out, "summary.md"), self.summary_md(final))
        except OSError as err:
            print(f"validate.py: could not write into {self.out}: {err}", file=sys.stderr, flush=True)

    def present_files(self):
        """The files in OUT (not the temporaries of an atomic write)."""
        try:
            return {n for n in os.listdir(self.out) if not n.startswith(".")}
        except OSError:
            return set()

    def status_word(self, final):
        if not final:
            return "RUNNING"
        return PASSED if self.ok() else FAILED

    def results_json(self, final):
        return {
            "stage": self.name, "smoke": self.smoke, "status": self.status_word(final),
            "exit_status": (0 if self.ok() else 1) if final else None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.start)),
            "seconds": round(self.elapsed(), 1),
            "deadline_s": self.deadline_s,
            "python": self.python, "environment": self.info, "install": self.install,
            "steps": [{k: v for k, v in s.items() if k not in ("argv", "log_offset", "log_end", "pid")}
                      for s in self.steps],
            "estimate_s": self.estimate, "budget": self.budget, "results": self.results, "work_dir": self.work,
            "files": sorted(self.present_files() | {"summary.md", "results.json"}),
        }

    def summary_md(self, final):
        info = self.info
        passed = sum(s["status"] == PASSED for s in self.steps)
        lines = [f"# GPU validation: stage `{self.name}`" + (" (--smoke, CPU)" if self.smoke else ""),
                 "",
                 f"**{self.status_word(final)}**: {passed} of {len(self.steps)} steps passed"
                 + (f"; failed or not run: {', '.join(s['name'] for s in self.failed_steps())}"
                    if self.failed_steps() else "")
                 + f"; {self.elapsed():.0f} s of the stage's "
                 f"{self.deadline_s} s"
                 + ("" if final else " (in progress: this file is rewritten after every step)"),
                 "",
                 f"- started: {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(self.start))}",
                 f"- command: `scripts/gpu/validate.sh {self.name} {self.out}"
                 f"{' --smoke' if self.smoke else ''}`",
                 f"- device: {info.get('device', 'unknown')}",
                 f"- versions: python {info.get('python', '?')}, torch {info.get('torch', '?')}"
                 f" (CUDA {info.get('torch_cuda') or '-'}), triton {info.get('triton', '?')}, "
                 f"fairseq {info.get('fairseq', '?')}, sut_fairseq {info.get('sut_fairseq', '?')}",
                 f"- sut_fairseq imported from: {info.get('sut_fairseq_path', '?')}",
                 f"- checkout: {info.get('git', 'unknown')}",
                 f"- CPU cores: {os.cpu_count()}",
                 f"- Python of the steps: {self.python or 'none found'}",
                 f"- install: {self.install.get('summary', self.install.get('status'))}",
                 f"- work directory (not brought back): {self.work}",
                 (f"- time plan: the required steps are estimated at {self.estimate} s with a "
                  f"fresh install, against the stage's deadline of {self.deadline_s} s "
                  "(estimates in validate.py, to be corrected from the measured times below)"
                  if self.estimate else "- time plan: --smoke (no GPU estimates)"),
                 "", "## Steps", "",
                 "| # | step | status | seconds | estimate (s) | note |",
                 "|---:|---|---|---:|---:|---|"]
        for i, s in enumerate(self.steps, 1):
            note = s.get("reason") or ""
            if not s["required"]:
                note = ("optional; " + note).rstrip("; ")
            lines.append(f"| {i} | {s['name']} | {s['status']} | {s['seconds']:.1f} | "
                         f"{s['estimate_s'] if s['estimate_s'] is not None else ''} | {note} |")
        lines += ["", "## Commands", ""]
        for i, s in enumerate(self.steps, 1):
            if s["command"]:
                lines.append(f"{i}. `{s['command']}`")
        for title, text in self.extra_sections:
            lines += ["", f"## {title}", "", text.rstrip()]
        present = self.present_files() | {"summary.md"}
        lines += ["", "## Files", "",
                  "In OUT: " + ", ".join(f"`{n}`" for n in sorted(present))
                  + f" (at most {MAX_OUT_FILES}). The output of every step is in "
                  f"`{self.name}.log`, in order, each after its `+ command` line.", ""]
        return "\n".join(lines)


# --------------------------------------------------------------------------- environment

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


def resolve(path):
    found = shutil.which(path) if os.sep not in path else (path if os.access(path, os.X_OK) else None)
    return os.path.abspath(found) if found and os.sep in found else found


def venv_dir():
    return os.path.abspath(os.environ.get("SUT_GPU_VENV")
                           or os.path.join(tempfile.gettempdir(), "sut-gpu", "venv"))


def candidate_pythons():
    if os.environ.get("PYTHON"):
        return [os.environ["PYTHON"]]
    seen, out = set(), []
    for c in (os.path.join(REPO, ".venv", "bin", "python"), os.path.join(venv_dir(), "bin", "python"),
              "python3", "python", sys.executable):
        path = resolve(c)
        if path and path not in seen:
            seen.add(path)
            out.append(path)
    return out


IMPORT_CHECK = "import fairseq, sut_fairseq"


def ensure_package(stage):
    """Find a Python that imports fairseq and sut_fairseq, or make one (venv + make
    install-offline). Records ``stage.install``; returns the Python or None."""
    env = step_env(stage)
    force = os.environ.get("SUT_GPU_FORCE_INSTALL") == "1"
    for python in ([] if force else candidate_pythons()):
        proc = stage.query([python, "-c", IMPORT_CHECK], env=env)
        if proc is not None and proc.returncode == 0:
            stage.install = {"status": "skipped", "needed": False, "python": python, "seconds": 0.0,
                             "summary": f"skipped: `{IMPORT_CHECK}` works in {python}"}
            stage.say(f"== install: skipped ({IMPORT_CHECK} works in {python})")
            return python
    if force:
        stage.say("== install: SUT_GPU_FORCE_INSTALL=1: installing into the venv without looking "
                  "for an importable package first")
    elif os.environ.get("PYTHON"):
        stage.install = {"status": FAILED, "needed": True,
                         "summary": f"PYTHON={os.environ['PYTHON']} cannot `{IMPORT_CHECK}`"}
        stage.fail("install", stage.install["summary"] + " (unset PYTHON to install into a venv)")
        return None

    # the install runs without the checkout on PYTHONPATH: make install-offline's last check
    # must import the installed sut_fairseq, not the checkout's
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.time()
    venv = venv_dir()
    vpy = os.path.join(venv, "bin", "python")
    wheelhouse = os.path.abspath(os.environ.get("WHEELHOUSE") or os.path.join(REPO, "wheelhouse"))
    stage.install = {"status": "running", "needed": True, "venv": venv, "wheelhouse": wheelhouse}
    # the Python with torch
    base = None
    for c in ([os.environ["SUT_BASE_PYTHON"]] if os.environ.get("SUT_BASE_PYTHON") else []) + \
             ["python3", "python", sys.executable]:
        path = resolve(c)
        if not path:
            continue
        proc = stage.query([path, "-c", "import torch"], env=env)
        if proc is not None and proc.returncode == 0:
            base = path
            break
    if base is None:
        stage.install.update(status=FAILED, summary="no Python here imports torch")
        stage.fail("install", "no Python here imports torch (set SUT_BASE_PYTHON)")
        return None
    stage.install["base_python"] = base
    if not os.path.exists(vpy):
        step = stage.run("install: venv", [base, "-m", "venv", "--system-site-packages", venv],
                         env=env, estimate=10)
        if step["status"] != PASSED:  # e.g. no ensurepip: pip then comes from the base (below)
            shutil.rmtree(venv, ignore_errors=True)
            step = stage.run("install: venv without pip",
                             [base, "-m", "venv", "--system-site-packages", "--without-pip", venv],
                             env=env, estimate=5)
            if step["status"] != PASSED:
                stage.install.update(status=FAILED, summary="creating the venv failed")
                return None
    # A venv made from a venv's Python sees the *base* interpreter's site-packages, not
    # that venv's (the node's python3 is /opt/torch/.venv/bin/python3): add them by a .pth.
    proc = stage.query([vpy, "-c", "import torch"], env=env)
    if proc is None or proc.returncode != 0:
        proc = stage.query([base, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"], env=env)
        dirs = json.loads(proc.stdout) if proc is not None and proc.returncode == 0 else []
        proc = stage.query([vpy, "-c", "import site; print(site.getsitepackages()[0])"], env=env)
        if not dirs or proc is None or proc.returncode != 0:
            stage.install.update(status=FAILED, summary="could not find the site-packages of " + base)
            stage.fail("install", stage.install["summary"])
            return None
        pth = os.path.join(proc.stdout.strip(), "_sut_gpu_base_site.pth")
        stage.say(f"== install: {vpy} does not import torch; adding {', '.join(dirs)} through {pth}")
        with open(pth, "w") as handle:
            handle.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
        stage.install["pth"] = pth
    make = shutil.which("make")
    if make is None:
        stage.install.update(status=FAILED, summary="`make` is not on PATH")
        stage.fail("install", "`make` is not on PATH (make install-offline needs it)")
        return None
    # NODE_HAS (the Makefile's: what the node has, left out of the wheelhouse and the
    # install) is passed on when set, e.g. NODE_HAS='$(CUDA_IMAGE_HAS)'
    node_has = [f"NODE_HAS={os.environ['NODE_HAS']}"] if os.environ.get("NODE_HAS") else []
    stage.install["node_has"] = os.environ.get("NODE_HAS")
    step = stage.run("install: make install-offline",
                     [make, "-C", REPO, "install-offline", f"WHEELHOUSE={wheelhouse}", f"PY={vpy}",
                      *node_has],
                     env={k: v for k, v in env.items() if k != "NODE_HAS"}, estimate=INSTALL_ESTIMATE_S)
    ok = step["status"] == PASSED
    if ok:
        proc = stage.query([vpy, "-c", IMPORT_CHECK], env=step_env(stage))
        ok = proc is not None and proc.returncode == 0
    seconds = round(time.time() - started, 1)
    stage.install.update(status=PASSED if ok else FAILED, seconds=seconds, python=vpy if ok else None,
                         summary=(f"installed into {venv} in {seconds:.0f} s (make install-offline "
                                  f"WHEELHOUSE={wheelhouse})" if ok else
                                  f"FAILED after {seconds:.0f} s (see the install steps)"))
    return vpy if ok else None


ENV_QUERY = r"""
import json, os, platform, sys
info = {"python": platform.python_version(), "python_path": sys.executable}
import torch
info["torch"] = torch.__version__
info["torch_cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
info["torch_threads"] = torch.get_num_threads()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}"
    info["bf16"] = torch.cuda.is_bf16_supported()
try:
    import triton
    info["triton"] = triton.__version__
except Exception as err:
    info["triton"] = f"not importable ({type(err).__name__})"
import fairseq, sut_fairseq
info["fairseq"] = getattr(fairseq, "__version__", "?")
info["sut_fairseq_path"] = os.path.dirname(sut_fairseq.__file__)
try:
    from importlib.metadata import version
    info["sut_fairseq"] = version("sut-fairseq")
except Exception:
    info["sut_fairseq"] = "not installed (the checkout)"
print("ENV " + json.dumps(info))
"""


def collect_environment(stage, python):
    """The 'environment' step: versions and device; on a GPU run it fails without CUDA."""
    found = {}

    def check(step):
        for line in log_lines_of(stage, step):
            if line.startswith("ENV "):
                found.update(json.loads(line[4:]))
        if not found:
            return "no ENV line in the output"
        if not stage.smoke and not found.get("cuda_available"):
            return "torch sees no CUDA device (use --smoke on a CPU machine)"
        return None

    script = os.path.join(stage.work, "env_query.py")
    with open(script, "w") as handle:
        handle.write(ENV_QUERY.lstrip())
    stage.run("environment", [python, script], env=step_env(stage, python),
              estimate=ENV_ESTIMATE_S, check=check)
    if not found.get("device"):
        found["device"] = "CPU (no CUDA device)" if not found.get("cuda_available") else "?"
    smi = shutil.which("nvidia-smi")
    if smi:
        proc = stage.query([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           timeout=30)
        if proc is not None and proc.returncode == 0:
            found["nvidia_smi"] = proc.stdout.strip()
            found["device"] += f" (nvidia-smi: {found['nvidia_smi']})"
    if os.path.isdir(os.path.join(REPO, ".git")) and shutil.which("git"):
        head = stage.query(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], timeout=30)
        dirty = stage.query(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], timeout=30)
        if head is not None and head.returncode == 0:
            n = len(dirty.stdout.splitlines()) if dirty is not None and dirty.returncode == 0 else 0
            found["git"] = head.stdout.strip() + (f" + {n} modified tracked files" if n else "")
    stage.info.update(found)


# --------------------------------------------------------------------------- stage: tests

PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)")


def stage_tests(stage, python, test_file, estimate, selftest):
    """``pytest -m gpu test_file``, then (``selftest``) ``python -m sut_fairseq.selftest``."""
    env = step_env(stage, python)
    counts = {}

    def pytest_check(step):
        lines = [l for l in log_lines_of(stage, step) if PYTEST_COUNTS.search(l)]
        if lines:
            for n, kind in PYTEST_COUNTS.findall(lines[-1]):
                counts[kind.rstrip("s") if kind.startswith(("error", "warning")) else kind] = int(n)
        if not counts:
            return "no pytest summary line in the output"
        if not stage.smoke and not counts.get("passed"):
            return "no test passed on the GPU node"
        return None

    # Failures printed as they happen (tests/conftest.py), and the slowest tests' times.
    step = stage.run("pytest -m gpu", [python, "-m", "pytest", "-m", "gpu", "-q", "--durations=15", test_file],
                     env={**env, "SUT_TEST_FAILURES_AT_ONCE": "1"}, estimate=estimate,
                     timeout=stage.remaining() - (TESTS_SELFTEST_ESTIMATE_S if selftest else 0),
                     check=pytest_check)
    stage.results["pytest"] = {"counts": counts, "status": step["status"],
                               "summary_line": last_matching(stage, step, PYTEST_COUNTS)}
    if stage.smoke and counts.get("skipped") and not counts.get("passed"):
        stage.results["pytest"]["note"] = "every test skipped: no CUDA device (expected with --smoke)"
    c = counts
    text = (f"- pytest -m gpu {test_file}: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
            f"{c.get('skipped', 0)} skipped, {c.get('error', 0)} errors"
            + (" (every test skipped: no CUDA device, expected with --smoke)"
               if stage.smoke and c.get("skipped") and not c.get("passed") else ""))
    if selftest:
        device = "cpu" if stage.smoke else "cuda"
        step = stage.run("selftest", [python, "-m", "sut_fairseq.selftest", "--device", device], env=env,
                         estimate=TESTS_SELFTEST_ESTIMATE_S)
        stage.results["selftest"] = {"status": step["status"], "tail": log_lines_of(stage, step)[-15:]}
        text += (f"\n- selftest: {step['status']}; its last lines:\n\n```\n"
                 + "\n".join(stage.results["selftest"]["tail"]) + "\n```")
    stage.extra_sections.append(("Results", text))


def log_lines_of(stage, step):
    """The lines a step wrote into the stage log."""
    with open(stage.log_path, "rb") as log:
        log.seek(step.get("log_offset", 0))
        data = log.read(step["log_end"] - step.get("log_offset", 0)) if step.get("log_end") else log.read()
    return data.decode("utf-8", "replace").splitlines()


def last_matching(stage, step, pattern):
    found = [l for l in log_lines_of(stage, step) if pattern.search(l)]
    return found[-1].strip() if found else None


# --------------------------------------------------------------------------- stage: bench

MOE_ROW = re.compile(r"^\s*(\d+)\s+(fwd\+bwd|fwd)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                     r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(.+?)\s*$")
TRAIN_ROW = re.compile(r"^(\S+)\s+(\d+) ms/step\s+(\d+) tokens/s(?:\s+([\d.]+) GiB peak)?\s*$")
RATIO_ROW = re.compile(r"^(\S+ / \S+) tokens/s: ([\d.]+)")


def stage_bench(stage, python):
    env = step_env(stage, python)
    moe_args = SMOKE_MOE_ARGS if stage.smoke else GPU_MOE_ARGS
    tokens = [int(t) for t in itertools.takewhile(lambda a: not a.startswith("--"),
                                                  moe_args[moe_args.index("--tokens") + 1:])]
    moe_rows, train_rows, ratios, profiles, header = [], {}, {}, {}, {}

    def moe_check(step):
        lines = log_lines_of(stage, step)
        header["moe"] = next((l for l in lines if "MoE-FFD projections" in l), None)
        for line in lines:
            m = MOE_ROW.match(line)
            if m:
                g = m.groups()
                moe_rows.append({"tokens": int(g[0]), "pass": g[1], "triton_ms": float(g[2]),
                                 "triton_tflops": float(g[3]), "dense_ms": float(g[4]),
                                 "dense_tflops": float(g[5]), "reference_ms": float(g[6]),
                                 "reference_tflops": float(g[7]), "triton_over_dense": float(g[8]),
                                 "host_syncs": g[9]})
        missing = [t for t in tokens if not any(r["tokens"] == t for r in moe_rows)]
        if missing:
            return f"no timing rows for tokens {missing} in the output"
        syncs = [r for r in moe_rows if r["host_syncs"] not in ("none", "n/a")]
        if syncs:
            return f"host syncs in the Triton path: {syncs[0]['host_syncs']}"
        return None

    extra = {"TRITON_INTERPRET": "1"} if stage.smoke else None
    stage.run("moe_gpu.py", [python, "benchmarks/moe_gpu.py", *moe_args],
              env=step_env(stage, python, extra), env_prefix=extra,
              estimate=BENCH_MOE_ESTIMATE_S,
              timeout=stage.remaining() - BENCH_TRAIN_STEP_ESTIMATE_S, check=moe_check)

    def train_check(step):
        lines = log_lines_of(stage, step)
        header["train_step"] = next((l for l in lines if "target tokens" in l), None)
        for line in lines:
            m = TRAIN_ROW.match(line)
            if m:
                train_rows[m.group(1)] = {"ms_per_step": int(m.group(2)), "tokens_per_s": int(m.group(3)),
                                          "peak_gib": float(m.group(4)) if m.group(4) else None}
            m = RATIO_ROW.match(line)
            if m:
                ratios[m.group(1)] = float(m.group(2))
            m = PROFILE_ROW.match(line)
            if m:
                profiles[m.group(1)] = {"wall_ms": float(m.group(2)), "launches": int(m.group(3)),
                                        "aten_calls": int(m.group(4)),
                                        "device_busy_ms": float(m.group(5)) if m.group(5) else None}
        missing = [a for a in ("sut_base", "ut_base", "transformer_wmt_en_de") if a not in train_rows]
        if missing:
            return f"no rows for {missing} in the output"
        if not stage.smoke and any(r["peak_gib"] is None for r in train_rows.values()):
            return "no peak memory in the output"
        unprofiled = [a for a in train_rows if a not in profiles]
        if unprofiled:
            return f"no profile of {unprofiled} in the output"
        return None

    stage.run("train_step.py", [python, "benchmarks/train_step.py",
                                *(SMOKE_TRAIN_STEP_ARGS if stage.smoke else GPU_TRAIN_STEP_ARGS)],
              env=env, estimate=BENCH_TRAIN_STEP_ESTIMATE_S, check=train_check)
    stage.results.update({"moe_gpu": {"header": header.get("moe"), "rows": moe_rows},
                          "train_step": {"header": header.get("train_step"), "models": train_rows,
                                         "ratios": ratios, "profiles": profiles}})
    text = []
    if moe_rows:
        text += [f"MoE-FFD expert GEMMs ({header.get('moe') or ''}):", "",
                 "| tokens | pass | Triton ms | TFLOP/s | dense ms | TFLOP/s | reference ms | Triton/dense | host syncs |",
                 "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
        text += [f"| {r['tokens']} | {r['pass']} | {r['triton_ms']:.3f} | {r['triton_tflops']:.1f} | "
                 f"{r['dense_ms']:.3f} | {r['dense_tflops']:.1f} | {r['reference_ms']:.3f} | "
                 f"{r['triton_over_dense']:.2f} | {r['host_syncs']} |" for r in moe_rows]
    if train_rows:
        text += ["", f"One training step ({header.get('train_step') or ''}):", "",
                 "| model | ms/step | tokens/s | peak GiB |", "|---|---:|---:|---:|"]
        text += [f"| {a} | {r['ms_per_step']} | {r['tokens_per_s']} | "
                 f"{'' if r['peak_gib'] is None else r['peak_gib']} |" for a, r in train_rows.items()]
        text += [""] + [f"- {k} tokens/s: {v:.2f}" for k, v in ratios.items()]
    if profiles:
        text += ["", "One profiled step per model (`train_step.py --profile`; the operations are in "
                 f"`{stage.name}.log`):", "",
                 "| model | wall ms | kernel launches | aten calls | device busy ms | busy % |",
                 "|---|---:|---:|---:|---:|---:|"]
        for a, r in profiles.items():
            busy, wall = r["device_busy_ms"], r["wall_ms"]
            busy_cells = " | |" if busy is None else f"{busy:.1f} | {100 * busy / wall:.0f} |"
            text.append(f"| {a} | {wall:.1f} | {r['launches']} | {r['aten_calls']} | {busy_cells}")
    if stage.smoke and text:
        text.insert(0, "(--smoke: CPU and Triton's interpreter; the numbers check the scripts and mean nothing)\n")
    if text:
        stage.extra_sections.append(("Results", "\n".join(text)))


# --------------------------------------------------------------------------- stage: logic

ORIGINAL_FILES = [f"{p}{k}" for p in ("train", "test") for k in range(13)]


def logic_plan(stage_name, smoke, environ=None):
    """The runs of a logic stage: [(model, protocol, required)]."""
    environ = os.environ if environ is None else environ
    plan = list(LOGIC_SUT_RUNS if stage_name == "logic-sut" else LOGIC_BASELINE_RUNS)
    models = environ.get("SUT_LOGIC_MODELS", "").split()
    protocols = environ.get("SUT_LOGIC_PROTOCOLS", "").split()
    if models or protocols:
        models = models or list(dict.fromkeys(m for m, _, _ in plan))
        protocols = protocols or list(dict.fromkeys(p for _, p, _ in plan))
        plan = [(m, p, True) for p in protocols for m in models]
    if smoke:  # the tiny CPU run: the required runs only
        plan = [r for r in plan if r[2]]
    return plan


def has_halting_analysis(model):
    return model != "transformer"


def _recipe_numbers():
    """sut_fairseq/recipes/numbers.py, the parser of table5.py's --buckets, loaded by path:
    it needs only the standard library, while importing the package would import fairseq
    and torch, which this driver runs without (before the install)."""
    path = os.path.join(REPO, "sut_fairseq", "recipes", "numbers.py")
    spec = importlib.util.spec_from_file_location("_sut_recipe_numbers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bucket_count(buckets):
    """How many buckets a table5.py --buckets value names ("all", "7..12", "7,12", "3")."""
    return 13 if buckets == "all" else len(_recipe_numbers().parse_numbers(buckets))


def run_estimate(model, protocol, smoke=False):
    """Estimated seconds of one table5.py call (train + evaluate one model, one protocol)."""
    if smoke:
        return 40
    if protocol == "standard":
        n = bucket_count(LOGIC_BUCKETS)
        evaluation = n * LOGIC_GENERATE_CALL_S + (LOGIC_ANALYSIS_ESTIMATE_S if has_halting_analysis(model) else 0)
    else:
        evaluation = LOGIC_GENERATE_CALL_S
    return LOGIC_TRAIN_OVERHEAD_S + LOGIC_TRAIN_CAP_S + evaluation


def required_estimate(stage_name, install=True, environ=None):
    """Estimated seconds of a stage's required steps (with the install on a fresh node)."""
    total = (INSTALL_ESTIMATE_S if install else 0) + ENV_ESTIMATE_S
    if stage_name in TEST_STAGES:
        _, pytest_s, selftest = TEST_STAGES[stage_name]
        return total + pytest_s + (TESTS_SELFTEST_ESTIMATE_S if selftest else 0)
    if stage_name == "bench":
        return total + BENCH_MOE_ESTIMATE_S + BENCH_TRAIN_STEP_ESTIMATE_S
    if stage_name == "cpvr":
        return (total + CPVR_GENERATE_ESTIMATE_S + CPVR_TRAIN_OVERHEAD_S + CPVR_MIN_TRAIN_S
                + CPVR_EVALUATE_ESTIMATE_S + CPVR_REPORT_ESTIMATE_S)
    plan = [r for r in logic_plan(stage_name, False, environ) if r[2]]
    total += LOGIC_GENERATE_ESTIMATE_S + LOGIC_SUMMARY_ESTIMATE_S
    total += sum(LOGIC_PREPARE_ESTIMATE_S.get(p, 30) for p in dict.fromkeys(p for _, p, _ in plan))
    return total + sum(run_estimate(m, p) for m, p, _ in plan)


def validate_logic_names(plan):
    models = ("sut", "ut-halting", "ut-no-halting", "transformer")
    for model, protocol, _ in plan:
        if model not in models:
            raise UsageError(f"SUT_LOGIC_MODELS: unknown model {model!r} (choose from {', '.join(models)})")
        if protocol not in ("standard", "A", "B", "C"):
            raise UsageError(f"SUT_LOGIC_PROTOCOLS: unknown protocol {protocol!r} (standard, A, B, C)")


UPS = re.compile(r"\bups[= ]([\d.]+)")
WALL = re.compile(r"\btrain_wall[= ](\d+)")


def stage_logic(stage, python):
    smoke = stage.smoke
    plan = logic_plan(stage.name, smoke)
    env = step_env(stage, python)
    pairs = SMOKE_PAIRS if smoke else LOGIC_PAIRS
    data = os.path.join(stage.work, f"logic-data-{pairs}")  # kept: a later stage reuses it
    work = os.path.join(stage.work, f"{stage.name}-runs")
    # this call's runs only (an earlier call's on a warm machine would join the table)
    shutil.rmtree(work, ignore_errors=True)
    train_log = os.path.join(stage.work, f"{stage.name}-fairseq-train.log")
    open(train_log, "w").close()
    stage.extra_logs["fairseq-train.log"] = train_log
    for name in ("fairseq-train.log", "table5.md", "table5.json", "figure4.png"):
        stage.add_out_file(name)
    scripts = os.path.join(REPO, "scripts", "logic")
    buckets = SMOKE_BUCKETS if smoke else LOGIC_BUCKETS
    cap_hours = SMOKE_STOP_TIME_HOURS if smoke else LOGIC_TRAIN_CAP_S / 3600
    stage.budget = {
        "deadline_s": stage.deadline_s,
        "install_estimate_s": INSTALL_ESTIMATE_S, "generate_estimate_s": LOGIC_GENERATE_ESTIMATE_S,
        "prepare_estimate_s": LOGIC_PREPARE_ESTIMATE_S, "train_cap_s": None if smoke else LOGIC_TRAIN_CAP_S,
        "train_overhead_s": LOGIC_TRAIN_OVERHEAD_S, "generate_call_s": LOGIC_GENERATE_CALL_S,
        "analysis_estimate_s": LOGIC_ANALYSIS_ESTIMATE_S, "summary_estimate_s": LOGIC_SUMMARY_ESTIMATE_S,
        "buckets": buckets, "pairs": pairs, "stop_time_hours": cap_hours,
        "max_update": SMOKE_MAX_UPDATE if smoke else None,
        "runs": [{"model": m, "protocol": p, "required": r, "estimate_s": run_estimate(m, p, smoke)}
                 for m, p, r in plan],
        "note": "estimates, not measurements: correct them from this summary's measured times",
    }
    planned = sum(run_estimate(m, p, smoke) for m, p, r in plan if r)
    stage.say(f"== plan: {', '.join(f'{m}/{p}' + ('' if r else ' (if time is left)') for m, p, r in plan)}; "
              f"training cap {cap_hours * 3600:.0f} s per run; required runs estimated {planned} s; "
              f"{stage.remaining():.0f} s left")

    # data: generate once (kept in the work directory: a later stage on the same machine reuses it)
    original = os.path.join(data, "original")
    if all(os.path.isfile(os.path.join(original, f)) for f in ORIGINAL_FILES):
        stage.say(f"== logic data: {original} is complete (reused)")
        gen_ok = True
    else:
        overwrite = ["--overwrite"] if os.path.isdir(original) else []
        gen_ok = stage.run("logic data: generate", [python, "data-prep/logic/generate.py", "--out", original,
                                                    "--pairs", str(pairs), "--seed", "1", "--no-progress",
                                                    *overwrite],
                           env=env, estimate=LOGIC_GENERATE_ESTIMATE_S)["status"] == PASSED
    prepared = {}

    def prepare(protocol):
        if protocol in prepared:
            return prepared[protocol]
        out = os.path.join(data, protocol)
        last = "test12" if protocol == "standard" else "test"
        done = all(os.path.exists(os.path.join(out, "bin", n)) for n in
                   ("dict.src.txt", f"{last}.src-tgt.src.bin", f"{last}.src-tgt.tgt.bin"))
        if done:
            stage.say(f"== logic data: {out}/bin is complete (reused)")
            prepared[protocol] = True
        elif not gen_ok:
            stage.skip(f"logic data: prepare {protocol}", "no generated data")
            prepared[protocol] = False
        else:
            overwrite = ["--overwrite"] if os.path.isdir(out) else []
            prepared[protocol] = stage.run(
                f"logic data: prepare {protocol}",
                [python, "data-prep/logic/prepare.py", "--data", original, "--out", out,
                 "--protocol", protocol, "--binarize", *overwrite],
                env=env, estimate=LOGIC_PREPARE_ESTIMATE_S.get(protocol, 30))["status"] == PASSED
        return prepared[protocol]

    # the brief of these stages: the standard protocol and split A prepared up front when
    # a required run needs them; optional protocols are prepared when their run starts
    for protocol in dict.fromkeys(p for _, p, r in plan if r):
        prepare(protocol)

    runs = []
    for i, (model, protocol, required) in enumerate(plan):
        name = f"logic: {model} / {protocol}"
        estimate = run_estimate(model, protocol, smoke)
        later_required = sum(run_estimate(m, p, smoke) for m, p, r in plan[i + 1:] if r)
        if not required:
            need = estimate + LOGIC_SUMMARY_ESTIMATE_S + (
                0 if protocol in prepared else LOGIC_PREPARE_ESTIMATE_S.get(protocol, 30))
            if stage.remaining() < need:
                stage.skip(name, f"not started: estimated {need} s, {stage.remaining():.0f} s left",
                           required=False)
                continue
        if not prepare(protocol):
            stage.skip(name, f"protocol {protocol} not prepared", required=required)
            continue
        train_args = SMOKE_TRAIN_ARGS[model] if smoke else ""
        if os.environ.get("SUT_LOGIC_TRAIN_ARGS"):
            train_args = (train_args + " " + os.environ["SUT_LOGIC_TRAIN_ARGS"]).strip()
        argv = [python, os.path.join(scripts, "table5.py"), "--data-dir", data, "--work-dir", work,
                "--models", model, "--protocols", protocol, "--seeds", "1", "--buckets", buckets,
                "--stop-time-hours", f"{cap_hours:.6g}", "--force"]
        if smoke:
            argv += ["--cpu", "--max-update", str(SMOKE_MAX_UPDATE)]
        if train_args:
            argv += ["--train-args", train_args]
        # a required run may use the time the later required runs do not need
        timeout = max(min(estimate, stage.remaining()),
                      stage.remaining() - later_required - LOGIC_SUMMARY_ESTIMATE_S)
        step = stage.run(name, argv, env=env, estimate=estimate, timeout=timeout, required=required)
        run_dir = os.path.join(work, model, protocol, "seed1")
        runs.append(collect_run(stage, model, protocol, run_dir, step, train_log))
        stage.flush()

    stage.results["runs"] = runs
    if any(r.get("accuracy") for r in runs):
        stage.run("logic: Table 5 and Figure 4", [python, os.path.join(scripts, "summarize.py"), work,
                                                  "--out-dir", stage.out],
                  env=env, estimate=LOGIC_SUMMARY_ESTIMATE_S, timeout=max(stage.remaining(), 30),
                  overrun=True)
        table_json = os.path.join(stage.out, "table5.json")
        if os.path.exists(table_json):
            with open(table_json) as handle:
                table = json.load(handle)
            stage.results["table5"] = {"rows": table.get("rows"), "columns": table.get("columns")}
            stage.results["figure4_halting_depth"] = table.get("halting_depth")
    else:
        stage.skip("logic: Table 5 and Figure 4", "no run finished")
    logic_sections(stage, runs)


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


def _key_order(key):
    return (0, int(key)) if key.isdigit() else (1, key)


def logic_sections(stage, runs):
    b = stage.budget
    if b["train_cap_s"] is not None:
        cap = f"{b['train_cap_s']}"
    else:
        cap = f"{b['stop_time_hours'] * 3600:.0f} (smoke: --max-update {b['max_update']})"
    text = [f"Estimates (seconds; correct them after a GPU run): stage deadline {b['deadline_s']}, "
            f"install {b['install_estimate_s']} (0 when the package was importable), generate "
            f"{b['generate_estimate_s']}, prepare {b['prepare_estimate_s']}, per run: training cap {cap}"
            f" + {b['train_overhead_s']} fairseq-train overhead + {b['generate_call_s']} per "
            f"fairseq-generate call + {b['analysis_estimate_s']} halting analysis; summary "
            f"{b['summary_estimate_s']}. Buckets evaluated: `{b['buckets']}`; pairs generated: {b['pairs']:,}.",
            "", "| run | required | estimate (s) |", "|---|---|---:|"]
    text += [f"| {r['model']} / {r['protocol']} | {'yes' if r['required'] else 'if time is left'} | "
             f"{r['estimate_s']} |" for r in b["runs"]]
    stage.extra_sections.append(("Time budget", "\n".join(text)))
    if runs:
        keys = sorted({k for r in runs for k in (r.get("accuracy") or {})}, key=_key_order)
        rows = ["| run | status | seconds | updates | updates/s | stop | params | "
                + " | ".join(keys) + " |",
                "|---|---|---:|---:|---:|---|---:|" + "---:|" * len(keys)]
        for r in runs:
            acc = r.get("accuracy") or {}
            params = f"{r['params']:,}" if r.get("params") else ""
            rows.append(f"| {r['model']} / {r['protocol']} | {r['status']} | {r['seconds']:.0f} | "
                        f"{r.get('updates') if r.get('updates') is not None else ''} | "
                        f"{r.get('updates_per_s') if r.get('updates_per_s') is not None else ''} | "
                        f"{(r.get('stop_reason') or '')[:40]} | "
                        f"{params} | "
                        + " | ".join("" if acc.get(k) is None else f"{acc[k]:.1f}" for k in keys) + " |")
        depth_runs = [r for r in runs if r.get("encoder_mean_depth")]
        if depth_runs:
            dkeys = sorted({k for r in depth_runs for k in r["encoder_mean_depth"]}, key=_key_order)
            rows += ["", "Figure 4 (average encoder halting depth per number of operators, "
                     "teacher-forced, standard protocol):", "",
                     "| model | " + " | ".join(dkeys) + " |", "|---|" + "---:|" * len(dkeys)]
            rows += [f"| {r['model']} | " + " | ".join(
                "" if r["encoder_mean_depth"].get(k) is None else f"{r['encoder_mean_depth'][k]:.2f}"
                for k in dkeys) + " |" for r in depth_runs]
        stage.extra_sections.append(("Results (accuracy %, per bucket / split)", "\n".join(rows)
                                     + "\n\n`table5.md`, `table5.json` and `figure4.png` (when a model "
                                     "with halting finished) are summarize.py's, written into OUT."))


# --------------------------------------------------------------------------- stage: cpvr

#: Each model's process, side by side: ``bash -c SCRIPT cpvr PYTHON ARGS...`` runs
#: ``PYTHON ARGS... --models M`` for every model M given after ``--`` and fails when one does.
SIDE_BY_SIDE = ('py=$1; shift; args=(); while [ "$1" != -- ]; do args+=("$1"); shift; done; shift; '
                'pids=(); for m in "$@"; do "$py" "${args[@]}" --models "$m" & pids+=($!); done; '
                'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc')


def side_by_side(python, args, models):
    return ["bash", "-c", SIDE_BY_SIDE, "cpvr", python, *args, "--", *models]


def cpvr_train_cap(remaining):
    """Seconds of training this call can give every model: what is left once the
    fairseq-train overhead, the evaluation and the report are set aside."""
    return int(remaining - CPVR_TRAIN_OVERHEAD_S - CPVR_EVALUATE_ESTIMATE_S - CPVR_REPORT_ESTIMATE_S)


def stage_cpvr(stage, python):
    """Data (reused when complete), the three models trained side by side under one cap
    (continuing an earlier call's runs on the same machine), evaluated side by side, the
    report copied into OUT."""
    smoke = stage.smoke
    env = step_env(stage, python, {"OMP_NUM_THREADS": "1" if smoke else str(CPVR_THREADS),
                                   "MKL_NUM_THREADS": "1" if smoke else str(CPVR_THREADS)})
    data = os.path.join(stage.work, "cpvr-data-smoke" if smoke else "cpvr-data")
    work = os.path.join(stage.work, "cpvr-runs")
    hops_py = os.path.join(REPO, "scripts", "cpvr", "hops.py")

    def has(model, name):  # a file of the model's run (hops.py: WORK/MODEL/seed1/)
        return os.path.exists(os.path.join(work, model, "seed1", name))

    budget_path = os.path.join(work, "budget.json")
    train_log = os.path.join(stage.work, "cpvr-fairseq-train.log")
    open(train_log, "w").close()
    stage.extra_logs["fairseq-train.log"] = train_log
    for name in ("fairseq-train.log", "hops.md", "accuracy.png", "depth.png"):
        stage.add_out_file(name)

    earlier = None
    if os.path.exists(budget_path):
        with open(budget_path) as handle:
            earlier = json.load(handle)
    calls = (earlier["calls"] if earlier else 0) + 1
    common = ["--data-dir", data, "--work-dir", work, "--config", "gpu", "--seeds", "1"]
    if smoke:
        common += ["--cpu", "--hops", SMOKE_CPVR_HOPS]

    # data: generated once per machine (a later call reuses it)
    if all(os.path.exists(os.path.join(data, n)) for n in ("stats.json", "baselines.json",
                                                          os.path.join("bin", "dict.src.txt"))):
        stage.say(f"== cpvr data: {data} is complete (reused)")
        data_ok = True
    else:
        argv = [python, "data-prep/cpvr/generate.py", "--config", "small", "--out", data, "--binarize",
                "--no-progress", *(["--overwrite"] if os.path.isdir(data) else []),
                *(SMOKE_CPVR_DATA_ARGS if smoke else [])]
        data_ok = stage.run("cpvr data: generate", argv, env=env,
                            estimate=CPVR_GENERATE_ESTIMATE_S)["status"] == PASSED

    # training: this call's cap on top of what the earlier calls granted (fairseq-train's
    # --stop-time-hours counts the training time of the checkpoint it resumes)
    cap_s = cpvr_train_cap(stage.remaining())
    granted_s = (earlier["granted_s"] if earlier else 0) + max(cap_s, 0)
    max_update = SMOKE_MAX_UPDATE * calls if smoke else None
    stage.budget = {"deadline_s": stage.deadline_s, "call": calls,
                    "train_cap_s": cap_s, "granted_train_s": granted_s, "max_update": max_update,
                    "generate_estimate_s": CPVR_GENERATE_ESTIMATE_S,
                    "train_overhead_s": CPVR_TRAIN_OVERHEAD_S, "min_train_s": CPVR_MIN_TRAIN_S,
                    "evaluate_estimate_s": CPVR_EVALUATE_ESTIMATE_S,
                    "report_estimate_s": CPVR_REPORT_ESTIMATE_S, "threads_per_model": 1 if smoke else CPVR_THREADS,
                    "note": "estimates, not measurements: correct them from this summary's measured times"}
    stage.say(f"== plan: call {calls} on this machine; {', '.join(CPVR_MODELS)} side by side, "
              f"{cap_s} s of training each this call ({granted_s} s in all); {stage.remaining():.0f} s left")
    if not data_ok:
        stage.skip("cpvr: train", "no data")
    elif cap_s < CPVR_MIN_TRAIN_S and not smoke:
        stage.skip("cpvr: train", f"{cap_s} s of training left, less than {CPVR_MIN_TRAIN_S} s")
    else:
        if earlier:
            stage.say(f"== cpvr: continuing the runs of {calls - 1} earlier call(s) in {work} "
                      f"(delete it to start over)")
        for model in CPVR_MODELS:  # what the train and evaluate stages skip when present
            for name in ("train.json", "result.json"):
                if has(model, name):
                    os.unlink(os.path.join(work, model, "seed1", name))
        train_args = common + ["--stage", "train", "--stop-stage", "train",
                               "--stop-time-hours", f"{granted_s / 3600:.6f}"]
        if smoke:
            train_args += ["--max-update", str(max_update), "--train-args", SMOKE_CPVR_TRAIN_ARGS]
        stage.run("cpvr: train", side_by_side(python, [hops_py, *train_args], CPVR_MODELS),
                  env=env, estimate=(cap_s + CPVR_TRAIN_OVERHEAD_S) if not smoke else 60,
                  timeout=stage.remaining() - CPVR_EVALUATE_ESTIMATE_S - CPVR_REPORT_ESTIMATE_S)
        os.makedirs(work, exist_ok=True)
        write_atomic(budget_path, json.dumps({"calls": calls, "granted_s": granted_s}) + "\n")
    trained = [m for m in CPVR_MODELS if has(m, "train.json")]
    if trained:
        stage.run("cpvr: evaluate",
                  side_by_side(python, [hops_py, *common, "--stage", "evaluate", "--stop-stage", "evaluate"],
                               trained),
                  env=env, estimate=CPVR_EVALUATE_ESTIMATE_S,
                  timeout=stage.remaining() - CPVR_REPORT_ESTIMATE_S)
    else:
        stage.skip("cpvr: evaluate", "no model was trained")
    evaluated = [m for m in CPVR_MODELS if has(m, "result.json")]
    if evaluated:
        stage.run("cpvr: report", [python, os.path.join(REPO, "scripts", "cpvr", "summarize.py"), work,
                                   "--data-dir", data],
                  env=env, estimate=CPVR_REPORT_ESTIMATE_S, timeout=max(stage.remaining(), 30), overrun=True)
        for name in ("hops.md", "accuracy.png", "depth.png"):
            path = os.path.join(work, name)
            if os.path.exists(path):
                with open(path, "rb") as handle:
                    write_atomic(os.path.join(stage.out, name), handle.read())
        if os.path.exists(os.path.join(work, "hops.json")):
            with open(os.path.join(work, "hops.json")) as handle:
                stage.results["hops"] = json.load(handle)
    else:
        stage.skip("cpvr: report", "no model was evaluated")
    runs = {}
    for model in CPVR_MODELS:
        status = "evaluated" if model in evaluated else "trained" if model in trained else "not trained"
        runs[model] = collect_run(stage, model, "C-PVR", os.path.join(work, model, "seed1"),
                                  {"status": status, "seconds": 0.0}, train_log)
    stage.results["runs"] = runs
    cpvr_sections(stage, runs, work)


def cpvr_sections(stage, runs, work):
    b = stage.budget
    text = [f"Call {b['call']} on this machine: {b['train_cap_s']} s of training per model this call, "
            f"{b['granted_train_s']} s in all (fairseq-train --stop-time-hours counts the time of the "
            f"checkpoint it resumes){'; smoke: --max-update ' + str(b['max_update']) if b['max_update'] else ''}. "
            f"Estimates (seconds): generate {b['generate_estimate_s']}, fairseq-train overhead "
            f"{b['train_overhead_s']}, evaluation {b['evaluate_estimate_s']}, report "
            f"{b['report_estimate_s']}; {b['threads_per_model']} CPU threads per model."]
    rows = ["| model | status | updates | updates/s | stop | params |", "|---|---|---:|---:|---|---:|"]
    for model, r in runs.items():
        rows.append(f"| {model} | {r['status']} | {r.get('updates') if r.get('updates') is not None else ''} | "
                    f"{r.get('updates_per_s') if r.get('updates_per_s') is not None else ''} | "
                    f"{(r.get('stop_reason') or '')[:50]} | {r['params']:,} |" if r.get("params") else
                    f"| {model} | {r['status']} | | | | |")
    stage.extra_sections.append(("Time budget", "\n".join(text)))
    hops_md = os.path.join(work, "hops.md")
    report = ""
    if os.path.exists(hops_md):
        with open(hops_md) as handle:
            report = "\n\n" + handle.read()
    stage.extra_sections.append(("Results", "\n".join(rows) + report))


# --------------------------------------------------------------------------- main

def parse_args(argv):
    args = [a for a in argv if a != "--smoke"]
    smoke = len(args) != len(argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        print(__doc__)
        raise SystemExit(0)
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        raise UsageError(f"unknown option {unknown[0]}")
    if len(args) != 2:
        raise UsageError("expected STAGE and OUT")
    stage, out = args
    if stage not in STAGES:
        raise UsageError(f"unknown STAGE {stage!r}")
    return stage, out, smoke


def check_out(out, stage_name):
    """OUT is created; it may hold only files this script writes (a re-run into it)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"OUT {out} exists and is not a directory")
    os.makedirs(out, exist_ok=True)
    ours = {"summary.md", "results.json", f"{stage_name}.log", "fairseq-train.log", "table5.md",
            "table5.json", "figure4.png", "hops.md", "accuracy.png", "depth.png"}
    others = [n for n in os.listdir(out) if n not in ours]
    if others:
        raise UsageError(f"OUT {out} holds other files ({', '.join(sorted(others)[:4])}): use an empty directory")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        name, out, smoke = parse_args(argv)
        deadline_s(smoke)   # a bad SUT_GPU_DEADLINE_S is a usage error, before OUT is made
        if name.startswith("logic"):
            validate_logic_names(logic_plan(name, smoke))
        check_out(out, name)
    except UsageError as err:
        print(f"validate.py: error: {err}\n{USAGE}", file=sys.stderr)
        return 2
    stage = Stage(name, out, smoke)
    if not smoke:
        stage.estimate = required_estimate(name)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: (stage.interrupt(signum), sys.exit(128 + signum)))
    stage.say(f"== stage {name}{' (--smoke: CPU, tiny sizes)' if smoke else ''}; OUT {stage.out}; "
              f"work {stage.work}; deadline {stage.deadline_s} s")
    stage.flush()
    try:
        python = ensure_package(stage)
        stage.python = python
        if python is None:
            stage.skip(name, "the package is not importable (see install)")
        else:
            collect_environment(stage, python)
            if stage.steps[-1]["status"] != PASSED:
                stage.skip(name, "the environment check failed")
            elif name in TEST_STAGES:
                stage_tests(stage, python, *TEST_STAGES[name])
            elif name == "bench":
                stage_bench(stage, python)
            elif name == "cpvr":
                stage_cpvr(stage, python)
            else:
                stage_logic(stage, python)
    except Exception as err:  # a bug here must still leave a summary
        import traceback
        stage.say("== validate.py failed:\n" + traceback.format_exc())
        stage.steps.append({"name": "validate.py", "status": FAILED, "required": True,
                            "reason": f"{type(err).__name__}: {err}", "command": None,
                            "seconds": 0.0, "estimate_s": None})
    stage.flush(final=True)
    n_files = len(os.listdir(stage.out))
    status = 0 if stage.ok() else 1
    stage_word = PASSED if status == 0 else FAILED
    print(f"\n== stage {name}: {stage_word} in {stage.elapsed():.0f} s; {n_files} files in {stage.out}"
          + (f"; not passed: {', '.join(s['name'] for s in stage.failed_steps())}" if status else ""),
          flush=True)
    if n_files > MAX_OUT_FILES:
        print(f"validate.py: error: {n_files} files in {stage.out} (more than {MAX_OUT_FILES})", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
