"""Helpers of the tests of the data-preparation command lines: run one and read what it
wrote."""
import os
import subprocess
import sys


def run_cli(script, *args):
    """Run ``python SCRIPT ARGS`` (each argument converted with ``str``); its
    CompletedProcess, output captured as text."""
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def read_lines(path):
    """The lines of a text file, without their newlines."""
    with open(path) as handle:
        return handle.read().splitlines()


def check_refusals(script, out, cases):
    """Every ``(arguments, message)`` of ``cases`` is refused with exit status 2 and the
    message on stderr, and leaves no ``out`` behind."""
    for args, message in cases:
        bad = run_cli(script, "--out", out, *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert not os.path.exists(out)


def run_binarized(script, out, *args):
    """``SCRIPT --out OUT ARGS --binarize``, which must succeed; its CompletedProcess."""
    result = run_cli(script, "--out", out, *args, "--binarize")
    assert result.returncode == 0, result.stderr
    return result
