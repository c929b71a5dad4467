"""The encoder-only classifier (docs/classification.md): pooling and Siamese features by
hand, padding and batching invariance, the criterion's loss against a hand computation
of the auxiliary terms it reuses, the task on fairseq-preprocess'd fixtures (one
sentence and pairs) and its refusals, and fairseq-train / fairseq-validate end to end."""
import random
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sut_fairseq.criterions.losses import mim_loss, record_routing, switch_loss
from sut_fairseq.criterions.sut_classification import SUTClassificationCriterion
from sut_fairseq.models.standalone import model_args, synthetic_dictionary
from sut_fairseq.models.sut_classifier import SUTClassifierModel, pool, siamese_features
from sut_fairseq.models.transformer_classifier import TransformerClassifierModel
from sut_fairseq.recipes.commands import tool
from sut_fairseq.tasks.sut_classification import SUTClassificationConfig, SUTClassificationTask
from sut_fairseq.user_dir import user_dir

PAD = 1


# --------------------------------------------------------------------------- pooling and features

def test_pooling_by_hand():
    states = torch.arange(2 * 4 * 3, dtype=torch.float64).view(2, 4, 3)
    # row 0: 3 real positions then padding; row 1: left padding, 2 real positions
    padding = torch.tensor([[False, False, False, True], [True, True, False, False]])
    states[0, 3] = float("nan")  # a padding state never reaches the result
    mean = pool(states, padding, "mean")
    assert torch.equal(mean[0], (states[0, 0] + states[0, 1] + states[0, 2]) / 3)
    assert torch.equal(mean[1], (states[1, 2] + states[1, 3]) / 2)
    end = pool(states, padding, "end")
    assert torch.equal(end, torch.stack([states[0, 2], states[1, 3]]))
    with pytest.raises(ValueError, match="--pooling='max' is invalid"):
        pool(states, padding, "max")


def test_pooling_stays_on_the_states_device():
    """Every tensor pooling makes is made on the states' device (meta tensors stand in for
    CUDA ones: an operation mixing them with CPU tensors fails as on a GPU)."""
    states = torch.empty(2, 4, 3, device="meta")
    padding = torch.zeros(2, 4, dtype=torch.bool, device="meta")
    for mode in ("mean", "end"):
        pooled = pool(states, padding, mode)
        assert pooled.device.type == "meta" and pooled.shape == (2, 3)


def test_siamese_features_exactly():
    u = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    v = torch.tensor([[4.0, 1.0], [-1.5, 3.0]])
    expected = torch.tensor([[1.0, -2.0, 4.0, 1.0, 4.0, -2.0, 3.0, 3.0],
                             [0.5, 3.0, -1.5, 3.0, -0.75, 9.0, 2.0, 0.0]])
    assert torch.equal(siamese_features(u, v), expected)


# --------------------------------------------------------------------------- the model

def _model(pair, num_classes=3, seed=0, **overrides):
    """A tiny eval-mode classifier without dropout whose halting units stop positions at
    different steps (α_thresh 0.5)."""
    torch.manual_seed(seed)
    overrides.setdefault("halting_threshold", 0.5)
    args = model_args("sut_classifier_tiny", dropout=0.0, **overrides)
    task = SimpleNamespace(source_dictionary=synthetic_dictionary(40), pair=pair,
                           num_classes=num_classes)
    model = SUTClassifierModel.build_model(args, task)
    unit = model.encoder.side.halting.unit
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        unit.fc2.weight.copy_(torch.randn(unit.fc2.weight.shape, generator=g) * 2.0
                              / unit.fc2.weight.size(1) ** 0.5)
        unit.fc2.bias.fill_(0.0)
    return model.eval()


def _tokens(lengths, seed=0, width=None):
    """Right-padded (B, width) sentences of the given lengths, each ending in </s> (2)."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    tokens = torch.full((len(lengths), width), PAD)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(4, 40, (n,), generator=g)
        tokens[i, n - 1] = 2
    return tokens, torch.tensor(lengths)


#: GUTLB's encoder at the tiny size: chunks of 3 real tokens, 2 memory slots, global-mean
#: transition-aware halting and the gate
GUTLB = dict(encoder_chunk_size=3, encoder_memory_slots=2, encoder_halting="global-mean",
             halting_transition=True, gated_ffn=True, encoder_normalize_before=True)


@pytest.mark.parametrize("pooling,options", [
    ("mean", {}), ("end", {}),
    ("end", dict(GUTLB, tlb_encoder_out="tokens")),      # the </s> state
    ("mean", dict(GUTLB, tlb_encoder_out="memory")),     # the mean over the memory slots
], ids=["mean", "end", "gutlb-end", "tlb-memory-mean"])
def test_padding_changes_neither_the_pooled_vector_nor_the_logits(pooling, options):
    model = _model(pair=False, pooling=pooling, **options)
    alone, n = _tokens([5], seed=1)
    batch, lengths = _tokens([5, 9], seed=1)           # the same first sentence, padded to 9
    batch[0] = PAD
    batch[0, :5] = alone[0]
    lengths[0] = 5
    with torch.no_grad():
        logits_alone, extra_alone = model(alone, n)
        logits_batch, extra_batch = model(batch, lengths)
    if not options:
        steps = extra_batch["halting_encoder"].steps[0, :5]
        assert steps.min() < steps.max()                # the halting rule is exercised
    torch.testing.assert_close(extra_batch["features"][:1], extra_alone["features"], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_batch[:1], logits_alone, atol=1e-5, rtol=0)
    assert logits_alone.shape == (1, 3)


def test_a_batch_of_pairs_equals_each_pair_alone():
    model = _model(pair=True, pooling="end")
    first, first_lengths = _tokens([4, 7, 3], seed=2)
    second, second_lengths = _tokens([6, 2, 8], seed=3)
    with torch.no_grad():
        logits, extra = model(first, first_lengths, second, second_lengths)
        for i in range(3):
            a, b = first_lengths[i], second_lengths[i]
            one, _ = model(first[i:i + 1, :a], first_lengths[i:i + 1],
                           second[i:i + 1, :b], second_lengths[i:i + 1])
            torch.testing.assert_close(logits[i:i + 1], one, atol=1e-5, rtol=0)
    assert extra["features"].shape == (3, 4 * 64)
    # one encoder pass over both sentences: 2B rows
    assert extra["halting_encoder"].real.sum().item() == 4 + 7 + 3 + 6 + 2 + 8
    with pytest.raises(ValueError, match="classifies pairs but was given one sentence"):
        model(first, first_lengths)


def test_decoder_options_are_refused():
    with pytest.raises(ValueError, match="--decoder-chunk-size=4 is invalid: sut_classifier has no decoder"):
        _model(pair=False, decoder_chunk_size=4)
    with pytest.raises(ValueError) as error:
        _model(pair=False, decoder_layers=5)
    assert str(error.value) == "--decoder-layers=5 is invalid: sut_classifier has no decoder (leave it unset)"


def test_a_model_given_the_other_kind_of_input_names_both():
    """A pair model given one sentence and a single-sentence model given a pair: the
    message says what the model classifies and what it was given."""
    first, first_lengths = _tokens([4, 3], seed=2)
    with pytest.raises(ValueError) as error:
        _model(pair=True)(first, first_lengths)
    assert str(error.value) == "this model classifies pairs but was given one sentence"
    with pytest.raises(ValueError) as error:
        _model(pair=False)(first, first_lengths, first, first_lengths)
    assert str(error.value) == "this model classifies single sentences but was given a pair"


def test_the_classifier_options_as_argparse_reads_them():
    """--pooling (choices, help) and --classifier-hidden-dim (an int, metavar N, help), as
    `fairseq-train --arch sut_classifier --help` shows them."""
    import argparse

    from sut_fairseq.models.sut_classifier import add_classifier_args

    parser = argparse.ArgumentParser()
    add_classifier_args(parser)
    actions = {a.dest: a for a in parser._actions}
    pooling, hidden = actions["pooling"], actions["classifier_hidden_dim"]
    assert pooling.option_strings == ["--pooling"] and tuple(pooling.choices) == ("mean", "end")
    assert pooling.help == ("sentence vector: mean over the real positions, or the state at the last one "
                            "(end: the </s>; the paper's choice for GUT/GUTLB) (default: mean)")
    assert hidden.option_strings == ["--classifier-hidden-dim"] and hidden.metavar == "N"
    assert hidden.help == "hidden width of the classification MLP (default: the encoder width)"
    assert parser.parse_args(["--classifier-hidden-dim", "7", "--pooling", "end"]) == \
        argparse.Namespace(pooling="end", classifier_hidden_dim=7)
    with pytest.raises(SystemExit):
        parser.parse_args(["--pooling", "max"])


def test_the_head_refuses_a_bad_pooling_or_width_by_name():
    from sut_fairseq.models.sut_classifier import build_head

    task = SimpleNamespace(pair=True, num_classes=3)
    args = SimpleNamespace(pooling="end", classifier_hidden_dim=1, encoder_embed_dim=8, dropout=0.0)
    head = build_head(args, task)  # width 1 is a positive integer
    assert (head.dense.in_features, head.dense.out_features, head.out_proj.out_features) == (32, 1, 3)
    with pytest.raises(ValueError) as error:
        build_head(SimpleNamespace(**dict(vars(args), pooling="max")), task)
    assert str(error.value) == "--pooling='max' is invalid: choose from ('mean', 'end')"
    for bad in (0, 2.5):
        with pytest.raises(ValueError) as error:
            build_head(SimpleNamespace(**dict(vars(args), classifier_hidden_dim=bad)), task)
        assert str(error.value) == f"--classifier-hidden-dim={bad!r} is invalid: must be a positive integer"


def test_the_encoder_holds_the_tasks_dictionary():
    for model in (_model(pair=False), _transformer(pair=False)):
        assert len(model.encoder.dictionary) == 40 and model.encoder.dictionary.pad() == PAD


# --------------------------------------------------------------------------- the transformer baseline

def _transformer(pair, pooling="mean", seed=0):
    """fairseq's TransformerEncoder (d 32, 2 layers, pre-LN) under the classifier's head."""
    torch.manual_seed(seed)
    args = model_args("transformer_classifier", dropout=0.0, encoder_embed_dim=32,
                      encoder_ffn_embed_dim=64, encoder_attention_heads=4, encoder_layers=2,
                      encoder_normalize_before=True, pooling=pooling)
    task = SimpleNamespace(source_dictionary=synthetic_dictionary(40), pair=pair, num_classes=3)
    return TransformerClassifierModel.build_model(args, task).eval()


@pytest.mark.parametrize("pooling", ["mean", "end"])
def test_the_transformer_classifier_pools_fairseqs_encoder_output(pooling):
    """The head's input is pool(fairseq's TransformerEncoder states) of each sentence
    alone, whatever the padding of the batch; no halting result."""
    model = _transformer(pair=True, pooling=pooling)
    from fairseq.models.transformer import TransformerEncoder

    assert type(model.encoder) is TransformerEncoder and len(model.encoder.layers) == 2
    first, first_lengths = _tokens([4, 7, 3], seed=6)
    second, second_lengths = _tokens([6, 2, 8], seed=7)
    with torch.no_grad():
        logits, extra = model(first, first_lengths, second, second_lengths)
        for i in range(3):
            u, v = [model.encoder(t[i:i + 1, :n[i]], n[i:i + 1])["encoder_out"][0][:, 0]
                    for t, n in ((first, first_lengths), (second, second_lengths))]
            if pooling == "mean":
                u, v = u.mean(0), v.mean(0)
            else:                                       # the </s>, the last real position
                u, v = u[-1], v[-1]
            features = torch.cat([u, v, u * v, (u - v).abs()])
            torch.testing.assert_close(extra["features"][i], features, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, model.head(extra["features"]))
    assert extra["halting_encoder"] is None and logits.shape == (3, 3)


def test_the_criterion_takes_a_classifier_without_halting():
    model = _transformer(pair=True).train()
    sample = _sample()
    with record_routing(model) as stats:
        logits, _ = model(**sample["net_input"])
    loss, sample_size, log = SUTClassificationCriterion(None)(model, sample)
    assert not stats and sample_size == 4
    torch.testing.assert_close(loss, F.cross_entropy(logits, sample["target"], reduction="sum"))
    assert log["mim"] == 0 and not any(key.endswith("_enc") for key in log)
    with pytest.raises(ValueError, match="--act-weight=0.1 is invalid: the model's encoder has no halting"):
        SUTClassificationCriterion(None, act_weight=0.1)(model, sample)


# --------------------------------------------------------------------------- the criterion

def _sample(pair=True, B=4):
    first, first_lengths = _tokens([5, 3, 6, 4][:B], seed=4)
    net_input = {"src_tokens": first, "src_lengths": first_lengths}
    if pair:
        second, second_lengths = _tokens([2, 6, 3, 5][:B], seed=5)
        net_input.update(pair_tokens=second, pair_lengths=second_lengths)
    return {"net_input": net_input, "target": torch.tensor([0, 2, 1, 2][:B]), "ntokens": 36}


def test_criterion_loss_is_cross_entropy_plus_the_auxiliary_terms():
    model = _model(pair=True).train()                   # no dropout: a deterministic forward
    sample = _sample()
    weights = dict(mim_weight=0.3, act_weight=0.05, switch_weight=0.2)
    crit = SUTClassificationCriterion(None, **weights)
    with record_routing(model) as stats:
        logits, extra = model(**sample["net_input"])
    ce = F.cross_entropy(logits, sample["target"], reduction="sum")
    mim = sum(mim_loss(s) for s in stats)
    switch = sum(switch_loss(s) for s in stats)
    act = extra["halting_encoder"].act_loss()
    assert len(stats) == 2 and mim.item() != 0 and act.item() > 1
    expected = ce + 4 * (0.3 * mim + 0.05 * act + 0.2 * switch)  # per-token scale: B sentences
    loss, sample_size, log = crit(model, sample)
    assert sample_size == 4
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(log["nll_loss"], ce.detach(), atol=1e-5, rtol=1e-6)
    assert log["ncorrect"] == logits.argmax(-1).eq(sample["target"]).sum().item()
    assert log["nsentences"] == log["sample_size"] == 4 and log["positions_enc"] == 18 + 16
    assert log["ntokens"] == 36
    torch.testing.assert_close(log["loss"], expected, atol=1e-5, rtol=1e-6)  # with the terms
    # reduce=False: the CE of each sentence, nothing auxiliary; logged as their sums
    per_sentence, _, log = crit(model, sample, reduce=False)
    torch.testing.assert_close(per_sentence, F.cross_entropy(logits, sample["target"], reduction="none"))
    assert log["loss"].dim() == log["nll_loss"].dim() == 0
    torch.testing.assert_close(log["loss"], ce.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(log["nll_loss"], ce.detach(), atol=1e-5, rtol=1e-6)
    # --aux-loss-scale reference: the terms unscaled; eval: the cross-entropy alone
    reference = SUTClassificationCriterion(None, aux_loss_scale="reference", **weights)
    torch.testing.assert_close(reference(model, sample)[0], ce + (expected - ce) / 4, atol=1e-5, rtol=1e-6)
    model.eval()
    with torch.no_grad():
        eval_loss, _, eval_log = crit(model, sample)
        eval_logits, _ = model(**sample["net_input"])
    torch.testing.assert_close(eval_loss, F.cross_entropy(eval_logits, sample["target"], reduction="sum"))


def test_criterion_reduces_accuracy_per_sentence():
    from fairseq.logging import metrics

    logs = [dict(loss=2.0, nll_loss=2.0, ntokens=10, nsentences=4, sample_size=4, ncorrect=3,
                 mim=0.0, switch=0.0, act_enc=6.0, act_units_enc=3, steps_enc=6, positions_enc=3),
            dict(loss=1.0, nll_loss=1.0, ntokens=10, nsentences=4, sample_size=4, ncorrect=2,
                 mim=0.0, switch=0.0, act_enc=2.0, act_units_enc=1, steps_enc=2, positions_enc=1)]
    with metrics.aggregate(new_root=True) as agg:
        SUTClassificationCriterion.reduce_metrics(logs)
        values = agg.get_smoothed_values()
    assert values["accuracy"] == 62.5
    assert values["loss"] == round(3.0 / 8 / 0.6931471805599453, 3)
    assert values["act_enc"] == 2.0 and values["steps_enc"] == 2.0
    assert not any(key.endswith("_dec") for key in values)
    assert SUTClassificationCriterion.logging_outputs_can_be_summed()


def test_criterion_metrics_are_weighted_rounded_and_skip_empty_outputs():
    """Two reductions into one aggregate (two batches of 1 and 3 sentences): loss and
    nll_loss (base 2, 3 decimals) averaged by sentences, accuracy (2 decimals) by sentences;
    an output without entries (``{}``) counts as zeros; a batch of one sentence is logged;
    nothing is logged for an empty one."""
    from fairseq.logging import metrics

    ln2 = 0.6931471805599453
    one = [dict(loss=0.7, nll_loss=0.5, ntokens=5, nsentences=1, sample_size=1, ncorrect=1, mim=0.0, switch=0.0)]
    three = [dict(loss=2.3, nll_loss=1.3, ntokens=9, nsentences=3, sample_size=3, ncorrect=1, mim=0.0, switch=0.0),
             {}]
    with metrics.aggregate(new_root=True) as agg:
        SUTClassificationCriterion.reduce_metrics(one)
        assert agg.get_smoothed_values()["loss"] == round(0.7 / ln2, 3)  # logged for one sentence
        SUTClassificationCriterion.reduce_metrics(three)
        values = agg.get_smoothed_values()
    # per-sentence means weighted by the sentences: (0.7 + 2.3) / 4 and (0.5 + 1.3) / 4, base 2
    assert values["loss"] == round(3.0 / 4 / ln2, 3) == 1.082
    assert values["nll_loss"] == round(1.8 / 4 / ln2, 3) == 0.649
    assert values["accuracy"] == 50.0  # (1 + 1) of 4
    with metrics.aggregate(new_root=True) as agg:
        SUTClassificationCriterion.reduce_metrics(three[:1])
        alone = agg.get_smoothed_values()
    # 2.3 / 3 / ln 2 = 1.10607, 1.3 / 3 / ln 2 = 0.62516: 3 decimals; 100 / 3: 2 decimals
    assert (alone["loss"], alone["nll_loss"], alone["accuracy"]) == (1.106, 0.625, 33.33)
    with metrics.aggregate(new_root=True) as agg:
        SUTClassificationCriterion.reduce_metrics([{}])
        assert not agg.get_smoothed_values()


# --------------------------------------------------------------------------- the task on fixtures

def _run(command):
    proc = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{command[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _preprocess(*argv):
    """fairseq-preprocess ARGV, in this process (the console script's main, without the
    seconds of a new interpreter importing fairseq)."""
    from fairseq import options
    from fairseq_cli import preprocess

    preprocess.main(options.get_preprocessing_parser().parse_args([str(a) for a in argv]))


def _write_split(root, split, n, rng):
    """Pairs of short sentences over a..f; the label says whether they start alike."""
    lines = {"input0": [], "input1": [], "label": []}
    for _ in range(n):
        a = [rng.choice("abcdef") for _ in range(rng.randint(1, 6))]
        b = [rng.choice("abcdef") for _ in range(rng.randint(1, 6))]
        lines["input0"].append(" ".join(a))
        lines["input1"].append(" ".join(b))
        lines["label"].append("same" if a[0] == b[0] else "different")
    for key, rows in lines.items():
        (root / f"{split}.{key}").write_text("\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """(pair data, single-sentence data): fairseq-preprocess'd input0 / input1 / label."""
    text = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    _write_split(text, "train", 64, rng)
    _write_split(text, "valid", 24, rng)
    pairs = tmp_path_factory.mktemp("pairs")
    for key in ("input0", "input1", "label"):
        dict_args = ["--srcdict", pairs / "input0" / "dict.txt"] if key == "input1" else []
        _preprocess("--only-source", "--workers", "1", "--trainpref", text / f"train.{key}",
                    "--validpref", text / f"valid.{key}", "--destdir", pairs / key, *dict_args)
    single = tmp_path_factory.mktemp("single")
    for key in ("input0", "label"):
        shutil.copytree(pairs / key, single / key)
    return pairs, single


def _task(data, **cfg):
    return SUTClassificationTask.setup_task(SUTClassificationConfig(data=str(data), seed=1, **cfg))


@pytest.mark.parametrize("kind", ["pairs", "single"])
def test_the_task_loads_the_fixture(fixtures, kind):
    data = fixtures[0] if kind == "pairs" else fixtures[1]
    task = _task(data, num_classes=2)
    assert task.pair == (kind == "pairs") and task.num_classes == 2
    dataset = task.load_dataset("valid")
    assert len(dataset) == 24
    batch = dataset.collater([dataset[i] for i in range(5)])
    net = batch["net_input"]
    keys = {"src_tokens", "src_lengths"} | ({"pair_tokens", "pair_lengths"} if kind == "pairs" else set())
    assert set(net) == keys
    assert batch["target"].shape == (5, 1)                # as sentence_prediction's
    labels = [task.label_dictionary[i + task.label_dictionary.nspecial]
              for i in batch["target"].view(-1).tolist()]
    assert set(labels) <= {"same", "different"}
    for name in ("src", "pair") if kind == "pairs" else ("src",):
        tokens, lengths = net[f"{name}_tokens"], net[f"{name}_lengths"]
        for row, n in zip(tokens, lengths):                  # right-padded, ending in </s>
            assert row[n - 1] == task.dictionary.eos() and row[n:].eq(task.dictionary.pad()).all()
    if kind == "pairs":  # the label is what the text says: same first word or not
        for i, label in enumerate(labels):
            same = net["src_tokens"][i, 0] == net["pair_tokens"][i, 0]
            assert label == ("same" if same else "different")
        assert batch["ntokens"] == (net["src_lengths"].sum() + net["pair_lengths"].sum()).item()


def test_the_task_refuses_missing_directories_and_a_wrong_class_count(fixtures, tmp_path):
    pairs, _ = fixtures
    with pytest.raises(ValueError, match=r"--num-classes=5 is invalid: .*label/dict.txt holds 2 labels"):
        _task(pairs, num_classes=5)
    for missing in ("input0", "label"):
        broken = tmp_path / missing
        shutil.copytree(pairs, broken)
        shutil.rmtree(broken / missing)
        with pytest.raises(FileNotFoundError, match=f"{re.escape(str(broken / missing))}/dict.txt not found"):
            _task(broken)
    with pytest.raises(FileNotFoundError, match=r"input0/test.bin/.idx not found: expected the test split"):
        _task(pairs).load_dataset("test")


@pytest.mark.parametrize("model", [
    ["--arch", "sut_classifier_tiny", "--act-weight", "0.01", "--mim-weight", "0.01"],
    ["--arch", "transformer_classifier", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
     "--encoder-attention-heads", "4", "--encoder-layers", "2", "--pooling", "end"],
], ids=["sut", "transformer"])
def test_fairseq_train_and_validate_report_accuracy(fixtures, tmp_path, model):
    pairs, _ = fixtures
    common = ["--user-dir", user_dir(), "--task", "sut_classification", "--num-workers", "0"]
    log = _run([tool("fairseq-train"), pairs, *common, *model, "--criterion", "sut_classification",
                "--optimizer", "adam", "--lr", "1e-3", "--batch-size", "16", "--max-update", "10",
                "--save-dir", tmp_path, "--no-epoch-checkpoints", "--log-format", "simple",
                "--best-checkpoint-metric", "accuracy", "--maximize-best-checkpoint-metric",
                "--seed", "1"])
    assert re.search(r"valid on 'valid' subset .*\| accuracy [\d.]+", log), log[-2000:]
    assert "num_updates 10" in log
    out = _run([tool("fairseq-validate"), pairs, *common, "--path", tmp_path / "checkpoint_best.pt",
                "--valid-subset", "valid", "--batch-size", "16"])
    accuracy = re.search(r"valid on 'valid' subset .*\| accuracy ([\d.]+)", out)
    assert accuracy and 0 <= float(accuracy.group(1)) <= 100, out[-2000:]


def test_the_criterions_defaults_are_the_command_lines():
    """Built without weights (as in a script), the criterion has ``AuxLossConfig``'s
    defaults (what fairseq-train passes without the options), and keeps its task."""
    from sut_fairseq.criterions.auxiliary import AuxLossConfig

    task = object()
    crit = SUTClassificationCriterion(task)
    config = AuxLossConfig()
    assert crit.task is task
    assert (crit.mim_weight, crit.act_weight, crit.switch_weight, crit.aux_loss_scale) == (
        config.mim_weight, config.act_weight, config.switch_weight, str(config.aux_loss_scale))
