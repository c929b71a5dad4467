"""Every option the plugin adds (models, criteria, task) is named in docs/options.md."""
import argparse
import os
import re

import pytest
from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import MODEL_REGISTRY
from fairseq.tasks import TASK_DATACLASS_REGISTRY

import sut_fairseq  # noqa: F401  (registers the plugin)

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "options.md")


def _flags(parser):
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _dataclass_flags(config):
    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, config)
    return _flags(parser)


def _model_flags(name):
    parser = argparse.ArgumentParser()
    MODEL_REGISTRY[name].add_args(parser)
    return _flags(parser)


def _undocumented(flags):
    with open(DOC) as f:
        doc = f.read()
    return [flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", doc)]


@pytest.mark.parametrize("model", ["sut_transformer", "sut_classifier"])
def test_every_model_option_is_documented(model):
    flags = _model_flags(model)
    assert "--compile-loop" in flags and len(flags) > 50
    assert _undocumented(flags) == []


@pytest.mark.parametrize("criterion,base", [
    ("sut_label_smoothed_cross_entropy", "label_smoothed_cross_entropy"),  # plus fairseq's own
    ("sut_classification", None),
])
def test_every_criterion_and_task_option_is_documented(criterion, base):
    flags = set(_dataclass_flags(CRITERION_DATACLASS_REGISTRY[criterion]()))
    if base is not None:
        flags -= set(_dataclass_flags(CRITERION_DATACLASS_REGISTRY[base]()))
    assert "--mim-weight" in flags
    assert _undocumented(sorted(flags)) == []
    assert _undocumented(_dataclass_flags(TASK_DATACLASS_REGISTRY["sut_classification"]())) == []


def test_the_check_finds_a_missing_option():
    assert _undocumented(["--compile-loop", "--no-such-option", "--compile"]) == ["--no-such-option", "--compile"]
