"""scripts/mutation.py (``make mutation``) without mutmut: which mutants a module's run
tries again, and how the "Equivalent mutants" table of docs/testing.md is read."""
import importlib.util
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture
def mutation():
    spec = importlib.util.spec_from_file_location("mutation_script", os.path.join(ROOT, "scripts", "mutation.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeMutmut:
    """Stands in for ``mutmut``: a ``run`` without names gives every mutant its status in
    ``first`` (the module's first run) and keeps the others; a ``run`` with names moves
    them to their status in ``after``. Records each run's names."""

    def __init__(self, first, after):
        self.status, self.first, self.after, self.runs = {}, first, after, []

    def run(self, workdir, *args, check=True):
        names = list(args[3:])
        self.runs.append(names)
        if not names:
            self.status = {**self.first, **self.status}
        for name in names:
            self.status[name] = self.after.get(name, self.status[name])
        return type("Done", (), {"returncode": 0})()

    def results(self, workdir):
        return dict(self.status)


def workdir_with_tests(tmp_path, text):
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "test_m.py").write_text(text)
    (tmp_path / "mutants").mkdir(exist_ok=True)
    return str(tmp_path)


def test_timeouts_are_tried_again_and_survivors_only_when_the_tests_changed(mutation, monkeypatch, tmp_path):
    status = {"m__mutmut_1": "killed", "m__mutmut_2": "survived", "m__mutmut_3": "timeout"}
    fake = FakeMutmut(status, {"m__mutmut_3": "survived"})
    monkeypatch.setattr(mutation, "mutmut", fake.run)
    monkeypatch.setattr(mutation, "results", fake.results)
    work = workdir_with_tests(tmp_path, "def test_a(): pass\n")
    # the module's first run: the timeout is tried again, nothing else
    assert mutation.run_module(work, ("test_m.py",), 1)
    assert fake.runs == [[], ["m__mutmut_3"]]
    assert fake.status["m__mutmut_3"] == "survived"   # a timeout of a loaded machine is not a kill
    # the same tests again: nothing is retried
    fake.runs.clear()
    assert mutation.run_module(work, ("test_m.py",), 1)
    assert fake.runs == [[]]
    # a sharper test: the survivors are tried again
    workdir_with_tests(tmp_path, "def test_a(): assert True\n")
    fake.runs.clear()
    assert mutation.run_module(work, ("test_m.py",), 1)
    assert fake.runs == [[], ["m__mutmut_2", "m__mutmut_3"]]
    # results of an unknown test state (no stamp): the survivors are tried again too
    os.remove(os.path.join(work, "mutants", "tests.sha256"))
    fake.runs.clear()
    assert mutation.run_module(work, ("test_m.py",), 1)
    assert fake.runs == [[], ["m__mutmut_2", "m__mutmut_3"]]


def test_the_equivalent_table_is_read_from_the_testing_page(mutation, monkeypatch, tmp_path):
    doc = tmp_path / "testing.md"
    doc.write_text("# Testing\n\n## Equivalent mutants\n\n| mutant | change | why |\n|---|---|---|\n"
                   "| `a.b.x_f__mutmut_3` | `<` as `<=` | never equal here |\n"
                   "| `a.b.x_g__mutmut_1`, `a.b.x_g__mutmut_2` | two casts | exact either way |\n\n"
                   "## Next section\n\n| `a.b.x_h__mutmut_9` | outside the table | no |\n")
    monkeypatch.setattr(mutation, "DOC", str(doc))
    assert mutation.equivalent_mutants() == {"a.b.x_f__mutmut_3": "never equal here",
                                            "a.b.x_g__mutmut_1": "exact either way",
                                            "a.b.x_g__mutmut_2": "exact either way"}


def test_the_report_leaves_untried_mutants_and_equivalents_out_of_the_score(mutation, monkeypatch, capsys):
    monkeypatch.setattr(mutation, "discover", lambda: {"pkg/a.py": ("test_a.py",), "pkg/b.py": ("test_b.py",)})
    monkeypatch.setattr(mutation, "equivalent_mutants", lambda: {"a__mutmut_4": "same values",
                                                                 "a__mutmut_1": "wrongly listed"})
    status = {"a": {"a__mutmut_1": "killed", "a__mutmut_2": "timeout", "a__mutmut_3": "survived",
                    "a__mutmut_4": "survived", "a__mutmut_5": "not checked"},
              "b": {"b__mutmut_1": "not checked"}}
    monkeypatch.setattr(mutation, "results", lambda workdir: status[workdir[-1]])
    assert mutation.main(["--report", "--workdir", "/w"]) == 0
    out = capsys.readouterr().out
    assert "| pkg/a.py | 3 | 2 | 66.7 % | 1 | 1 | 1 |" in out
    assert "| pkg/b.py | 0 | 0 | not run | 0 | 0 | 1 |" in out
    assert "survivor: a__mutmut_3 (survived)" in out and "a__mutmut_4 (" not in out
    assert "not tried yet (left out of the score): 2 mutants" in out
    # a listed mutant that a test kills counts as killed, and the table is said to be wrong
    assert "listed as equivalent but killed (take it out of the table): a__mutmut_1" in out
    assert out.strip().splitlines()[-1] == "mutation score: 2 killed of 3 (66.7%)"


def test_targets_name_test_files_found_in_their_concept_folders(mutation, capsys):
    """TARGETS names test files; a module's run gets each as its path under tests/ (a
    name that no file has fails here, not hours into ``make mutation``)."""
    targets = mutation.discover()
    assert targets["sut_fairseq/modules/halting.py"] == (
        "halting/test_halting_per_position.py", "halting/test_halting_rules.py")
    for module, tests in targets.items():
        for path in tests:
            assert os.path.isfile(os.path.join(ROOT, "tests", path)), (module, path)


def git(repo, *args):
    import subprocess

    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_changed_since_names_the_functions_whose_code_changed(mutation, monkeypatch, tmp_path):
    """--changed-since REV: a function whose docstring alone changed keeps its mutants out;
    a changed method, a new function and a changed function each give their mutmut glob
    (methods as ``xǁClassǁname``); a module new since REV is whole (None); an unknown
    revision is refused by name."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "m.py").write_text(
        'def f(x):\n    """Old words."""\n    return x + 1\n\n\n'
        'def g(x):\n    return x * 2\n\n\n'
        'class C:\n    def keep(self):\n        return 1\n\n    def g(self, y):\n        return y - 1\n')
    git(repo, "init", "-q"), git(repo, "add", "."), git(repo, "commit", "-qm", "base")
    (repo / "pkg" / "m.py").write_text(
        'def f(x):\n    """New words, same code."""\n    return x + 1\n\n\n'
        'def g(x):\n    return x * 3\n\n\n'
        'def h():\n    return 0\n\n\n'
        'class C:\n    def keep(self):\n        """Documented now."""\n        return 1\n\n'
        '    def g(self, y):\n        return y + 1\n')
    (repo / "pkg" / "new.py").write_text("def n():\n    return 1\n")
    monkeypatch.setattr(mutation, "REPO", str(repo))
    assert mutation.changed_since("pkg/m.py", "HEAD") == [
        "pkg.m.x_g__mutmut_*", "pkg.m.x_h__mutmut_*", "pkg.m.x\u01c1C\u01c1g__mutmut_*"]
    assert mutation.changed_since("pkg/new.py", "HEAD") is None
    with pytest.raises(SystemExit, match="'nosuchrev' is not a revision"):
        mutation.changed_since("pkg/new.py", "nosuchrev")


def test_a_change_runs_only_its_mutants_and_resumes(mutation, monkeypatch, tmp_path):
    """With patterns, a fresh work directory runs the globs; a second call runs, by name,
    only the selected mutants not tried yet (mutmut runs again every mutant it is named),
    never the others; the report counts the selected mutants alone."""
    every = {"p.x_f__mutmut_1": "killed", "p.x_f__mutmut_2": "survived", "p.x_g__mutmut_1": "survived"}
    status, runs = {}, []

    def run(workdir, *args, check=True):
        names = list(args[3:])
        runs.append(names)
        for name in every:
            if any(__import__("fnmatch").fnmatchcase(name, n) for n in names):
                status[name] = "not checked" if len(runs) == 1 and name.endswith("_2") else every[name]
            else:
                status.setdefault(name, "not checked")
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(mutation, "mutmut", run)
    monkeypatch.setattr(mutation, "results", lambda workdir: dict(status))
    work = workdir_with_tests(tmp_path, "def test_a(): pass\n")
    assert mutation.run_module(work, ("test_m.py",), 1, ["p.x_f__mutmut_*"])   # interrupted after mutant 1
    assert runs == [["p.x_f__mutmut_*"]] and status["p.x_f__mutmut_2"] == "not checked"
    assert mutation.run_module(work, ("test_m.py",), 1, ["p.x_f__mutmut_*"])
    assert runs[1] == ["p.x_f__mutmut_2"] and status["p.x_g__mutmut_1"] == "not checked"
    # all tried, then f's code changes: a run (of one tried mutant) makes its new mutant,
    # a second pass tries it
    runs.clear()
    every["p.x_f__mutmut_3"] = "killed"
    generated = run
    def run(workdir, *args, check=True):  # noqa: F811 (the fake, with generation)
        done = generated(workdir, *args, check=check)
        status.setdefault("p.x_f__mutmut_3", "not checked")
        return done
    monkeypatch.setattr(mutation, "mutmut", run)
    assert mutation.run_module(work, ("test_m.py",), 1, ["p.x_f__mutmut_*"])
    assert runs == [["p.x_f__mutmut_1"], ["p.x_f__mutmut_3"]] and status["p.x_f__mutmut_3"] == "killed"
    runs.clear()
    assert mutation.run_module(work, ("test_m.py",), 1, ["p.x_f__mutmut_*"])   # nothing new: one re-run
    assert runs == [["p.x_f__mutmut_1"]]
    monkeypatch.setattr(mutation, "discover", lambda: {"p.py": ("test_m.py",)})
    monkeypatch.setattr(mutation, "changed_since", lambda module, rev: ["p.x_f__mutmut_*"])
    monkeypatch.setattr(mutation, "equivalent_mutants", lambda: {})
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mutation.main(["--report", "--workdir", str(tmp_path), "--changed-since", "abc"]) == 0
    lines = out.getvalue().strip().splitlines()
    assert "| p.py | 3 | 2 | 66.7 % | 0 | 1 | 0 |" in lines
    assert lines[-1] == "mutation score: 2 killed of 3 (66.7%) (the functions changed since abc)"
