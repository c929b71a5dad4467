"""The ``bench`` stage, one command, eager and compiled:

1. ``benchmarks/moe_gpu.py`` (the Triton expert GEMMs against cuBLAS and the reference,
   forward and forward + backward, host syncs);
2. ``benchmarks/train_step.py --device cuda --bf16 --profile 25 --compile sut_base
   transformer_wmt_en_de`` (sut_base, ut_base and transformer_wmt_en_de on the same
   128 x 32 = 4,096-token batch: tokens/s and peak memory eager, then sut_base and the
   transformer compiled with the seconds of each first step, then one profiled step each,
   eager and compiled);
3. ``benchmarks/train_step.py --device cuda --bf16 --batch 512 --len 32 --compile sut_base
   transformer_wmt_en_de`` (the same at 16,384 target tokens, no profile);
4. ``benchmarks/generate_throughput.py --device cuda --bf16 --compile --sentences 3003
   --max-tokens 12000 --beam 4 --arch sut_base transformer_wmt_en_de --thresholds 0.999`` (beam 4 over 3,003
   WMT-shaped synthetic sentences: sentences/s of sut_base and transformer_wmt_en_de, eager
   then compiled);
5. only when named: ``train-loop`` (``train_step.py ... --arch sut_base+loop
   transformer_wmt_en_de --compile``: all steps of a side one compiled graph),
   ``train-graphs`` (``--arch sut_base+loop+graphs transformer_wmt_en_de+graphs
   --compile``: both models in torch.compile's mode reduce-overhead, CUDA graphs) and
   ``model`` (``benchmarks/gpu_model.py``, the CPU model of the GPU step, eager,
   ``--compile-step`` and ``--compile-loop``, for the node's GPU: its predicted launches
   and device time beside the profiled steps of the same call).

1 and 2 always run; 3 and 4 start when their estimate fits the time left (always on a warm
node, where the package is already importable; not after a fresh install) and, once
started, must pass. ``SUT_BENCH_STEPS`` names the steps to run (``moe train train-16k
generate train-loop train-graphs``, any of them): every step it names is required."""
import itertools
import os
import re
import shlex

from gpu_common import UsageError, log_lines_of, step_env

# --------------------------------------------------------------------------- time plan
# The stage deadline is 540 s at the default --time-limit 600, the install 180 s on a fresh
# node, the environment step 10 s. Every estimate below is for an H100 or H200 node.

#: moe_gpu.py: Triton autotuning, then 3 sizes x 2 passes x 3 implementations x 23 runs.
#: Measured 17.6 s (H200) and 31.9 s (H100).
BENCH_MOE_ESTIMATE_S = 40
#: train_step.py at 4,096 target tokens: three WMT-size models, 3 rounds of 2 steps each,
#: eager, then sut_base and the transformer compiled (GPU_COMPILE: the SUT with
#: --compile-step, the transformer through torch.compile), then one profiled step each,
#: eager and compiled. Measured eager with the profiles: 92.3 s on an H100 (51.4 s on an
#: H200 without them), most of it start-up and the first steps (imports, CUDA, Triton's
#: compilation and autotuning of the expert kernels: the timed steps are about 4 s). The
#: compiled pass of all three models did not finish within 265 s on an H200 (2026-11-27);
#: sut_base and the transformer alone, eager + compiled + profiles, took 134 s with
#: inductor's on-disk cache of that first try (first compiled steps 24.5 and 63.2 s); a
#: cold sut_base compilation about 80 s more, the eager ut_base about 20 s.
BENCH_TRAIN_STEP_ESTIMATE_S = 240
#: train_step.py at 16,384 target tokens (512 x 32; eager then compiled, no profile), a
#: second process after the first: start-up and the three models built twice, about 30 s;
#: the expert kernels come from Triton's on-disk caches (compiled, autotuned: the
#: autotuner's key has no row count), about 5 s; the timed steps about 15 s (the 4,096-token
#: SUT step is host-bound, 294 ms with the device busy 60 ms: at 4x the tokens the device
#: work grows to about 0.25 s per step, the launches stay about 14,000); the compilations:
#: the SUT/UT steps are compiled with dynamic batch and length (``maybe_mark_dynamic``), so
#: inductor's on-disk caches can serve the graphs of the first run and what is left is
#: tracing, about 15 s per model; the transformer is compiled for static shapes, so its new
#: shape compiles afresh, about 40 s.
BENCH_TRAIN_STEP_16K_ESTIMATE_S = 120
#: generate_throughput.py (3,003 sentences, beam 4, --max-tokens 12000: 9 batches, 633
#: decoder calls per model, every sentence to its maximum length): start-up (imports, CUDA,
#: collating the batches) and four model builds, about 25 s; eager, the SUT at 10-30 ms per
#: incremental decoder call (six recurrence steps with routing and halting, each reading
#: on the host whether a position still runs: host-bound like its training step; plus the
#: generator's beam bookkeeping), 6-19 s, the transformer at 5-8 ms, 3-5 s, and the
#: warm-ups (the encoders on every batch, the first batch's 31 decoder calls), about 25 s
#: in all; compiled, the SUT's encoder step (--compile-step, forward only, dynamic shapes)
#: about 30 s to compile, the transformer's encoder twice (a static, then a dynamic
#: shape), about 25 s, and the same decoding again, about 25 s (the incremental decoder
#: steps stay eager).
BENCH_GENERATE_ESTIMATE_S = 130

#: train_step.py with --compile-loop (``sut_base+loop``: all steps of a side one graph)
#: against the transformer, eager, compiled and profiled; run only when SUT_BENCH_STEPS
#: names it. Not measured on a GPU yet: the unrolled graphs of sut_base's 6 + 6 steps
#: are 6 times the step's, so their compilation is estimated at 4 minutes.
BENCH_TRAIN_LOOP_ESTIMATE_S = 330

#: train_step.py with CUDA graphs (``sut_base+loop+graphs``: the compiled loop in
#: torch.compile's mode reduce-overhead; ``transformer_wmt_en_de+graphs`` likewise), eager,
#: compiled and profiled; run only when SUT_BENCH_STEPS names it. Not measured on a GPU yet:
#: the loop's compilation as for train-loop (about 4 minutes), the transformer's about a
#: minute, the recording of each graph a few steps.
BENCH_TRAIN_GRAPHS_ESTIMATE_S = 360

#: gpu_model.py (on the node's CPU: no GPU work): three runs of about 10 s, eager,
#: --compile-step and --compile-loop, each sut_base and the transformer at 4,096 tokens;
#: run only when SUT_BENCH_STEPS names it (beside the steps whose profiles it predicts)
BENCH_MODEL_ESTIMATE_S = 45

#: SUT_BENCH_STEPS keys that run only when named
NAMED_ONLY = ("train-loop", "train-graphs", "model")

#: The stage's steps in order: SUT_BENCH_STEPS key -> (step name, GPU estimate s, run
#: without SUT_BENCH_STEPS whatever the time left; NAMED_ONLY: not without it). On a warm node all four fit the
#: deadline (10 + 490 s of 540); after a fresh install (180 s) the first two do, and the
#: other two are skipped for lack of time (a second, warm call runs them:
#: ``SUT_BENCH_STEPS="train-16k generate"``, docs/gpu.md).
BENCH_STEPS = {"moe": ("moe_gpu.py", BENCH_MOE_ESTIMATE_S, True),
               "train": ("train_step.py", BENCH_TRAIN_STEP_ESTIMATE_S, True),
               "train-16k": ("train_step.py large batch", BENCH_TRAIN_STEP_16K_ESTIMATE_S, False),
               "generate": ("generate_throughput.py", BENCH_GENERATE_ESTIMATE_S, False),
               "train-loop": ("train_step.py --compile-loop", BENCH_TRAIN_LOOP_ESTIMATE_S, False),
               "train-graphs": ("train_step.py CUDA graphs", BENCH_TRAIN_GRAPHS_ESTIMATE_S, False),
               "model": ("gpu_model.py", BENCH_MODEL_ESTIMATE_S, False)}

SMOKE_MOE_ARGS = ["--device", "cpu", "--tokens", "32", "--dim", "16", "--hidden", "16",
                  "--experts", "4", "--topk", "2", "--repeats", "1", "--dtype", "bf16"]
SMOKE_TRAIN_STEP_ARGS = ["--batch", "2", "--len", "4", "--vocab", "64", "--repeats", "1", "--profile", "5"]
SMOKE_TRAIN_STEP_16K_ARGS = ["--batch", "8", "--len", "4", "--vocab", "64", "--repeats", "1"]
#: the default 32k vocabulary (a tiny one would let the random models emit </s>), 6
#: sentences of a few generated tokens each, eager only
SMOKE_GENERATE_ARGS = ["--sentences", "6", "--batch-size", "2", "--beam", "2", "--max-len-a", "0.1",
                       "--max-len-b", "2", "--arch", "sut_base", "transformer_wmt_en_de", "--thresholds", "0.999"]
GPU_MOE_ARGS = ["--tokens", "4096", "8192", "16384", "--dtype", "bf16"]
#: the compiled pass: the SUT and the transformer (ut_base's compilation would not fit the
#: stage after a fresh install, and the comparison the stage reports is SUT / transformer)
GPU_COMPILE = ["--compile", "sut_base", "transformer_wmt_en_de"]
GPU_TRAIN_STEP_ARGS = ["--device", "cuda", "--bf16", "--profile", "25", *GPU_COMPILE]
GPU_TRAIN_STEP_16K_ARGS = ["--device", "cuda", "--bf16", "--batch", "512", "--len", "32", *GPU_COMPILE]
#: the workload the estimate above was made for (the benchmark's CPU defaults are smaller:
#: 64 sentences, batches of 64, beam 5, the UT and two thresholds)
GPU_GENERATE_ARGS = ["--device", "cuda", "--bf16", "--compile", "--sentences", "3003", "--max-tokens", "12000",
                     "--beam", "4", "--arch", "sut_base", "transformer_wmt_en_de", "--thresholds", "0.999"]
GPU_TRAIN_LOOP_ARGS = ["--device", "cuda", "--bf16", "--profile", "25", "--arch", "sut_base+loop",
                       "transformer_wmt_en_de", "--compile"]
SMOKE_TRAIN_LOOP_ARGS = ["--batch", "2", "--len", "4", "--vocab", "64", "--repeats", "1",
                         "--arch", "sut_base+loop", "transformer_wmt_en_de"]
GRAPHS_MODELS = ("sut_base+loop+graphs", "transformer_wmt_en_de+graphs")
GPU_TRAIN_GRAPHS_ARGS = ["--device", "cuda", "--bf16", "--profile", "25", "--arch", *GRAPHS_MODELS, "--compile"]
SMOKE_TRAIN_GRAPHS_ARGS = ["--batch", "2", "--len", "4", "--vocab", "64", "--repeats", "1",
                           "--arch", *GRAPHS_MODELS]
#: "== profile [compiled ]ARCH: W ms wall under the profiler, L kernel launches, O aten operator calls[, device busy D ms (P%)]"
PROFILE_ROW = re.compile(r"^== profile ((?:compiled )?\S+): ([\d.]+) ms wall under the profiler, (\d+) kernel launches, "
                         r"(\d+) aten operator calls(?:, device busy ([\d.]+) ms)?")
#: a timing row of moe_gpu.py, and train_step.py's rows and ratios
MOE_ROW = re.compile(r"^\s*(\d+)\s+(fwd\+bwd|fwd)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                     r"([\d.]+)\s+([\d.]+)\s+([\d.]+|nan)\s+([\d.]+|nan)\s+([\d.]+)\s+(.+?)\s*$")
#: moe_gpu.py: the shared weight gradient per step against deferred (ops/weight_grads.py)
WGRAD_ROW = re.compile(r"^wgrad over (\d+) steps of (\d+) tokens: per step ([\d.]+) ms \(\d+ launches\), "
                       r"deferred ([\d.]+) ms \(one\), per step / deferred ([\d.]+)")
TRAIN_ROW = re.compile(r"^(\S+)\s+(\d+) ms/step\s+(\d+) tokens/s(?:\s+([\d.]+) GiB peak)?\s*$")
RATIO_ROW = re.compile(r"^((?:compiled: )?\S+ / \S+) tokens/s: ([\d.]+)")
#: "[N threads] compiled ARCH  MS ms/step  TOK target tokens/s (first step, compiling: S s)"
COMPILED_ROW = re.compile(r"^\[.*\] compiled (\S+)\s+([\d.]+) ms/step\s+(\d+) target tokens/s "
                          r"\(first step, compiling: ([\d.]+) s\)")
#: generate_throughput.py: "[compiled ]ARCH  S sentences/s  T generated tokens/s  D ms/decoder
#: step[  P GiB peak][ (warm-up, compiling: W s)]", its ratios and whether every sentence
#: ran to its maximum length
GENERATE_ROW = re.compile(r"^(compiled )?(\S+)\s+([\d.]+) sentences/s\s+([\d.]+) generated tokens/s\s+"
                          r"([\d.]+) ms/decoder step(?:\s+([\d.]+) GiB peak)?"
                          r"(?: \(warm-up, compiling: ([\d.]+) s\))?\s*$")
GENERATE_RATIO = re.compile(r"^((?:compiled: )?\S+ / \S+|\S+ compiled / eager) sentences/s: ([\d.]+)")
GENERATE_LENGTHS = re.compile(r"^(compiled )?(\S+): (every sentence ran to its maximum length|"
                              r"\d+ of \d+ sentences ended before their maximum length)")
GENERATE_MODELS = ("sut_base", "transformer_wmt_en_de")
TRAIN_MODELS = ("sut_base", "ut_base", "transformer_wmt_en_de")
LOOP_MODELS = ("sut_base+loop", "transformer_wmt_en_de")


def bench_plan(smoke=False, environ=None):
    """The steps to run: [(key, required)] (required: run whatever the time left; the
    others start when their estimate fits). UsageError for an unknown SUT_BENCH_STEPS key."""
    environ = os.environ if environ is None else environ
    named = environ.get("SUT_BENCH_STEPS", "").replace(",", " ").split()
    unknown = [k for k in named if k not in BENCH_STEPS]
    if unknown:
        raise UsageError(f"SUT_BENCH_STEPS: unknown step {unknown[0]!r} (choose from {', '.join(BENCH_STEPS)})")
    if named:
        return [(k, True) for k in BENCH_STEPS if k in named]
    return [(k, smoke or always) for k, (_, _, always) in BENCH_STEPS.items() if k not in NAMED_ONLY]


def bench_required_estimate(environ=None):
    """Estimated seconds of the bench stage's required steps (install and environment aside)."""
    return sum(BENCH_STEPS[k][1] for k, required in bench_plan(False, environ) if required)


def parse_train_step(lines):
    """train_step.py's output -> {header, models, ratios, profiles, compiled}."""
    out = {"header": next((l for l in lines if "target tokens" in l), None), "models": {},
           "ratios": {}, "profiles": {}, "compiled": {}}
    for line in lines:
        m = TRAIN_ROW.match(line)
        if m:
            out["models"][m.group(1)] = {"ms_per_step": int(m.group(2)), "tokens_per_s": int(m.group(3)),
                                         "peak_gib": float(m.group(4)) if m.group(4) else None}
        m = RATIO_ROW.match(line)
        if m:
            out["ratios"][m.group(1)] = float(m.group(2))
        m = COMPILED_ROW.match(line)
        if m:
            out["compiled"][m.group(1)] = {"ms_per_step": float(m.group(2)), "tokens_per_s": int(m.group(3)),
                                           "first_step_s": float(m.group(4))}
        m = PROFILE_ROW.match(line)
        if m:
            out["profiles"][m.group(1)] = {"wall_ms": float(m.group(2)), "launches": int(m.group(3)),
                                           "aten_calls": int(m.group(4)),
                                           "device_busy_ms": float(m.group(5)) if m.group(5) else None}
    return out


def parse_generate(lines):
    """generate_throughput.py's output -> {header, models, compiled, ratios}; a model's
    ``full_length``: whether every sentence ran to its maximum length."""
    out = {"header": next((l for l in lines if " sentences, source tokens" in l), None), "models": {},
           "compiled": {}, "ratios": {}}
    for line in lines:
        m = GENERATE_ROW.match(line)
        if m:
            out["compiled" if m.group(1) else "models"][m.group(2)] = {
                "sentences_per_s": float(m.group(3)), "tokens_per_s": float(m.group(4)),
                "ms_per_decoder_step": float(m.group(5)),
                "peak_gib": float(m.group(6)) if m.group(6) else None,
                **({"warm_up_s": float(m.group(7))} if m.group(7) else {})}
        m = GENERATE_RATIO.match(line)
        if m:
            out["ratios"][m.group(1)] = float(m.group(2))
        m = GENERATE_LENGTHS.match(line)
        if m:
            row = out["compiled" if m.group(1) else "models"].get(m.group(2))
            if row is not None:
                row["full_length"] = m.group(3).startswith("every")
    return out


#: the model's modes: (mode, gpu_model.py flag, the profile it predicts: train_step.py's
#: profile key of the SUT and the transformer, and the step that profiles them)
MODEL_MODES = (("eager", "", "train", ("sut_base", "transformer_wmt_en_de")),
               ("compile-step", "--compile-step", "train",
                ("compiled sut_base", "compiled transformer_wmt_en_de")),
               ("compile-loop", "--compile-loop", "train-loop",
                ("compiled sut_base+loop", "compiled transformer_wmt_en_de")))
MODEL_ARCHS = ("sut_base", "transformer_wmt_en_de")
#: "== gpu model mode MODE" (the step's own marker) and gpu_model.py's closing lines
MODEL_MODE_ROW = re.compile(r"^== gpu model mode (\S+)")
MODEL_ROW = re.compile(r"^gpu model: (\S+) launches (\d+) device_ms ([\d.]+) misaligned_gemms (\d+)")
#: gpu_model.py --measured-kernels: a routed kernel's efficiency refit (or not) on a
#: profile, or no profile to refit on
MODEL_REFIT_ROW = re.compile(r"^gpu model: (refit|measured|no) .*")


def model_command(python, smoke, measured_log=None):
    """One shell command running gpu_model.py in every mode of MODEL_MODES, each run after a
    marker line, for the node's GPU (H100 or H200, as ``torch.cuda.get_device_name`` says;
    H200 without one); --smoke: a batch of 2 x 4 tokens. ``measured_log``: the stage log,
    whose train steps' profiles (``== plugin kernels`` lines) refit the routed kernels'
    efficiencies on today's kernels (``--measured-kernels``)."""
    sizes = " --batch 2 --len 4 --vocab 64" if smoke else ""
    if measured_log:
        sizes += f" --measured-kernels {shlex.quote(str(measured_log))}"
    device = (f'$({python} -c "import torch; name = torch.cuda.get_device_name() '
              f'if torch.cuda.is_available() else \'\'; print(\'H100\' if \'H100\' in name else \'H200\')")')
    runs = [f"echo '== gpu model mode {mode}' && {python} benchmarks/gpu_model.py --arch "
            f"{' '.join(MODEL_ARCHS)} --device $device{sizes} {flag}".rstrip()
            for mode, flag, _, _ in MODEL_MODES]
    return " && ".join([f"device={device}"] + runs)


def parse_model(lines):
    """gpu_model.py's runs -> {"modes": {mode: {arch: {launches, device_ms,
    misaligned_gemms}}}, "refits": {mode: [its --measured-kernels lines]}, "device": the
    first run's header}."""
    out, mode = {"device": next((l for l in lines if l.startswith("gpu model of one training step")), None),
                 "modes": {}, "refits": {}}, None
    for line in lines:
        m = MODEL_MODE_ROW.match(line)
        if m:
            mode = m.group(1)
            continue
        if MODEL_REFIT_ROW.match(line) and mode is not None:
            out["refits"].setdefault(mode, []).append(line[len("gpu model: "):].strip())
            continue
        m = MODEL_ROW.match(line)
        if m and mode is not None:
            out["modes"].setdefault(mode, {})[m.group(1)] = {
                "launches": int(m.group(2)), "device_ms": float(m.group(3)),
                "misaligned_gemms": int(m.group(4))}
    return out


def model_table(model, parsed):
    """The model's prediction beside the profiled steps of this call (``parsed``: the
    train steps' parsed outputs by SUT_BENCH_STEPS key); an empty cell where the call did
    not profile that step."""
    text = ["", f"The CPU model of the GPU step (`benchmarks/gpu_model.py`; {model['device'] or ''}) "
            "beside the profiled steps:", "",
            "| mode | model | predicted launches | profiled launches | predicted device ms | "
            "profiled device busy ms |", "|---|---|---:|---:|---:|---:|"]
    for mode, _, step, keys in MODEL_MODES:
        profiles = parsed.get(step, {}).get("profiles", {})
        for arch, key in zip(MODEL_ARCHS, keys):
            predicted = model["modes"].get(mode, {}).get(arch)
            if predicted is None:
                continue
            measured = profiles.get(key, {})
            busy = measured.get("device_busy_ms")
            text.append(f"| {mode} | {arch} | {predicted['launches']} | {measured.get('launches', '')} | "
                        f"{predicted['device_ms']:.1f} | {'' if busy is None else f'{busy:.1f}'} |")
    refits = model["refits"]
    if refits:
        text += ["", "The routed kernels' efficiencies, refit on this call's profiles "
                 "(`--measured-kernels`; the rest of the step predicted):", ""]
        text += [f"* {mode}: {line}" for mode, lines in refits.items() for line in lines]
    return text


def train_table(title, r):
    text = ["", f"{title} ({r['header'] or ''}):", "",
            "| model | ms/step | tokens/s | peak GiB |", "|---|---:|---:|---:|"]
    text += [f"| {a} | {m['ms_per_step']} | {m['tokens_per_s']} | "
             f"{'' if m['peak_gib'] is None else m['peak_gib']} |" for a, m in r["models"].items()]
    if r["compiled"]:
        text += ["", "Compiled (`--compile`):", "",
                 "| model | ms/step | tokens/s | first step (compiling) s |", "|---|---:|---:|---:|"]
        text += [f"| {a} | {m['ms_per_step']:.0f} | {m['tokens_per_s']} | {m['first_step_s']:.1f} |"
                 for a, m in r["compiled"].items()]
    return text + [""] + [f"- {k} tokens/s: {v:.2f}" for k, v in r["ratios"].items()]


def generate_table(r):
    text = ["", f"Beam search, `generate_throughput.py` ({r['header'] or ''}):", "",
            "| model | sentences/s | generated tokens/s | ms/decoder step | peak GiB | "
            "every sentence to its maximum length | warm-up (compiling) s |",
            "|---|---:|---:|---:|---:|---|---:|"]
    for prefix, rows in (("", r["models"]), ("compiled ", r["compiled"])):
        for a, m in rows.items():
            cells = [f"{prefix}{a}", f"{m['sentences_per_s']:.2f}", f"{m['tokens_per_s']:.1f}",
                     f"{m['ms_per_decoder_step']:.2f}", "" if m["peak_gib"] is None else f"{m['peak_gib']}",
                     {True: "yes", False: "no", None: ""}[m.get("full_length")],
                     f"{m['warm_up_s']:.1f}" if "warm_up_s" in m else ""]
            text.append("| " + " | ".join(cells) + " |")
    return text + [""] + [f"- {k} sentences/s: {v:.2f}" for k, v in r["ratios"].items()]


def stage_bench(stage, python):
    """The plan's steps in order; their numbers into results.json and summary.md."""
    env = step_env(stage, python)
    plan = bench_plan(stage.smoke)
    stage.budget = {"steps": [{"step": BENCH_STEPS[k][0], "estimate_s": BENCH_STEPS[k][1],
                               "required": r} for k, r in plan],
                    "note": "GPU estimates (gpu_bench.py), not measurements: correct them from the "
                            "measured times above"}
    moe_args = SMOKE_MOE_ARGS if stage.smoke else GPU_MOE_ARGS
    tokens = [int(t) for t in itertools.takewhile(lambda a: not a.startswith("--"),
                                                  moe_args[moe_args.index("--tokens") + 1:])]
    moe_rows, wgrad_rows, header, parsed = [], [], {}, {}

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
                                 "reference_tflops": float(g[7]), "grouped_ms": float(g[8]),
                                 "grouped_tflops": float(g[9]), "triton_over_dense": float(g[10]),
                                 "host_syncs": g[11]})
            m = WGRAD_ROW.match(line)
            if m:
                g = m.groups()
                wgrad_rows.append({"steps": int(g[0]), "tokens": int(g[1]), "per_step_ms": float(g[2]),
                                   "deferred_ms": float(g[3]), "per_step_over_deferred": float(g[4])})
        missing = [t for t in tokens if not any(r["tokens"] == t for r in moe_rows)
                   or not any(r["tokens"] == t for r in wgrad_rows)]
        if missing:
            return f"no timing rows for tokens {missing} in the output"
        syncs = [r for r in moe_rows if r["host_syncs"] not in ("none", "n/a")]
        if syncs:
            return f"host syncs in the Triton path: {syncs[0]['host_syncs']}"
        return None

    def train_check(key, profiled, models=TRAIN_MODELS):
        def check(step):
            r = parsed[key] = parse_train_step(log_lines_of(stage, step))
            missing = [a for a in models if a not in r["models"]]
            if missing:
                return f"no rows for {missing} in the output"
            if not stage.smoke and any(m["peak_gib"] is None for m in r["models"].values()):
                return "no peak memory in the output"
            unprofiled = [a for a in r["models"] if a not in r["profiles"]] if profiled else []
            if unprofiled:
                return f"no profile of {unprofiled} in the output"
            return None
        return check

    generate_args = SMOKE_GENERATE_ARGS if stage.smoke else GPU_GENERATE_ARGS

    def generate_check(step):
        r = parsed["generate"] = parse_generate(log_lines_of(stage, step))
        passes = ("models", "compiled") if "--compile" in generate_args else ("models",)
        missing = [f"{p} {a}" for p in passes for a in GENERATE_MODELS if a not in r[p]]
        if missing:
            return f"no rows for {missing} in the output"
        if not stage.smoke and any(m["peak_gib"] is None for m in r["models"].values()):
            return "no peak memory in the output"
        return None

    def model_check(step):
        r = parsed["model"] = parse_model(log_lines_of(stage, step))
        missing = [f"{mode} {a}" for mode, *_ in MODEL_MODES for a in MODEL_ARCHS
                   if a not in r["modes"].get(mode, {})]
        return f"no prediction for {missing} in the output" if missing else None

    smoke_moe_env = {"TRITON_INTERPRET": "1"} if stage.smoke else None
    argv = {"moe": [python, "benchmarks/moe_gpu.py", *moe_args],
            "train": [python, "benchmarks/train_step.py",
                      *(SMOKE_TRAIN_STEP_ARGS if stage.smoke else GPU_TRAIN_STEP_ARGS)],
            "train-16k": [python, "benchmarks/train_step.py",
                          *(SMOKE_TRAIN_STEP_16K_ARGS if stage.smoke else GPU_TRAIN_STEP_16K_ARGS)],
            "generate": [python, "benchmarks/generate_throughput.py", *generate_args],
            "train-loop": [python, "benchmarks/train_step.py",
                           *(SMOKE_TRAIN_LOOP_ARGS if stage.smoke else GPU_TRAIN_LOOP_ARGS)],
            "train-graphs": [python, "benchmarks/train_step.py",
                             *(SMOKE_TRAIN_GRAPHS_ARGS if stage.smoke else GPU_TRAIN_GRAPHS_ARGS)],
            "model": ["bash", "-c", model_command(python, stage.smoke,
                                                  None if stage.smoke else stage.log_path)]}
    checks = {"moe": moe_check, "train": train_check("train", True),
              "train-16k": train_check("train-16k", False), "generate": generate_check,
              "train-loop": train_check("train-loop", not stage.smoke, LOOP_MODELS),
              "train-graphs": train_check("train-graphs", not stage.smoke, GRAPHS_MODELS),
              "model": model_check}
    for i, (key, required) in enumerate(plan):
        name, estimate, _ = BENCH_STEPS[key]
        later = sum(BENCH_STEPS[k][1] for k, _ in plan[i + 1:])
        if not required and not stage.smoke and stage.remaining() < estimate:
            stage.skip(name, f"not started: estimated {estimate} s, {stage.remaining():.0f} s left",
                       required=False)
            continue
        # a step may use the time the later steps' estimates leave, and at least its own
        timeout = max(min(estimate, stage.remaining()), stage.remaining() - later)
        moe = key == "moe"
        stage.run(name, argv[key], env=step_env(stage, python, smoke_moe_env) if moe else env,
                  env_prefix=smoke_moe_env if moe else None, estimate=estimate, timeout=timeout,
                  check=checks[key])
    stage.results.update({"moe_gpu": {"header": header.get("moe"), "rows": moe_rows,
                                      "wgrad_steps": wgrad_rows}})
    for key, result in (("train", "train_step"), ("train-16k", "train_step_16k"), ("generate", "generate"),
                        ("train-loop", "train_step_loop"), ("train-graphs", "train_step_graphs"),
                        ("model", "gpu_model")):
        if key in parsed:
            stage.results[result] = parsed[key]
    text = []
    if moe_rows:
        text += [f"MoE-FFD expert GEMMs ({header.get('moe') or ''}):", "",
                 "| tokens | pass | Triton ms | TFLOP/s | dense ms | TFLOP/s | reference ms | grouped_mm ms | TFLOP/s | Triton/dense | host syncs |",
                 "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        text += [f"| {r['tokens']} | {r['pass']} | {r['triton_ms']:.3f} | {r['triton_tflops']:.1f} | "
                 f"{r['dense_ms']:.3f} | {r['dense_tflops']:.1f} | {r['reference_ms']:.3f} | "
                 f"{r['grouped_ms']:.3f} | {r['grouped_tflops']:.1f} | "
                 f"{r['triton_over_dense']:.2f} | {r['host_syncs']} |" for r in moe_rows]
    if wgrad_rows:
        text += ["", "The up projection's weight gradient shared by the recurrence's steps "
                 "(SUT_WEIGHT_GRADS):", "",
                 "| steps | tokens per step | per step ms | deferred ms | per step / deferred |",
                 "|---:|---:|---:|---:|---:|"]
        text += [f"| {r['steps']} | {r['tokens']} | {r['per_step_ms']:.3f} | {r['deferred_ms']:.3f} | "
                 f"{r['per_step_over_deferred']:.2f} |" for r in wgrad_rows]
    for key, title in (("train", "One training step"), ("train-16k", "One training step, the large batch"),
                       ("train-loop", "One training step, --compile-loop"),
                       ("train-graphs", "One training step, CUDA graphs over the compiled loop")):
        if parsed.get(key, {}).get("models"):
            text += train_table(title, parsed[key])
    profiles = dict(parsed.get("train", {}).get("profiles", {}))
    for key, run in (("train-loop", "--compile-loop run"), ("train-graphs", "CUDA-graphs run")):
        profiles.update({f"{a} ({run})": r for a, r in parsed.get(key, {}).get("profiles", {}).items()})
    if profiles:
        text += ["", "One profiled step per model (`train_step.py --profile`; the operations are in "
                 f"`{stage.name}.log`):", "",
                 "| model | wall ms | kernel launches | aten calls | device busy ms | busy % |",
                 "|---|---:|---:|---:|---:|---:|"]
        for a, r in profiles.items():
            busy, wall = r["device_busy_ms"], r["wall_ms"]
            busy_cells = " | |" if busy is None else f"{busy:.1f} | {100 * busy / wall:.0f} |"
            text.append(f"| {a} | {wall:.1f} | {r['launches']} | {r['aten_calls']} | {busy_cells}")
    if parsed.get("model", {}).get("modes"):
        text += model_table(parsed["model"], parsed)
    if parsed.get("generate", {}).get("models"):
        text += generate_table(parsed["generate"])
        text += ["", "(Randomly initialised models: a sentence whose beams never end in </s> runs to "
                 "its batch's maximum length, int(max_len_a x source width + max_len_b), the same "
                 "work per sentence for every model.)"]
    if stage.smoke and text:
        text.insert(0, "(--smoke: CPU and Triton's interpreter; the numbers check the scripts and mean nothing)\n")
    if text:
        stage.extra_sections.append(("Results", "\n".join(text)))
