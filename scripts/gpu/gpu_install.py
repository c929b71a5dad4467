"""The first two steps of every stage: make sure a Python imports fairseq and sut_fairseq
(or make one: a venv over the Python with torch, then ``make install-offline``), and
record the environment (device, versions, where sut_fairseq is imported from, the
checkout's commit)."""
import json
import os
import shutil
import sys
import tempfile
import time

from gpu_common import FAILED, PASSED, REPO, log_lines_of, step_env

#: make install-offline on a fresh node: fairseq-fixed is built from its sdist (its C++,
#: Cython and torch extensions took about 2 of the 4.5 minutes of a fresh `make install`
#: on the 2-core machine; the build is mostly serial, the node's cores are faster), then
#: wheels from the local wheelhouse. 0 when the venv of an earlier stage on the same
#: (still warm) machine is found. Measured (2026-11-26): 122.5 and 124.5 s on an H200 node,
#: 177.4 s on an H100 node.
INSTALL_ESTIMATE_S = 180
#: versions and device query (imports torch, fairseq and sut_fairseq once); measured 6-7 s.
ENV_ESTIMATE_S = 10


def resolve(path):
    """An executable's absolute path (a name is looked up on PATH), or None."""
    found = shutil.which(path) if os.sep not in path else (path if os.access(path, os.X_OK) else None)
    return os.path.abspath(found) if found and os.sep in found else found


def venv_dir():
    """The stage venv: SUT_GPU_VENV, by default outside the repository."""
    return os.path.abspath(os.environ.get("SUT_GPU_VENV")
                           or os.path.join(tempfile.gettempdir(), "sut-gpu", "venv"))


def candidate_pythons():
    """The Pythons that may already import the package: PYTHON alone when set."""
    if os.environ.get("PYTHON"):
        return [os.environ["PYTHON"]]
    seen, out = set(), []
    for c in (os.path.join(REPO, ".venv", "bin", "python"), os.path.join(venv_dir(), "bin", "python"),
              "python3", "python", sys.executable):
        path = resolve(c)
        if path and path not in seen:
            seen.add(path)
            out.append(path)
    return out


IMPORT_CHECK = "import fairseq, sut_fairseq"


def ensure_package(stage):
    """Find a Python that imports fairseq and sut_fairseq, or make one (venv + make
    install-offline). Records ``stage.install``; returns the Python or None."""
    env = step_env(stage)
    force = os.environ.get("SUT_GPU_FORCE_INSTALL") == "1"
    for python in ([] if force else candidate_pythons()):
        proc = stage.query([python, "-c", IMPORT_CHECK], env=env)
        if proc is not None and proc.returncode == 0:
            stage.install = {"status": "skipped", "needed": False, "python": python, "seconds": 0.0,
                             "summary": f"skipped: `{IMPORT_CHECK}` works in {python}"}
            stage.say(f"== install: skipped ({IMPORT_CHECK} works in {python})")
            return python
    if force:
        stage.say("== install: SUT_GPU_FORCE_INSTALL=1: installing into the venv without looking "
                  "for an importable package first")
    elif os.environ.get("PYTHON"):
        stage.install = {"status": FAILED, "needed": True,
                         "summary": f"PYTHON={os.environ['PYTHON']} cannot `{IMPORT_CHECK}`"}
        stage.fail("install", stage.install["summary"] + " (unset PYTHON to install into a venv)")
        return None

    # the install runs without the checkout on PYTHONPATH: make install-offline's last check
    # must import the installed sut_fairseq, not the checkout's
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.time()
    venv = venv_dir()
    vpy = os.path.join(venv, "bin", "python")
    wheelhouse = os.path.abspath(os.environ.get("WHEELHOUSE") or os.path.join(REPO, "wheelhouse"))
    stage.install = {"status": "running", "needed": True, "venv": venv, "wheelhouse": wheelhouse}
    # the Python with torch
    base = None
    chosen = stage.options.base_python or os.environ.get("SUT_BASE_PYTHON")
    for c in ([chosen] if chosen else []) + \
             ["python3", "python", sys.executable]:
        path = resolve(c)
        if not path:
            continue
        proc = stage.query([path, "-c", "import torch"], env=env)
        if proc is not None and proc.returncode == 0:
            base = path
            break
    if base is None:
        stage.install.update(status=FAILED, summary="no Python here imports torch")
        stage.fail("install", "no Python here imports torch (pass --base-python or set SUT_BASE_PYTHON)")
        return None
    stage.install["base_python"] = base
    if not os.path.exists(vpy):
        step = stage.run("install: venv", [base, "-m", "venv", "--system-site-packages", venv],
                         env=env, estimate=10)
        if step["status"] != PASSED:  # e.g. no ensurepip: pip then comes from the base (below)
            shutil.rmtree(venv, ignore_errors=True)
            step = stage.run("install: venv without pip",
                             [base, "-m", "venv", "--system-site-packages", "--without-pip", venv],
                             env=env, estimate=5)
            if step["status"] != PASSED:
                stage.install.update(status=FAILED, summary="creating the venv failed")
                return None
    # A venv made from a venv's Python sees the *base* interpreter's site-packages, not
    # that venv's (GPU images often ship torch in such a venv): add them by a .pth.
    proc = stage.query([vpy, "-c", "import torch"], env=env)
    if proc is None or proc.returncode != 0:
        proc = stage.query([base, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"], env=env)
        dirs = json.loads(proc.stdout) if proc is not None and proc.returncode == 0 else []
        proc = stage.query([vpy, "-c", "import site; print(site.getsitepackages()[0])"], env=env)
        if not dirs or proc is None or proc.returncode != 0:
            stage.install.update(status=FAILED, summary="could not find the site-packages of " + base)
            stage.fail("install", stage.install["summary"])
            return None
        pth = os.path.join(proc.stdout.strip(), "_sut_gpu_base_site.pth")
        stage.say(f"== install: {vpy} does not import torch; adding {', '.join(dirs)} through {pth}")
        with open(pth, "w") as handle:
            handle.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
        stage.install["pth"] = pth
    make = shutil.which("make")
    if make is None:
        stage.install.update(status=FAILED, summary="`make` is not on PATH")
        stage.fail("install", "`make` is not on PATH (make install-offline needs it)")
        return None
    # NODE_HAS (the Makefile's: what the node has, left out of the wheelhouse and the
    # install) is passed on when set, e.g. NODE_HAS='$(CUDA_IMAGE_HAS)'
    node_has = [f"NODE_HAS={os.environ['NODE_HAS']}"] if os.environ.get("NODE_HAS") else []
    stage.install["node_has"] = os.environ.get("NODE_HAS")
    step = stage.run("install: make install-offline",
                     [make, "-C", REPO, "install-offline", f"WHEELHOUSE={wheelhouse}", f"PY={vpy}",
                      *node_has],
                     env={k: v for k, v in env.items() if k != "NODE_HAS"}, estimate=INSTALL_ESTIMATE_S)
    ok = step["status"] == PASSED
    if ok:
        proc = stage.query([vpy, "-c", IMPORT_CHECK], env=step_env(stage))
        ok = proc is not None and proc.returncode == 0
    seconds = round(time.time() - started, 1)
    stage.install.update(status=PASSED if ok else FAILED, seconds=seconds, python=vpy if ok else None,
                         summary=(f"installed into {venv} in {seconds:.0f} s (make install-offline "
                                  f"WHEELHOUSE={wheelhouse})" if ok else
                                  f"FAILED after {seconds:.0f} s (see the install steps)"))
    return vpy if ok else None


ENV_QUERY = r"""
import json, os, platform, sys
info = {"python": platform.python_version(), "python_path": sys.executable}
import torch
info["torch"] = torch.__version__
info["torch_cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
info["torch_threads"] = torch.get_num_threads()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}"
    info["bf16"] = torch.cuda.is_bf16_supported()
try:
    import triton
    info["triton"] = triton.__version__
except Exception as err:
    info["triton"] = f"not importable ({type(err).__name__})"
import fairseq, sut_fairseq
info["fairseq"] = getattr(fairseq, "__version__", "?")
info["sut_fairseq_path"] = os.path.dirname(sut_fairseq.__file__)
try:
    from importlib.metadata import version
    info["sut_fairseq"] = version("sut-fairseq")
except Exception:
    info["sut_fairseq"] = "not installed (the checkout)"
print("ENV " + json.dumps(info))
"""


def collect_environment(stage, python):
    """The 'environment' step: versions and device; on a GPU run it fails without CUDA."""
    found = {}

    def check(step):
        for line in log_lines_of(stage, step):
            if line.startswith("ENV "):
                found.update(json.loads(line[4:]))
        if not found:
            return "no ENV line in the output"
        if not stage.smoke and not found.get("cuda_available"):
            return "torch sees no CUDA device (use --smoke on a CPU machine)"
        return None

    script = os.path.join(stage.work, "env_query.py")
    with open(script, "w") as handle:
        handle.write(ENV_QUERY.lstrip())
    stage.run("environment", [python, script], env=step_env(stage, python),
              estimate=ENV_ESTIMATE_S, check=check)
    if not found.get("device"):
        found["device"] = "CPU (no CUDA device)" if not found.get("cuda_available") else "?"
    smi = shutil.which("nvidia-smi")
    if smi:
        proc = stage.query([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           timeout=30)
        if proc is not None and proc.returncode == 0:
            found["nvidia_smi"] = proc.stdout.strip()
            found["device"] += f" (nvidia-smi: {found['nvidia_smi']})"
    if os.path.isdir(os.path.join(REPO, ".git")) and shutil.which("git"):
        head = stage.query(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], timeout=30)
        dirty = stage.query(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], timeout=30)
        if head is not None and head.returncode == 0:
            n = len(dirty.stdout.splitlines()) if dirty is not None and dirty.returncode == 0 else 0
            found["git"] = head.stdout.strip() + (f" + {n} modified tracked files" if n else "")
    stage.info.update(found)

