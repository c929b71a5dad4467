"""The ``cpvr`` stage: the C-PVR recipe (``scripts/cpvr/hops.py``, the ``gpu``
configuration) for the UT, the SUT and Hyper-UT trained side by side under one
wall-clock cap, evaluated side by side on hops 1-9, then reported (``hops.md``,
``accuracy.png``, ``depth.png`` into OUT). A later call on the same (warm) machine
continues the same runs with a new cap."""
import json
import os

from gpu_common import PASSED, REPO, collect_run, step_env, write_atomic
from gpu_logic_plan import SMOKE_MAX_UPDATE

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

#: Each model's process, side by side: ``bash -c SCRIPT cpvr PYTHON ARGS...`` runs
#: ``PYTHON ARGS... --models M`` for every model M given after ``--`` and fails when one does.
SIDE_BY_SIDE = ('py=$1; shift; args=(); while [ "$1" != -- ]; do args+=("$1"); shift; done; shift; '
                'pids=(); for m in "$@"; do "$py" "${args[@]}" --models "$m" & pids+=($!); done; '
                'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc')


def side_by_side(python, args, models):
    """The command that runs ``python args... --models M`` for every model at once."""
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

