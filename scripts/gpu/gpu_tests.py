"""The three test stages: ``tests`` runs ``pytest -m gpu tests/gpu/test_gpu.py`` (the Triton
kernels and the expert layers against the reference, incremental decoding, no host
syncs); ``tests-compiled`` runs ``pytest -m gpu tests/gpu/test_gpu_compiled.py`` (the compiled
recurrence: no host sync in a compiled step, CUDA graphs over the compiled loop equal to
eager); ``tests-train`` runs ``pytest -m gpu tests/gpu/test_gpu_train.py`` (fairseq-train of
sut_tiny in fp32, fp16 and bf16) and then ``python -m sut_fairseq.selftest``."""
import re

from gpu_common import last_matching, log_lines_of, step_env

#: tests stage: tests/gpu/test_gpu.py (Triton kernels and expert layers vs the reference,
#: incremental decoding, host syncs; Triton compiles and autotuning included). Measured on
#: an H100 node (2026-11-26): its 60 kernel and layer tests within 261 s, the 9 others 27 s.
TESTS_PYTEST_ESTIMATE_S = 300
#: tests-compiled stage: tests/gpu/test_gpu_compiled.py. The two compiled-step tests took 93 s
#: on an H200 (2026-11-27; inductor compiling sut_tiny's step graphs, forward and backward);
#: the CUDA-graph test compiles the loop of sut_tiny's 3 + 3 steps and records each graph
#: for two shapes, estimated at 100 s.
TESTS_COMPILED_ESTIMATE_S = 200
#: tests-train stage: tests/gpu/test_gpu_train.py (fairseq-train of sut_tiny in fp32, fp16,
#: bf16, each compiling the kernels afresh) then the selftest. Measured on an H100 node:
#: 34 + 65 + 58 + 8 s (plus 8 s building the data); the selftest 45 and 62 s on an H200,
#: more than 75 s on an H100 right after the kernel tests.
TESTS_TRAIN_ESTIMATE_S = 190
TESTS_SELFTEST_ESTIMATE_S = 90
#: The test stages: (test file, its pytest estimate, whether the selftest follows).
TEST_STAGES = {"tests": ("tests/gpu/test_gpu.py", TESTS_PYTEST_ESTIMATE_S, False),
               "tests-compiled": ("tests/gpu/test_gpu_compiled.py", TESTS_COMPILED_ESTIMATE_S, False),
               "tests-train": ("tests/gpu/test_gpu_train.py", TESTS_TRAIN_ESTIMATE_S, True)}

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

