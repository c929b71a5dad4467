"""Data robustness (issue 9): empty source or target lines, pairs longer than the model's
maximum positions, rows that are entirely padding, a batch of one token.

What fairseq 0.12 does, verified here:

* ``fairseq-preprocess`` keeps an empty line as an example of length 1 (just EOS); source
  and target stay aligned line by line. Such examples train and decode like any other.
* ``fairseq-train`` silently drops (with a WARNING naming the ids) *training* pairs longer
  than ``--max-source-positions`` / ``--max-target-positions``, but refuses to start when
  the *validation* set has one: ``Exception: Size of sample #N is invalid ... skip this
  example with --skip-invalid-size-inputs-valid-test``. With that flag the pair is
  dropped from validation (and, in ``fairseq-generate``, from the output) with a WARNING.
* The model itself does not crash on a longer sequence (sinusoidal positions extend,
  relative positions are clipped); the limit is fairseq's filter, not a shape error.
"""
import os
import random
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch

from conftest import make_model, randomise_halting
from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
    SUTLabelSmoothedCrossEntropyCriterion,
)
from sut_fairseq.demo import fairseq_tool
from sut_fairseq.eval.generate_output import read_generate_output
from sut_fairseq.user_dir import user_dir

ENV = dict(os.environ, OMP_NUM_THREADS="1")
MAX_POSITIONS = 24
LONG = 40  # symbols in the over-long pair (+ EOS)
EMPTY_SRC, EMPTY_TGT, EMPTY_BOTH, TOO_LONG = 0, 1, 2, 3  # example ids in every split


def _run(command, ok=True, timeout=300):
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)
    if ok:
        assert proc.returncode == 0, f"{command[0]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _write_split(prefix, n, rng):
    src, tgt = [], []
    for _ in range(n):
        seq = [rng.choice("abcdefgh") for _ in range(rng.randint(3, 8))]
        src.append(" ".join(seq))
        tgt.append(" ".join(reversed(seq)))
    src[EMPTY_SRC] = ""
    tgt[EMPTY_TGT] = ""
    src[EMPTY_BOTH] = tgt[EMPTY_BOTH] = ""
    seq = [rng.choice("abcdefgh") for _ in range(LONG)]
    src[TOO_LONG], tgt[TOO_LONG] = " ".join(seq), " ".join(reversed(seq))
    for ext, lines in (("src", src), ("tgt", tgt)):
        with open(f"{prefix}.{ext}", "w") as f:
            f.write("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("robust")
    rng = random.Random(0)
    for split, n in (("train", 200), ("valid", 20), ("test", 12)):
        _write_split(str(root / split), n, rng)
    dest = str(root / "bin")
    _run([fairseq_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
          "--trainpref", str(root / "train"), "--validpref", str(root / "valid"),
          "--testpref", str(root / "test"), "--destdir", dest, "--joined-dictionary",
          "--workers", "1"])
    return dest


def test_preprocess_keeps_empty_lines_as_a_lone_eos(data_bin):
    from fairseq.data import data_utils

    for split, n in (("train", 200), ("valid", 20)):
        src = data_utils.load_indexed_dataset(os.path.join(data_bin, f"{split}.src-tgt.src"), None)
        tgt = data_utils.load_indexed_dataset(os.path.join(data_bin, f"{split}.src-tgt.tgt"), None)
        assert len(src) == len(tgt) == n  # nothing dropped, lines stay aligned
        eos = 2
        assert src[EMPTY_SRC].tolist() == [eos] and len(tgt[EMPTY_SRC]) > 1
        assert tgt[EMPTY_TGT].tolist() == [eos] and len(src[EMPTY_TGT]) > 1
        assert src[EMPTY_BOTH].tolist() == tgt[EMPTY_BOTH].tolist() == [eos]
        assert src.sizes[TOO_LONG] == tgt.sizes[TOO_LONG] == LONG + 1


def _train_command(data_bin, save_dir, *extra):
    return [fairseq_tool("fairseq-train"), data_bin, "--user-dir", user_dir(),
            "--task", "translation", "-s", "src", "-t", "tgt", "--arch", "sut_tiny",
            "--share-all-embeddings", "--dropout", "0.1",
            "--criterion", "sut_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--mim-weight", "0.01", "--act-weight", "0.001",
            "--optimizer", "adam", "--lr", "2e-3", "--max-tokens", "512", "--max-update", "6",
            "--max-source-positions", str(MAX_POSITIONS),
            "--max-target-positions", str(MAX_POSITIONS), "--seed", "1",
            "--save-dir", save_dir, "--no-epoch-checkpoints", "--num-workers", "0", "--cpu",
            "--log-format", "json", "--log-interval", "1", *extra]


def _skip_warnings(out):
    return re.findall(r"WARNING \| fairseq.tasks.fairseq_task \| (\d+) samples have invalid sizes "
                      r"and will be skipped, max_positions=\((\d+), (\d+)\), first few sample "
                      r"ids=\[([\d, ]*)\]", out)


def test_long_validation_pair_stops_fairseq_train_unless_skipped(data_bin, tmp_path):
    proc = _run(_train_command(data_bin, str(tmp_path / "a")), ok=False)
    assert proc.returncode == 1
    last = [l for l in proc.stderr.splitlines() if l.strip()][-1]
    assert last.startswith(f"Exception: Size of sample #{TOO_LONG} is invalid (="), last
    assert last.endswith(f"since max_positions=({MAX_POSITIONS}, {MAX_POSITIONS}), skip this "
                         "example with --skip-invalid-size-inputs-valid-test"), last
    # the over-long *training* pair was already dropped with a warning, before validation
    assert _skip_warnings(proc.stdout) == [("1", "24", "24", str(TOO_LONG))]


@pytest.fixture(scope="module")
def trained(data_bin, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("robust_ckpt"))
    proc = _run(_train_command(data_bin, save_dir, "--skip-invalid-size-inputs-valid-test"))
    return save_dir, proc.stdout + proc.stderr


def test_training_with_empty_lines_and_a_skipped_long_pair(trained):
    _, log = trained
    # the long pair is dropped from train and from valid; the empty lines are kept
    assert _skip_warnings(log) == [("1", "24", "24", str(TOO_LONG))] * 2
    losses = [float(m) for m in re.findall(r'train_inner \| \{.*?"loss": "([-\d.naif]+)"', log)]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses))), losses
    assert "end of epoch 1" in log  # a whole epoch, so every kept example was trained on
    valid = re.findall(r'valid \| \{.*?"valid_loss": "([-\d.naif]+)"', log)
    assert valid and all(torch.isfinite(torch.tensor([float(v) for v in valid]))), valid


def test_generate_skips_the_long_pair_and_decodes_an_empty_source(data_bin, trained, tmp_path):
    save_dir, _ = trained
    command = [fairseq_tool("fairseq-generate"), data_bin, "--user-dir", user_dir(),
               "--task", "translation", "-s", "src", "-t", "tgt",
               "--path", os.path.join(save_dir, "checkpoint_last.pt"), "--gen-subset", "test",
               "--beam", "2", "--batch-size", "16", "--required-batch-size-multiple", "1",
               "--num-workers", "0", "--cpu", "--max-source-positions", str(MAX_POSITIONS),
               "--max-target-positions", str(MAX_POSITIONS), "--skip-invalid-size-inputs-valid-test"]
    proc = _run(command)
    out = tmp_path / "gen.txt"
    out.write_text(proc.stdout)
    examples = read_generate_output(str(out))
    assert len(examples) == 12 - 1
    ids = {int(m) for m in re.findall(r"^S-(\d+)\t", proc.stdout, re.M)}
    assert TOO_LONG not in ids and {EMPTY_SRC, EMPTY_TGT, EMPTY_BOTH} <= ids
    assert re.search(rf"^S-{EMPTY_SRC}\t$", proc.stdout, re.M)  # the empty source line
    scores = [float(s) for s in re.findall(r"^H-\d+\t(\S+)\t", proc.stdout, re.M)]
    assert len(scores) == 11 and all(torch.isfinite(torch.tensor(scores)))


# ---- in-process: padding rows and tiny batches, forward and backward ----------------------

def _criterion(model, **weights):
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    return SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, mim_weight=0.1,
                                                 act_weight=0.01, **weights)


def _sample(src, prev, target):
    pad = 1
    return {"net_input": {"src_tokens": src, "src_lengths": src.ne(pad).sum(1),
                          "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(pad).sum())}


def _assert_finite_backward(model, sample):
    model.zero_grad()
    loss, _, log = _criterion(model)(model, sample)
    assert torch.isfinite(loss), log
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not missing and not bad, (missing, bad)
    for key in ("mim", "switch", "act_enc", "act_dec"):
        assert torch.isfinite(torch.tensor(log[key])), (key, log)
    return loss, log


def _batch(B=3, S=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    target = torch.cat([prev[:, 1:], torch.full((B, 1), 2)], 1)
    return src, prev, target


@pytest.mark.parametrize("rule", ["stick-breaking", "act", "global-mean", "none"])
def test_all_padding_source_row_gives_no_nan(rule):
    """A source row that is entirely padding: its encoder output rows, halting weights and
    steps are 0, nothing is NaN in outputs or gradients, and the other rows are unchanged."""
    model = make_model(encoder_halting=rule, decoder_halting=rule, halting_threshold=0.9)
    randomise_halting(model)
    src, prev, target = _batch()
    src[0] = 1  # entirely padding
    with torch.no_grad():
        out, extra = model(src, src.ne(1).sum(1), prev)
        alone, _ = model(src[1:], src[1:].ne(1).sum(1), prev[1:])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], alone, atol=1e-5, rtol=1e-5)
    enc = extra["halting_encoder"]
    assert not enc.real[0].any() and (enc.steps[0] == 0).all() and (enc.weights[0] == 0).all()
    torch.testing.assert_close(enc.weights[1:].sum(-1), torch.ones(2, 6), atol=1e-6, rtol=0)
    model.train()
    _assert_finite_backward(model, _sample(src, prev, target))


def test_all_padding_rows_on_both_sides_give_no_nan():
    """Padding rows in the decoder too (fairseq never makes one, the model must not care)."""
    model = make_model(dropout=0.1).train()
    randomise_halting(model)
    src, prev, target = _batch(B=4)
    src[0] = 1
    prev[1] = 1
    target[1] = 1
    out, extra = model(src, src.ne(1).sum(1), prev)
    assert torch.isfinite(out).all()
    assert (extra["halting_decoder"].steps[1] == 0).all()
    _assert_finite_backward(model, _sample(src, prev, target))


def test_batch_of_one_token_gives_no_nan():
    """Source = EOS only (an empty line), target = EOS only: one position per side."""
    model = make_model(dropout=0.1, sample_topk=1).train()
    randomise_halting(model)
    eos = torch.tensor([[2]])
    loss, log = _assert_finite_backward(model, _sample(eos, eos, eos))
    assert log["positions_enc"] == log["positions_dec"] == 1
    assert 1 <= log["steps_enc"] <= 3 and 1 <= log["steps_dec"] <= 3
    # and in a batch of several one-token rows, with every position forced to halt at once
    for side in (model.encoder.side, model.decoder.side):
        with torch.no_grad():
            side.halting.unit.fc2.bias.fill_(30.0)
    many = torch.full((5, 1), 2)
    _, log = _assert_finite_backward(model, _sample(many, many, many))
    assert log["steps_enc"] == log["steps_dec"] == 5  # one step each


def test_sequence_longer_than_max_positions_runs_in_the_model():
    """fairseq filters pairs by ``model.max_positions()``; the model itself extends its
    sinusoidal positions and clips relative offsets instead of failing."""
    model = make_model(max_source_positions=8, max_target_positions=8)
    assert model.max_positions() == (8, 8)
    src, prev, _ = _batch(B=2, S=12, T=11)
    with torch.no_grad():
        out, _ = model(src, src.ne(1).sum(1), prev)
    assert out.shape == (2, 11, 40) and torch.isfinite(out).all()
