"""The WMT'14 evaluation tools on hand-checked examples: compound splitting, tokenised BLEU,
SacreBLEU on detokenised output, and checkpoint averaging on tiny fake checkpoints."""
import argparse
import math
import os

import pytest
import torch

from sut_fairseq.eval import average_checkpoints as avg
from sut_fairseq.eval import bleu


# --------------------------------------------------------------------------- compound split

@pytest.mark.parametrize("mode,text,expected", [
    ("atat", "a rich @-@ text format", "a rich ##AT##-##AT## text format"),
    ("atat", "a rich-text format", "a rich ##AT##-##AT## text format"),  # not -a tokenised
    ("atat", "the state @-@ of @-@ the @-@ art", "the state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art"),
    ("atat", "3 @-@ 4 - 5 -x", "3 ##AT##-##AT## 4 - 5 -x"),  # a free-standing '-' is no compound
    # the perl rule s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g consumes one character each side:
    ("atat", "a-b-c", "a ##AT##-##AT## b-c"),
    # as the reference scoring scripts did on -a text: '@-@' becomes three tokens
    ("reference", "a rich @-@ text", "a rich @ ##AT##-##AT## @ text"),
    ("reference", "a rich-text", "a rich ##AT##-##AT## text"),
])
def test_compound_split(mode, text, expected):
    assert bleu.compound_split(text, mode) == expected


# --------------------------------------------------------------------------- tokenised BLEU

def test_identical_text_gives_100():
    refs = ["Die baden @-@ württembergische Landesregierung begrüßte die Entscheidung .",
            "Niemand wurde verletzt ."]
    assert bleu.tokenized_bleu(refs, refs).score == pytest.approx(100.0)
    raw = ["Die baden-württembergische Landesregierung begrüßte die Entscheidung.",
           "Niemand wurde verletzt."]
    assert bleu.sacrebleu_score(bleu.detokenize(refs), raw).score == pytest.approx(100.0)


def test_tokenised_bleu_hand_computed():
    # precisions 5/6, 3/5, 2/4, 1/3, equal lengths: BLEU = (1/12) ** (1/4)
    score = bleu.tokenized_bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert score.score == pytest.approx(100 * (1 / 12) ** 0.25, abs=1e-6)
    # brevity penalty: hypothesis of 4 tokens for a reference of 6, all n-grams right
    short = bleu.tokenized_bleu(["the cat sat on"], ["the cat sat on a mat"])
    assert short.score == pytest.approx(100 * math.exp(1 - 6 / 4), abs=1e-6)
    # no smoothing: a missing 4-gram order gives 0 (as multi-bleu.perl)
    assert bleu.tokenized_bleu(["a b c"], ["a b c"]).score == 0.0


def test_compound_split_changes_what_is_counted():
    hyp, ref = ["Wi @-@ Fi frei"], ["Wi @-@ Fi frei"]
    assert "hyp_len = 4 ref_len = 4" in bleu.tokenized_bleu(hyp, ref, "atat").detail
    assert "hyp_len = 6 ref_len = 6" in bleu.tokenized_bleu(hyp, ref, "reference").detail
    # a hyphen the model did not split aggressively still matches the reference's @-@
    assert bleu.tokenized_bleu(["ein Wi-Fi Netz ist da"], ["ein Wi @-@ Fi Netz ist da"]).score == pytest.approx(100)


def test_sacrebleu_detokenises_and_reports_its_signature():
    hyps = ["&quot; Es ist ein großer Tag für unsere Stadt &quot; , sagte sie ."]
    assert bleu.detokenize(hyps) == ['"Es ist ein großer Tag für unsere Stadt", sagte sie.']
    score = bleu.sacrebleu_score(bleu.detokenize(hyps), ['"Es ist ein großer Tag für unsere Stadt", sagte sie.'])
    assert score.score == pytest.approx(100.0)
    assert score.signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    with pytest.raises(ValueError, match="1 hypotheses for 2 references"):
        bleu.sacrebleu_score(["a"], ["a", "b"])


def test_bleu_cli(tmp_path, capsys):
    (tmp_path / "hyp").write_text("Niemand wurde verletzt .\nDer Verkehr war dicht .\n")
    (tmp_path / "tok").write_text("Niemand wurde verletzt .\nDer Verkehr war dicht .\n")
    (tmp_path / "raw").write_text("Niemand wurde verletzt.\nDer Verkehr war dicht.\n")
    assert bleu.main(["--hyp", str(tmp_path / "hyp"), "--tok-ref", str(tmp_path / "tok"),
                      "--raw-ref", str(tmp_path / "raw"), "--detok-out", str(tmp_path / "detok")]) == 0
    out = capsys.readouterr().out
    assert "tokenised BLEU (compound-split, multi-bleu equivalent): 100.00" in out
    assert "SacreBLEU (detokenised vs raw reference): 100.00" in out and "tok:13a" in out
    assert (tmp_path / "detok").read_text() == "Niemand wurde verletzt.\nDer Verkehr war dicht.\n"


# --------------------------------------------------------------------------- averaging

def fake_checkpoint(path, w, h, n, extra=None):
    state = {"args": argparse.Namespace(arch="fake"), "cfg": {"model": argparse.Namespace(arch="fake")},
             "model": {"w": torch.tensor(w, dtype=torch.float32),
                       "h": torch.tensor(h, dtype=torch.float16),
                       "n": torch.tensor(n, dtype=torch.long)},
             "extra_state": {"val_loss": 1.0}, "last_optimizer_state": {"step": 3}}
    if extra:
        state["model"].update(extra)
    torch.save(state, path)
    return str(path)


def test_average_of_two_fake_checkpoints_is_the_hand_computed_mean(tmp_path):
    a = fake_checkpoint(tmp_path / "a.pt", [1.0, 2.0, -3.0], [0.5, 1.0], [7, 8])
    b = fake_checkpoint(tmp_path / "b.pt", [3.0, 4.0, 0.0], [1.5, 2.0], [7, 8])
    out = str(tmp_path / "avg.pt")
    assert avg.main(["--inputs", a, b, "--output", out]) == 0
    state = torch.load(out, weights_only=True)  # Namespace is allow-listed by sut_fairseq
    assert torch.equal(state["model"]["w"], torch.tensor([2.0, 3.0, -1.5]))
    assert state["model"]["h"].dtype == torch.float16
    assert torch.equal(state["model"]["h"], torch.tensor([1.0, 1.5], dtype=torch.float16))
    assert torch.equal(state["model"]["n"], torch.tensor([7, 8]))
    assert state["args"].arch == "fake" and state["last_optimizer_state"] == {"step": 3}
    assert state["averaged_from"] == ["a.pt", "b.pt"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_averaging_refuses_mismatched_checkpoints(tmp_path):
    a = fake_checkpoint(tmp_path / "a.pt", [1.0], [1.0], [1])
    b = fake_checkpoint(tmp_path / "b.pt", [1.0, 2.0], [1.0], [1])
    c = fake_checkpoint(tmp_path / "c.pt", [1.0], [1.0], [2])
    d = fake_checkpoint(tmp_path / "d.pt", [1.0], [1.0], [1], extra={"z": torch.zeros(1)})
    for other, message in ((b, "shape"), (c, "differs"), (d, "does not have the parameters")):
        with pytest.raises(ValueError, match=message):
            avg.average_checkpoints([a, other], str(tmp_path / "x.pt"))
    assert not (tmp_path / "x.pt").exists()


def test_best_checkpoints_are_chosen_by_the_value_in_their_names(tmp_path):
    # fairseq: checkpoint.best_{metric}_{value:.3f}{tie-break digit}.pt
    for name in ("checkpoint.best_nll_loss_2.1003.pt", "checkpoint.best_nll_loss_2.0501.pt",
                 "checkpoint.best_nll_loss_2.3002.pt", "checkpoint_best.pt", "checkpoint_last.pt"):
        fake_checkpoint(tmp_path / name, [1.0], [1.0], [1])
    best = avg.best_checkpoints(str(tmp_path), 2)
    assert [os.path.basename(p) for p in best] == ["checkpoint.best_nll_loss_2.0501.pt",
                                                   "checkpoint.best_nll_loss_2.1003.pt"]
    worst_first = avg.best_checkpoints(str(tmp_path), 1, maximize=True)
    assert os.path.basename(worst_first[0]) == "checkpoint.best_nll_loss_2.3002.pt"
    with pytest.raises(ValueError, match="only 3"):
        avg.best_checkpoints(str(tmp_path), 5)
    with pytest.raises(FileNotFoundError, match="--keep-best-checkpoints"):
        avg.best_checkpoints(str(tmp_path / "nothing"), 5)
