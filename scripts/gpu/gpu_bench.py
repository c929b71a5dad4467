"""The ``bench`` stage: ``benchmarks/moe_gpu.py`` (the Triton expert GEMMs against cuBLAS
and the reference, forward and forward + backward, host syncs) and
``benchmarks/train_step.py --device cuda --bf16 --profile 25 --compile`` (sut_base, ut_base
and transformer_wmt_en_de on the same batch: tokens/s and peak memory eager, then compiled
with the seconds of each first step, then one profiled eager step each)."""
import itertools
import re

from gpu_common import log_lines_of, step_env

#: bench stage: moe_gpu.py (Triton autotuning, then 3 sizes x 2 passes x 3 implementations
#: x 23 runs) and train_step.py (three WMT-size models, 3 rounds of 2 steps each, eager,
#: then compiled with --compile: the SUT/UT with --compile-step, the transformer through
#: torch.compile). Measured on an H200 node, eager only: 17.6 s and 51.4 s; the compiled
#: half (three compilations) is not measured on a GPU yet: 150 s allowed for it.
BENCH_MOE_ESTIMATE_S = 40
BENCH_TRAIN_STEP_ESTIMATE_S = 200

SMOKE_MOE_ARGS = ["--device", "cpu", "--tokens", "32", "--dim", "16", "--hidden", "16",
                  "--experts", "4", "--topk", "2", "--repeats", "1", "--dtype", "bf16"]
SMOKE_TRAIN_STEP_ARGS = ["--batch", "2", "--len", "4", "--vocab", "64", "--repeats", "1", "--profile", "5"]
GPU_MOE_ARGS = ["--tokens", "4096", "8192", "16384", "--dtype", "bf16"]
GPU_TRAIN_STEP_ARGS = ["--device", "cuda", "--bf16", "--profile", "25", "--compile"]
#: "== profile ARCH: W ms wall under the profiler, L kernel launches, O aten operator calls[, device busy D ms (P%)]"
PROFILE_ROW = re.compile(r"^== profile (\S+): ([\d.]+) ms wall under the profiler, (\d+) kernel launches, "
                         r"(\d+) aten operator calls(?:, device busy ([\d.]+) ms)?")
#: a timing row of moe_gpu.py, and train_step.py's rows and ratios
MOE_ROW = re.compile(r"^\s*(\d+)\s+(fwd\+bwd|fwd)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                     r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(.+?)\s*$")
TRAIN_ROW = re.compile(r"^(\S+)\s+(\d+) ms/step\s+(\d+) tokens/s(?:\s+([\d.]+) GiB peak)?\s*$")
RATIO_ROW = re.compile(r"^((?:compiled: )?\S+ / \S+) tokens/s: ([\d.]+)")
#: "[N threads] compiled ARCH  MS ms/step  TOK target tokens/s (first step, compiling: S s)"
COMPILED_ROW = re.compile(r"^\[.*\] compiled (\S+)\s+([\d.]+) ms/step\s+(\d+) target tokens/s "
                          r"\(first step, compiling: ([\d.]+) s\)")


def stage_bench(stage, python):
    """moe_gpu.py then train_step.py; their numbers into results.json and summary.md."""
    env = step_env(stage, python)
    moe_args = SMOKE_MOE_ARGS if stage.smoke else GPU_MOE_ARGS
    tokens = [int(t) for t in itertools.takewhile(lambda a: not a.startswith("--"),
                                                  moe_args[moe_args.index("--tokens") + 1:])]
    moe_rows, train_rows, ratios, profiles, header, compiled_rows = [], {}, {}, {}, {}, {}

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
            m = COMPILED_ROW.match(line)
            if m:
                compiled_rows[m.group(1)] = {"ms_per_step": float(m.group(2)),
                                             "tokens_per_s": int(m.group(3)),
                                             "first_step_s": float(m.group(4))}
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
                                         "ratios": ratios, "profiles": profiles,
                                         "compiled": compiled_rows}})
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
        if compiled_rows:
            text += ["", "Compiled (`--compile`):", "",
                     "| model | ms/step | tokens/s | first step (compiling) s |", "|---|---:|---:|---:|"]
            text += [f"| {a} | {r['ms_per_step']:.0f} | {r['tokens_per_s']} | {r['first_step_s']:.1f} |"
                     for a, r in compiled_rows.items()]
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

