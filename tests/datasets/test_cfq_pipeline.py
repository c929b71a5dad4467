"""CFQ end to end on the fixture: prepare.py (stream, preprocess, simplify, fairseq-preprocess)
-> table4.py --smoke (fairseq-train with --eval-exact-match selecting checkpoint_best.pt by
dev exact match -> fairseq-generate -> exact_match.py -> result.json -> Table 4), plus the
exact-match task, the scorer and the table on hand-made inputs."""
import importlib.util
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from cli_helpers import run_in_process
from sut_fairseq.checkpoint_safety import CHECKPOINT_GLOBALS

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "cfq")
PREPARE = os.path.join(REPO, "data-prep", "cfq", "prepare.py")
SCRIPTS = os.path.join(REPO, "scripts", "cfq")
TABLE4 = os.path.join(SCRIPTS, "table4.py")
EXACT_MATCH = os.path.join(SCRIPTS, "exact_match.py")
SUMMARIZE = os.path.join(SCRIPTS, "summarize.py")


def load_script(name):
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location(f"cfq_script_{name}", os.path.join(SCRIPTS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(command, timeout=300):
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command[:2]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def in_process(command, check=True):
    """``run`` for a command that starts no tool (a dry run, a finished grid, a scorer):
    ``[sys.executable, SCRIPT, *args]`` called in the test's process (``run_in_process``),
    without the seconds a new interpreter spends importing torch and fairseq; the
    CompletedProcess unless ``check`` (then its stdout, as ``run``)."""
    assert command[0] == sys.executable
    proc = run_in_process(command[1], command[2:])
    if not check:
        return proc
    assert proc.returncode == 0, f"{command[:2]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfq")
    data, work = str(root / "data"), str(root / "work")
    prep_out = run([sys.executable, PREPARE, "--cfq-dir", FIXTURE, "--out", data, "--split", "mcd1",
                    "--binarize", "--no-progress"])
    table_out = run([sys.executable, TABLE4, "--data", data, "--work-dir", work, "--splits", "mcd1",
                     "--variants", "halting", "--seeds", "1", "--smoke"])
    return data, work, prep_out, table_out


def test_prepare_binarizes_the_simplified_targets(pipeline):
    data, _, prep_out, _ = pipeline
    assert "+ " in prep_out and "fairseq-preprocess" in prep_out  # the command is printed
    for subset in ("train", "valid", "test"):
        for side in ("src", "tgt"):
            assert os.path.exists(os.path.join(data, "mcd1", "bin", f"{subset}.src-tgt.{side}.bin"))
    targets = lines(os.path.join(data, "mcd1", "train.tgt"))
    assert any(" , " in t for t in targets) and all("ns:m." not in t and "\n" not in t for t in targets)


def test_smoke_run_trains_selects_by_exact_match_generates_and_scores_every_line(pipeline):
    data, work, _, table_out = pipeline
    run_dir = os.path.join(work, "halting", "mcd1", "seed1")
    # every command printed
    for tool in ("fairseq-train", "fairseq-generate", "exact_match.py"):
        assert re.search(rf"^\+ .*{tool} ", table_out, re.M), tool
    train_line = next(l for l in table_out.splitlines() if l.startswith("+ ") and "fairseq-train" in l)
    train = shlex.split(train_line[2:])
    for flag in ("--eval-exact-match", "--maximize-best-checkpoint-metric", "--encoder-halting"):
        assert flag in train
    assert train[train.index("--best-checkpoint-metric") + 1] == "exact_match"
    assert train[train.index("--arch") + 1] == "ut_cfq"
    # dev exact match logged at validation, checkpoint_best chosen by it
    log = open(os.path.join(run_dir, "train.log")).read()
    valid = [l for l in log.splitlines() if "valid on 'valid' subset" in l]
    assert valid and re.search(r"\| exact_match [\d.]+ ", valid[-1]), valid
    assert "score" in log and os.path.exists(os.path.join(run_dir, "checkpoints", "checkpoint_best.pt"))
    # every test line scored
    result = json.load(open(os.path.join(run_dir, "result.json")))
    n_test = len(lines(os.path.join(data, "mcd1", "test.tgt")))
    assert result["total"] == n_test == 6
    assert 0 <= result["correct"] <= n_test and result["exact_match"] == 100.0 * result["correct"] / n_test
    assert result["variant"] == "halting" and result["split"] == "mcd1" and result["seed"] == 1
    assert result["best_dev_exact_match"] is not None
    assert f"({result['correct']} / {n_test} examples; all {n_test} lines" in table_out
    # the table
    assert "| UT with halting (ours) | " in table_out and "(n=1)" in table_out
    assert "| UT w/o halting (paper) | 71.0 ± 3.5 | 48.6 ± 2.3 | 51.3 ± 0.2 | 56.9 ± 1.5 |" in table_out
    assert os.path.exists(os.path.join(work, "table4.md"))


def test_checkpoint_of_the_exact_match_task_needs_only_allow_listed_globals(pipeline):
    _, work, _, _ = pipeline
    path = os.path.join(work, "halting", "mcd1", "seed1", "checkpoints", "checkpoint_best.pt")
    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    assert unsafe <= {f"{c.__module__}.{c.__qualname__}" for c in CHECKPOINT_GLOBALS}


def test_a_finished_run_is_skipped(pipeline):
    data, work, _, _ = pipeline
    out = in_process([sys.executable, TABLE4, "--data", data, "--work-dir", work, "--splits", "mcd1",
                      "--variants", "halting", "--seeds", "1", "--smoke"])  # every run done: no tool
    assert "done before" in out and "+ " not in out


def test_dry_run_prints_the_whole_table4_grid(tmp_path):
    out = in_process([sys.executable, TABLE4, "--data", str(tmp_path / "d"), "--work-dir",
                      str(tmp_path / "w"), "--dry-run"])
    trains = [shlex.split(l[2:].split(" > ")[0]) for l in out.splitlines()
              if l.startswith("+ ") and "fairseq-train" in l]
    assert len(trains) == 4 * 2 * 5  # splits x variants x seeds
    runs = {(c[1].split(os.sep)[-2], c[c.index("--encoder-halting") + 1], c[c.index("--seed") + 1])
            for c in trains}
    assert {r[0] for r in runs} == {"mcd1", "mcd2", "mcd3", "random_split"}
    assert {r[1] for r in runs} == {"none", "stick-breaking"} and {r[2] for r in runs} == set("12345")
    for c in trains:
        assert c[c.index("--arch") + 1] == "ut_cfq" and "--encoder-layers" not in c  # full size
        halting = c[c.index("--encoder-halting") + 1]
        assert c[c.index("--decoder-halting") + 1] == halting
        assert c[c.index("--act-weight") + 1] == ("0" if halting == "none" else "0.001")
    assert not os.path.exists(tmp_path / "w")


def test_shell_wrapper_prepares_missing_splits_then_runs_the_grid(tmp_path):
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, DATA=str(tmp_path / "d"),
               WORK=str(tmp_path / "w"), CFQ_DIR=FIXTURE, SPLITS="mcd1 random_split", SEEDS="3")
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, "table4.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"prepare.py --cfq-dir {FIXTURE} --out {tmp_path / 'd'} --split mcd1 random_split --binarize" in out
    assert out.count("fairseq-train ") == 4 and "--seed 3 " in out
    assert not os.path.exists(tmp_path / "d") and not os.path.exists(tmp_path / "w")


# --------------------------------------------------------------------------- the scorer

def write_generate_output(path, pairs):
    """fairseq-generate-like output for (reference shown in T-, hypothesis) pairs, out of order."""
    with open(path, "w") as f:
        f.write("2026-01-01 | INFO | fairseq_cli.generate | loading\n")
        for i in reversed(range(len(pairs))):
            shown, hyp = pairs[i]
            f.write(f"S-{i}\tsource {i}\nT-{i}\t{shown}\nH-{i}\t-0.1\t{hyp}\nD-{i}\t-0.1\t{hyp}\n")
        f.write("Generate test with beam=1: BLEU4 = 0.0\n")


Q1 = "SELECT DISTINCT ?x0 WHERE { ?x0 film.director.film M0 , M1 . ?x0 film.editor.film M0 }"
Q2 = "SELECT count ( * ) WHERE { M0 a film.film . M0 film.film.directed_by M1 }"
Q3 = "SELECT count ( * ) WHERE { ?x0 people.person.gender m_02zsn }"


def test_exact_match_counts_strictly_and_order_insensitively(tmp_path):
    ref = tmp_path / "test.tgt"
    ref.write_text("\n".join([Q1, Q2, Q3, Q1]) + "\n")
    reordered = "SELECT count ( * ) WHERE { M0 film.film.directed_by M1 . M0 a film.film }"
    write_generate_output(tmp_path / "gen.txt", [
        (Q1, Q1),                                    # exact
        (Q2, reordered),                             # right query, non-canonical order
        ("SELECT count ( * ) WHERE { ?x0 people.person.gender <unk> }",
         "SELECT count ( * ) WHERE { ?x0 people.person.gender <unk> }"),  # <unk> never matches
        (Q1, "SELECT DISTINCT ?x0 WHERE { ?x0"),      # unparsable
    ])
    out = in_process([sys.executable, EXACT_MATCH, str(tmp_path / "gen.txt"), "--reference", str(ref),
                      "--json", str(tmp_path / "r.json")])
    assert "exact match 25.00% (1 / 4 examples; all 4 lines" in out and "order-insensitive 50.00%" in out
    result = json.load(open(tmp_path / "r.json"))
    assert (result["correct"], result["total"], result["order_insensitive_correct"]) == (1, 4, 2)


def test_exact_match_fails_unless_every_line_is_scored(tmp_path):
    ref = tmp_path / "test.tgt"
    ref.write_text("\n".join([Q1, Q2, Q3]) + "\n")
    write_generate_output(tmp_path / "gen.txt", [(Q1, Q1), (Q2, Q2)])
    proc = subprocess.run([sys.executable, EXACT_MATCH, str(tmp_path / "gen.txt"), "--reference", str(ref)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "scored 2 examples but" in proc.stderr and "has 3 lines" in proc.stderr
    write_generate_output(tmp_path / "gen.txt", [(Q1, Q1), (Q3, Q2), (Q3, Q3)])
    proc = in_process([sys.executable, EXACT_MATCH, str(tmp_path / "gen.txt"), "--reference", str(ref)],
                      check=False)
    assert proc.returncode == 1 and "T-1 is" in proc.stderr and "but line 2 of" in proc.stderr


# --------------------------------------------------------------------------- the table

def test_summary_is_mean_and_sample_std_with_a_per_seed_average(tmp_path):
    values = {"mcd1": [70, 72, 74, 70, 74], "mcd2": [50, 50, 50, 50, 50], "mcd3": [40, 41, 42, 43, 44],
              "random_split": [98, 99]}
    for split, accs in values.items():
        for seed, acc in enumerate(accs, 1):
            d = tmp_path / "no-halting" / split / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "result.json").write_text(json.dumps(
                {"variant": "no-halting", "split": split, "seed": seed, "exact_match": acc}))
    summarize = load_script("summarize")
    row = summarize.table(summarize.load_results(str(tmp_path)))["no-halting"]
    assert row["mcd1"] == pytest.approx((72.0, 2.0, 5))   # stdev([70,72,74,70,74]) = 2
    assert row["mcd2"] == (50.0, 0.0, 5)
    per_seed = [(70 + 50 + 40) / 3, (72 + 50 + 41) / 3, (74 + 50 + 42) / 3, (70 + 50 + 43) / 3, (74 + 50 + 44) / 3]
    import statistics
    assert row["avg"] == pytest.approx((statistics.mean(per_seed), statistics.stdev(per_seed), 5))
    assert row["random_split"] == pytest.approx((98.5, 0.7071, 2), abs=1e-4)
    out = run([sys.executable, SUMMARIZE, str(tmp_path)])
    assert "| UT w/o halting (ours) | 72.0 ± 2.0 | 50.0 ± 0.0 | 42.0 ± 1.6 | 54.7 ± 1.0 | 98.5 ± 0.7 (n=2) |" in out


# --------------------------------------------------------------------------- the task

def make_task(**cfg):
    from fairseq.data import Dictionary
    from sut_fairseq.tasks.translation_exact_match import (TranslationExactMatchConfig,
                                                           TranslationExactMatchTask)
    d = Dictionary()
    for word in Q1.split() + Q2.split():
        d.add_symbol(word)
    return TranslationExactMatchTask(TranslationExactMatchConfig(**cfg), d, d), d


class _NoCriterion:
    @staticmethod
    def reduce_metrics(logging_outputs):
        pass


def test_task_is_registered_with_its_options():
    from fairseq.tasks import TASK_REGISTRY
    assert "translation_exact_match" in TASK_REGISTRY
    task, _ = make_task()
    assert task.cfg.eval_exact_match is False and '"beam": 1' in task.cfg.eval_exact_match_args


def test_sequence_matches_ignores_eos_and_never_matches_unk():
    from sut_fairseq.tasks.translation_exact_match import sequence_matches
    assert sequence_matches([5, 6, 2], [5, 6, 2], eos=2, unk=3)
    assert sequence_matches([5, 6], [5, 6, 2], eos=2, unk=3)
    assert not sequence_matches([5, 6, 7, 2], [5, 6, 2], eos=2, unk=3)
    assert not sequence_matches([5, 3, 2], [5, 3, 2], eos=2, unk=3)


def test_valid_step_decodes_and_exact_match_aggregates_over_batches(caplog):
    from fairseq import metrics
    task, d = make_task(eval_exact_match=True, eval_exact_match_print_samples=True)
    refs = [d.encode_line(q, add_if_not_exist=False) for q in (Q1, Q2, Q1)]
    width = max(len(r) for r in refs)
    target = torch.full((3, width), d.pad(), dtype=torch.long)
    for i, r in enumerate(refs):
        target[i, :len(r)] = r
    hyps = [refs[0], torch.cat([refs[1][:-2], refs[1][-1:]]), refs[2]]  # 2 of 3 right
    task.exact_match_generator = object()
    task.inference_step = lambda generator, models, sample, prefix_tokens=None: \
        [[{"tokens": h}] for h in hyps]
    with caplog.at_level(logging.INFO):
        correct, total = task._exact_match({"target": target}, model=None)
    assert (correct, total) == (2, 3)
    assert "exact-match example hypothesis: " + Q1 in caplog.text

    with metrics.aggregate(new_root=True) as agg:
        sizes = {"ntokens": 10, "nsentences": 2}
        task.reduce_metrics([{"_em_correct": 2, "_em_total": 3, **sizes}], _NoCriterion())
        task.reduce_metrics([{"_em_correct": 3, "_em_total": 5, **sizes},
                             {"_em_correct": 0, "_em_total": 2, **sizes}], _NoCriterion())
        task.reduce_metrics([sizes], _NoCriterion())  # a batch without decoding (training)
    assert agg.get_smoothed_values()["exact_match"] == 50.0  # 5 of 10


def test_build_model_makes_the_validation_generator():
    from fairseq.models import ARCH_CONFIG_REGISTRY
    task, _ = make_task(eval_exact_match=True)
    args = Namespace(arch="sut_tiny", encoder_layers=1, decoder_layers=1, share_all_embeddings=True)
    ARCH_CONFIG_REGISTRY["sut_tiny"](args)
    task.build_model(args)
    assert task.exact_match_generator.beam_size == 1  # greedy by default
    task.cfg.eval_exact_match_args = '{"beam": 3, "max_len_b": 7}'
    task.build_model(args)
    assert (task.exact_match_generator.beam_size, task.exact_match_generator.max_len_b) == (3, 7)
    task.cfg.eval_exact_match_args = "not json"
    with pytest.raises(ValueError, match="--eval-exact-match-args is not JSON"):
        task.build_model(args)
