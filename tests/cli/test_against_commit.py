"""benchmarks/against_commit.py: a benchmark run on an earlier commit and on the working tree
in turns, each side importing its own code, in a small git repository made for the test."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
BENCH = """import os, sys, time
import pkg
if "--fail" in sys.argv:
    sys.exit("broken on purpose")
if "--slow" in sys.argv:
    print(f"pid: {os.getpid()}", flush=True)
    time.sleep(120)
print("noise line 1.5")
print(f"model {int(pkg.VALUE * 10)} ms/step")
print(f"model / baseline tokens/s: {pkg.VALUE} (goal >= 0.5; at peak: 9.9)")
"""


def git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env=dict(os.environ, **GIT_ENV))


@pytest.fixture
def repo(tmp_path):
    """A repository whose package reports 1.0 at its first commit, 2.0 at HEAD and 3.0 in
    the working tree (uncommitted)."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "pkg").mkdir()
    shutil.copy(os.path.join(ROOT, "benchmarks", "against_commit.py"), repo / "benchmarks")
    (repo / "benchmarks" / "fake.py").write_text(BENCH)
    git(repo, "init", "-q")
    for value in ("1.0", "2.0"):
        (repo / "pkg" / "__init__.py").write_text(f"VALUE = {value}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", value)
    (repo / "pkg" / "__init__.py").write_text("VALUE = 3.0\n")
    return repo


def run(repo, *args):
    return subprocess.run([sys.executable, str(repo / "benchmarks" / "against_commit.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_each_side_runs_its_own_code_in_alternating_order(repo):
    out = run(repo, "HEAD~1", "--rounds", "3", "--", "benchmarks/fake.py")
    assert out.returncode == 0, out.stderr
    sides = re.findall(r"^(earlier|today) (\d): model / baseline tokens/s: (\S+) ", out.stdout, re.M)
    assert sides == [("earlier", "1", "1.0"), ("today", "1", "3.0"),
                     ("today", "2", "3.0"), ("earlier", "2", "1.0"),
                     ("earlier", "3", "1.0"), ("today", "3", "3.0")], out.stdout
    assert out.stdout.count("noise line 1.5") == 6  # every line shown, only the ratio summarised
    assert "against HEAD~1: noise" not in out.stdout
    assert re.search(r"^against HEAD~1: model / baseline tokens/s: earlier 1 1 1 \(mean 1\.000\), "
                     r"today 3 3 3 \(mean 3\.000\), today / earlier 3\.000$", out.stdout, re.M), out.stdout
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True, text=True)
    assert len(worktrees.stdout.strip().splitlines()) == 1, worktrees.stdout  # removed again


def test_match_selects_other_lines(repo):
    out = run(repo, "HEAD", "--rounds", "1", "--match", "^noise", "--", "benchmarks/fake.py")
    assert out.returncode == 0, out.stderr
    assert "against HEAD" not in out.stdout  # a line with no ": NUMBER" is shown, not summarised
    assert "earlier 1: noise line 1.5" in out.stdout and "today 1: noise line 1.5" in out.stdout
    assert "against HEAD: model" not in out.stdout  # not selected by --match


@pytest.mark.parametrize("args, message", [
    (["no-such-ref", "--", "benchmarks/fake.py"], "'no-such-ref' is not a commit"),
    (["HEAD", "--", "benchmarks/missing.py"], "'benchmarks/missing.py': no such file"),
    (["HEAD"], "no benchmark given"),
    (["HEAD", "--rounds", "0", "--", "benchmarks/fake.py"], "--rounds 0: at least 1"),
    (["HEAD", "--match", "(", "--", "benchmarks/fake.py"], "is not a regular expression"),
])
def test_bad_arguments_are_named(repo, args, message):
    out = run(repo, *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_failing_benchmark_stops_with_its_output(repo):
    out = run(repo, "HEAD", "--", "benchmarks/fake.py", "--fail")
    assert out.returncode != 0
    assert "earlier 1: the benchmark exited with 1" in out.stderr and "broken on purpose" in out.stderr
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True, text=True)
    assert len(worktrees.stdout.strip().splitlines()) == 1, worktrees.stdout


def test_a_terminated_comparison_stops_its_benchmark_and_removes_the_worktree(repo):
    tool = subprocess.Popen([sys.executable, str(repo / "benchmarks" / "against_commit.py"), "HEAD",
                             "--", "benchmarks/fake.py", "--slow"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in tool.stdout:  # the benchmark has started when it prints its pid
        if line.startswith("earlier 1: pid: "):
            pid = int(line.split()[-1])
            break
    tool.terminate()
    assert tool.wait(timeout=60) == 128 + signal.SIGTERM
    for _ in range(100):  # the benchmark was told to stop too
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the benchmark outlived the comparison")
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True, text=True)
    assert len(worktrees.stdout.strip().splitlines()) == 1, worktrees.stdout


def test_a_group_in_match_is_the_number_compared(repo):
    """``--match`` with a group: the group's number, labelled by the text before it (a line
    whose group is not a number is shown, not summarised)."""
    out = run(repo, "HEAD~1", "--rounds", "1", "--match", r"(\d+) ms/step|noise line (x)?", "--",
              "benchmarks/fake.py")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^against HEAD~1: model: earlier 10 \(mean 10\.000\), "
                     r"today 30 \(mean 30\.000\), today / earlier 3\.000$", out.stdout, re.M), out.stdout
    assert "against HEAD~1: noise" not in out.stdout and "tokens/s: earlier" not in out.stdout
