"""The CPU benchmark scripts run end to end (tiny sizes) and print the lines the docs quote."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


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


def test_train_step_logic_times_the_recipes_dense_models():
    """``--arch`` takes the logic recipe's UT, GUT, TLB and GUTLB; those that halt per
    position print their mean executed encoder steps of their own depth."""
    out = run("train_step.py", "--preset", "logic", "--logic-tokens", "120", "--repeats", "1",
              "--threads", "1", "--arch", "ut_logic", "gut_logic", "tlb_logic", "gutlb_logic")
    for arch in ("ut_logic", "gut_logic", "tlb_logic", "gutlb_logic"):
        assert re.search(rf"^\[1 thread\] {arch}\s+\d+\.\d ms/step\s+\d+ source tokens/s$", out, re.M), out
    assert re.search(r"^\[1 thread\] ut_logic mean executed encoder steps: \d+\.\d\d of 12$", out, re.M), out
    assert re.search(r"^\[1 thread\] gut_logic mean executed encoder steps: \d+\.\d\d of 15$", out, re.M), out


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


def _generate_benchmark():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import generate_throughput

    return generate_throughput


def test_generate_throughput_source_lengths_are_wmt_shaped_and_seeded():
    g = _generate_benchmark()
    lengths = g.source_lengths(3003, 0).float()   # tokens with </s>, newstest2014's size
    assert 27 <= lengths.mean() <= 31 and 24 <= lengths.median() <= 27
    assert lengths.min() >= 3 and lengths.max() <= 151 and (lengths > 81).float().mean() < 0.03
    assert g.source_lengths(3003, 0).equal(lengths.long()) and not g.source_lengths(3003, 1).equal(lengths.long())


def test_generate_throughput_multi30k_lengths_match_the_test_set():
    """--preset multi30k: Multi30k test 2016 under the recipe's 8k SentencePiece has 15.6
    tokens per source on average (</s> included), median 15, at most 37."""
    g = _generate_benchmark()
    p = g.PRESETS["multi30k"]
    lengths = g.source_lengths(1000, 0, p["mu"], p["sigma"]).float()
    assert 15.0 <= lengths.mean() <= 16.5 and 14 <= lengths.median() <= 16 and lengths.max() <= 45
    assert p["vocab"] == 8000 and p["archs"] == ["sut_multi30k", "transformer_multi30k", "ut_multi30k"]


def test_generate_throughput_decodes_every_sentence_to_its_maximum_length():
    """Beam search of the three models on 5 sentences in batches of 2: the rows, the ratio
    lines, and the generated tokens equal to what the length limit gives, computed here
    from the sorted source lengths (a batch of width W runs int(a W + b) steps, then </s>)."""
    a, b, n = 0.1, 2, 5
    out = run("generate_throughput.py", "--sentences", str(n), "--batch-size", "2", "--beam", "2",
              "--max-len-a", str(a), "--max-len-b", str(b), "--arch", "sut_base", "transformer_wmt_en_de",
              "ut_base")
    lengths = sorted(_generate_benchmark().source_lengths(n, 0).tolist())
    batches = [lengths[i:i + 2] for i in range(0, n, 2)]
    expected = sum(len(batch) * (int(a * max(batch) + b) + 1) for batch in batches)
    assert re.search(rf"; {n} sentences, .*; vocabulary 32768; beam 2, max_len_a {a}, max_len_b {b}; "
                     rf"--batch-size 2: {len(batches)} batches$", out, re.M), out
    for arch in ("sut_base", "transformer_wmt_en_de", "ut_base"):
        m = re.search(rf"^{arch}\s+(\d+\.\d\d) sentences/s\s+(\d+\.\d) generated tokens/s\s+"
                      r"(\d+\.\d\d) ms/decoder step$", out, re.M)
        assert m, out
        sentences_s, tokens_s, ms = map(float, m.groups())
        assert sentences_s > 0 and ms > 0
        # tokens/s over sentences/s: the tokens per sentence of the one timed pass (to rounding)
        rounding = 0.005 / sentences_s + 0.05 / tokens_s
        assert abs(tokens_s / sentences_s - expected / n) <= 1.01 * rounding * expected / n
        m = re.search(rf"^{arch}: every sentence ran to its maximum length \((\d+) generated tokens\)", out, re.M)
        assert m and int(m.group(1)) == expected, (expected, out)
    assert re.search(r"^sut_base: .* \| decoder steps executed 100.0% ", out, re.M), out
    # alpha_thresh 0.5: a random model's halting units give 0.5 at once, one step per position
    for arch in ("sut_base", "ut_base"):
        assert re.search(rf"^{arch}@0.5\s+\d+\.\d\d sentences/s", out, re.M), out
        assert re.search(rf"^{arch}@0.5: .* \| encoder steps executed 16.7% .* decoder steps executed "
                         r"16.7% ", out, re.M), out
    for other in ("ut_base", "ut_base@0.5", "transformer_wmt_en_de"):
        sut = "sut_base@0.5" if other.endswith("@0.5") else "sut_base"
        assert re.search(rf"^{sut} / {other} sentences/s: \d+\.\d\d$", out, re.M), out
    assert re.fullmatch(r"sut_base / transformer_wmt_en_de sentences/s: \d+\.\d\d", out.splitlines()[-1])


def test_generate_throughput_multi30k_preset_ends_with_its_ratio():
    out = run("generate_throughput.py", "--preset", "multi30k", "--sentences", "3", "--batch-size", "2",
              "--beam", "2", "--max-len-a", "0.1", "--max-len-b", "2", "--thresholds", "0.999")
    assert re.search(r"^--preset multi30k, .*; vocabulary 8000; beam 2", out, re.M), out
    for arch in ("sut_multi30k", "transformer_multi30k", "ut_multi30k"):
        assert re.search(rf"^{arch}: every sentence ran to its maximum length", out, re.M), out
    assert "@" not in out
    assert re.fullmatch(r"sut_multi30k / transformer_multi30k sentences/s: \d+\.\d\d", out.splitlines()[-1])


def test_profile_decode_counts_operators_per_decoder_call():
    out = run("profile_decode.py", "--arch", "sut_tiny", "transformer_wmt_en_de", "--sentences", "2",
              "--beam", "2", "--max-len-a", "0.1", "--max-len-b", "2", "--top", "3")
    for arch in ("sut_tiny", "transformer_wmt_en_de"):
        m = re.search(rf"^== {arch}: [\d.]+ s unprofiled, (\d+) decoder calls of 4 rows, [\d.]+ ms/decoder "
                      r"call, (\d+) aten calls/decoder call, (\d+) from Python\n   (.*)$",
                      out, re.M)
        assert m and int(m.group(1)) >= 2 and 10 < int(m.group(3)) <= int(m.group(2)), out
        assert "matmul" in m.group(4) and "other" in m.group(4), out


def compiled_generate_throughput(option, timeout):
    """generate_throughput.py with ``option`` (--compile or --compile-decoder) on sut_tiny and
    the transformer at tiny sizes (the ``eager`` backend: dynamo's trace of the same
    graphs, no code generation; the compiled model's arithmetic is tests/recurrence/test_compiled_step.py's); stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", SUT_COMPILE_BACKEND="eager")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "generate_throughput.py"),
                           "--sentences", "3", "--batch-size", "2", "--beam", "2", "--max-len-a", "0.1",
                           "--max-len-b", "2", "--arch", "sut_tiny", "transformer_wmt_en_de", option],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def check_pass_rows(out, mode):
    """Both models' rows of the ``mode`` pass (after its warm-up) and their ratio to eager."""
    for arch in ("sut_tiny", "transformer_wmt_en_de"):
        assert re.search(rf"^{mode} {arch}\s+\d+\.\d\d sentences/s\s+\d+\.\d generated tokens/s\s+"
                         r"\d+\.\d\d ms/decoder step \(warm-up, compiling: \d+\.\d s\)$", out, re.M), out
        assert re.search(rf"^{mode} {arch}: every sentence ran to its maximum length", out, re.M), out
        m = re.search(rf"^{arch} {mode} / eager sentences/s: (\d+\.\d\d)$", out, re.M)
        assert m and float(m.group(1)) > 0, out


@pytest.mark.slow  # 14 s of compiling; the eager rows: test_generate_throughput_decodes_every_sentence_...
def test_generate_throughput_compiled_rows():
    """--compile: the plugin's model with --compile-step and the transformer's encoder
    compiled, each after its warm-up."""
    out = compiled_generate_throughput("--compile", timeout=600)
    check_pass_rows(out, "compiled")
    assert "compiled decoder" not in out


@pytest.mark.slow  # compiling the incremental decoders, even with aot_eager: about 100 s
def test_generate_throughput_compiled_decoder_rows():
    """--compile-decoder: a pass with every model's decoder forward compiled as well, its
    rows and its ratio to the eager pass (and no --compile pass)."""
    out = compiled_generate_throughput("--compile-decoder", timeout=900)
    assert not re.search(r"^compiled (sut_tiny|transformer)", out, re.M), out
    check_pass_rows(out, "compiled decoder")


def test_cpu_parallel_averages_fairseqs_ups_past_the_warm_up():
    """The speed cpu_parallel.py reports: the mean of fairseq's ``ups`` over the log lines
    past ``--warmup`` updates (either order of the fields); no such line: a clear exit."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import cpu_parallel

    log = ("epoch 001:     10 / 90 loss=2.1, ups=1.5, wpb=100, num_updates=10\n"
           "epoch 001:     20 / 90 loss=2.0, ups=2.0, wpb=100, num_updates=20\n"
           "epoch 001:     30 / 90 loss=1.9, num_updates=30, lr=0.1, ups=3.0\n")
    assert cpu_parallel.ups_after(log, 10) == 2.5
    assert cpu_parallel.ups_after(log, 0) == 6.5 / 3
    with pytest.raises(SystemExit, match="no training log lines past update 30"):
        cpu_parallel.ups_after(log, 30)


@pytest.mark.slow  # three fairseq-train processes (the distributed path: test_distributed.py)
def test_cpu_parallel_runs_the_recipe_both_ways_and_prints_the_ratio():
    out = run("cpu_parallel.py", "--model", "ut-halting", "--updates", "12", "--warmup", "5",
              "--max-tokens", "256", "--pairs", "600")
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


def test_train_step_builds_the_loop_variant_and_checks_what_compile_names(capsys):
    """``ARCH+loop`` is the model compiled with --compile-loop (eager: the model itself);
    ``--compile`` naming a model that is not timed stops before any timing."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_step
    from sut_fairseq.modules.recurrence import TensorLoop, TensorStep

    model, _ = train_step.build("sut_logic+loop", 64, 0.5, compiled=True)
    assert all(isinstance(side.compiled_step.step, TensorLoop) for side in (model.encoder.side, model.decoder.side))
    model, _ = train_step.build("sut_logic", 64, 0.5, compiled=True)
    assert all(isinstance(side.compiled_step.step, TensorStep) for side in (model.encoder.side, model.decoder.side))
    model, _ = train_step.build("sut_logic+loop", 64, 0.5)
    assert model.encoder.side.compiled_step is None
    with pytest.raises(SystemExit, match="--compile ut_base: not among the timed models"):
        train_step.main(["--batch", "2", "--len", "4", "--vocab", "64", "--arch", "sut_base",
                         "--compile", "ut_base"])
    assert capsys.readouterr().out == ""  # nothing timed


def test_grouped_gemm_cpu_checks_both_forwards_agree_and_ends_with_the_ratios():
    out = run("grouped_gemm_cpu.py", "--tokens", "8", "400", "--repeats", "1")
    lines = re.findall(r"^\w+ +E +\d+ d +\d+ +(\d+) tokens \( *[\d.]+ rows/expert\) .+ +loop +\d+\.\d{3} ms  "
                       r"grouped +\d+\.\d{3} ms  ratio \d+\.\d\d$", out, re.M)
    assert sorted(lines) == ["400"] * 6 + ["8"] * 6, out  # 3 sizes x 2 layouts per token count
    assert re.fullmatch(r"grouped / loop time, rows per expert <= 64: \d+\.\d\d\n"
                        r"grouped / loop time, rows per expert > 64: \d+\.\d\d",
                        "\n".join(out.strip().splitlines()[-2:])), out


def test_train_step_graphs_suffix_compiles_in_reduce_overhead_mode(monkeypatch):
    """``+graphs``: the SUT's compiled loop and fairseq's transformer in torch.compile's
    mode reduce-overhead (CUDA graphs on a GPU); without ``+loop`` on a SUT, an unknown
    suffix: errors that name the arch."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_step

    assert train_step.split_arch("sut_base+loop+graphs") == ("sut_base", {"+loop", "+graphs"})
    with pytest.raises(SystemExit, match=r"sut_base\+graphs: \+graphs on a SUT/UT needs \+loop"):
        train_step.split_arch("sut_base+graphs")
    with pytest.raises(SystemExit, match=r"sut_base\+lop: unknown suffix '\+lop'"):
        train_step.split_arch("sut_base+lop")
    with pytest.raises(SystemExit, match=r"transformer_wmt_en_de\+flex: \+flex is an option of the plugin's models"):
        train_step.split_arch("transformer_wmt_en_de+flex")
    model, _ = train_step.build("sut_tiny+flex", 64, 0.5)
    attn = model.encoder.side.block.self_attn
    assert attn.flex and attn.attention_dropout == 0.0 and not model.decoder.side.block.cross_attn.flex
    model, _ = train_step.build("sut_tiny+loop+graphs", 64, 0.5, compiled=True)
    assert [side.compiled_step.mode for side in (model.encoder.side, model.decoder.side)] == ["reduce-overhead"] * 2
    model, _ = train_step.build("sut_tiny+loop", 64, 0.5, compiled=True)
    assert [side.compiled_step.mode for side in (model.encoder.side, model.decoder.side)] == [None, None]
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: modes.append(kw.get("mode")) or model)
    train_step.build("transformer_wmt_en_de+graphs", 64, 0.5, compiled=True)
    train_step.build("transformer_wmt_en_de", 64, 0.5, compiled=True)
    assert modes == ["reduce-overhead", None]


def test_device_busy_counts_each_kernel_once():
    """A host operator carries the device time of the kernels it launched as its own
    self device time; the kernels' events carry it again. Summing every event counted a
    step's device time twice (the leases' "device busy" figures until stop 47)."""
    from types import SimpleNamespace
    from torch.autograd import DeviceType

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_step

    def event(device, us, annotation=False):
        return SimpleNamespace(device_type=device, self_device_time_total=us,
                               is_user_annotation=annotation)

    events = [event(DeviceType.CPU, 300.0),            # aten::mm, its kernel's 300 us
              event(DeviceType.CUDA, 300.0),           # the GEMM kernel
              event(DeviceType.CPU, 20.0),             # aten::zero_
              event(DeviceType.CUDA, 20.0),            # its memset
              event(DeviceType.CUDA, 999.0, True),     # a user annotation on the device's row
              event(DeviceType.CPU, 0.0)]              # a view: no device time
    assert train_step.device_ms(events) == pytest.approx(0.32)
