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
