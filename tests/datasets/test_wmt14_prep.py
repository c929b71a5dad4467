"""WMT'14 En-De preparation (data-prep/wmt14_en_de) on the hand-written fixture in
tests/fixtures/wmt14: SGML extraction, normalisation + aggressive tokenisation, the length
filter, joint BPE, archives, resumability, and the clear errors."""
import importlib.util
import os
import shutil
import sys
import tarfile

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PREP_DIR = os.path.join(REPO, "data-prep", "wmt14_en_de")
FIXTURE = os.path.join(REPO, "tests", "fixtures", "wmt14")
sys.path.insert(0, PREP_DIR)

import wmt14_prep as wp  # noqa: E402


def load_cli():
    spec = importlib.util.spec_from_file_location("wmt14_prepare_cli", os.path.join(PREP_DIR, "prepare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = load_cli()


def lines(path):
    return list(wp.read_lines(path))


def run_prep(workdir, *extra, local=FIXTURE):
    argv = ["--workdir", str(workdir), "--no-download", "--workers", "1", "--bpe-merges", "200",
            "--no-binarize", *extra]
    if local:
        argv += ["--local-dir", str(local)]
    return prepare.main(argv)


# --------------------------------------------------------------------------- SGML

def test_sgml_extraction_keeps_segment_order_and_collapses_whitespace():
    segments = wp.extract_sgml(os.path.join(FIXTURE, "newstest2014-deen-ref.de.sgm"))
    assert len(segments) == 8
    assert segments[0] == "Der Bürgermeister eröffnete am Montag die neue Schule."
    # "<seg id=\"3\">  Das  hochmoderne ... Euro. </seg>" in the file
    assert segments[2] == "Das hochmoderne Gebäude kostete 12 Millionen Euro."
    assert segments[3] == "„Es ist ein großer Tag für unsere Stadt“, sagte sie."
    assert segments[4] == "Der Verkehr auf der A8 war dicht."  # second <doc>, seg id 1 again
    source = wp.extract_sgml(os.path.join(FIXTURE, "newstest2014-deen-src.en.sgm"))
    assert len(source) == 8 and source[7] == "The Baden-Württemberg government welcomed the decision."


def test_sgml_without_segments_is_an_error(tmp_path):
    path = tmp_path / "x.sgm"
    path.write_text("<srcset>\n</srcset>\n")
    with pytest.raises(wp.PrepError, match="no <seg>"):
        wp.extract_sgml(str(path))


# --------------------------------------------------------------------------- tokenisation

def test_remove_non_printing_replaces_category_c_with_spaces():
    assert wp.remove_non_printing("a\x07b\u200bc\u00add\u00a0e") == "a b c d\u00a0e"  # NBSP is Zs: kept


@pytest.mark.parametrize("lang,text,expected", [
    # aggressive hyphen splitting, XML escaping, en dash normalised to '-', '$' split off
    ("en", 'The state-of-the-art "SUT" model costs $5,000 – really?',
     "The state @-@ of @-@ the @-@ art &quot; SUT &quot; model costs $ 5,000 - really ?"),
    # zero-width space (category Cf) -> space; tab and double space collapsed
    ("en", "Free\u200bWi-Fi\tand  more", "Free Wi @-@ Fi and more"),
    ("en", "It's a well-known fact: 3-4 people (e.g. Anna) came.",
     "It &apos;s a well @-@ known fact : 3 @-@ 4 people ( e.g. Anna ) came ."),
    # German quotes normalised to '"' (then escaped), compound hyphens split
    ("de", "„Das ist ein E-Mail-Konto“, sagte er.",
     "&quot; Das ist ein E @-@ Mail @-@ Konto &quot; , sagte er ."),
    ("de", "Er kam am 3. Oktober.", "Er kam am 3. Oktober ."),
])
def test_normalise_and_tokenise_hand_checked(lang, text, expected):
    assert wp.Tokeniser(lang)(text) == expected


def test_tokenise_file_splits_lines_on_newline_only(tmp_path):
    # a stray carriage return and a form feed inside a line must not create new lines
    # (normalize-punctuation deletes \r; remove-non-printing turns \x0c into a space)
    src = tmp_path / "in.en"
    src.write_bytes("one\rtwo\nthree\x0cfour\n\nlast-one\n".encode())
    out = tmp_path / "out.en"
    assert wp.tokenise_file("en", str(src), str(out)) == 4
    assert lines(out) == ["onetwo", "three four", "", "last @-@ one"]


def test_parallel_tokenisation_equals_serial(tmp_path):
    src = os.path.join(FIXTURE, "europarl-v7.de-en.de")
    wp.tokenise_file("de", src, str(tmp_path / "serial"), workers=1)
    wp.tokenise_file("de", src, str(tmp_path / "parallel"), workers=2, chunk_lines=3)
    assert lines(tmp_path / "parallel") == lines(tmp_path / "serial")
    assert len(lines(tmp_path / "serial")) == 12
    assert lines(tmp_path / "serial")[10] == "Wir unterstützen die deutsch @-@ französische Initiative ."
    serial_counts = wp.word_counts([str(tmp_path / "serial")], workers=1)
    assert wp.word_counts([str(tmp_path / "serial")], workers=2, chunk_lines=2) == serial_counts
    assert serial_counts["Die"] == 3 and serial_counts["@-@"] == 1


# --------------------------------------------------------------------------- length filter

def test_pair_verdict_follows_clean_corpus_n():
    assert wp.pair_verdict("a b", "c d") is None
    assert wp.pair_verdict("", "c") == "empty"
    assert wp.pair_verdict("a", "   ") == "empty"
    assert wp.pair_verdict(" ".join(["w"] * 80), " ".join(["w"] * 80)) is None
    assert wp.pair_verdict(" ".join(["w"] * 81), "c " * 20) == "too_long"
    assert wp.pair_verdict("a", " ".join(["w"] * 9)) is None          # ratio 9 is allowed
    assert wp.pair_verdict("a", " ".join(["w"] * 10)) == "ratio"       # ratio 10 > 9
    assert wp.pair_verdict("a", " ".join(["w"] * 10), max_ratio=0) is None
    assert wp.pair_verdict("a b", "c " + "x" * 1001) == "long_word"


def test_clean_corpus_on_the_fixture(tmp_path):
    pairs = []
    for name in wp.TRAIN_CORPORA:
        stem = {"europarl-v7": "europarl-v7.de-en", "commoncrawl": "commoncrawl.de-en",
                "news-commentary-v12": "news-commentary-v12.de-en"}[name]
        tok = []
        for lang in wp.LANGS:
            out = tmp_path / f"{name}.{lang}"
            wp.tokenise_file(lang, os.path.join(FIXTURE, f"{stem}.{lang}"), str(out))
            tok.append(str(out))
        pairs.append(tuple(tok))
    stats = wp.clean_corpus(pairs, str(tmp_path / "train.en"), str(tmp_path / "train.de"))
    # commoncrawl holds one empty English side, a 1:14 pair and a 90-token pair
    assert stats.as_dict() == {"read": 32, "kept": 29, "empty": 1, "too_long": 1, "ratio": 1,
                               "long_word": 0}
    en, de = lines(tmp_path / "train.en"), lines(tmp_path / "train.de")
    assert len(en) == len(de) == 29
    assert "Contact" not in en and "Impressum" not in de
    assert all(1 <= len(s.split()) <= 80 for s in en + de)


# --------------------------------------------------------------------------- BPE

def test_joint_bpe_hand_checked(tmp_path):
    (tmp_path / "a.txt").write_text("aaa aaa aaa\n")
    (tmp_path / "b.txt").write_text("ab ab\n")
    codes = str(tmp_path / "codes")
    # word counts aaa:3, ab:2 -> pairs (a,a):3, (a,a</w>):3, (a,b</w>):2; ties go to the
    # larger pair, so: a+a</w>, then a+aa</w>, then a+b</w>; nothing occurs twice after that
    assert wp.learn_joint_bpe([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], codes, 10) == 3
    assert lines(codes) == ["#version: 0.2", "a a</w>", "a aa</w>", "a b</w>"]
    apply = wp.BPEApplier(codes)
    assert apply("aaa ab ba aa") == "aaa ab b@@ a aa"
    out = tmp_path / "out"
    (tmp_path / "in").write_text("ba ab\n\nbab\n")
    assert wp.apply_bpe_file(codes, str(tmp_path / "in"), str(out), workers=2, chunk_lines=1) == 3
    assert lines(out) == ["b@@ a ab", "", "b@@ ab"]


# --------------------------------------------------------------------------- the pipeline

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("wmt14_prep")
    assert run_prep(workdir) == 0
    return workdir


def test_every_step_on_the_fixture(prepared, capsys):
    W = prepared
    assert lines(W / "raw" / "newstest2014.de")[2] == "Das hochmoderne Gebäude kostete 12 Millionen Euro."
    assert lines(W / "tok" / "newstest2014.en")[2] == \
        "The state @-@ of @-@ the @-@ art building cost 12 million euros ."
    assert lines(W / "tok" / "commoncrawl.en")[9] == "Parking is free ."  # zero-width space removed
    for split, n in (("train", 29), ("valid", 6), ("test", 8)):
        for lang in wp.LANGS:
            assert len(lines(W / "bpe" / f"{split}.{lang}")) == n
    merges = lines(W / "bpe" / "codes")
    assert merges[0].startswith("#version") and len(merges) == 201
    # BPE undone gives back the tokenised text
    bpe_test = [l.replace("@@ ", "") for l in lines(W / "bpe" / "test.de")]
    assert bpe_test == lines(W / "tok" / "newstest2014.de")
    for name in ("fetch-newstest2014", "tokenise-europarl-v7.en", "clean-train", "learn-bpe",
                 "apply-bpe-test.de"):
        assert (W / "done" / f"{name}.done").is_file()


def test_second_run_skips_every_step(prepared, capsys):
    before = {p: os.path.getmtime(p) for p in map(str, prepared.rglob("*")) if os.path.isfile(p)}
    assert run_prep(prepared) == 0
    out = capsys.readouterr().out
    assert "[run ]" not in out and out.count("[skip]") == 23
    assert "clean/train.en" in out and "29" in out  # the summary still lists the counts
    after = {p: os.path.getmtime(p) for p in before}
    assert before == after


def test_resume_reruns_only_what_is_missing_or_changed(tmp_path, capsys):
    assert run_prep(tmp_path) == 0
    os.unlink(tmp_path / "tok" / "newstest2013.de")          # a lost output
    capsys.readouterr()
    assert run_prep(tmp_path) == 0
    ran = [l.split()[-1] for l in capsys.readouterr().out.splitlines() if l.startswith("[run ]")]
    assert ran == ["tokenise-newstest2013.de", "apply-bpe-valid.de"]
    # a changed parameter is refused unless --overwrite; with it, it reruns its step and
    # everything downstream of it only
    assert run_prep(tmp_path, "--max-len", "12") == 2
    assert "clean-train: max_len 80 -> 12" in capsys.readouterr().err
    assert run_prep(tmp_path, "--max-len", "12", "--overwrite") == 0
    ran = [l.split()[-1] for l in capsys.readouterr().out.splitlines() if l.startswith("[run ]")]
    assert ran == ["clean-train", "learn-bpe"] + [f"apply-bpe-{s}.{l}" for s in
                                                  ("train", "valid", "test") for l in ("en", "de")]
    assert all(len(s.split()) <= 12 for s in lines(tmp_path / "clean" / "train.de"))


def test_interrupted_step_leaves_no_marker_and_runs_again(tmp_path):
    pipe = wp.Pipeline(str(tmp_path))
    out = tmp_path / "x.txt"

    def crash():
        with wp.AtomicFiles(str(out)) as (handle,):
            handle.write("partial\n")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pipe.step("s", [str(out)], {}, crash, count=[str(out)])
    assert not out.exists() and not os.path.exists(pipe.marker("s"))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert pipe.step("s", [str(out)], {}, lambda: wp.write_lines_atomic(str(out), ["a", "b"]),
                     count=[str(out)])
    again = wp.Pipeline(str(tmp_path))
    assert not again.step("s", [str(out)], {}, lambda: 1 / 0, count=[str(out)])
    assert again.counts == {"x.txt": 2}
    out.write_text("a\nb\nc\n")  # modified after completion: not complete any more
    assert wp.Pipeline(str(tmp_path)).step("s", [str(out)], {}, lambda: None, count=[str(out)])


def test_directory_outputs_are_checked_file_by_file(tmp_path):
    out = tmp_path / "bin"

    def make():
        out.mkdir(exist_ok=True)
        (out / "a").write_text("1")
        (out / "b").write_text("22")

    assert wp.Pipeline(str(tmp_path)).step("d", [str(out)], {}, make)
    assert not wp.Pipeline(str(tmp_path)).step("d", [str(out)], {}, make)
    os.unlink(out / "b")
    assert wp.Pipeline(str(tmp_path)).step("d", [str(out)], {}, make)


def test_downloading_an_archive_does_not_change_the_fetch_fingerprint(tmp_path):
    corpus = wp.CORPORA["newstest2013"]
    orig = tmp_path / "orig"
    before = wp.source_fingerprint(corpus, [], str(orig))
    orig.mkdir()
    (orig / corpus.archive).write_bytes(b"downloaded")
    assert wp.source_fingerprint(corpus, [], str(orig)) == before
    local = tmp_path / "local"
    local.mkdir()
    (local / "newstest2013.en").write_text("x\n")
    changed = wp.source_fingerprint(corpus, [str(local)], str(orig))
    assert changed[0] != before[0] and str(local) in changed[0] and changed[1] == before[1]


def test_archives_give_the_same_raw_text(tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    for corpus in wp.CORPORA.values():
        with tarfile.open(archives / corpus.archive, "w:gz") as tar:
            for member in corpus.members.values():
                tar.add(os.path.join(FIXTURE, os.path.basename(member)), arcname=member)
    raw = tmp_path / "raw"
    for corpus in wp.CORPORA.values():
        sources = wp.fetch_corpus(corpus, str(raw), [str(archives)], str(tmp_path / "orig"),
                                  allow_download=False)
        assert all(".tgz:" in s for s in sources.values())
    direct = tmp_path / "direct"
    for corpus in wp.CORPORA.values():
        wp.fetch_corpus(corpus, str(direct), [FIXTURE], str(tmp_path / "orig"), allow_download=False)
    for name in wp.CORPORA:
        for lang in wp.LANGS:
            assert lines(raw / f"{name}.{lang}") == lines(direct / f"{name}.{lang}")
    assert len(lines(raw / "newstest2014.en")) == 8


# --------------------------------------------------------------------------- errors

def test_missing_file_is_a_clear_error(tmp_path, capsys):
    local = tmp_path / "local"
    shutil.copytree(FIXTURE, local)
    os.unlink(local / "commoncrawl.de-en.de")
    assert run_prep(tmp_path / "w", local=local) == 2
    err = capsys.readouterr().err
    assert "missing file" in err and "training-parallel-commoncrawl.tgz" in err
    assert "commoncrawl.de-en.de" in err and "--local-dir" in err


def test_line_count_mismatch_is_a_clear_error(tmp_path, capsys):
    local = tmp_path / "local"
    shutil.copytree(FIXTURE, local)
    text = (local / "europarl-v7.de-en.de").read_text().splitlines(keepends=True)
    (local / "europarl-v7.de-en.de").write_text("".join(text[:-1]))
    assert run_prep(tmp_path / "w", local=local) == 2
    err = capsys.readouterr().err
    assert "different line counts" in err and "12 lines" in err and "has 11" in err
    assert not (tmp_path / "w" / "done" / "fetch-europarl-v7.done").exists()


def test_failed_download_says_what_to_do(tmp_path):
    corpus = wp.Corpus("nowhere", "nowhere.tgz", "http://127.0.0.1:9/nowhere.tgz",
                       {"en": "nowhere.en", "de": "nowhere.de"})
    with pytest.raises(wp.PrepError, match=r"could not download .*offline\? download .*--local-dir"):
        wp.fetch_corpus(corpus, str(tmp_path / "raw"), [], str(tmp_path / "orig"))
    assert not os.listdir(tmp_path / "orig")  # no partial archive left behind
