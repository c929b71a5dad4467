"""Every recipe's model configs (``configs/TASK/MODEL.json``) build the halting they state:
the encoder's and the decoder's rule in ``halting_rules`` are those fairseq-train parses
from the recipe's full option list, in every configuration of the recipe. (The decoder's
rule follows the encoder's unless given: a config that sets ``--encoder-halting`` and
says the decoder halts otherwise must say so with ``--decoder-halting``.)"""
import glob
import json
import os

import pytest
from fairseq import options

import sut_fairseq  # noqa: F401  (registers the plugin's models)
from sut_fairseq.recipes.grid import ModelGrid

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NOT_MODELS = ("common.json", "ablations.json")


def model_configs():
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*", "*.json"))):
        if os.path.basename(path) not in NOT_MODELS:
            found.append(os.path.relpath(path, REPO))
    return found


def parsed(flags):
    return options.parse_args_and_arch(options.get_training_parser(), input_args=["/dev/null", *flags])


def full_flags(path):
    """{configuration: the recipe's fairseq-train options of this model} (WMT'14: its
    common flags, the model's arch and flags: it has no configurations)."""
    directory, name = os.path.dirname(os.path.join(REPO, path)), os.path.basename(path)[:-5]
    with open(os.path.join(directory, "common.json")) as handle:
        common = json.load(handle)
    if "configs" not in common:
        with open(os.path.join(REPO, path)) as handle:
            spec = json.load(handle)
        return {"-": [*common["task"], *common["flags"], "--arch", spec["arch"], *spec.get("flags", [])]}
    grid = ModelGrid(directory, [name])
    return {config: grid.train_flags(name, config) for config in common["configs"]}


@pytest.mark.parametrize("path", model_configs())
def test_the_config_builds_the_halting_it_states(path):
    with open(os.path.join(REPO, path)) as handle:
        spec = json.load(handle)
    stated = spec.get("halting_rules")
    for config, flags in full_flags(path).items():
        args = parsed(flags)
        built = {side: getattr(args, f"{side}_halting", None) for side in ("encoder", "decoder")}
        if built["encoder"] is None:  # fairseq's own transformer: no halting
            assert stated is None, f"{path} states halting_rules for a model without halting"
            continue
        assert stated == built, f"{path} ({config}): states {stated}, builds {built}"


def test_every_config_with_halting_states_its_rules():
    """A model of the plugin says which rule each side halts with (the check above then
    holds it to it)."""
    missing = []
    for path in model_configs():
        with open(os.path.join(REPO, path)) as handle:
            spec = json.load(handle)
        if spec["arch"].startswith("transformer"):
            continue
        if set(spec.get("halting_rules", {})) != {"encoder", "decoder"}:
            missing.append(path)
    assert not missing, f"configs without halting_rules: {missing}"


# --------------------------------------------------------------------------- classify setup

def classify_configs():
    """configs/TASK/classify/MODEL.json: the classify setup's models (issue #52)."""
    found = sorted(glob.glob(os.path.join(REPO, "configs", "*", "classify", "*.json")))
    return [os.path.relpath(p, REPO) for p in found if os.path.basename(p) != "common.json"]


def test_the_logic_and_listops_recipes_have_classify_configs():
    tasks = {path.split(os.sep)[1] for path in classify_configs()}
    assert tasks == {"logic", "listops"}


@pytest.mark.parametrize("path", classify_configs())
def test_the_classify_config_builds_the_halting_kv_and_pooling_it_states(path):
    """The encoder's halting rule, keys/values and pooling a classify config states are
    those fairseq-train parses (the sut_classifier preset applied), in every
    configuration; TLB's unshared blocks and memory read-out where it says so."""
    with open(os.path.join(REPO, path)) as handle:
        spec = json.load(handle)
    baseline = spec["arch"] == "transformer_classifier"  # fairseq's encoder: no halting
    assert spec["arch"].startswith("sut_classifier") or baseline
    assert set(spec.get("halting_rules", {})) == (set() if baseline else {"encoder"})
    for config, flags in full_flags(path).items():
        args = parsed(flags)
        assert args.task == "sut_classification" and args.criterion == "sut_classification"
        built = {"pooling": args.pooling}
        stated = {"pooling": spec["pooling"]}
        if not baseline:
            built.update(halting=args.encoder_halting, kv=args.encoder_halting_kv)
            stated.update(halting=spec["halting_rules"]["encoder"], kv=spec["halting_kv"])
        assert built == stated, f"{path} ({config}): states {stated}, builds {built}"
        assert hasattr(args, "encoder_halting") == (not baseline)
        assert args.lr_scheduler == "fixed" and args.warmup_updates == 4000 and args.batch_size == 256
        assert args.lr == [7e-4] and args.weight_decay == 0.1


@pytest.mark.parametrize("task", ["logic", "listops"])
def test_the_classify_configs_are_the_papers_models(task):
    """Steps, chunking, GUT's keys/values, TLB's unshared blocks and read-out, pooling."""
    built = {}
    for path in classify_configs():
        if path.split(os.sep)[1] == task:
            name = os.path.basename(path)[:-5]
            built[name] = parsed(next(iter(full_flags(path).values())))
    assert built["ut"].encoder_layers == built["gut"].encoder_layers == 15
    assert built["gut"].halting_transition and built["gut"].gated_ffn
    assert built["gutlb"].encoder_layers == 5 and built["tlb"].encoder_layers == 2
    for name in ("tlb", "gutlb"):
        args = built[name]
        assert (args.encoder_chunk_size, args.encoder_memory_slots) == (10, 10)
    assert built["tlb"].tlb_unshared and built["tlb"].tlb_encoder_out == "memory"
    assert not built["gutlb"].tlb_unshared and built["gutlb"].tlb_encoder_out == "tokens"
    assert not any(built[m].tlb_unshared for m in built if m not in ("tlb", "transformer"))
    if task == "logic":  # the transformer baseline: the seq2seq recipe's encoder sizes
        args = built["transformer"]
        assert (args.encoder_layers, args.encoder_embed_dim, args.encoder_ffn_embed_dim,
                args.encoder_attention_heads, args.encoder_normalize_before) == (6, 128, 256, 4, True)


@pytest.mark.parametrize("path", classify_configs())
def test_the_classify_config_builds_its_model(path):
    """The model fairseq-train builds from a classify config (the first configuration,
    logic as pairs, ListOps as single sequences): its pooling, keys/values, halting rule
    and unshared TLB blocks are those stated, and a batch classifies."""
    import torch
    from fairseq.data import Dictionary

    from fairseq.models import ARCH_MODEL_REGISTRY

    with open(os.path.join(REPO, path)) as handle:
        spec = json.load(handle)
    args = parsed(next(iter(full_flags(path).values())))
    dictionary = Dictionary()
    for symbol in "( ) a b c and or not".split():
        dictionary.add_symbol(symbol)
    pair = path.split(os.sep)[1] == "logic"
    task = type("Task", (), {"source_dictionary": dictionary, "pair": pair, "num_classes": 3})()
    model = ARCH_MODEL_REGISTRY[spec["arch"]].build_model(args, task).eval()
    assert model.pooling == spec["pooling"] and model.pair == pair
    tokens = torch.tensor([[4, 5, 6, 2], [7, 8, 2, 1]])
    lengths = torch.tensor([4, 3])
    extra = {"pair_tokens": tokens.flip(0), "pair_lengths": lengths.flip(0)} if pair else {}
    logits, out = model(tokens, lengths, **extra)
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()
    if spec["arch"] == "transformer_classifier":
        assert out["halting_encoder"] is None and not hasattr(model.encoder, "side")
        return
    assert model.encoder.side.kv_from_state == (spec["halting_kv"] == "state")
    assert hasattr(model.encoder.side, "later_blocks") == ("--tlb-unshared" in spec["model_flags"])
    built_rule = getattr(model.encoder.side.halting, "rule", "none")  # NoHalting has no rule
    assert built_rule == spec["halting_rules"]["encoder"]
