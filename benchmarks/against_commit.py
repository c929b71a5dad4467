"""Run one benchmark on an earlier commit and on the working tree, in turns, on this machine.

A CPU's speed moves from day to day and from machine to machine (the WMT-sized training
step ran at 0.48x to 0.86x the transformer on different days' machines), so "no
regression" is a comparison made in one session: the same benchmark, the earlier code and
today's, alternately, each ratio it prints collected per side.

    python benchmarks/against_commit.py COMMIT [--rounds 2] [--match REGEX] \\
        -- benchmarks/train_step.py --threads 2

The earlier commit is checked out in a temporary ``git worktree`` (removed at the end);
each run is ``python SCRIPT ARGS`` with the tree as its working directory and first on
``PYTHONPATH``, so that the benchmark imports that tree's ``sut_fairseq`` (the installed
package is this checkout's, in editable mode). The two sides swap order every round
(the earlier commit first in odd rounds), so a drift of the machine's speed during the
runs weighs on both. Each run's output is printed as it comes, prefixed by side and round; the
lines that match ``--match`` (default: the ratio lines, ``... tokens/s: X``) are collected,
and the end is one line per collected line's label (the text before its number; with a
group in ``--match``, e.g. ``"(\\d+) ms/step"`` for each model's time, the group is the
number)::

    against COMMIT: LABEL: earlier A1 A2 (mean A), today T1 T2 (mean T), today / earlier R

A run that fails stops the comparison with its exit status and the last lines of its
output.
"""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
#: the number a matched line reports: the first one that follows a ": "
VALUE = re.compile(r":\s*(-?\d+(?:\.\d+)?)")


def git(*args: str) -> subprocess.CompletedProcess:
    """``git ARGS`` in this repository, its output captured."""
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def label_and_value(found: re.Match) -> Optional[Tuple[str, float]]:
    """(label, value) of a line that ``--match`` selected (``found``, its match). Where the
    pattern has a group, the value is its first group's number and the label the line
    before it ('sut_base   17115 ms/step' with ``(\\d+) ms/step``: ('sut_base', 17115.0));
    else the first number that follows a ': ' and the text before that ('sut_base /
    transformer tokens/s: 0.72 (goal >= 0.6; at ...: 0.43)': ('sut_base / transformer
    tokens/s', 0.72)). None where there is no number (the line is printed, not summarised)."""
    line = found.string
    if found.re.groups:
        try:
            return line[: found.start(1)].strip().rstrip(":").rstrip(), float(found.group(1))
        except (TypeError, ValueError):  # the group did not take part, or is not a number
            return None
    first = VALUE.search(line)
    if first is None:
        return None
    return line[: first.start()].strip(), float(first.group(1))


def run_side(tree: str, command: List[str], match: re.Pattern, prefix: str) -> List[re.Match]:
    """``python COMMAND`` in ``tree`` with the tree first on PYTHONPATH; its standard output
    printed line by line as it comes (prefixed); the matches of the lines ``match`` selects."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    print(f"+ (cd {tree} && python {' '.join(command)})", flush=True)
    selected, printed = [], []
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([sys.executable, *command], cwd=tree, env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                printed.append(line)
                print(f"{prefix}: {line}", flush=True)
                found = match.search(line)
                if found:
                    selected.append(found)
        finally:  # interrupted (Ctrl-C, SIGTERM): the benchmark stops too
            if proc.poll() is None and sys.exc_info()[0] is not None:
                proc.terminate()
        if proc.wait():
            err.seek(0)
            tail = ("\n".join(printed) + "\n" + err.read())[-3000:]
            raise SystemExit(f"against_commit: {prefix}: the benchmark exited with {proc.returncode}:\n{tail}")
    return selected


def summary(commit: str, values: Dict[str, Dict[str, List[float]]]) -> List[str]:
    """One line per label: both sides' values, their means and today / earlier."""
    rows = []
    for label, sides in values.items():
        earlier, today = sides.get("earlier", []), sides.get("today", [])
        if not earlier or not today:
            continue
        a, t = statistics.mean(earlier), statistics.mean(today)
        ratio = f"{t / a:.3f}" if a else "n/a"
        rows.append(f"against {commit}: {label}: earlier {' '.join(f'{v:g}' for v in earlier)} (mean {a:.3f}), "
                    f"today {' '.join(f'{v:g}' for v in today)} (mean {t:.3f}), today / earlier {ratio}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commit", help="the earlier commit (any name git knows)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side (default 2)")
    parser.add_argument("--match", default=r"tokens/s: \d",
                        help="regular expression of the output lines to collect (default: the ratios); "
                             "its first group, if any, is the number to compare")
    parser.usage = "%(prog)s COMMIT [--rounds N] [--match REGEX] -- SCRIPT [ARGS]"
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]  # the benchmark, a path relative to the repository, and its arguments
    if not command:
        parser.error("no benchmark given: add -- SCRIPT [ARGS], e.g. -- benchmarks/train_step.py --threads 2")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    try:
        match = re.compile(args.match)
    except re.error as err:
        parser.error(f"--match {args.match!r} is not a regular expression: {err}")
    found = git("rev-parse", "--verify", "--quiet", f"{args.commit}^{{commit}}")
    sha = found.stdout.strip()
    if found.returncode or not sha:
        parser.error(f"{args.commit!r} is not a commit of {ROOT}")
    if not os.path.exists(os.path.join(ROOT, command[0])):
        parser.error(f"{command[0]!r}: no such file in {ROOT}")
    print(f"against_commit: {args.commit} ({sha[:12]}) and the working tree, {args.rounds} round(s) of "
          f"python {' '.join(command)}", flush=True)
    # SIGTERM as an exception, so that the worktree is removed and the run stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parent = tempfile.mkdtemp(prefix="against-commit-")
    tree = os.path.join(parent, "earlier")
    added = git("worktree", "add", "--detach", tree, sha)
    if added.returncode:
        raise SystemExit(f"against_commit: git worktree add failed: {added.stderr.strip()}")
    values: Dict[str, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    try:
        if not os.path.exists(os.path.join(tree, command[0])):
            raise SystemExit(f"against_commit: {command[0]!r} does not exist at {args.commit}")
        for r in range(1, args.rounds + 1):
            sides = [("earlier", tree), ("today", ROOT)]
            for side, where in (sides if r % 2 else sides[::-1]):
                for selected in run_side(where, command, match, f"{side} {r}"):
                    found = label_and_value(selected)
                    if found is not None:
                        values[found[0]][side].append(found[1])
    finally:
        git("worktree", "remove", "--force", tree)
        shutil.rmtree(parent, ignore_errors=True)
    for row in summary(args.commit, values):
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
