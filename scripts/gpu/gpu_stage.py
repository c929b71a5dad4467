"""The stage of the GPU validation driver: runs its steps one after the other under the
stage deadline, prints every command before it runs, logs every step's output, and keeps
OUT's ``summary.md``, ``results.json`` and ``STAGE.log`` current (after every step and
every REFRESH_S seconds while one runs), so a command killed at the node's limit still
leaves them."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from gpu_common import (FAILED, PASSED, REPO, SKIPPED, NodeOptions, deadline_s, fmt_command,
                        log_lines_of, read_capped, write_atomic)

#: While a step runs, its log and summary.md in OUT are refreshed this often (seconds).
REFRESH_S = 20


class Stage:
    """Runs steps, logs them, keeps OUT's summary.md / results.json / STAGE.log current."""

    def __init__(self, name, out, smoke, options=None):
        self.name, self.out, self.smoke = name, os.path.abspath(out), smoke
        self.options = options or NodeOptions()
        self.start = time.time()
        self.deadline_s = deadline_s(smoke, self.options.time_limit_s)   # read from the environment once
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
        limit = self.options.max_files - 1  # one more for a temporary at any time
        if len(self.out_files) > limit:
            raise RuntimeError(f"more than {limit} files planned for OUT: {sorted(self.out_files)}")

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
        step that may run past the deadline: the time limit leaves room for it)."""
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
            write_atomic(os.path.join(self.out, f"{self.name}.log"), read_capped(self.log_path, self.options.max_log_bytes))
            for out_name, path in self.extra_logs.items():
                if os.path.exists(path):
                    write_atomic(os.path.join(self.out, out_name), read_capped(path, self.options.max_log_bytes))
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
            "deadline_s": self.deadline_s, "node": self.options.as_dict(),
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
                 f"- node limits: {self.options.time_limit_s} s per command, at most "
                 f"{self.options.max_files} files of at most {self.options.max_file_mib} MiB from OUT",
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
                  + f" (at most {self.options.max_files}). The output of every step is in "
                  f"`{self.name}.log`, in order, each after its `+ command` line.", ""]
        return "\n".join(lines)

