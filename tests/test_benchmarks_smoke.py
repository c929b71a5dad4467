"""The CPU benchmark scripts run end to end (tiny sizes) and print the lines the docs quote."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_train_step_prints_tokens_per_second_and_both_ratios():
    out = run("train_step.py", "--batch", "2", "--len", "4", "--vocab", "64", "--repeats", "1",
              "--arch", "sut_base", "ut_base", "transformer_wmt_en_de",
              "transformer_wmt_en_de+fused-ce", "--profile", "3")
    for arch in ("sut_base", "ut_base", "transformer_wmt_en_de"):
        assert re.search(rf"^{arch}\s+\d+ ms/step\s+\d+ tokens/s$", out, re.M), out
    assert re.search(r"^sut_base / ut_base tokens/s: \d+\.\d\d \(goal >= 2\.0\)$", out, re.M), out
    assert re.search(r"^sut_base / transformer_wmt_en_de tokens/s: \d+\.\d\d \(goal >= 0\.6\)$",
                     out, re.M), out
    assert re.search(r"^sut_base / transformer_wmt_en_de\+fused-ce tokens/s: \d+\.\d\d$", out, re.M), out
    # --profile: one profiled step per model, its counts, then its 3 most expensive operations
    for arch in ("sut_base", "ut_base", "transformer_wmt_en_de"):
        m = re.search(rf"^== profile {re.escape(arch)}: \d+\.\d ms wall under the profiler, 0 kernel launches, "
                      r"(\d+) aten operator calls\n(.*?)\nSelf CPU time total", out, re.M | re.S)
        assert m and int(m.group(1)) > 0, out
        assert len(re.findall(r"^\s+aten::\S+\s+\d", m.group(2), re.M)) >= 1, m.group(2)


def test_train_step_logic_prints_the_ratio_and_its_mac_bound():
    out = run("train_step.py", "--preset", "logic", "--logic-tokens", "120", "--repeats", "1",
              "--threads", "1")
    assert re.search(r"^MACs of one forward on this batch: sut_logic \d+\.\d\d G \(dynamic\), "
                     r"transformer \d+\.\d\d G$", out, re.M), out
    full = re.search(r"^with all 12 encoder steps run \(as in training\): sut_logic (\d+\.\d\d) G, "
                     r"R at the transformer's MACs/s: (\d+\.\d\d)$", out, re.M)
    assert full, out
    forced = float(re.search(r"sut_logic (\d+\.\d\d) G \(dynamic\)", out).group(1))
    assert float(full.group(1)) >= forced  # the forcing halts some positions, full depth none
    m = re.search(r"^\[1 thread\] sut_logic / transformer tokens/s: (\d+\.\d\d) \(goal >= 0\.4; "
                  r"at the transformer's MACs/s: (\d+\.\d\d); sut_logic's MACs/s = "
                  r"(\d+\.\d\d)x the transformer's\)$", out, re.M)
    assert m, out
    ratio, bound, efficiency = map(float, m.groups())
    assert 0 < bound < 1 and abs(efficiency - ratio / bound) <= 0.03  # each printed to 2 decimals
    assert re.search(r"^\[1 thread\] sut_logic mean executed encoder steps: \d+\.\d\d of 12$", out, re.M), out


def test_train_step_logic_runs_in_bfloat16():
    out = run("train_step.py", "--preset", "logic", "--logic-tokens", "120", "--repeats", "1",
              "--threads", "1", "--bf16")
    assert re.search(r"^torch .*; logic batch: .*; bf16$", out, re.M), out
    assert re.search(r"^\[1 thread\] sut_logic / transformer tokens/s: \d+\.\d\d ", out, re.M), out


def test_train_step_cpvr_prints_every_model_and_both_ratios():
    out = run("train_step.py", "--preset", "cpvr", "--logic-tokens", "170", "--repeats", "1",
              "--threads", "1")
    assert re.search(r"^torch .*; C-PVR batch: 10 sequences, 170 source tokens, 20 target tokens; "
                     r"vocabulary \d+; halting bias 0\.5$", out, re.M), out
    for arch in ("ut_cpvr", "sut_cpvr", "hyper_ut_cpvr"):
        assert re.search(rf"^\[1 thread\] {arch}\s+\d+\.\d ms/step\s+\d+ source tokens/s, "
                         r"\d+\.\d\d encoder steps of 16$", out, re.M), out
    for arch in ("hyper_ut_cpvr", "sut_cpvr"):
        assert re.search(rf"^\[1 thread\] {arch} / ut_cpvr tokens/s: \d+\.\d\d$", out, re.M), out


def test_train_step_builds_the_cpvr_models_from_the_recipe():
    """The benchmark's C-PVR models are the recipe's: architecture, experts, hyper-modules,
    pre-LN, and losses (no label smoothing, ACT 0.01, MIM 0.01 for the SUT only)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_step

    arch, kwargs, loss = train_step.recipe_model("sut_cpvr")
    assert arch == "ut_cpvr" and kwargs["att_experts"] == 8 and kwargs["ffd_topk"] == 2
    assert kwargs["encoder_normalize_before"] and kwargs["share_all_embeddings"]
    assert loss == {"criterion": "sut_label_smoothed_cross_entropy", "mim_weight": 0.01,
                    "act_weight": 0.01, "label_smoothing": 0}
    arch, kwargs, loss = train_step.recipe_model("hyper_ut_cpvr")
    assert arch == "hyper_ut_cpvr" and loss["mim_weight"] == 0 and loss["label_smoothing"] == 0
    model, criterion = train_step.build("hyper_ut_cpvr", 104, 0.5)
    from sut_fairseq.modules.hyper_module import HyperLinear
    assert sum(isinstance(m, HyperLinear) for m in model.modules()) == 12  # q k v out fc1 fc2, per side
    assert criterion.eps == 0 and criterion.act_weight == 0.01
    _, _, loss = train_step.recipe_model("sut_logic")  # the logic recipe: label smoothing 0.1
    assert loss["label_smoothing"] == 0.1 and loss["act_weight"] == 0


def test_cpu_parallel_runs_the_recipe_both_ways_and_prints_the_ratio():
    out = run("cpu_parallel.py", "--model", "ut-halting", "--updates", "20", "--warmup", "5",
              "--max-tokens", "256")
    assert "--arch sut_logic --att-experts 1" in out and "--encoder-normalize-before" in out, out
    assert out.count("--distributed-rank") == 2, out
    assert re.search(r"^one process, 2 threads: +\d+\.\d{3} updates/s$", out, re.M), out
    assert re.search(r"^two gloo processes, 1 thread: +\d+\.\d{3} updates/s$", out, re.M), out
    assert re.fullmatch(r"two processes / two threads: \d+\.\d\d", out.strip().splitlines()[-1]), out


def test_moe_cpu_ends_with_the_ratio():
    out = run("moe_cpu.py", "--tokens", "64", "--dim", "16", "--hidden", "16", "--experts", "4",
              "--topk", "2", "--repeats", "1")
    assert re.fullmatch(r"ratio \d+\.\d+", out.strip().splitlines()[-1]), out


def test_dropout_cpu_ends_with_the_ratio():
    out = run("dropout_cpu.py", "--repeats", "1")
    assert re.search(r"forward\s+\d+\.\d\d ms\s+backward\s+\d+\.\d\d ms", out), out
    assert re.fullmatch(r"ratio \d+\.\d\d", out.strip().splitlines()[-1]), out


def test_profile_step_prints_the_groups_of_both_models_and_the_bounds():
    out = run("profile_step.py", "--logic-tokens", "120", "--top", "3")
    for model in ("sut_logic:", "transformer:"):
        assert model in out
    assert out.count("gather/scatter") >= 2 and "matmul-only R" in out
