"""Test support for the kernels: interpreter/compiler modes and child pytest processes.

Triton decides when ``triton`` is imported whether ``@triton.jit`` functions, its own
standard library (``tl.sum``, ``tl.cdiv``, ...) included, are interpreted
(``TRITON_INTERPRET=1``) or compiled, so one process can interpret kernels or compile
them, not both; and setting ``TRITON_INTERPRET`` inside a shared pytest process would leak
into every later import and subprocess. A test module that needs a mode this process lacks
therefore re-runs its selected tests in a child ``python -m pytest`` whose environment
has the right setting from the start, and each test here reports its child's outcome
(``delegate_module``).
"""
import functools
import inspect
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

CHILD_FLAG = "SUT_KERNEL_TESTS_CHILD"


def interpreter_active() -> bool:
    """Whether Triton runs in interpreter mode in this process (imports triton)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def compiler_active() -> bool:
    """Whether Triton kernels can be compiled (ahead of time) in this process."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return isinstance(tl.sum, JITFunction)


def run_pytest_child(nodeids, rootdir, env_updates, timeout=900):
    """Run ``pytest nodeids`` in a child process; returns ``({name: (outcome, text)}, log)``.

    ``env_updates`` maps variables to values (None removes one). Outcomes are "passed",
    "failed", "error" or "skipped", read from the child's JUnit XML.
    """
    env = dict(os.environ)
    for key, value in env_updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env[CHILD_FLAG] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "results.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={xml}", "--rootdir", str(rootdir), *nodeids]
        try:
            proc = subprocess.run(cmd, cwd=str(rootdir), env=env, capture_output=True, text=True,
                                  timeout=timeout)
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            return {}, f"child pytest timed out after {timeout} s:\n{err.stdout or ''}"
        results = {}
        if os.path.exists(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                outcome, text = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        outcome = {"failure": "failed"}.get(tag, tag)
                        text = (node.get("message") or "") + "\n" + (node.text or "")
                        break
                results[case.get("name")] = (outcome, text)
        return results, log


def delegate_module(namespace: dict, env_updates: dict) -> None:
    """Make every ``test_*`` function in ``namespace`` report the outcome of the same test
    run in a child pytest process with ``env_updates`` (one child per module and session,
    running the tests selected in this one)."""
    if os.environ.get(CHILD_FLAG) == "1":
        raise RuntimeError("the child test process lacks the Triton mode it was started for")
    cache = {}

    def outcome(request):
        if "results" not in cache:
            module_file = request.node.fspath
            nodeids = [item.nodeid for item in request.session.items if item.fspath == module_file]
            cache["results"] = run_pytest_child(nodeids, request.config.rootpath, env_updates)
        results, log = cache["results"]
        return results.get(request.node.name, ("missing", log[-6000:]))

    def make_proxy(fn):
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        if "request" not in sig.parameters:
            params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD))

        @functools.wraps(fn)
        def proxy(*args, **kwargs):
            import pytest

            result, text = outcome(kwargs["request"])
            if result == "skipped":
                pytest.skip(text.strip().splitlines()[0] if text.strip() else "skipped in child")
            if result != "passed":
                pytest.fail(f"[{result} in the child pytest process]\n{text}", pytrace=False)

        proxy.__signature__ = sig.replace(parameters=params)
        return proxy

    for name, value in list(namespace.items()):
        if name.startswith("test_") and inspect.isfunction(value):
            namespace[name] = make_proxy(value)
