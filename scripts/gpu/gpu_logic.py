"""The two logic stages: the logic Table 5 recipe (``scripts/logic/table5.py``, the
``full`` configuration under a wall-clock cap per run) for the runs of the stage's plan
(``gpu_logic_plan.py``): the data generated and prepared once per machine, each run
trained and evaluated, then Table 5 and Figure 4 (``summarize.py``) written into OUT."""
import json
import os
import shutil

from gpu_common import PASSED, REPO, collect_run, key_order, step_env
from gpu_logic_plan import (LOGIC_ANALYSIS_ESTIMATE_S, LOGIC_BUCKETS, LOGIC_GENERATE_CALL_S,
                            LOGIC_GENERATE_ESTIMATE_S, LOGIC_PAIRS, LOGIC_PREPARE_ESTIMATE_S,
                            LOGIC_SUMMARY_ESTIMATE_S, LOGIC_TRAIN_CAP_S, LOGIC_TRAIN_OVERHEAD_S,
                            ORIGINAL_FILES, SMOKE_BUCKETS, SMOKE_MAX_UPDATE, SMOKE_PAIRS,
                            SMOKE_STOP_TIME_HOURS, SMOKE_TRAIN_ARGS, logic_plan, run_estimate)
from gpu_install import INSTALL_ESTIMATE_S


def stage_logic(stage, python):
    """Data, the plan's runs in order (optional ones only when their estimate fits in the
    time left), then Table 5 and Figure 4 into OUT."""
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
        # the SUT paper's Table 5: the translation setup (the recipe's default is classify)
        argv = [python, os.path.join(scripts, "table5.py"), "--setup", "seq2seq", "--data-dir", data,
                "--work-dir", work, "--models", model, "--protocols", protocol, "--seeds", "1", "--buckets", buckets,
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


def logic_sections(stage, runs):
    """summary.md's time budget and results sections of a logic stage."""
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
        keys = sorted({k for r in runs for k in (r.get("accuracy") or {})}, key=key_order)
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
            dkeys = sorted({k for r in depth_runs for k in r["encoder_mean_depth"]}, key=key_order)
            rows += ["", "Figure 4 (average encoder halting depth per number of operators, "
                     "teacher-forced, standard protocol):", "",
                     "| model | " + " | ".join(dkeys) + " |", "|---|" + "---:|" * len(dkeys)]
            rows += [f"| {r['model']} | " + " | ".join(
                "" if r["encoder_mean_depth"].get(k) is None else f"{r['encoder_mean_depth'][k]:.2f}"
                for k in dkeys) + " |" for r in depth_runs]
        stage.extra_sections.append(("Results (accuracy %, per bucket / split)", "\n".join(rows)
                                     + "\n\n`table5.md`, `table5.json` and `figure4.png` (when a model "
                                     "with halting finished) are summarize.py's, written into OUT."))

