"""scripts/gpu/validate.sh (staged GPU validation, docs/gpu.md) on the CPU: every stage with
``--smoke`` into a temporary OUT, plus the failures it must report (usage errors, a step
that fails, an install that cannot work) and the time plan of the GPU stages.

The smoke runs are subprocesses with one thread. The default run has the smokes of the
``tests``, ``bench`` and ``logic-sut`` stages; the ``logic-baselines`` smoke (the same
stage code with other models) and the ``cpvr`` smoke (minutes of process start-ups) are
``slow``: the ``cpvr`` stage's plan runs by default against a stand-in Python that writes
what the recipe would (``test_cpvr_stage_*``), and the recipe itself has its own smoke in
test_cpvr_recipe.py."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest


REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WRAPPER = os.path.join(REPO, "scripts", "gpu", "validate.sh")
SCRIPT = os.path.join(REPO, "scripts", "gpu", "validate.py")
#: variables of the caller that would change what a stage does
CLEARED = ("PYTEST_ADDOPTS", "SUT_LOGIC_MODELS", "SUT_LOGIC_PROTOCOLS", "SUT_LOGIC_TRAIN_ARGS",
           "SUT_GPU_WORK", "SUT_GPU_VENV", "SUT_GPU_FORCE_INSTALL", "SUT_BASE_PYTHON", "WHEELHOUSE",
           "TRITON_INTERPRET", "SUT_KERNELS", "NODE_HAS", "SUT_GPU_DEADLINE_S", "SUT_BENCH_STEPS")


def load_validate():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_stage(*args, timeout=400, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    # the driver and the steps run with this interpreter (the venv that has fairseq)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", VALIDATE_PYTHON=sys.executable,
               PYTHON=sys.executable)
    env.update(env_extra)
    return subprocess.run(["sh", WRAPPER, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def step_rows(summary):
    """{step name: status} from summary.md's steps table."""
    rows = {}
    for line in summary.splitlines():
        m = re.match(r"^\| \d+ \| (.+?) \| (PASSED|FAILED|SKIPPED) \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def check_passed(proc, out, stage, expected_steps):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = sorted(os.listdir(out))
    assert len(files) <= 8, files
    assert not [f for f in files if f.startswith(".") or f.endswith(".tmp")], files  # no temporaries
    assert {"summary.md", "results.json", f"{stage}.log"} <= set(files), files
    summary = (out / "summary.md").read_text()
    assert f"stage `{stage}`" in summary and "**PASSED**" in summary
    rows = step_rows(summary)
    assert list(rows) == expected_steps, rows
    assert set(rows.values()) == {"PASSED"}, rows
    results = json.loads((out / "results.json").read_text())
    assert results["stage"] == stage and results["smoke"] is True
    assert results["status"] == "PASSED" and results["exit_status"] == 0
    assert [s["name"] for s in results["steps"]] == expected_steps
    assert all(s["status"] == "PASSED" and s["seconds"] >= 0 for s in results["steps"])
    assert results["install"]["status"] == "skipped"  # importable here: nothing installed
    assert results["environment"]["torch"] and results["environment"]["fairseq"]
    log = (out / f"{stage}.log").read_text()
    for step in results["steps"]:  # every command printed before its output
        assert "+ " + step["command"] in log
        assert "+ " + step["command"] in proc.stdout
    return summary, results


# --------------------------------------------------------------------------- errors

def test_usage_errors_exit_2(tmp_path):
    proc = run_stage("nonsense", tmp_path / "out", "--smoke")
    assert proc.returncode == 2 and "unknown STAGE 'nonsense'" in proc.stderr
    assert "usage: scripts/gpu/validate.sh STAGE OUT [--smoke]" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert run_stage("bench").returncode == 2
    assert run_stage("bench", tmp_path / "o", "--fast").returncode == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "other.txt").write_text("x")
    proc = run_stage("bench", tmp_path / "full", "--smoke")
    assert proc.returncode == 2 and "holds other files" in proc.stderr
    proc = run_stage("logic-sut", tmp_path / "o", "--smoke", SUT_LOGIC_MODELS="lstm")
    assert proc.returncode == 2 and "unknown model 'lstm'" in proc.stderr
    proc = run_stage("bench", tmp_path / "o", "--smoke", SUT_BENCH_STEPS="train generation")
    assert proc.returncode == 2 and "SUT_BENCH_STEPS: unknown step 'generation'" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_failing_step_is_reported_and_the_next_still_runs(tmp_path):
    """The tests-train stage (its smoke run): pytest of tests/gpu/test_gpu_train.py refuses an
    unknown option from PYTEST_ADDOPTS, so the pytest step fails; the selftest after it
    still runs and passes; the stage fails. (The passing pytest step of a smoke run, every
    test skipped, is test_smoke_tests_stage's.)"""
    out = tmp_path / "out"
    proc = run_stage("tests-train", out, "--smoke", PYTEST_ADDOPTS="--no-such-option")
    assert proc.returncode == 1, proc.stdout[-3000:]
    summary = (out / "summary.md").read_text()
    assert "**FAILED**" in summary and "failed or not run: pytest -m gpu" in summary
    assert "pytest -m gpu tests/gpu/test_gpu_train.py:" in summary
    assert "result      : PASS" in "\n".join(json.loads((out / "results.json").read_text())["results"]["selftest"]["tail"])
    assert step_rows(summary) == {"environment": "PASSED", "pytest -m gpu": "FAILED", "selftest": "PASSED"}
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "FAILED" and results["exit_status"] == 1
    failed = [s for s in results["steps"] if s["status"] == "FAILED"]
    assert [s["name"] for s in failed] == ["pytest -m gpu"] and failed[0]["reason"] == "exit status 4"
    assert "--no-such-option" in (out / "tests-train.log").read_text()  # pytest's own complaint, logged


def test_an_install_that_cannot_work_is_reported(tmp_path):
    """SUT_GPU_FORCE_INSTALL=1: the venv over this Python (a venv itself: its packages come
    through a .pth file), then make install-offline with a WHEELHOUSE that does not exist."""
    out, venv = tmp_path / "out", tmp_path / "venv"
    proc = run_stage("bench", out, "--smoke", SUT_GPU_FORCE_INSTALL="1", SUT_BASE_PYTHON=sys.executable,
                     SUT_GPU_VENV=str(venv), WHEELHOUSE=str(tmp_path / "no-wheelhouse"),
                     NODE_HAS="$(CUDA_IMAGE_HAS)", timeout=200)
    assert proc.returncode == 1, proc.stdout[-3000:]
    summary = (out / "summary.md").read_text()
    assert f"install-offline WHEELHOUSE={tmp_path / 'no-wheelhouse'} PY={venv / 'bin' / 'python'} " \
           "'NODE_HAS=$(CUDA_IMAGE_HAS)'`" in summary
    rows = step_rows(summary)
    assert rows == {"install: venv": "PASSED", "install: make install-offline": "FAILED", "bench": "SKIPPED"}
    assert "is not a directory" in (out / "bench.log").read_text()
    results = json.loads((out / "results.json").read_text())
    assert results["install"]["status"] == "FAILED" and results["install"]["needed"] is True
    # torch importable in the new venv (directly, or through the .pth file)
    check = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True)
    assert check.returncode == 0, check.stderr


def test_a_python_that_cannot_import_the_package_fails_the_install(tmp_path):
    out = tmp_path / "out"
    proc = run_stage("logic-sut", out, "--smoke", PYTHON=str(tmp_path / "no-python"))
    assert proc.returncode == 1
    summary = (out / "summary.md").read_text()
    assert step_rows(summary) == {"install": "FAILED", "logic-sut": "SKIPPED"}
    assert "cannot `import fairseq, sut_fairseq`" in summary
    assert json.loads((out / "results.json").read_text())["status"] == "FAILED"


# --------------------------------------------------------------------------- the time plan

def test_lower_deadline_chains_stages(monkeypatch, tmp_path):
    """SUT_GPU_DEADLINE_S lowers a stage's deadline (to chain two stages in one device call);
    a value that is not a whole number of seconds within the default is a usage error."""
    v = load_validate()
    monkeypatch.delenv("SUT_GPU_DEADLINE_S", raising=False)
    assert v.deadline_s(False) == v.STAGE_DEADLINE_S and v.deadline_s(True) == v.SMOKE_DEADLINE_S
    monkeypatch.setenv("SUT_GPU_DEADLINE_S", "200")
    assert v.deadline_s(False) == 200
    for bad in ("0", "-5", str(v.STAGE_DEADLINE_S + 1), "soon"):
        proc = run_stage("bench", tmp_path / "out", SUT_GPU_DEADLINE_S=bad)
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
        assert f"SUT_GPU_DEADLINE_S='{bad}'" in proc.stderr and f"1..{v.STAGE_DEADLINE_S}" in proc.stderr
        assert not (tmp_path / "out").exists()


def test_failures_print_at_once(tmp_path):
    """SUT_TEST_FAILURES_AT_ONCE=1 (set by the tests stage): a failing test's traceback is
    printed before the tests after it run, so a run killed at a time limit still shows it."""
    import shutil

    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_two.py").write_text(
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic is off'\n\n"
        "def test_after():\n    print('SECOND TEST RUNS')\n")
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env["SUT_TEST_FAILURES_AT_ONCE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_two.py"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    out = proc.stdout
    assert "FAILED test_two.py::test_fails (call)" in out, out
    assert out.index("arithmetic is off") < out.index("SECOND TEST RUNS"), out


def test_gpu_time_plan_fits_the_stage_deadline():
    v = load_validate()
    assert v.STAGE_DEADLINE_S <= 9 * 60
    for stage in v.STAGES:  # a fresh node: install included
        assert v.required_estimate(stage) <= v.STAGE_DEADLINE_S, stage
    assert v.logic_plan("logic-sut", False, {}) == [("sut", "standard", True), ("sut", "A", False)]
    baselines = v.logic_plan("logic-baselines", False, {})
    assert [(m, p) for m, p, r in baselines if r] == [("transformer", "standard"), ("ut-halting", "standard")]
    assert {m for m, _, _ in baselines} == {"transformer", "ut-halting", "ut-no-halting"}
    # the same training cap for every model; a standard run evaluates buckets 7 and 12
    assert v.run_estimate("transformer", "A") == v.run_estimate("sut", "A")
    assert v.LOGIC_BUCKETS == "7,12"
    assert v.run_estimate("sut", "standard") == (v.LOGIC_TRAIN_OVERHEAD_S + v.LOGIC_TRAIN_CAP_S
                                                 + 2 * v.LOGIC_GENERATE_CALL_S + v.LOGIC_ANALYSIS_ESTIMATE_S)
    assert [v.bucket_count(b) for b in ("all", "7..12", "7,12", "0,3..5", "12")] == [13, 6, 2, 4, 1]
    # explicit choices: every run they name is required
    plan = v.logic_plan("logic-baselines", False, {"SUT_LOGIC_PROTOCOLS": "A"})
    assert plan == [("transformer", "A", True), ("ut-halting", "A", True), ("ut-no-halting", "A", True)]
    plan = v.logic_plan("logic-baselines", False, {"SUT_LOGIC_MODELS": "transformer", "SUT_LOGIC_PROTOCOLS": "A"})
    assert plan == [("transformer", "A", True)]
    assert v.logic_plan("logic-baselines", True, {}) == [r for r in baselines if r[2]]


def test_bench_plan_runs_everything_on_a_warm_node_and_the_rest_in_a_second_call():
    """bench: moe_gpu.py and the 4,096-token train_step.py always run (they fit after a fresh
    install); the 16,384-token train_step.py and generate_throughput.py start when their
    estimates fit, which on a warm node (no install) they all do; SUT_BENCH_STEPS runs the
    steps it names, every one required."""
    v = load_validate()
    import gpu_bench as b   # beside validate.py, on the path load_validate() set

    assert b.bench_plan(False, {}) == [("moe", True), ("train", True), ("train-16k", False),
                                       ("generate", False)]
    assert all(required for _, required in b.bench_plan(True, {}))   # --smoke: every step
    estimates = {k: e for k, (_, e, _) in b.BENCH_STEPS.items() if k not in b.NAMED_ONLY}
    assert v.required_estimate("bench", environ={}) == (v.INSTALL_ESTIMATE_S + v.ENV_ESTIMATE_S
                                                         + estimates["moe"] + estimates["train"])
    warm = v.required_estimate("bench", install=False, environ={"SUT_BENCH_STEPS": " ".join(estimates)})
    assert warm == v.ENV_ESTIMATE_S + sum(estimates.values()) <= v.STAGE_DEADLINE_S
    rest = {"SUT_BENCH_STEPS": "generate,train-16k"}
    assert b.bench_plan(False, rest) == [("train-16k", True), ("generate", True)]
    assert v.required_estimate("bench", environ=rest) <= v.STAGE_DEADLINE_S   # even after an install
    with pytest.raises(v.UsageError, match="unknown step 'x'"):
        b.bench_plan(False, {"SUT_BENCH_STEPS": "moe x"})


def test_train_step_parser_keeps_eager_and_compiled_profiles_apart():
    """train_step.py --profile with --compile prints a compiled model's profile as
    ``== profile compiled ARCH: ...``: its own row, beside the eager one of the same model."""
    load_validate()
    import gpu_bench as b

    r = b.parse_train_step([
        "== profile sut_base: 299.0 ms wall under the profiler, 5844 kernel launches, "
        "19047 aten operator calls, device busy 79.0 ms (26%)",
        "== profile compiled sut_base: 179.4 ms wall under the profiler, 3558 kernel launches, "
        "6825 aten operator calls, device busy 68.4 ms (38%)",
        "== profile transformer_wmt_en_de: 53.5 ms wall under the profiler, 996 kernel launches, "
        "5799 aten operator calls"])
    assert r["profiles"] == {
        "sut_base": {"wall_ms": 299.0, "launches": 5844, "aten_calls": 19047, "device_busy_ms": 79.0},
        "compiled sut_base": {"wall_ms": 179.4, "launches": 3558, "aten_calls": 6825, "device_busy_ms": 68.4},
        "transformer_wmt_en_de": {"wall_ms": 53.5, "launches": 996, "aten_calls": 5799, "device_busy_ms": None}}
    assert b.GPU_TRAIN_STEP_ARGS[-3:] == ["--compile", "sut_base", "transformer_wmt_en_de"]


@pytest.mark.parametrize("key", ["train-loop", "train-graphs"])
def test_the_compiled_loop_steps_run_only_when_named(key):
    """SUT_BENCH_STEPS=train-loop: the --compile-loop step (sut_base+loop against the
    transformer); train-graphs: the same loop and the transformer, both as CUDA graphs.
    Never part of the default plan, whose estimates they would not fit."""
    load_validate()
    import gpu_bench as b

    assert all(k != key for k, _ in b.bench_plan(False, {}))
    assert all(k != key for k, _ in b.bench_plan(True, {}))
    assert b.bench_plan(False, {"SUT_BENCH_STEPS": key}) == [(key, True)]
    assert "sut_base+loop" in b.GPU_TRAIN_LOOP_ARGS and "--compile" in b.GPU_TRAIN_LOOP_ARGS
    assert b.GPU_TRAIN_GRAPHS_ARGS[-4:] == ["--arch", "sut_base+loop+graphs",
                                            "transformer_wmt_en_de+graphs", "--compile"]


def test_smoke_bench_stage_runs_the_named_loop_steps(tmp_path):
    """SUT_BENCH_STEPS="train-loop train-graphs" on the smoke sizes: both steps run
    train_step.py with their suffixed models (eager: the models themselves), parse their
    rows into results.json and give each its table in the summary."""
    out = tmp_path / "out"
    proc = run_stage("bench", out, "--smoke", SUT_BENCH_STEPS="train-loop train-graphs")
    summary, results = check_passed(proc, out, "bench", ["environment", "train_step.py --compile-loop",
                                                         "train_step.py CUDA graphs"])
    assert set(results["results"]["train_step_loop"]["models"]) == {"sut_base+loop", "transformer_wmt_en_de"}
    graphs = results["results"]["train_step_graphs"]["models"]
    assert set(graphs) == {"sut_base+loop+graphs", "transformer_wmt_en_de+graphs"}
    assert "One training step, CUDA graphs over the compiled loop" in summary
    assert "| sut_base+loop+graphs |" in summary


# --------------------------------------------------------------------------- smoke runs

@pytest.mark.parametrize("stage,test_file", [("tests", "gpu/test_gpu.py"), ("tests-compiled", "gpu/test_gpu_compiled.py")])
def test_smoke_tests_stage(tmp_path, stage, test_file):
    out = tmp_path / "out"
    proc = run_stage(stage, out, "--smoke")
    summary, results = check_passed(proc, out, stage, ["environment", "pytest -m gpu"])
    counts = results["results"]["pytest"]["counts"]
    assert counts.get("skipped", 0) > 0 and not counts.get("failed") and not counts.get("passed")
    assert f"pytest -m gpu tests/{test_file}:" in summary
    assert "every test skipped: no CUDA device" in summary  # recorded, not hidden
    assert "selftest" not in results["results"]


@pytest.mark.slow  # 45 s: every benchmark of the bench stage on its smoke sizes; the stage's runner and
# parsing run by default in test_smoke_bench_stage_runs_the_named_loop_steps
def test_smoke_bench_stage(tmp_path):
    out = tmp_path / "out"
    proc = run_stage("bench", out, "--smoke")
    summary, results = check_passed(proc, out, "bench", ["environment", "moe_gpu.py", "train_step.py",
                                                         "train_step.py large batch", "generate_throughput.py"])
    assert "TRITON_INTERPRET=1 " in proc.stdout  # the interpreter, as the command shows
    rows = results["results"]["moe_gpu"]["rows"]
    assert {(r["tokens"], r["pass"]) for r in rows} == {(32, "fwd"), (32, "fwd+bwd")}
    assert all(r["grouped_ms"] > 0 and r["grouped_tflops"] >= 0 for r in rows)  # PyTorch's grouped GEMM
    wgrad = results["results"]["moe_gpu"]["wgrad_steps"]  # the shared weight gradient, deferred
    assert [(r["steps"], r["tokens"]) for r in wgrad] == [(6, 32)]
    assert all(r["per_step_ms"] > 0 and r["deferred_ms"] > 0 for r in wgrad)
    assert "| 6 | 32 |" in summary
    models = results["results"]["train_step"]["models"]
    assert set(models) == {"sut_base", "ut_base", "transformer_wmt_en_de"}
    assert all(m["tokens_per_s"] >= 0 and m["ms_per_step"] > 0 for m in models.values())
    assert "sut_base / ut_base" in results["results"]["train_step"]["ratios"]
    assert "| transformer_wmt_en_de |" in summary
    profiles = results["results"]["train_step"]["profiles"]   # --profile: the CPU's counts
    assert set(profiles) == set(models) and all(p["aten_calls"] > 0 for p in profiles.values())
    assert profiles["sut_base"]["launches"] == 0 and profiles["sut_base"]["device_busy_ms"] is None
    assert re.search(r"^\| sut_base \| [\d.]+ \| 0 \| \d+ \|  \| \|$", summary, re.M), summary
    large = results["results"]["train_step_16k"]   # the second batch: 4x the tokens of the first
    assert "batch 8 x 4 = 32 target tokens" in large["header"] and set(large["models"]) == set(models)
    assert not large["profiles"]
    generated = results["results"]["generate"]   # beam search: both models, one pass each (no --compile)
    assert "6 sentences" in generated["header"] and "beam 2" in generated["header"]
    assert set(generated["models"]) == {"sut_base", "transformer_wmt_en_de"} and not generated["compiled"]
    assert all(m["sentences_per_s"] > 0 and m["tokens_per_s"] > 0 and m["ms_per_decoder_step"] > 0
               and m["full_length"] is True for m in generated["models"].values())
    assert generated["ratios"]["sut_base / transformer_wmt_en_de"] > 0
    assert re.search(r"^\| sut_base \| [\d.]+ \| [\d.]+ \| [\d.]+ \|  \| yes \|  \|$", summary, re.M), summary
    assert [(s["step"], s["required"]) for s in results["budget"]["steps"]][-1] == ("generate_throughput.py", True)


def check_logic(proc, out, stage, runs):
    steps = (["environment", "logic data: generate"]
             + [f"logic data: prepare {p}" for p in dict.fromkeys(p for _, p in runs)]
             + [f"logic: {m} / {p}" for m, p in runs] + ["logic: Table 5 and Figure 4"])
    summary, results = check_passed(proc, out, stage, steps)
    assert {"fairseq-train.log", "table5.md", "table5.json"} <= set(os.listdir(out))
    got = {(r["model"], r["protocol"]): r for r in results["results"]["runs"]}
    assert list(got) == runs
    for (model, protocol), run in got.items():
        assert run["status"] == "PASSED" and run["updates"] == 3 and run["params"] > 0
        assert set(run["accuracy"]) == ({"0", "12"} if protocol == "standard" else {protocol})
    table = json.loads((out / "table5.json").read_text())
    assert set(table["rows"]) == {m for m, _ in runs}
    train_log = (out / "fairseq-train.log").read_text()
    assert all(f"######## {m} / {p}:" in train_log for m, p in runs)
    assert "## Time budget" in summary and "Figure 4" in summary
    return summary, results


@pytest.mark.slow  # 30 s: the logic recipe's own smoke (tests/recipes/test_logic_recipe.py) runs by default
@pytest.mark.parametrize("protocols", [
    "standard",
    # split A is optional in the GPU plan (smoke runs only required runs): named, it is
    # required (the plan itself: test_logic_plan_*)
    "standard A"])
def test_smoke_logic_sut_stage(tmp_path, protocols):
    out = tmp_path / "out"
    proc = run_stage("logic-sut", out, "--smoke", timeout=600, SUT_LOGIC_PROTOCOLS=protocols)
    summary, results = check_logic(proc, out, "logic-sut", [("sut", p) for p in protocols.split()])
    depth = results["results"]["figure4_halting_depth"]["sut"]
    assert set(depth) == {"0", "12"}
    assert (out / "figure4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "--stop-time-hours 0.05" in summary and "--max-update 3" in summary


@pytest.mark.slow  # the same stage code as logic-sut's smoke (gpu_logic.py) with other models
def test_smoke_logic_baselines_stage(tmp_path):
    out = tmp_path / "out"
    proc = run_stage("logic-baselines", out, "--smoke", timeout=600)
    check_logic(proc, out, "logic-baselines", [("transformer", "standard"), ("ut-halting", "standard")])
    assert (out / "figure4.png").exists()  # ut-halting has halting


def test_cpvr_time_plan_leaves_training_time_on_a_fresh_node():
    v = load_validate()
    assert "cpvr" in v.STAGES
    after_data = v.STAGE_DEADLINE_S - v.INSTALL_ESTIMATE_S - v.ENV_ESTIMATE_S - v.CPVR_GENERATE_ESTIMATE_S
    assert v.cpvr_train_cap(after_data) >= v.CPVR_MIN_TRAIN_S
    assert v.cpvr_train_cap(after_data) == (after_data - v.CPVR_TRAIN_OVERHEAD_S
                                            - v.CPVR_EVALUATE_ESTIMATE_S - v.CPVR_REPORT_ESTIMATE_S)


#: A stand-in for the stage's Python: writes what data-prep/cpvr/generate.py, hops.py
#: (train / evaluate, one model) and summarize.py would, and records every call.
FAKE_CPVR_PYTHON = r"""#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\n")
def value(name):
    return args[args.index(name) + 1]
script = os.path.basename(args[0])
if script == "generate.py":
    if os.environ.get("FAKE_DATA_FAILS"):
        sys.exit("generate.py: failed")
    out = value("--out")
    os.makedirs(os.path.join(out, "bin"), exist_ok=True)
    for name in ("stats.json", "baselines.json", os.path.join("bin", "dict.src.txt")):
        open(os.path.join(out, name), "w").write("{{}}")
elif script == "hops.py":
    run = os.path.join(value("--work-dir"), value("--models"), "seed1")
    os.makedirs(run, exist_ok=True)
    updates = int(value("--max-update")) if "--max-update" in args else 0
    if value("--stage") == "train":
        open(os.path.join(run, "train.log"), "w").write("| ups 2.5 | train_wall 7 |\n")
        json.dump({{"updates": updates, "params": 1234}}, open(os.path.join(run, "train.json"), "w"))
    else:
        train = json.load(open(os.path.join(run, "train.json")))
        json.dump(dict(train, accuracy={{"1": 0.5, "9": 0.25}}, encoder_depth={{"1": 1.0, "9": 2.0}}),
                  open(os.path.join(run, "result.json"), "w"))
elif script == "summarize.py":
    work = args[1]
    open(os.path.join(work, "hops.md"), "w").write("| hops |\n")
    json.dump({{"models": ["ut"]}}, open(os.path.join(work, "hops.json"), "w"))
    for name in ("accuracy.png", "depth.png"):
        open(os.path.join(work, name), "wb").write(b"\x89PNG")
else:
    sys.exit("unexpected call: " + " ".join(args))
"""


def run_cpvr_stage(tmp_path, monkeypatch, smoke=True, **env):
    """gpu_cpvr.stage_cpvr in this process with the stand-in Python; (stage, calls)."""
    monkeypatch.syspath_prepend(os.path.dirname(SCRIPT))
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)
    tmp_path.mkdir(parents=True, exist_ok=True)
    python = tmp_path / "python"
    python.write_text(FAKE_CPVR_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    calls.write_text("")
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.setenv("SUT_GPU_WORK", str(tmp_path / "work"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from gpu_cpvr import stage_cpvr
    from gpu_stage import Stage
    stage = Stage("cpvr", str(tmp_path / "out"), smoke)
    os.makedirs(stage.out, exist_ok=True)
    stage_cpvr(stage, str(python))
    return stage, [json.loads(line) for line in calls.read_text().splitlines()]


def test_cpvr_stage_plans_side_by_side_runs_and_continues_them_in_a_second_call(tmp_path, monkeypatch):
    stage, calls = run_cpvr_stage(tmp_path, monkeypatch)
    steps = {s["name"]: s for s in stage.steps}
    assert list(steps) == ["cpvr data: generate", "cpvr: train", "cpvr: evaluate", "cpvr: report"]
    assert {s["status"] for s in stage.steps} == {"PASSED"}, stage.steps
    # the three models side by side: one process per model, each with the same arguments
    trains = [c for c in calls if c[0].endswith("hops.py") and "train" in c]
    assert sorted(c[-1] for c in trains) == ["hyper-ut", "sut", "ut"]
    assert all(c[:-2] == trains[0][:-2] for c in trains)
    train = trains[0]
    assert train[train.index("--max-update") + 1] == "3" and train[train.index("--hops") + 1] == "1,9"
    assert "--cpu" in train and train[train.index("--config") + 1] == "gpu"
    assert steps["cpvr: train"]["argv"][:2] == ["bash", "-c"] and steps["cpvr: train"]["argv"][-4:] == [
        "--", "ut", "sut", "hyper-ut"]
    runs = stage.results["runs"]
    assert list(runs) == ["ut", "sut", "hyper-ut"]
    assert all(r["status"] == "evaluated" and r["updates"] == 3 and r["params"] == 1234
               and r["accuracy"] == {"1": 0.5, "9": 0.25} and r["updates_per_s"] == 2.5 for r in runs.values())
    assert stage.results["hops"] == {"models": ["ut"]}
    assert stage.budget["call"] == 1 and stage.budget["max_update"] == 3
    assert {"accuracy.png", "depth.png", "hops.md", "summary.md", "results.json"} <= set(os.listdir(stage.out))
    assert "######## sut / C-PVR:" in open(stage.extra_logs["fairseq-train.log"]).read()
    # a second call on the same machine: the data reused, the runs trained on (3 more updates)
    stage, calls = run_cpvr_stage(tmp_path, monkeypatch)
    assert [s["name"] for s in stage.steps] == ["cpvr: train", "cpvr: evaluate", "cpvr: report"]
    assert not [c for c in calls if c[0].endswith("generate.py")]
    assert stage.budget["call"] == 2 and stage.budget["max_update"] == 6
    assert stage.budget["granted_train_s"] > stage.budget["train_cap_s"]
    assert all(r["updates"] == 6 for r in stage.results["runs"].values())


def test_cpvr_stage_skips_what_cannot_run(tmp_path, monkeypatch):
    # no data: nothing is trained, evaluated or reported, and the summary says why
    stage, calls = run_cpvr_stage(tmp_path / "a", monkeypatch, FAKE_DATA_FAILS="1")
    status = {s["name"]: (s["status"], s["reason"]) for s in stage.steps}
    assert status["cpvr data: generate"][0] == "FAILED"
    assert status["cpvr: train"] == ("SKIPPED", "no data")
    assert status["cpvr: evaluate"] == ("SKIPPED", "no model was trained")
    assert status["cpvr: report"] == ("SKIPPED", "no model was evaluated")
    assert {r["status"] for r in stage.results["runs"].values()} == {"not trained"}
    # on the GPU (no --smoke) with too little time left to train: training is not started
    stage, calls = run_cpvr_stage(tmp_path / "b", monkeypatch, smoke=False, SUT_GPU_DEADLINE_S="200",
                                  FAKE_DATA_FAILS="")
    status = {s["name"]: (s["status"], s["reason"]) for s in stage.steps}
    assert status["cpvr: train"][0] == "SKIPPED" and "less than 120 s" in status["cpvr: train"][1]
    assert not [c for c in calls if c[0].endswith("hops.py")]


def check_cpvr(proc, out, updates, generated=True):
    steps = (["environment"] + (["cpvr data: generate"] if generated else [])
             + ["cpvr: train", "cpvr: evaluate", "cpvr: report"])
    summary, results = check_passed(proc, out, "cpvr", steps)
    assert {"fairseq-train.log", "hops.md", "accuracy.png", "depth.png"} <= set(os.listdir(out))
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = results["results"]["runs"]
    assert list(runs) == ["ut", "sut", "hyper-ut"]
    for model, run in runs.items():
        assert run["status"] == "evaluated" and run["updates"] == updates and run["params"] > 0, model
        assert set(run["accuracy"]) == {"1", "9"} and set(run["encoder_depth"]) == {"1", "9"}
        assert set(run["decoder_depth"]) == {"1", "9"}
    assert set(results["results"]["hops"]["models"]) == {"ut", "sut", "hyper-ut"}
    assert "| Hyper-UT | decoder |" in (out / "hops.md").read_text()
    train_log = (out / "fairseq-train.log").read_text()
    assert all(f"######## {m} / C-PVR:" in train_log for m in runs)
    # the three models side by side, in one command each for training and evaluation
    train = next(s for s in results["steps"] if s["name"] == "cpvr: train")
    assert train["command"].startswith("bash -c ") and train["command"].endswith(" -- ut sut hyper-ut")
    assert "--config gpu" in train["command"]
    assert "## Time budget" in summary and "Spearman" in summary
    return summary, results


@pytest.mark.slow  # ~2 CPU-minutes of process start-ups; the recipe's own smoke is in test_cpvr_recipe.py,
# the stage's plan in test_cpvr_stage_plans_side_by_side_runs_and_skips_what_cannot_run
def test_smoke_cpvr_stage(tmp_path):
    out = tmp_path / "out"
    proc = run_stage("cpvr", out, "--smoke", timeout=600)
    summary, results = check_cpvr(proc, out, updates=3)
    assert results["budget"]["call"] == 1
    assert "--max-update 3" in summary


@pytest.mark.slow
def test_smoke_cpvr_stage_continues_the_runs_of_an_earlier_call(tmp_path):
    work = tmp_path / "work"
    first = run_stage("cpvr", tmp_path / "one", "--smoke", timeout=600, SUT_GPU_WORK=str(work))
    check_cpvr(first, tmp_path / "one", updates=3)
    second = run_stage("cpvr", tmp_path / "two", "--smoke", timeout=600, SUT_GPU_WORK=str(work))
    summary, results = check_cpvr(second, tmp_path / "two", updates=6, generated=False)
    assert results["budget"]["call"] == 2
    assert results["budget"]["granted_train_s"] > results["budget"]["train_cap_s"]
    assert "continuing the runs of 1 earlier call(s)" in second.stdout


def test_the_model_step_puts_its_prediction_beside_the_profiles():
    """SUT_BENCH_STEPS=model: gpu_model.py in each mode after a marker line; the parsed
    predictions go beside the profiled steps of the same call (eager and --compile-step
    from train_step.py's profiles, --compile-loop from the train-loop step's), an empty
    cell where the call did not profile that step. Only when named."""
    load_validate()
    import gpu_bench as b

    assert b.bench_plan(False, {"SUT_BENCH_STEPS": "model train"}) == [("train", True), ("model", True)]
    assert all(k != "model" for k, _ in b.bench_plan(False, {}))
    command = b.model_command("py", False)
    assert command.count("benchmarks/gpu_model.py --arch sut_base transformer_wmt_en_de --device $device") == 3
    assert "--compile-step" in command and "--compile-loop" in command and "--batch" not in command
    assert "--measured-kernels" not in command   # without a log of the call's profiles
    measured = b.model_command("py", False, "/out dir/bench.log")
    assert measured.count("--measured-kernels '/out dir/bench.log'") == 3
    lines = ["== gpu model mode eager",
             "gpu model of one training step on H100 SXM: batch 128 x 32 = 4096 target tokens, bfloat16, eager",
             "gpu model: sut_base launches 3594 device_ms 29.8 misaligned_gemms 0",
             "gpu model: transformer_wmt_en_de launches 1120 device_ms 11.3 misaligned_gemms 0",
             "== gpu model mode compile-step",
             "gpu model: sut_base launches 1787 device_ms 18.9 misaligned_gemms 0",
             "gpu model: transformer_wmt_en_de launches 684 device_ms 9.1 misaligned_gemms 0",
             "== gpu model mode compile-loop",
             "gpu model: refit routed_gemm 0.41 (was 0.235) from _routed_gemm 120 launches 1.788 ms "
             "(profile 'compiled sut_base')",
             "gpu model: measured _routed_wgrad: 10 launches in the profile 'compiled sut_base' "
             "against 60 in the modelled step: routed_wgrad not refit",
             "gpu model: sut_base launches 1366 device_ms 16.7 misaligned_gemms 0",
             "gpu model: transformer_wmt_en_de launches 684 device_ms 9.1 misaligned_gemms 0"]
    model = b.parse_model(lines)
    assert model["device"].startswith("gpu model of one training step on H100 SXM")
    assert model["modes"]["compile-loop"]["sut_base"] == {"launches": 1366, "device_ms": 16.7,
                                                          "misaligned_gemms": 0}
    train = b.parse_train_step([
        "== profile sut_base: 299.0 ms wall under the profiler, 5844 kernel launches, "
        "19047 aten operator calls, device busy 39.5 ms (13%)",
        "== profile compiled sut_base: 179.4 ms wall under the profiler, 3558 kernel launches, "
        "6825 aten operator calls, device busy 34.2 ms (19%)"])
    table = "\n".join(b.model_table(model, {"train": train}))
    assert "| eager | sut_base | 3594 | 5844 | 29.8 | 39.5 |" in table
    assert "| compile-step | sut_base | 1787 | 3558 | 18.9 | 34.2 |" in table
    assert "| eager | transformer_wmt_en_de | 1120 |  | 11.3 |  |" in table   # not profiled here
    assert "| compile-loop | sut_base | 1366 |  | 16.7 |  |" in table       # no train-loop step
    assert model["refits"] == {"compile-loop": [lines[8][len("gpu model: "):], lines[9][len("gpu model: "):]]}
    assert ("* compile-loop: refit routed_gemm 0.41 (was 0.235) from _routed_gemm 120 launches "
            "1.788 ms (profile 'compiled sut_base')") in table


@pytest.mark.slow  # about 35 s: gpu_model.py three times on the smoke sizes
def test_smoke_bench_stage_runs_the_model_step(tmp_path):
    out = tmp_path / "out"
    proc = run_stage("bench", out, "--smoke", SUT_BENCH_STEPS="model")
    summary, results = check_passed(proc, out, "bench", ["environment", "gpu_model.py"])
    modes = results["results"]["gpu_model"]["modes"]
    assert set(modes) == {"eager", "compile-step", "compile-loop"}
    assert all(set(m) == {"sut_base", "transformer_wmt_en_de"} for m in modes.values())
    assert "The CPU model of the GPU step" in summary and "| compile-loop | sut_base |" in summary
