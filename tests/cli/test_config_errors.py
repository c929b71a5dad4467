"""Bad configurations fail at model build time with a message that names the option, the
bad value and what is allowed (issue 9), through ``sut_fairseq.models.standalone.build_model``
(exactly what ``fairseq-train --arch ...`` parses and builds) and through the real
``fairseq-train`` command line."""
import os
import subprocess

import pytest

from sut_fairseq.demo import fairseq_tool
from sut_fairseq.models.standalone import build_model, model_args, synthetic_dictionary
from sut_fairseq.models.validation import validate_args
from sut_fairseq.user_dir import user_dir

# (overrides of sut_tiny, the exact message); sut_tiny: d = 64, MoMHA (4, 2, 2, 16, 4),
# FFD (4, 2, 64), L = 3 / 3
BAD_CONFIGS = {
    "att k > E": (dict(att_experts=2, att_topk=3),
                  "--att-topk=3 is invalid: must satisfy 1 <= k <= --att-experts (2)"),
    "ffd k > E": (dict(ffd_topk=5),
                  "--ffd-topk=5 is invalid: must satisfy 1 <= k <= --ffd-experts (4)"),
    "att k < 1": (dict(att_topk=0),
                  "--att-topk=0 is invalid: must satisfy 1 <= k <= --att-experts (4)"),
    "ffd k < 1": (dict(ffd_topk=-1),
                  "--ffd-topk=-1 is invalid: must satisfy 1 <= k <= --ffd-experts (4)"),
    "E < 1": (dict(ffd_experts=0), "--ffd-experts=0 is invalid: must be a positive integer"),
    "W < 0": (dict(rel_window=-1), "--rel-window=-1 is invalid: must be an integer >= 0"),
    "router width < 0": (dict(router_hidden_dim=-1),
                         "--router-hidden-dim=-1 is invalid: must be an integer >= 0 (0 = model width)"),
    "dropout < 0": (dict(activation_dropout=-0.1), "--activation-dropout=-0.1 is invalid: must be in [0, 1)"),
    "flex with attention dropout": (
        dict(flex_attention=True, attention_dropout=0.1),
        "--attention-dropout=0.1 is invalid: --flex-attention needs 0 (FlexAttention has no dropout)"),
    "flex with hyper-modules": (
        dict(flex_attention=True, hyper_modules=2, att_experts=1, att_topk=1, ffd_experts=1,
             ffd_topk=1, rel_pos="none"),
        "--hyper-modules=2 is invalid: --flex-attention needs 0 (the hyper-modules' "
        "self-attention has no FlexAttention form)"),
    "threshold 0": (dict(halting_threshold=0.0),
                    "--halting-threshold=0.0 is invalid: must be in (0, 1]"),
    "threshold > 1": (dict(halting_threshold=1.5),
                      "--halting-threshold=1.5 is invalid: must be in (0, 1]"),
    "threshold < 0": (dict(halting_threshold=-0.1),
                      "--halting-threshold=-0.1 is invalid: must be in (0, 1]"),
    "threshold nan": (dict(halting_threshold="nan"),
                      "--halting-threshold=nan is invalid: must be in (0, 1]"),
    "shared embeddings, decoder width": (
        dict(decoder_embed_dim=32),
        "--decoder-embed-dim=32 is invalid: --share-all-embeddings needs it equal to "
        "--encoder-embed-dim (64)"),
    "shared embeddings, encoder width": (
        dict(encoder_embed_dim=128, decoder_embed_dim=64),
        "--decoder-embed-dim=64 is invalid: --share-all-embeddings needs it equal to "
        "--encoder-embed-dim (128)"),
    "transition with act (encoder)": (
        dict(encoder_halting="act", halting_transition=True),
        "--encoder-halting='act' is invalid: --halting-transition needs 'stick-breaking' or "
        "'global-mean' (or 'none')"),
    "transition with act (decoder)": (
        dict(decoder_halting="act", halting_transition=True),
        "--decoder-halting='act' is invalid: --halting-transition needs 'stick-breaking' or "
        "'global-mean' (or 'none')"),
    "sample-topk > k": (dict(sample_topk=3),
                        "--sample-topk=3 is invalid: must be between 0 and the smaller top-k (2)"),
    "zero steps": (dict(decoder_layers=0), "--decoder-layers=0 is invalid: must be a positive integer"),
    "dropout 1": (dict(gating_dropout=1.0), "--gating-dropout=1.0 is invalid: must be in [0, 1)"),
    "max positions 0": (dict(max_source_positions=0),
                        "--max-source-positions=0 is invalid: must be a positive integer"),
}


def _build(**overrides):
    return build_model("sut_tiny", dict_size=40, share_all_embeddings=True, **overrides)


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_configuration_is_rejected_with_a_clear_message(name):
    overrides, message = BAD_CONFIGS[name]
    with pytest.raises(ValueError) as err:
        _build(**overrides)
    assert str(err.value) == message


def test_share_all_embeddings_needs_a_joined_dictionary():
    with pytest.raises(ValueError, match=r"--share-all-embeddings requires a joined dictionary "
                                         r"\(fairseq-preprocess --joined-dictionary\)"):
        build_model("sut_tiny", dict_size=40, joined=False, tgt_dict_size=50,
                    share_all_embeddings=True)


def test_unknown_halting_rule_and_preset_typo_are_refused_by_the_parser(capsys):
    """On the command line these are argparse choices: fairseq's own error, exit code 2."""
    with pytest.raises(SystemExit) as exit_:
        model_args("sut_tiny", encoder_halting="stick_breaking")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --encoder-halting: invalid choice: 'stick_breaking'" in err
    assert "'stick-breaking'" in err  # the allowed values are listed
    with pytest.raises(ValueError, match=r"unknown --arch 'sut_tinny'; registered: \[.*'sut_tiny'"):
        model_args("sut_tinny")


def test_unknown_halting_rule_from_a_config_or_checkpoint_is_refused_at_build():
    """Values that bypass argparse (a checkpoint's args, ``--model-overrides``, Python
    callers) meet the same check in ``build_model``."""
    from sut_fairseq.models.sut_transformer import SUTTransformerModel
    from sut_fairseq.models.standalone import _Task

    d = synthetic_dictionary(40)
    for option, value, message in [
        ("decoder_halting", "stick_breaking",
         "--decoder-halting='stick_breaking' is invalid: choose from ('stick-breaking', "
         "'global-mean', 'act', 'none', 'pabee', 'entropy')"),
        ("rel_pos", "relative", "--rel-pos='relative' is invalid: choose from ('clipped', 't5', 'none')"),
        ("halting_threshold", 2, "--halting-threshold=2 is invalid: must be in (0, 1]"),
        ("att_heads", 2.0, "--att-heads=2.0 is invalid: must be a positive integer"),
        ("halting_threshold", "0.5", "--halting-threshold='0.5' is invalid: must be in (0, 1]"),
        ("halting_threshold", True, "--halting-threshold=True is invalid: must be in (0, 1]"),
        ("encoder_halting", "pabee",
         "--encoder-halting='pabee' is invalid: choose from ('stick-breaking', 'global-mean', 'act', "
         "'none') (the exit rules ('pabee', 'entropy') are for the decoder)"),
        ("encoder_halting_kv", "states", "--encoder-halting-kv='states' is invalid: choose from ('mixture', 'state')"),
        ("decoder_halting_kv", "h", "--decoder-halting-kv='h' is invalid: choose from ('mixture', 'state')"),
        ("decoder_step_embedding", "sinusoid",
         "--decoder-step-embedding='sinusoid' is invalid: choose from ('none', 'timestep', 'coordinate')"),
        ("encoder_chunk_positions", "middle",
         "--encoder-chunk-positions='middle' is invalid: choose from ('local', 'global')"),
        ("decoder_chunk_positions", "start",
         "--decoder-chunk-positions='start' is invalid: choose from ('local', 'global')"),
        ("tlb_encoder_out", "all", "--tlb-encoder-out='all' is invalid: choose from ('tokens', 'memory', 'both')"),
    ]:
        args = model_args("sut_tiny", share_all_embeddings=True)
        setattr(args, option, value)
        with pytest.raises(ValueError) as err:
            SUTTransformerModel.build_model(args, _Task(d, d))
        assert str(err.value) == message


def test_post_training_threshold_is_checked():
    model = _build(dropout=0.0)
    with pytest.raises(ValueError, match=r"halting threshold must be in \(0, 1\]; got 1.5"):
        model.set_halting_threshold(1.5)
    model.set_halting_threshold(1.0)
    assert model.encoder.side.halting.threshold == 1.0


def test_the_boundaries_of_every_range_are_accepted():
    model = _build(att_experts=2, att_topk=2, ffd_experts=1, ffd_topk=1, rel_window=0,
                   halting_threshold=1.0, sample_topk=1, gating_dropout=0.0,
                   encoder_halting="none", halting_transition=True)
    assert model.encoder.side.block.self_attn.router.top_k == 2
    # widths may differ when the embeddings are not shared
    model = build_model("sut_tiny", dict_size=40, joined=False, tgt_dict_size=50,
                        encoder_embed_dim=64, decoder_embed_dim=32)
    assert model.decoder.output_projection.weight.shape == (50, 32)
    assert model.decoder.side.block.cross_attn.k_proj.in_features == 64


@pytest.mark.parametrize("options", [
    dict(encoder_chunk_size=1, encoder_memory_slots=1, tlb_encoder_out="memory"),
    dict(encoder_chunk_size=1, encoder_memory_slots=1, tlb_encoder_out="both"),
    dict(encoder_chunk_size=0, encoder_memory_slots=0, tlb_encoder_out="both"),  # no chunks: tokens only
    dict(encoder_chunk_size=1, tlb_unshared=True),
    dict(encoder_chunk_size=1, encoder_memory_slots=1, tlb_memory_reset=True),
    dict(decoder_chunk_size=1, decoder_memory_slots=1, tlb_memory_reset=True, tlb_encoder_out="tokens"),
    dict(decoder_halting="pabee", decoder_layers=2, exit_patience=0),
    dict(decoder_halting="entropy", decoder_layers=2, exit_entropy=0.0),
    dict(flex_attention=True, attention_dropout=0.0),
], ids=["memory", "both", "both unchunked", "unshared", "reset", "reset decoder", "pabee", "entropy", "flex"])
def test_the_boundaries_of_the_options_that_need_others_are_accepted(options):
    """The smallest chunk, the smallest memory, each option that needs them; the exit rules
    at two decoder steps and their options at 0; FlexAttention with what it needs (the
    checks alone: ``validate_args`` on what ``fairseq-train --arch sut_tiny`` parses)."""
    validate_args(model_args("sut_tiny", share_all_embeddings=True, **options))


def test_the_hyper_modules_smallest_widths_are_accepted():
    validate_args(model_args("hyper_ut_cpvr", hyper_embed_dim=1, hyper_key_dim=0))


def test_one_step_side_builds_no_halting_unit():
    """With one step nothing is decided: the side's rule is 'none' (no parameter that
    never gets a gradient, which PyTorch DDP would reject)."""
    model = _build(encoder_layers=1, decoder_layers=2)
    assert not hasattr(model.encoder.side.halting, "unit")
    assert hasattr(model.decoder.side.halting, "unit")


@pytest.fixture(scope="module")
def dict_only_data(tmp_path_factory):
    """fairseq-train builds the model right after loading the dictionaries: no data needed."""
    root = tmp_path_factory.mktemp("dicts")
    d = synthetic_dictionary(20)
    for lang in ("src", "tgt"):
        d.save(str(root / f"dict.{lang}.txt"))
    return str(root)


def _fairseq_train(data, *options):
    command = [fairseq_tool("fairseq-train"), data, "--user-dir", user_dir(),
               "--task", "translation", "-s", "src", "-t", "tgt", "--arch", "sut_tiny",
               "--share-all-embeddings", "--criterion", "sut_label_smoothed_cross_entropy",
               "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "512", "--cpu",
               "--save-dir", os.path.join(data, "ckpt"), *options]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)


def test_fairseq_train_prints_the_message_last_with_no_torch_frames(dict_only_data):
    """fairseq 0.12 does not catch exceptions from ``build_model``: Python prints the
    traceback (fairseq's and the plugin's frames only, none inside torch) and our message
    is its last line; the exit status is 1."""
    proc = _fairseq_train(dict_only_data, "--att-topk", "5")
    assert proc.returncode == 1
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines[-1] == ("ValueError: --att-topk=5 is invalid: must satisfy 1 <= k <= "
                         "--att-experts (4)"), proc.stderr[-2000:]
    frames = [l for l in lines if l.lstrip().startswith('File "')]
    assert frames and not any(os.sep + "torch" + os.sep in f for f in frames), frames
    assert frames[-1].split('"')[1].endswith(os.path.join("sut_fairseq", "models", "validation.py"))
    assert not os.path.exists(os.path.join(dict_only_data, "ckpt", "checkpoint_last.pt"))


def test_fairseq_train_preset_typo_is_fairseqs_choice_error(dict_only_data):
    proc = _fairseq_train(dict_only_data, "--arch", "sut_tinny")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "error: argument --arch/-a: invalid choice: 'sut_tinny'" in proc.stderr
