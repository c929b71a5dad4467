"""Reliability of the data-preparation scripts' outputs (data-prep/logic/generate.py,
data-prep/logic/prepare.py, data-prep/cfq/prepare.py, data-prep/wmt14_en_de/prepare.py):

* a non-empty output directory that is not the script's own resumable work is refused with
  exit status 2 and a one-line ``error:`` naming the directory and ``--overwrite``, and
  nothing in it changes;
* ``--overwrite`` replaces the output without leaving files of the earlier run;
* an interrupted run (an exception mid-way, a failing fairseq-preprocess, SIGKILL) leaves no
  file under a final name, only a temporary that a rerun ignores and deletes;
* WMT: identical parameters resume, changed parameters are refused (naming them) unless
  ``--overwrite`` / ``--force``.

Everything runs on tiny inputs; ``fairseq-preprocess`` is replaced by a small fake script.
"""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from cli_helpers import run_in_process

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GENERATE = os.path.join(REPO, "data-prep", "logic", "generate.py")
LOGIC_PREPARE = os.path.join(REPO, "data-prep", "logic", "prepare.py")
CFQ_PREPARE = os.path.join(REPO, "data-prep", "cfq", "prepare.py")
WMT_DIR = os.path.join(REPO, "data-prep", "wmt14_en_de")
CFQ_FIXTURE = os.path.join(REPO, "tests", "fixtures", "cfq")
WMT_FIXTURE = os.path.join(REPO, "tests", "fixtures", "wmt14")


def load_script(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load_script(GENERATE, "rel_logic_generate")
logic_prepare = load_script(LOGIC_PREPARE, "rel_logic_prepare")
cfq_prepare = load_script(CFQ_PREPARE, "rel_cfq_prepare")
if WMT_DIR not in sys.path:
    sys.path.insert(0, WMT_DIR)
wmt_prepare = load_script(os.path.join(WMT_DIR, "prepare.py"), "rel_wmt_prepare")
wp = sys.modules["wmt14_prep"]
from sut_fairseq.data import cfq as cfq_module, logic_inference, output_dir as od  # noqa: E402


def run(script, *args, env=None):
    """``python SCRIPT ARGS`` in the test's process (cli_helpers.run_in_process: the
    script's main with its output captured and its exit status, without the seconds of a
    fresh interpreter importing torch and fairseq); the tools a script starts (the fake
    fairseq-preprocess) are still processes, with ``env``. test_logic_data.py,
    test_logic_recipe.py and test_cfq_pipeline.py run these scripts as real processes."""
    return run_in_process(script, args, env=env)


def snapshot(root):
    """Every directory and file under ``root`` with the files' bytes."""
    result = {}
    for directory, dirs, files in os.walk(root):
        rel = os.path.relpath(directory, root)
        result[rel + "/"] = sorted(dirs)
        for name in files:
            with open(os.path.join(directory, name), "rb") as handle:
                result[os.path.join(rel, name)] = handle.read()
    return result


def temporaries(parent):
    """Temporary files / directories anywhere under ``parent`` (staging dirs, .tmp files)."""
    found = []
    for directory, dirs, files in os.walk(parent):
        for name in dirs + files:
            if ".tmp" in name or ".old-" in name or name.endswith(".part"):
                found.append(os.path.relpath(os.path.join(directory, name), parent))
    return found


def assert_refused(proc, directory):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(directory) in lines[0] and "--overwrite" in lines[0], lines[0]
    assert proc.stdout == "", proc.stdout  # refused before any work, not when renaming at the end


def make_foreign(directory):
    os.makedirs(directory / "sub", exist_ok=True)
    (directory / "notes.txt").write_text("mine, keep me\n")
    (directory / "sub" / "x.bin").write_bytes(b"\x00\x01")


@pytest.fixture
def fake_preprocess(tmp_path):
    """A stand-in for fairseq-preprocess: writes a dictionary into --destdir, then fails
    (exit 3) when FAKE_FAIL is set, else writes the .bin/.idx files of every prefix."""
    path = tmp_path / "fake-fairseq-preprocess"
    path.write_text(f"""#!{sys.executable}
import os, sys
args = sys.argv[1:]
dest = args[args.index("--destdir") + 1]
src, tgt = args[args.index("--source-lang") + 1], args[args.index("--target-lang") + 1]
os.makedirs(dest, exist_ok=True)
for lang in (src, tgt):
    with open(os.path.join(dest, "dict." + lang + ".txt"), "w") as f:
        f.write("a 1\\nb 1\\n")
if os.environ.get("FAKE_FAIL"):
    sys.exit(3)
names = ["train", "valid"] + ["test" + (str(k) if k else "") for k, _ in
                              enumerate(args[args.index("--testpref") + 1].split(","))]
for name in names:
    for lang in (src, tgt):
        for ext in ("bin", "idx"):
            with open(os.path.join(dest, f"{{name}}.{{src}}-{{tgt}}.{{lang}}.{{ext}}"), "w") as f:
                f.write(name)
""")
    path.chmod(0o755)
    return path


# --------------------------------------------------------------------------- shared helper

def test_staged_dir_commits_only_on_success_and_stale_temporaries_are_removed(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with od.StagedDir(str(final)) as stage:
            (tmp_path / stage.path / "a").write_text("partial")
            raise RuntimeError("interrupted")
    assert not final.exists() and os.listdir(tmp_path) == []
    with od.StagedDir(str(final)) as stage:
        open(os.path.join(stage.path, "a"), "w").write("1")
    assert os.listdir(final) == ["a"] and os.listdir(tmp_path) == ["out"]
    with pytest.raises(od.OutputExistsError, match="--overwrite"):
        od.check_output_dir(str(final), overwrite=False)
    assert od.check_output_dir(str(final), overwrite=True) is True
    # a temporary of a dead process is deleted, one of a live process is kept
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / f".out.tmp-{dead}-abc").mkdir()
    (tmp_path / f".out.tmp-{os.getpid()}-abc").mkdir()
    removed = od.remove_stale(str(final))
    assert [os.path.basename(p) for p in removed] == [f".out.tmp-{dead}-abc"]
    assert sorted(os.listdir(tmp_path)) == [f".out.tmp-{os.getpid()}-abc", "out"]


# --------------------------------------------------------------------------- logic: generate.py

def test_generate_refuses_a_foreign_non_empty_directory(tmp_path):
    out = tmp_path / "raw"
    make_foreign(out)
    before = snapshot(tmp_path)
    proc = run(GENERATE, "--out", out, "--pairs", 2000, "--no-progress")
    assert_refused(proc, out)
    assert snapshot(tmp_path) == before
    proc = run(GENERATE, "--out", out, "--pairs", 2000, "--no-progress", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == sorted(f"{p}{k}" for p in ("train", "test") for k in range(13))
    assert os.listdir(tmp_path) == ["raw"]  # the foreign files went with the old directory


def test_generate_refuses_its_own_output_and_overwrite_replaces_it(tmp_path):
    out = tmp_path / "raw"
    assert run(GENERATE, "--out", out, "--pairs", 2000, "--seed", 1, "--no-progress").returncode == 0
    first = snapshot(out)
    assert_refused(run(GENERATE, "--out", out, "--pairs", 2000, "--seed", 1, "--no-progress"), out)
    assert snapshot(out) == first
    (out / "train99").write_text("= a b\n")  # a file the new run does not write
    proc = run(GENERATE, "--out", out, "--pairs", 2000, "--seed", 2, "--no-progress", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    second = snapshot(out)
    assert "./train99" not in second and set(second) == set(first)
    assert second["./train3"] != first["./train3"]  # really regenerated with seed 2
    assert temporaries(tmp_path) == []


def test_generate_interrupted_mid_write_keeps_the_previous_output(tmp_path, monkeypatch):
    out = tmp_path / "raw"
    assert generate.main(["--out", str(out), "--pairs", "2000", "--no-progress"]) == 0
    before = snapshot(tmp_path)
    li = logic_inference
    real, calls = li.write_pairs, []

    def failing(path, pairs):
        calls.append(path)
        if len(calls) == 6:
            raise KeyboardInterrupt
        real(path, pairs)

    monkeypatch.setattr(li, "write_pairs", failing)
    with pytest.raises(KeyboardInterrupt):
        generate.main(["--out", str(out), "--pairs", "2000", "--seed", "5", "--no-progress",
                       "--overwrite"])
    assert len(calls) == 6 and all(os.path.basename(os.path.dirname(p)).startswith(".raw.tmp-")
                                   for p in calls)  # it wrote into the staging directory
    assert snapshot(tmp_path) == before  # the old output untouched, no temporary left


def test_generate_killed_leaves_only_a_temporary_that_the_rerun_ignores(tmp_path):
    out, reference = tmp_path / "raw", tmp_path / "ref"
    driver = tmp_path / "driver.py"
    driver.write_text(f"""import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("gen", {GENERATE!r})
gen = importlib.util.module_from_spec(spec); spec.loader.exec_module(gen)
from sut_fairseq.data import logic_inference as li
real, calls = li.write_pairs, []
def killing(path, pairs):
    calls.append(path)
    if len(calls) == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, pairs)
li.write_pairs = killing
sys.exit(gen.main(sys.argv[1:]))
""")
    proc = subprocess.run([sys.executable, str(driver), "--out", str(out), "--pairs", "2000",
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    (staging,) = [p for p in os.listdir(tmp_path) if p.startswith(".raw.tmp-")]
    assert len(os.listdir(tmp_path / staging)) == 4  # the partial output, under a temporary name
    proc = run(GENERATE, "--out", out, "--pairs", 2000, "--no-progress")  # no --overwrite needed
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / staging).exists()
    assert run(GENERATE, "--out", reference, "--pairs", 2000, "--no-progress").returncode == 0
    assert snapshot(out) == snapshot(reference)


# --------------------------------------------------------------------------- logic: prepare.py

@pytest.fixture(scope="module")
def original(tmp_path_factory):
    raw = tmp_path_factory.mktemp("logic") / "original"
    assert generate.main(["--out", str(raw), "--pairs", "2000", "--no-progress"]) == 0
    return raw


def test_logic_prepare_refuses_a_foreign_directory_and_a_foreign_bin_dir(tmp_path, original,
                                                                        fake_preprocess):
    out = tmp_path / "std"
    make_foreign(out)
    before = snapshot(tmp_path)
    assert_refused(run(LOGIC_PREPARE, "--data", original, "--out", out), out)
    assert snapshot(tmp_path) == before
    bin_dir = tmp_path / "bin"
    make_foreign(bin_dir)
    before = snapshot(tmp_path)
    proc = run(LOGIC_PREPARE, "--data", original, "--out", tmp_path / "new", "--binarize",
               "--bin-dir", bin_dir, "--fairseq-preprocess", fake_preprocess)
    assert_refused(proc, bin_dir)
    assert snapshot(tmp_path) == before
    proc = run(LOGIC_PREPARE, "--data", original, "--out", tmp_path / "new", "--binarize",
               "--bin-dir", bin_dir, "--fairseq-preprocess", fake_preprocess, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert "notes.txt" not in os.listdir(bin_dir) and (bin_dir / "dict.src.txt").is_file()
    assert (bin_dir / "test12.src-tgt.tgt.bin").is_file()
    # --data inside the directory that --overwrite would delete is refused
    proc = run(LOGIC_PREPARE, "--data", original, "--out", original.parent, "--overwrite")
    assert_refused(proc, original.parent)
    assert (original / "train0").is_file()


def test_logic_prepare_overwrite_leaves_no_file_of_the_earlier_protocol(tmp_path, original,
                                                                        fake_preprocess):
    out = tmp_path / "data"
    proc = run(LOGIC_PREPARE, "--data", original, "--out", out, "--binarize",
               "--fairseq-preprocess", fake_preprocess)
    assert proc.returncode == 0, proc.stderr
    assert (out / "test12.src").is_file() and (out / "bin" / "test12.src-tgt.src.bin").is_file()
    before = snapshot(out)
    # the same command again: refused (documented), nothing changed
    proc = run(LOGIC_PREPARE, "--data", original, "--out", out, "--binarize",
               "--fairseq-preprocess", fake_preprocess)
    assert_refused(proc, out)
    assert snapshot(out) == before
    proc = run(LOGIC_PREPARE, "--data", original, "--out", out, "--protocol", "A", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["test.src", "test.tgt", "train.src", "train.tgt",
                                       "valid.src", "valid.tgt"]  # no test12.*, no old bin/
    assert temporaries(tmp_path) == []


def test_logic_prepare_interrupted_mid_write_keeps_the_previous_output(tmp_path, original,
                                                                       monkeypatch):
    out = tmp_path / "std"
    assert logic_prepare.main(["--data", str(original), "--out", str(out)]) == 0
    before = snapshot(tmp_path)
    li = logic_inference
    real, calls = li.write_seq2seq, []

    def failing(directory, split, pairs):
        calls.append(directory)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return real(directory, split, pairs)

    monkeypatch.setattr(li, "write_seq2seq", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        logic_prepare.main(["--data", str(original), "--out", str(out), "--protocol", "B",
                            "--overwrite"])
    assert len(calls) == 3
    assert snapshot(tmp_path) == before


def test_logic_prepare_failed_binarization_leaves_no_output(tmp_path, original, fake_preprocess):
    out = tmp_path / "std"
    env = dict(os.environ, FAKE_FAIL="1")
    proc = run(LOGIC_PREPARE, "--data", original, "--out", out, "--binarize",
               "--fairseq-preprocess", fake_preprocess, env=env)
    assert proc.returncode == 1 and "fairseq-preprocess failed" in proc.stderr
    assert os.listdir(tmp_path) == [fake_preprocess.name]  # no std/, no std/bin/dict.*, no temporary
    proc = run(LOGIC_PREPARE, "--data", original, "--out", out, "--binarize",
               "--fairseq-preprocess", fake_preprocess)
    assert proc.returncode == 0, proc.stderr
    assert (out / "bin" / "test.src-tgt.src.bin").is_file()


# --------------------------------------------------------------------------- cfq: prepare.py

def cfq_run(out, *args, env=None):
    return run(CFQ_PREPARE, "--cfq-dir", CFQ_FIXTURE, "--out", out, "--no-progress", *args, env=env)


def test_cfq_refuses_a_foreign_split_directory(tmp_path):
    out = tmp_path / "cfq"
    make_foreign(out / "mcd1")
    before = snapshot(tmp_path)
    assert_refused(cfq_run(out, "--split", "mcd1"), out / "mcd1")
    assert snapshot(tmp_path) == before
    # other entries of OUT are not the split's directory: a new split can be added
    foreign = snapshot(out / "mcd1")
    proc = cfq_run(out, "--split", "random_split")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["mcd1", "random_split"]
    assert snapshot(out / "mcd1") == foreign
    proc = cfq_run(out, "--split", "mcd1", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out / "mcd1")) == sorted(
        [f"{s}.{e}" for s in ("train", "valid", "test") for e in ("src", "tgt", "sparql")] + ["prep.json"])


def test_cfq_refuses_its_own_output_and_overwrite_drops_the_old_bin(tmp_path, fake_preprocess):
    out = tmp_path / "cfq"
    proc = cfq_run(out, "--split", "mcd1", "--binarize", "--fairseq-preprocess", fake_preprocess)
    assert proc.returncode == 0, proc.stderr
    assert (out / "mcd1" / "bin" / "dict.src.txt").is_file()
    before = snapshot(tmp_path)
    proc = cfq_run(out, "--split", "mcd1", "--binarize", "--fairseq-preprocess", fake_preprocess)
    assert_refused(proc, out / "mcd1")
    assert snapshot(tmp_path) == before
    proc = cfq_run(out, "--split", "mcd1", "--target-form", "plain", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "mcd1" / "bin").exists()  # the old binarization (simplified targets) is gone
    assert json.load(open(out / "mcd1" / "prep.json"))["target_form"] == "plain"
    assert temporaries(tmp_path) == []


def test_cfq_interrupted_mid_write_leaves_no_split_directory(tmp_path, monkeypatch):
    out = tmp_path / "cfq"
    cfq = cfq_module
    real, calls = cfq.write_lines_atomic, []

    def failing(path, lines):
        calls.append(path)
        if len(calls) == 13:  # mcd1 complete (10 files), random_split half-way
            raise KeyboardInterrupt
        return real(path, lines)

    monkeypatch.setattr(cfq, "write_lines_atomic", failing)
    with pytest.raises(KeyboardInterrupt):
        cfq_prepare.main(["--cfq-dir", CFQ_FIXTURE, "--out", str(out), "--split", "mcd1",
                          "random_split", "--no-progress"])
    assert len(calls) == 13
    assert os.listdir(out) == []  # neither split appears: no partial directory, no temporary
    monkeypatch.setattr(cfq, "write_lines_atomic", real)
    assert cfq_prepare.main(["--cfq-dir", CFQ_FIXTURE, "--out", str(out), "--split", "mcd1",
                             "random_split", "--no-progress"]) == 0
    assert sorted(os.listdir(out)) == ["mcd1", "random_split"]


def test_cfq_failed_binarization_keeps_the_previous_split(tmp_path, fake_preprocess):
    out = tmp_path / "cfq"
    assert cfq_run(out, "--split", "mcd1").returncode == 0
    before = snapshot(tmp_path)
    proc = cfq_run(out, "--split", "mcd1", "--binarize", "--fairseq-preprocess", fake_preprocess,
                   "--overwrite", env=dict(os.environ, FAKE_FAIL="1"))
    assert proc.returncode == 1 and "fairseq-preprocess failed for mcd1" in proc.stderr
    assert snapshot(tmp_path) == before  # no mcd1/bin with only a dictionary in it


# --------------------------------------------------------------------------- WMT'14: prepare.py

def wmt_argv(workdir, *extra):
    return ["--workdir", str(workdir), "--no-download", "--workers", "1", "--bpe-merges", "200",
            "--local-dir", WMT_FIXTURE, *map(str, extra)]


def wmt_main(workdir, *extra):
    return wmt_prepare.main(wmt_argv(workdir, *extra))


@pytest.fixture(scope="module")
def wmt_prepared(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("wmt") / "w"
    assert wmt_main(workdir, "--no-binarize") == 0
    return workdir


@pytest.fixture
def wmt_copy(wmt_prepared, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(wmt_prepared, workdir)
    return workdir


def ran_steps(out):
    return [l.split()[-1] for l in out.splitlines() if l.startswith("[run ]")]


def test_wmt_refuses_a_foreign_workdir(tmp_path, capsys):
    workdir = tmp_path / "w"
    make_foreign(workdir)
    before = snapshot(tmp_path)
    assert wmt_main(workdir, "--no-binarize") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(workdir) in err[0]
    assert "--overwrite" in err[0] and "notes.txt" in err[0]
    assert snapshot(tmp_path) == before
    # a --local-dir kept inside the work directory is an input, not a foreign entry
    local = tmp_path / "w2" / "downloads"
    shutil.copytree(WMT_FIXTURE, local)
    assert wmt_prepare.main(["--workdir", str(tmp_path / "w2"), "--no-download", "--workers", "1",
                             "--bpe-merges", "200", "--local-dir", str(local), "--no-binarize"]) == 0
    assert wmt_main(workdir, "--no-binarize", "--overwrite") == 0
    assert (workdir / "notes.txt").is_file() and (workdir / "bpe" / "test.de").is_file()


def test_wmt_same_parameters_resume_changed_ones_are_refused(wmt_copy, capsys):
    before = snapshot(wmt_copy)
    os.unlink(wmt_copy / "tok" / "newstest2013.de")  # a lost output: resumed, not refused
    assert wmt_main(wmt_copy, "--no-binarize") == 0
    assert ran_steps(capsys.readouterr().out) == ["tokenise-newstest2013.de", "apply-bpe-valid.de"]
    assert snapshot(wmt_copy) == before
    assert wmt_main(wmt_copy, "--no-binarize", "--max-len", "12", "--bpe-merges", "150") == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and str(wmt_copy) in err[0] and "--overwrite" in err[0]
    assert "clean-train: max_len 80 -> 12" in err[0] and "learn-bpe: merges 200 -> 150" in err[0]
    assert ran_steps(captured.out) == [] and snapshot(wmt_copy) == before
    assert wmt_main(wmt_copy, "--no-binarize", "--max-len", "12", "--overwrite") == 0
    assert ran_steps(capsys.readouterr().out)[:2] == ["clean-train", "learn-bpe"]
    assert all(len(s.split()) <= 12 for s in open(wmt_copy / "clean" / "train.de"))
    # back to the default: changed again, so refused; --force (rerun everything) accepts it
    assert wmt_main(wmt_copy, "--no-binarize") == 2
    assert "max_len 12 -> 80" in capsys.readouterr().err
    assert wmt_main(wmt_copy, "--no-binarize", "--force") == 0
    assert len(ran_steps(capsys.readouterr().out)) == 23


def test_wmt_interrupted_step_leaves_the_old_file_and_no_marker(wmt_copy, monkeypatch, capsys):
    old = open(wmt_copy / "clean" / "train.en").read()

    def crash(pairs_in, out_src, out_tgt, **kwargs):
        with wp.AtomicFiles(out_src, out_tgt) as (fs, ft):
            fs.write("half a line")
            raise KeyboardInterrupt

    monkeypatch.setattr(wp, "clean_corpus", crash)
    with pytest.raises(KeyboardInterrupt):
        wmt_main(wmt_copy, "--no-binarize", "--max-len", "12", "--overwrite")
    assert open(wmt_copy / "clean" / "train.en").read() == old  # not the partial text
    assert not (wmt_copy / "done" / "clean-train.done").exists()
    assert temporaries(wmt_copy) == []
    monkeypatch.undo()
    capsys.readouterr()
    # the interrupted step has no marker, so the rerun is a resume (no --overwrite needed)
    assert wmt_main(wmt_copy, "--no-binarize", "--max-len", "12") == 0
    assert ran_steps(capsys.readouterr().out)[:2] == ["clean-train", "learn-bpe"]
    assert all(len(s.split()) <= 12 for s in open(wmt_copy / "clean" / "train.de"))


def test_wmt_failed_binarization_leaves_no_data_bin(wmt_copy, fake_preprocess, capsys):
    argv = ["--fairseq-preprocess", fake_preprocess]
    os.environ["FAKE_FAIL"] = "1"
    try:
        assert wmt_main(wmt_copy, *argv) == 2
    finally:
        del os.environ["FAKE_FAIL"]
    assert "fairseq-preprocess failed" in capsys.readouterr().err
    assert not (wmt_copy / "data-bin").exists() and not (wmt_copy / "done" / "binarize.done").exists()
    assert temporaries(wmt_copy) == []
    assert wmt_main(wmt_copy, *argv) == 0
    assert ran_steps(capsys.readouterr().out) == ["binarize"]
    assert (wmt_copy / "data-bin" / "dict.en.txt").is_file()


def test_wmt_overwrite_deletes_a_data_bin_built_from_replaced_steps(wmt_copy, fake_preprocess, capsys):
    argv = ["--fairseq-preprocess", fake_preprocess]
    assert wmt_main(wmt_copy, *argv) == 0 and (wmt_copy / "data-bin").is_dir()
    capsys.readouterr()
    assert wmt_main(wmt_copy, "--no-binarize", "--max-len", "12", "--overwrite") == 0
    assert "[del ] binarize" in capsys.readouterr().out
    assert not (wmt_copy / "data-bin").exists() and not (wmt_copy / "done" / "binarize.done").exists()


def test_wmt_a_step_built_from_an_older_dependency_is_not_trusted(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    write = lambda path, text: (lambda: wp.write_lines_atomic(str(path), [text]))
    pipe = wp.Pipeline(str(tmp_path))
    assert pipe.step("a", [str(a)], {}, write(a, "one"))
    assert pipe.step("b", [str(b)], {}, write(b, "from one"), deps=["a"])
    again = wp.Pipeline(str(tmp_path))
    assert not again.step("a", [str(a)], {}, write(a, "never"))
    assert not again.step("b", [str(b)], {}, write(b, "never"), deps=["a"])
    # "a" is rebuilt by a run that does not declare "b"
    assert wp.Pipeline(str(tmp_path), force=True).step("a", [str(a)], {}, write(a, "two!"))
    again = wp.Pipeline(str(tmp_path))
    assert not again.step("a", [str(a)], {}, write(a, "never"))
    assert again.step("b", [str(b)], {}, write(b, "from two"), deps=["a"])  # its "a" changed
    assert b.read_text() == "from two\n"


def test_atomic_outputs_get_the_usual_file_mode_not_mkstemps_private_one(tmp_path):
    """Files and staged directories are created private by mkstemp/mkdtemp (0600/0700);
    the renamed outputs must carry the mode the umask gives ordinary files (here 0644/0755)."""
    import importlib.util
    import stat

    from sut_fairseq.data.atomic import atomic_path

    old = os.umask(0o022)
    try:
        spec = importlib.util.spec_from_file_location(
            "_recipe_mode", os.path.join(REPO, "scripts", "logic", "logic_recipe.py"))
        recipe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(recipe)
        recipe.write_json_atomic(str(tmp_path / "a.json"), {"x": 1})
        with atomic_path(str(tmp_path / "b.png")) as tmp:
            open(tmp, "w").write("png")
        with od.StagedDir(str(tmp_path / "out")) as staged:
            open(os.path.join(staged.path, "f"), "w").write("x")
        modes = {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("a.json", "b.png", "out")}
    finally:
        os.umask(old)
    assert modes == {"a.json": 0o644, "b.png": 0o644, "out": 0o755}
