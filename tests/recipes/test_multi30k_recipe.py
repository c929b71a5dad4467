"""The Multi30k recipe: the preparation of any parallel corpus from local files
(``data-prep/parallel``, ``data-prep/multi30k``) on a tiny corpus in the Multi30k layout,
the presets at this scale, the recipe's dry run and report, and the whole recipe (data ->
train -> evaluate -> report) on the fixture."""
import gzip
import json
import os
import re
import shutil

import pytest

from cli_helpers import read_lines, run_in_process
from multi30k_fixture import SPLITS, write_multi30k

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PREPARE = os.path.join(REPO, "data-prep", "multi30k", "prepare.py")
PARALLEL = os.path.join(REPO, "data-prep", "parallel", "prepare.py")
TABLE = os.path.join(REPO, "scripts", "multi30k", "table.py")
REPORT = os.path.join(REPO, "scripts", "multi30k", "report.py")
SMALL_VOCAB = ["--vocab-size", "120"]


def fixture_lines(directory, name, lang):
    plain = os.path.join(directory, f"{name}.{lang}")
    if os.path.exists(plain):
        return read_lines(plain)
    with gzip.open(plain + ".gz", "rt", encoding="utf-8") as handle:
        return handle.read().splitlines()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The fixture corpus (gzip and plain files, an extra test set) prepared once."""
    root = tmp_path_factory.mktemp("multi30k")
    local = write_multi30k(str(root / "raw"))
    work = str(root / "prep")
    result = run_in_process(PREPARE, ["--local-dir", local, "--workdir", work, *SMALL_VOCAB])
    assert result.returncode == 0, result.stderr
    return local, work, result


def test_every_test_set_found_is_binarized_as_its_own_subset(prepared):
    local, work, result = prepared
    with open(os.path.join(work, "data-bin", "subsets.json")) as handle:
        record = json.load(handle)
    assert record["test_subsets"] == {"test": "test_2016_flickr", "test1": "test_2017_mscoco"}
    assert (record["src"], record["tgt"], record["subword"]) == ("en", "de", "spm")
    for subset, name in record["test_subsets"].items():
        for lang in ("en", "de"):
            assert os.path.getsize(os.path.join(work, "data-bin", f"{subset}.en-de.{lang}.bin")) > 0
    assert "test_2016_flickr (test), test_2017_mscoco (test1)" in result.stdout
    assert os.path.exists(os.path.join(work, "data-bin", "spm.model"))


def test_gzip_and_plain_inputs_are_read_line_for_line(prepared):
    local, work, _ = prepared
    for name, split in (("train", "train"), ("val", "valid"), ("test_2016_flickr", "test_2016_flickr"),
                        ("test_2017_mscoco", "test_2017_mscoco")):
        for lang in ("en", "de"):
            assert read_lines(os.path.join(work, "raw", f"{split}.{lang}")) == fixture_lines(local, name, lang)
            assert len(read_lines(os.path.join(work, "spm", f"{split}.{lang}"))) == SPLITS[name][0]


def test_the_pieces_decode_back_to_the_text(prepared):
    import sentencepiece

    _, work, _ = prepared
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(work, "data-bin", "spm.model"))
    raw = read_lines(os.path.join(work, "raw", "test_2016_flickr.de"))
    pieces = read_lines(os.path.join(work, "spm", "test_2016_flickr.de"))
    assert [sp.decode_pieces(p.split()) for p in pieces] == raw


def test_a_second_run_resumes_without_running_a_step(prepared):
    local, work, _ = prepared
    again = run_in_process(PREPARE, ["--local-dir", local, "--workdir", work, *SMALL_VOCAB])
    assert again.returncode == 0, again.stderr
    assert "[run ]" not in again.stdout and "0 steps run" in again.stdout


def test_changed_parameters_are_refused_unless_overwrite(prepared):
    local, work, _ = prepared
    changed = run_in_process(PREPARE, ["--local-dir", local, "--workdir", work, "--vocab-size", "100"])
    assert changed.returncode == 2
    assert "learn-spm: vocab_size 120 -> 100" in changed.stderr and "--overwrite" in changed.stderr


def _copy(local, tmp_path):
    target = str(tmp_path / "raw")
    shutil.copytree(local, target)
    return target


@pytest.mark.parametrize("case", ["missing-required", "missing-val-side", "one-sided-test",
                                  "mismatched", "gz-and-plain", "not-gzip"])
def test_bad_inputs_are_refused_by_name_before_anything_is_written(prepared, tmp_path, case):
    local = _copy(prepared[0], tmp_path)
    if case == "missing-required":
        os.remove(os.path.join(local, "test_2016_flickr.de.gz"))
        message = "missing file: " + os.path.join(local, "test_2016_flickr.de") + "[.gz] (required test set)"
    elif case == "missing-val-side":
        os.remove(os.path.join(local, "val.de"))
        message = "missing file: " + os.path.join(local, "val.de") + " (or val.de.gz), the de side of valid"
    elif case == "one-sided-test":
        os.remove(os.path.join(local, "test_2017_mscoco.en"))
        message = "missing file: " + os.path.join(local, "test_2017_mscoco.en") + "[.gz] (the other side of test_2017_mscoco)"
    elif case == "mismatched":
        with open(os.path.join(local, "val.de"), "a") as handle:
            handle.write("Eine Zeile zu viel.\n")
        message = "the two sides of valid have different line counts"
    elif case == "gz-and-plain":
        shutil.copy(os.path.join(local, "val.de"), os.path.join(local, "val.de.gz"))
        message = "both " + os.path.join(local, "val.de") + " and "
    else:
        with open(os.path.join(local, "train.en.gz"), "wb") as handle:
            handle.write(b"plain text with a gzip name\n")
        message = "cannot read " + os.path.join(local, "train.en.gz")
    work = str(tmp_path / "prep")
    result = run_in_process(PREPARE, ["--local-dir", local, "--workdir", work, *SMALL_VOCAB])
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not os.path.exists(work)


def test_a_missing_local_dir_is_refused(tmp_path):
    result = run_in_process(PREPARE, ["--local-dir", str(tmp_path / "nowhere"), "--workdir", str(tmp_path / "w")])
    assert result.returncode == 2 and "is not a directory" in result.stderr


def test_the_generic_preparation_refuses_two_test_sets_of_one_name(tmp_path):
    local = write_multi30k(str(tmp_path / "raw"))
    other = write_multi30k(str(tmp_path / "other" / "raw"))
    result = run_in_process(PARALLEL, ["--workdir", str(tmp_path / "w"), "--src", "en", "--tgt", "de",
                                       "--train", os.path.join(local, "train"), "--valid", os.path.join(local, "val"),
                                       "--test", os.path.join(local, "test_2016_flickr"),
                                       "--test", os.path.join(other, "test_2016_flickr")])
    assert result.returncode == 2 and "two --test sets are named 'test_2016_flickr'" in result.stderr


def test_the_generic_preparation_prepares_bpe(tmp_path):
    """Any pair of languages, Moses tokens and joint BPE: the WMT'14 steps on local files."""
    local = write_multi30k(str(tmp_path / "raw"), splits={"train": (60, False), "val": (5, True),
                                                          "test_2016_flickr": (4, False)})
    for name in ("train", "val", "test_2016_flickr"):  # a language pair of other names
        for old, new in (("en", "xx"), ("de", "yy")):
            for suffix in ("", ".gz"):
                if os.path.exists(os.path.join(local, f"{name}.{old}{suffix}")):
                    os.rename(os.path.join(local, f"{name}.{old}{suffix}"), os.path.join(local, f"{name}.{new}{suffix}"))
    work = str(tmp_path / "w")
    result = run_in_process(PARALLEL, ["--workdir", work, "--src", "xx", "--tgt", "yy", "--subword", "bpe",
                                       "--bpe-merges", "50", "--train", os.path.join(local, "train"),
                                       "--valid", os.path.join(local, "val"),
                                       "--test", os.path.join(local, "test_2016_flickr")])
    assert result.returncode == 0, result.stderr
    assert os.path.exists(os.path.join(work, "data-bin", "test.xx-yy.yy.bin"))
    assert any("@@" in line for line in read_lines(os.path.join(work, "bpe", "train.xx")))
    with open(os.path.join(work, "data-bin", "subsets.json")) as handle:
        assert json.load(handle)["subword"] == "bpe"


# --------------------------------------------------------------------------- presets

def test_the_presets_stand_as_the_papers_base_models():
    """SUT: about the transformer's parameters at about 1.3x its static MACs; UT about 3.3x
    (paper: 787/604 and 1998/604)."""
    from sut_fairseq.analysis.macs import count_arch
    from sut_fairseq.models.standalone import build_model

    params = {arch: sum(p.numel() for p in build_model(arch, dict_size=8000, share_all_embeddings=True).parameters())
              for arch in ("transformer_multi30k", "sut_multi30k")}
    assert params["transformer_multi30k"] == 7_577_600
    assert 1.0 <= params["sut_multi30k"] / params["transformer_multi30k"] <= 1.15
    macs = {arch: count_arch(arch, 16, 16, 8000, ["static"], None, 0)["static"].total
            for arch in ("transformer_multi30k", "sut_multi30k", "ut_multi30k")}
    assert abs(macs["sut_multi30k"] / macs["transformer_multi30k"] - 787 / 604) < 0.1
    assert abs(macs["ut_multi30k"] / macs["transformer_multi30k"] - 1998 / 604) < 0.2


def test_the_recipe_configs_build_the_models_they_describe():
    import argparse

    from sut_fairseq.models.architectures import PRESETS

    for name, arch, halting in (("sut", "sut_multi30k", True), ("ut", "ut_multi30k", True),
                                ("transformer", "transformer_multi30k", False)):
        with open(os.path.join(REPO, "configs", "multi30k", f"{name}.json")) as handle:
            spec = json.load(handle)
        assert (spec["arch"], spec["halting"]) == (arch, halting)
        if arch in PRESETS:
            args = argparse.Namespace()
            PRESETS[arch](args)
            assert args.decoder_halting == args.encoder_halting == "stick-breaking"
            assert args.halting_threshold == 0.999 and args.dropout == 0.3


# --------------------------------------------------------------------------- recipe

def test_the_dry_run_prints_every_stage_and_writes_nothing(tmp_path):
    work, data = str(tmp_path / "runs"), str(tmp_path / "data")
    result = run_in_process(TABLE, ["--local-dir", str(tmp_path / "raw"), "--data-dir", data, "--work-dir", work,
                                    "--core", "1", "--dry-run"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "data-prep/multi30k/prepare.py --local-dir" in out
    for model, arch in (("transformer", "transformer_multi30k"), ("sut", "sut_multi30k"), ("ut", "ut_multi30k")):
        for seed in (1, 2, 3):
            assert f"== {model} seed {seed}" in out
        assert f"--arch {arch}" in out
    assert out.count("env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 taskset -c 1 /usr/bin/time -v") == 18
    assert "--max-update 1000" in out and "--keep-best-checkpoints 5" in out
    assert out.count("--gen-subset test --batch-size 64 --beam 5") == 9
    assert "sut_fairseq.analysis.sweep" in out and "--metric sacrebleu" in out
    assert "sut_fairseq.analysis.expert_report" in out and "heatmaps.py" in out
    assert not os.path.exists(work) and not os.path.exists(data)


def test_the_data_stage_needs_the_local_files(tmp_path):
    result = run_in_process(TABLE, ["--data-dir", str(tmp_path / "d"), "--work-dir", str(tmp_path / "w")])
    assert result.returncode == 2 and "the data stage needs --local-dir DIR" in result.stderr


def load_report():
    import importlib.util

    spec = importlib.util.spec_from_file_location("multi30k_report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_the_knee_is_the_most_skipping_threshold_within_the_loss():
    report = load_report()
    rows = [{"threshold": 0.999, "skipped": 0.0, "metric": 30.0},
            {"threshold": 0.9, "skipped": 0.10, "metric": 29.9},
            {"threshold": 0.5, "skipped": 0.30, "metric": 29.75},
            {"threshold": 0.3, "skipped": 0.45, "metric": 29.5},
            {"threshold": 0.1, "skipped": 0.60, "metric": 20.0}]
    assert report.knee(rows, 0.3)["threshold"] == 0.5
    assert report.knee(rows, 0.5)["threshold"] == 0.3
    assert report.knee(rows, 0.0)["threshold"] == 0.999
    assert report.knee([], 0.3) is None


def test_training_cost_is_hours_of_one_core_whatever_the_threads():
    """A run of 2 threads for 1 h costs 2 core-hours, one of 1 thread for 3 h costs 3:
    the column is their mean and sample sd (2.5 +- 0.71), not the wall clock's (2.0)."""
    report = load_report()
    test = {"sacrebleu": 30.0, "tok_lc_bleu": 31.0, "sentences_per_second": 10.0}
    runs = [{"seed": seed, "updates": 1000, "params": 1e6, "tests": {"t": dict(test)},
             "train": {"train_wall_seconds": hours * 3600, "threads": threads, "peak_rss_gb": 1.0}}
            for seed, hours, threads in ((1, 1.0, 2), (2, 3.0, 1))]
    header, rows, numbers = report.model_rows({"ut": runs}, ["t"])
    assert rows[0][header.index("train core-h / run")] == "2.50 ± 0.71"
    assert numbers["ut"]["train_core_hours"][:2] == (2.5, pytest.approx(0.7071, abs=1e-4))


# slow (~80 s, the longest test of the suite): in the default run the shared recipe stages
# are trained, averaged, decoded and scored by test_wmt14_recipe.py's end-to-end test, the
# threshold sweep by test_analysis.py::test_sweep_writes_csv_and_pngs, and this recipe's
# stages and commands by test_the_dry_run_prints_every_stage_and_writes_nothing
@pytest.mark.slow
def test_the_whole_recipe_runs_on_the_fixture_and_resumes(prepared, tmp_path):
    """data -> train -> evaluate -> report on the tiny corpus, two models, one seed; the
    second call finds every stage done."""
    local = prepared[0]
    data, work = str(tmp_path / "data"), str(tmp_path / "runs")
    args = ["--local-dir", local, "--data-dir", data, "--work-dir", work, "--config", "smoke",
            "--models", "transformer", "sut", "--seeds", "1", "--thresholds", "0.5,0.999",
            "--heatmap-ids", "0", "1", "--prep-args", "--vocab-size 120"]
    result = run_in_process(TABLE, args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for model in ("transformer", "sut"):
        with open(os.path.join(work, model, "seed1", "result.json")) as handle:
            scored = json.load(handle)
        assert set(scored["tests"]) == {"test_2016_flickr", "test_2017_mscoco"}
        first = scored["tests"]["test_2016_flickr"]
        assert first["sentences"] == SPLITS["test_2016_flickr"][0]
        assert first["sacrebleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
        assert first["tok_lc_bleu_signature"].endswith("|moses-tok:de|lc")
        assert scored["train"]["updates"] == 6
        if os.access("/usr/bin/time", os.X_OK):  # GNU time's report ends the logs
            assert 0.1 < scored["train"]["peak_rss_gb"] < 8 and 0.1 < first["decode_peak_rss_gb"] < 8
    analysis = os.path.join(work, "analysis", "sut-seed1")
    for name in ("sweep/tradeoff.png", "sweep/sweep.json", "heatmaps-0.png", "heatmaps-1.png", "experts.json"):
        assert os.path.exists(os.path.join(analysis, name)), name
    experts = open(os.path.join(analysis, "experts.md")).read()
    assert experts.startswith(os.path.join(work, "sut", "seed1", "averaged.pt") + ": 12 sentence pairs of test")
    assert "### encoder self-attn (E = 12, k = 4;" in experts and "INFO" not in experts
    with open(os.path.join(analysis, "sweep", "sweep.json")) as handle:
        rows = json.load(handle)["rows"]
    assert [r["threshold"] for r in rows] == [0.5, 0.999] and all(r["decode_seconds"] > 0 for r in rows)
    table = open(os.path.join(work, "table.md")).read()
    assert "| SUT (sut_multi30k) | 1 | 6 |" in table and "| Transformer (transformer_multi30k) | 1 | 6 |" in table
    assert "test_2017_mscoco SacreBLEU" in table and "Knee (most skipped at ≤ 0.3 BLEU loss" in table
    assert re.search(r"SUT: [\d.]+ sentences/s at its α_thresh \(0.999\): \*\*[\d.]+×\*\* the transformer", table)
    assert os.path.exists(os.path.join(work, "learning_curves.png"))
    again = run_in_process(TABLE, args)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("trained before") == 2 and again.stdout.count("done before") == 2
    assert "analysed before" in again.stdout
