#!/usr/bin/env python3
"""Staged validation of sut_fairseq on one GPU node, one command per stage.

    scripts/gpu/validate.sh STAGE OUT [--smoke] [options]
    python3 scripts/gpu/validate.py STAGE OUT [--smoke] [options]

STAGE is one of

* ``tests``           ``pytest -m gpu -q tests/gpu/test_gpu.py``: the Triton kernels and the expert
                      layers against the reference, incremental decoding, no host syncs;
* ``tests-compiled``  ``pytest -m gpu -q tests/gpu/test_gpu_compiled.py``: no host sync in a
                      compiled step, CUDA graphs over the compiled loop equal to eager;
* ``tests-train``     ``pytest -m gpu -q tests/gpu/test_gpu_train.py`` (fairseq-train in fp32, fp16
                      and bf16) and ``python -m sut_fairseq.selftest``;
* ``bench``           ``benchmarks/moe_gpu.py`` (bf16, 4096 8192 16384 tokens),
                      ``benchmarks/train_step.py --device cuda --bf16 --compile sut_base
                      transformer_wmt_en_de`` at 4,096 and 16,384 target tokens (sut_base,
                      ut_base, transformer_wmt_en_de on the same batch: tokens/s and peak
                      memory eager; sut_base and the transformer compiled) and
                      ``benchmarks/generate_throughput.py`` (beam 4, 3,003 sentences:
                      sentences/s of sut_base and transformer_wmt_en_de, eager and compiled;
                      the last two when the time is left: on a warm node);
* ``logic-sut``       the logic Table 5 recipe (``scripts/logic/table5.py``, the ``full``
                      configuration under a wall-clock cap) for ``sut`` on the standard
                      protocol (buckets 7 and 12) and, if time is left, compositional split A;
* ``logic-baselines`` the same for ``transformer`` and ``ut-halting`` (and more when time
                      is left);
* ``cpvr``            the C-PVR recipe (``scripts/cpvr/hops.py``, the ``gpu`` configuration)
                      for ``ut``, ``sut`` and ``hyper-ut`` trained side by side under one
                      wall-clock cap, evaluated on hops 1-9, reported. A later call on the
                      same machine continues the same runs with a new cap.

Options (the node's limits; the defaults are those of a time-limited node where one
command runs at most 10 minutes and at most 8 files of at most 16 MiB come back):

  --time-limit S     the longest one command may run (default 600); the stage stops
                     starting work and ends the step in progress 60 s before it
  --max-files N      how many files of OUT the node brings back (default 8)
  --max-file-mib M   the largest file it brings back, MiB (default 16; logs are cut to M-1)
  --base-python P    the Python with torch to make the venv from (default: the first of
                     $SUT_BASE_PYTHON, python3, python that imports torch)

Each stage makes sure a Python imports fairseq and sut_fairseq (else it makes a venv over
the Python with torch and runs ``make install-offline``), records the environment, runs
its steps (every command printed before it runs, every output into ``OUT/STAGE.log``) and
keeps ``OUT/summary.md`` and ``OUT/results.json`` current, also when a step fails or the
command is killed. Every file in OUT is written atomically. The exit status is 0 when
every required step passed, 1 otherwise, 2 for a usage error.

``--smoke`` runs the same stage on the CPU with tiny sizes (a check of this script and of
the commands, not of the GPU).

Environment: ``PYTHON`` (the Python of the steps; no search), ``WHEELHOUSE`` (default
``wheelhouse`` in the repository), ``NODE_HAS`` (passed to make install-offline),
``SUT_GPU_VENV``, ``SUT_GPU_FORCE_INSTALL=1``, ``SUT_GPU_WORK`` (data and runs; default
``/tmp/sut-gpu``), ``SUT_GPU_DEADLINE_S`` (a lower deadline), ``SUT_BENCH_STEPS`` (the bench
steps to run), ``SUT_LOGIC_MODELS`` / ``SUT_LOGIC_PROTOCOLS`` / ``SUT_LOGIC_TRAIN_ARGS``
(docs/gpu.md).

This file is the stage runner; the work is in the modules beside it, standard library
only: ``gpu_common.py`` (paths, limits, files), ``gpu_stage.py`` (steps, logs, summary),
``gpu_install.py`` (install and environment), ``gpu_tests.py``, ``gpu_bench.py``,
``gpu_logic_plan.py`` with ``gpu_logic.py``, and ``gpu_cpvr.py``.
"""
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the stage modules beside this file (also when loaded by path)
    sys.path.insert(0, HERE)

from gpu_bench import bench_plan, bench_required_estimate, stage_bench  # noqa: E402
from gpu_common import (DEADLINE_MARGIN_S, FAILED, MAX_FILE_MIB, MAX_OUT_FILES, PASSED,  # noqa: E402
                        SMOKE_DEADLINE_S, STAGE_DEADLINE_S, TIME_LIMIT_S, NodeOptions, UsageError,
                        deadline_s)
from gpu_cpvr import (CPVR_EVALUATE_ESTIMATE_S, CPVR_GENERATE_ESTIMATE_S, CPVR_MIN_TRAIN_S,  # noqa: E402
                      CPVR_REPORT_ESTIMATE_S, CPVR_TRAIN_OVERHEAD_S, cpvr_train_cap, stage_cpvr)
from gpu_install import ENV_ESTIMATE_S, INSTALL_ESTIMATE_S, collect_environment, ensure_package  # noqa: E402
from gpu_logic import stage_logic  # noqa: E402
from gpu_logic_plan import (LOGIC_ANALYSIS_ESTIMATE_S, LOGIC_BUCKETS, LOGIC_GENERATE_CALL_S,  # noqa: E402
                            LOGIC_GENERATE_ESTIMATE_S, LOGIC_PREPARE_ESTIMATE_S, LOGIC_SUMMARY_ESTIMATE_S,
                            LOGIC_TRAIN_CAP_S, LOGIC_TRAIN_OVERHEAD_S, bucket_count, logic_plan,
                            run_estimate, validate_logic_names)
from gpu_stage import Stage  # noqa: E402
from gpu_tests import TEST_STAGES, TESTS_SELFTEST_ESTIMATE_S, stage_tests  # noqa: E402

#: The time plan's names, read by tests/gpu/test_gpu_validate.py, come from the stage modules.
__all__ = ["main", "parse_args", "required_estimate", "deadline_s", "STAGES", "TIME_LIMIT_S",
           "STAGE_DEADLINE_S", "SMOKE_DEADLINE_S", "MAX_OUT_FILES", "MAX_FILE_MIB",
           "INSTALL_ESTIMATE_S", "ENV_ESTIMATE_S", "LOGIC_BUCKETS", "LOGIC_TRAIN_CAP_S",
           "LOGIC_TRAIN_OVERHEAD_S", "LOGIC_GENERATE_CALL_S", "LOGIC_ANALYSIS_ESTIMATE_S",
           "bucket_count", "logic_plan", "run_estimate", "cpvr_train_cap", "CPVR_GENERATE_ESTIMATE_S",
           "CPVR_TRAIN_OVERHEAD_S", "CPVR_MIN_TRAIN_S", "CPVR_EVALUATE_ESTIMATE_S", "CPVR_REPORT_ESTIMATE_S"]

STAGES = ("tests", "tests-compiled", "tests-train", "bench", "logic-sut", "logic-baselines", "cpvr")
USAGE = ("usage: scripts/gpu/validate.sh STAGE OUT [--smoke] [--time-limit S] [--max-files N] "
         "[--max-file-mib M] [--base-python P]\n"
         f"  STAGE: one of {', '.join(STAGES)}\n"
         "  OUT:   directory for summary.md, results.json, STAGE.log (created; must hold no "
         "other files)\n"
         "  --smoke: the same stage on the CPU with tiny sizes (--help: every option)")

#: The files a stage writes into OUT, besides summary.md, results.json and STAGE.log.
STAGE_FILES = {"logic-sut": ("fairseq-train.log", "table5.md", "table5.json", "figure4.png"),
               "logic-baselines": ("fairseq-train.log", "table5.md", "table5.json", "figure4.png"),
               "cpvr": ("fairseq-train.log", "hops.md", "accuracy.png", "depth.png")}
#: The options that take a value: name -> (NodeOptions field, type, least value).
OPTIONS = {"--time-limit": ("time_limit_s", int, DEADLINE_MARGIN_S + 1),
           "--max-files": ("max_files", int, None),
           "--max-file-mib": ("max_file_mib", int, 2),
           "--base-python": ("base_python", str, None)}


# --------------------------------------------------------------------------- time plan

def required_estimate(stage_name, install=True, environ=None):
    """Estimated seconds of a stage's required steps (with the install on a fresh node)."""
    total = (INSTALL_ESTIMATE_S if install else 0) + ENV_ESTIMATE_S
    if stage_name in TEST_STAGES:
        _, pytest_s, selftest = TEST_STAGES[stage_name]
        return total + pytest_s + (TESTS_SELFTEST_ESTIMATE_S if selftest else 0)
    if stage_name == "bench":
        return total + bench_required_estimate(environ)
    if stage_name == "cpvr":
        return (total + CPVR_GENERATE_ESTIMATE_S + CPVR_TRAIN_OVERHEAD_S + CPVR_MIN_TRAIN_S
                + CPVR_EVALUATE_ESTIMATE_S + CPVR_REPORT_ESTIMATE_S)
    plan = [r for r in logic_plan(stage_name, False, environ) if r[2]]
    total += LOGIC_GENERATE_ESTIMATE_S + LOGIC_SUMMARY_ESTIMATE_S
    total += sum(LOGIC_PREPARE_ESTIMATE_S.get(p, 30) for p in dict.fromkeys(p for _, p, _ in plan))
    return total + sum(run_estimate(m, p) for m, p, _ in plan)


# --------------------------------------------------------------------------- command line

def parse_args(argv):
    """(stage, OUT, smoke, NodeOptions) from the command line; UsageError when wrong."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        print(__doc__)
        raise SystemExit(0)
    options, positional, smoke = NodeOptions(), [], False
    items = list(argv)
    while items:
        arg = items.pop(0)
        name, _, inline = arg.partition("=")
        if arg == "--smoke":
            smoke = True
        elif name in OPTIONS:
            field, kind, least = OPTIONS[name]
            if not inline and not items:
                raise UsageError(f"{name} needs a value")
            text = inline or items.pop(0)
            try:
                value = kind(text)
            except ValueError:
                raise UsageError(f"{name} {text!r} is not a whole number") from None
            if least is not None and value < least:
                raise UsageError(f"{name} {value} is below {least}")
            setattr(options, field, value)
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise UsageError("expected STAGE and OUT")
    stage, out = positional
    if stage not in STAGES:
        raise UsageError(f"unknown STAGE {stage!r}")
    needed = 3 + len(STAGE_FILES.get(stage, ())) + 1  # and a temporary at any time
    if options.max_files < needed:
        raise UsageError(f"--max-files {options.max_files}: stage {stage} needs {needed} "
                         f"({needed - 1} files and a temporary)")
    return stage, out, smoke, options


def check_out(out, stage_name):
    """OUT is created; it may hold only files this script writes (a re-run into it)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"OUT {out} exists and is not a directory")
    os.makedirs(out, exist_ok=True)
    ours = {"summary.md", "results.json", f"{stage_name}.log"}
    ours.update(name for files in STAGE_FILES.values() for name in files)
    others = [n for n in os.listdir(out) if n not in ours]
    if others:
        raise UsageError(f"OUT {out} holds other files ({', '.join(sorted(others)[:4])}): use an empty directory")


# --------------------------------------------------------------------------- main

def run_stage(stage, name):
    """The install, the environment, then the stage's own steps."""
    python = ensure_package(stage)
    stage.python = python
    if python is None:
        stage.skip(name, "the package is not importable (see install)")
        return
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        name, out, smoke, options = parse_args(argv)
        # a bad SUT_GPU_DEADLINE_S is a usage error, before OUT is made
        deadline_s(smoke, options.time_limit_s)
        if name.startswith("logic"):
            validate_logic_names(logic_plan(name, smoke))
        if name == "bench":
            bench_plan(smoke)  # an unknown SUT_BENCH_STEPS key is a usage error
        check_out(out, name)
    except UsageError as err:
        print(f"validate.py: error: {err}\n{USAGE}", file=sys.stderr)
        return 2
    stage = Stage(name, out, smoke, options)
    if not smoke:
        stage.estimate = required_estimate(name)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: (stage.interrupt(signum), sys.exit(128 + signum)))
    stage.say(f"== stage {name}{' (--smoke: CPU, tiny sizes)' if smoke else ''}; OUT {stage.out}; "
              f"work {stage.work}; deadline {stage.deadline_s} s")
    stage.flush()
    try:
        run_stage(stage, name)
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
    if n_files > options.max_files:
        print(f"validate.py: error: {n_files} files in {stage.out} (more than {options.max_files})",
              file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
