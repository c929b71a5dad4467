"""The SentencePiece path of the WMT'14 recipe (``prepare.py --subword spm``, then
``scripts/wmt14/evaluate.py`` on ``data-bin-spm``) on a small generated copy-task corpus
(German-looking words on both sides, identical source and target): the text the model
is trained on, the dictionary against the model's own ids, the encoding against the
sentencepiece library called directly, resumability beside the BPE path, a few updates
of ``sut_tiny`` decoded with ``--bpe sentencepiece`` and scored with SacreBLEU, the
reference scored through the same decoding chain (detokenised output equal to the raw
reference), and the errors for a missing or mismatched model."""
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PREP_DIR = os.path.join(REPO, "data-prep", "wmt14_en_de")
SCRIPTS = os.path.join(REPO, "scripts", "wmt14")
for path in (PREP_DIR, SCRIPTS):
    if path not in sys.path:
        sys.path.insert(0, path)

import wmt14_prep as wp  # noqa: E402


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = load(os.path.join(PREP_DIR, "prepare.py"), "wmt14_prepare_cli_spm")
evaluate = load(os.path.join(SCRIPTS, "evaluate.py"), "wmt14_evaluate_spm")

WORDS = ("der die das Haus Straße Größe über schön Bürger Mädchen Fuß grün Zeit Welt "
         "Stadt neue alte sagte „Zitat“ Euro 12 300 heute morgen viel wenig Tag").split()


def sentence(rng):
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
    return " ".join(words).capitalize() + rng.choice([".", "!", "?", ","])


def sgml(segments, kind):
    body = "".join(f'<seg id="{i + 1}">{s}</seg>\n' for i, s in enumerate(segments))
    return f'<{kind}set setid="newstest2014">\n<doc docid="d1">\n{body}</doc>\n</{kind}set>\n'


def write_copy_corpus(directory, seed=0):
    """Copy-task files under the WMT'14 member names: 300 training pairs over three
    corpora, 20 validation and 30 test sentences (target = source). The test reference
    has a double space and a tab inside segments, which the SGML reading collapses."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    for stem, n in (("europarl-v7.de-en", 150), ("commoncrawl.de-en", 100),
                    ("news-commentary-v12.de-en", 50), ("newstest2013", 20)):
        text = "".join(sentence(rng) + "\n" for _ in range(n))
        for lang in ("en", "de"):
            with open(os.path.join(directory, f"{stem}.{lang}"), "w", encoding="utf-8") as f:
                f.write(text)
    test = [sentence(rng) for _ in range(30)]
    test[0] = test[0].replace(" ", "  ", 1)
    test[1] = test[1].replace(" ", "\t", 1)
    with open(os.path.join(directory, "newstest2014-deen-src.en.sgm"), "w", encoding="utf-8") as f:
        f.write(sgml(test, "src"))
    with open(os.path.join(directory, "newstest2014-deen-ref.de.sgm"), "w", encoding="utf-8") as f:
        f.write(sgml(test, "ref"))
    return [" ".join(s.split()) for s in test]


def run_prep(workdir, local, *extra):
    return prepare.main(["--workdir", str(workdir), "--local-dir", str(local), "--no-download",
                         "--workers", "1", "--subword", "spm", "--spm-vocab-size", "80",
                         "--spm-character-coverage", "1.0", *extra])


def lines(path):
    return list(wp.read_lines(str(path)))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("wmt14_spm")
    test_text = write_copy_corpus(root / "corpus")
    assert run_prep(root / "w", root / "corpus") == 0
    return root, root / "w", test_text


# --------------------------------------------------------------------------- preparation

def test_spm_text_hand_checked():
    assert wp.spm_text("  Ein\u200bTest\tmit\u00a0Abstand \u2028 „hier“.\r ") == "Ein Test mit Abstand „hier“."
    assert wp.spm_text("") == ""


def test_training_text_holds_the_pairs_clean_train_keeps(tmp_path):
    """On the hand-written fixture (32 pairs, 3 dropped by the length filter): text-train
    keeps the same 29 pairs as clean-train, untokenised; tokenising them gives clean/."""
    fixture = os.path.join(REPO, "tests", "fixtures", "wmt14")
    assert prepare.main(["--workdir", str(tmp_path), "--local-dir", fixture, "--no-download",
                         "--workers", "1", "--subword", "spm", "--spm-vocab-size", "120",
                         "--spm-character-coverage", "1.0", "--no-binarize"]) == 0
    for lang in wp.LANGS:
        text, clean = lines(tmp_path / "text" / f"train.{lang}"), lines(tmp_path / "clean" / f"train.{lang}")
        assert len(text) == len(clean) == 29
        tokenise = wp.Tokeniser(lang)
        assert [tokenise(t) for t in text] == clean
    assert "Contact" not in lines(tmp_path / "text" / "train.en")
    assert not (tmp_path / "bpe").exists() and not (tmp_path / "data-bin").exists()


def test_dictionary_lists_exactly_the_pieces_at_their_ids(prepared):
    import sentencepiece
    from fairseq.data import Dictionary

    _, W, _ = prepared
    sp = sentencepiece.SentencePieceProcessor(model_file=str(W / "spm" / "spm.model"))
    assert sp.get_piece_size() == 80
    assert [sp.id_to_piece(i) for i in range(4)] == ["<s>", "<pad>", "</s>", "<unk>"]
    expected = [f"{sp.id_to_piece(i)} 1" for i in range(4, 80)]
    assert lines(W / "spm" / "dict.txt") == expected
    for lang in wp.LANGS:
        assert lines(W / "data-bin-spm" / f"dict.{lang}.txt") == expected
        dictionary = Dictionary.load(str(W / "data-bin-spm" / f"dict.{lang}.txt"))
        assert len(dictionary) == 80
        assert all(dictionary.index(sp.id_to_piece(i)) == i for i in range(80))
    with open(W / "data-bin-spm" / "spm.model", "rb") as a, open(W / "spm" / "spm.model", "rb") as b:
        assert a.read() == b.read()


def test_encoded_text_decodes_to_the_raw_reference(prepared):
    import sentencepiece

    _, W, test_text = prepared
    sp = sentencepiece.SentencePieceProcessor(model_file=str(W / "spm" / "spm.model"))
    assert lines(W / "raw" / "newstest2014.de") == test_text
    pieces = lines(W / "spm" / "test.de")
    assert pieces == [" ".join(sp.encode(t, out_type=str)) for t in test_text]
    assert [sp.decode(p.split()) for p in pieces] == test_text
    assert lines(W / "spm" / "test.en") == pieces  # copy task: source = target
    assert all("<unk>" not in p and "\u2581" in p for p in pieces)


def test_parallel_application_equals_serial(prepared, tmp_path):
    _, W, _ = prepared
    model, src = str(W / "spm" / "spm.model"), str(W / "text" / "train.de")
    assert wp.apply_spm_file(model, src, str(tmp_path / "serial"), workers=1) == 300
    assert wp.apply_spm_file(model, src, str(tmp_path / "parallel"), workers=2, chunk_lines=7) == 300
    assert lines(tmp_path / "parallel") == lines(tmp_path / "serial") == lines(W / "spm" / "train.de")


def test_rerun_skips_and_bpe_beside_it_is_unchanged(prepared, capsys, tmp_path):
    root, W, _ = prepared
    work = tmp_path / "w"
    shutil.copytree(W, work)
    capsys.readouterr()
    assert run_prep(work, root / "corpus") == 0
    out = capsys.readouterr().out
    assert "[run ]" not in out and out.count("[skip]") == 29
    # the BPE path in the same work directory runs only its own steps
    assert prepare.main(["--workdir", str(work), "--local-dir", str(root / "corpus"), "--no-download",
                         "--workers", "1", "--bpe-merges", "50", "--no-binarize"]) == 0
    ran = [l.split()[-1] for l in capsys.readouterr().out.splitlines() if l.startswith("[run ]")]
    assert ran == ["learn-bpe"] + [f"apply-bpe-{s}.{l}" for s in ("train", "valid", "test") for l in wp.LANGS]
    # another vocabulary size is refused, then reruns the model and what was built from it
    assert run_prep(work, root / "corpus", "--spm-vocab-size", "70") == 2
    assert "learn-spm: vocab_size 80 -> 70" in capsys.readouterr().err
    assert run_prep(work, root / "corpus", "--spm-vocab-size", "70", "--overwrite") == 0
    ran = [l.split()[-1] for l in capsys.readouterr().out.splitlines() if l.startswith("[run ]")]
    assert ran == ["learn-spm"] + [f"apply-spm-{s}.{l}" for s in ("train", "valid", "test")
                                   for l in wp.LANGS] + ["binarize-spm"]
    assert len(lines(work / "data-bin-spm" / "dict.de.txt")) == 66


def test_bad_spm_settings_are_clear_errors(tmp_path):
    (tmp_path / "t.txt").write_text("ein Satz\n")
    with pytest.raises(wp.PrepError, match="vocabulary size 4 must exceed"):
        wp.learn_spm([str(tmp_path / "t.txt")], *(str(tmp_path / n) for n in ("m", "v", "d")), 4)
    with pytest.raises(wp.PrepError, match=r"missing file: .*nothing\.model"):
        wp.apply_spm_file(str(tmp_path / "nothing.model"), str(tmp_path / "t.txt"), str(tmp_path / "o"))


# --------------------------------------------------------------------------- decoding

def _run(command, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{command[:3]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def trained(prepared):
    """A few updates of sut_tiny on data-bin-spm through the recipe's train.py."""
    root, W, _ = prepared
    ckpt = root / "ckpt"
    _run([sys.executable, os.path.join(SCRIPTS, "train.py"), "sut_base", "--arch", "sut_tiny",
          "--data", str(W / "data-bin-spm"), "--save-dir", str(ckpt), "--cpu", "--update-freq", "1",
          "--max-tokens", "512", "--", "--max-update", "4", "--warmup-updates", "2", "--lr", "2e-3",
          "--num-workers", "0", "--required-batch-size-multiple", "1", "--no-save-optimizer-state"])
    assert (ckpt / "checkpoint_last.pt").is_file()
    return ckpt


def eval_argv(W, ckpt, *extra):
    return [sys.executable, os.path.join(SCRIPTS, "evaluate.py"), "--checkpoint-dir", str(ckpt),
            "--checkpoint", str(ckpt / "checkpoint_last.pt"), "--data", str(W / "data-bin-spm"),
            "--prep-dir", str(W), "--cpu", "--beam", "2", *extra]


def test_end_to_end_train_generate_sacrebleu(prepared, trained):
    _, W, test_text = prepared
    out = _run(eval_argv(W, trained))
    assert "--bpe sentencepiece --sentencepiece-model " + str(W / "data-bin-spm" / "spm.model") in out
    assert "--remove-bpe" not in out
    assert re.search(r"SacreBLEU \(SentencePiece-decoded vs raw reference\): \d+\.\d\d", out)
    assert "signature: nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in out
    assert re.search(r"\| ckpt \| 0\.\dM \([\d,]+\) \| n/a \(spm\) \| \d+\.\d\d \|", out), out[-1500:]
    result = json.loads((trained / "eval.json").read_text())
    assert result["subword"] == "spm" and result["sentences"] == 30 and result["bleu_tokenized"] is None
    hyps = lines(trained / "hyp.detok.de")
    assert len(hyps) == 30 and not any("\u2581" in h for h in hyps)  # decoded, not pieces
    gen = (trained / "generate-test.txt").read_text()
    first_d = {}
    for line in gen.splitlines():
        if line.startswith("D-"):
            first_d.setdefault(int(line.split("\t")[0][2:]), line.split("\t")[2])
    assert hyps == [first_d[i] for i in range(30)]


def test_reference_through_the_decoding_chain_is_the_raw_reference(prepared, trained):
    """fairseq-generate --score-reference outputs the binarized reference as its
    hypothesis through the same --bpe sentencepiece decoding: the detokenised text must be
    the raw reference line for line, and SacreBLEU 100."""
    _, W, test_text = prepared
    out = _run(eval_argv(W, trained, "--generate-args", "--score-reference"))
    assert lines(trained / "hyp.detok.de") == test_text == lines(W / "raw" / "newstest2014.de")
    assert "SacreBLEU (SentencePiece-decoded vs raw reference): 100.00" in out


def test_missing_or_mismatched_model_is_a_clear_error(prepared, trained, tmp_path, capsys):
    root, W, _ = prepared
    data = tmp_path / "data-bin-spm"
    shutil.copytree(W / "data-bin-spm", data)
    os.unlink(data / "spm.model")
    argv = ["--checkpoint-dir", str(tmp_path / "c"), "--checkpoint", str(trained / "checkpoint_last.pt"),
            "--data", str(data), "--prep-dir", str(W), "--cpu"]
    # the dictionary holds SentencePiece pieces: never decoded as BPE
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err
    assert "holds SentencePiece pieces" in err and str(data / "spm.model") in err
    assert evaluate.main(argv + ["--subword", "spm"]) == 2
    assert f"missing SentencePiece model {data / 'spm.model'}" in capsys.readouterr().err
    # a model of another vocabulary: named, with the first differing entry
    other = tmp_path / "other"
    wp.learn_spm([str(W / "text" / "train.de")], str(other / "m.model"), str(other / "m.vocab"),
                 str(other / "d.txt"), 60, character_coverage=1.0)
    assert evaluate.main(argv + ["--spm-model", str(other / "m.model")]) == 2
    err = capsys.readouterr().err
    assert f"SentencePiece model {other / 'm.model'} does not match the dictionary" in err
    assert str(data / "dict.en.txt") in err and "56 pieces, 76 entries" in err
    # an unreadable model file
    (data / "spm.model").write_bytes(b"not a model")
    assert evaluate.main(argv) == 2
    assert f"cannot load SentencePiece model {data / 'spm.model'}" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # nothing decoded


def test_generate_output_and_dictionary_readers(tmp_path):
    gen = tmp_path / "generate-test.txt"
    gen.write_text("S-1\tsrc\nH-1\t-0.5\t\u2581Ein \u2581Haus\nD-1\t-0.5\tEin Haus\nH-1\t-0.9\t\u2581x\n"
                   "D-1\t-0.9\tx\nH-0\t-0.1\t\u2581Ja\nD-0\t-0.1\tJa\n")
    assert evaluate.detokenised_hypotheses(str(gen)) == {0: "Ja", 1: "Ein Haus"}  # first per id
    gen.write_text("H-0\t-0.1\t\u2581Ja\nD-0\t-0.1\tJa\nH-1\t-0.5\t\u2581Nein\n")
    with pytest.raises(ValueError, match=re.escape(f"{gen}: 1 examples have no D- line (e.g. id 1)")):
        evaluate.detokenised_hypotheses(str(gen))
    recipe = sys.modules["wmt14_recipe"]
    (tmp_path / "dict.txt").write_text("\u2581a 1\nb 1\nmadeupword0000 0\nmadeupword0001 0\n")
    assert recipe.dictionary_entries(str(tmp_path / "dict.txt")) == ["\u2581a", "b"]
