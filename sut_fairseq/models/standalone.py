"""Build any registered fairseq architecture outside ``fairseq-train`` (for the benchmarks,
tests and analysis tools), from the arguments ``fairseq-train --arch ARCH`` would give, over
synthetic dictionaries of a chosen size.
"""
import argparse
from typing import Optional

from fairseq import options
from fairseq.data import Dictionary
from fairseq.models import ARCH_MODEL_REGISTRY

from . import sut_transformer  # noqa: F401  (registers sut_transformer and its presets)


def synthetic_dictionary(size: int) -> Dictionary:
    """A fairseq Dictionary of exactly ``size`` entries (4 specials + symbols)."""
    d = Dictionary()
    for i in range(size - len(d)):
        d.add_symbol(f"w{i}")
    return d


class _Task:
    def __init__(self, src: Dictionary, tgt: Dictionary):
        self.source_dictionary, self.target_dictionary = src, tgt


def model_args(arch: str, **overrides) -> argparse.Namespace:
    """The Namespace ``fairseq-train DATA --task translation --arch ARCH`` parses, with
    ``overrides`` given as command-line options (``share_all_embeddings=True`` ->
    ``--share-all-embeddings``; ``halting_threshold=0.5`` -> ``--halting-threshold 0.5``)."""
    if arch not in ARCH_MODEL_REGISTRY:
        raise ValueError(f"unknown --arch {arch!r}; registered: {sorted(ARCH_MODEL_REGISTRY)}")
    cli = ["/dev/null", "--task", "translation", "--arch", arch]
    for name, value in overrides.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            cli.append(flag)
        elif value is not False and value is not None:
            cli += [flag, str(value)]
    return options.parse_args_and_arch(options.get_training_parser(), input_args=cli)


def build_model(arch: str, dict_size: int = 32768, joined: bool = True,
                tgt_dict_size: Optional[int] = None, **overrides):
    """Build ``arch`` over synthetic dictionaries (one shared dictionary when ``joined``)."""
    src = synthetic_dictionary(dict_size)
    tgt = src if joined else synthetic_dictionary(tgt_dict_size or dict_size)
    return ARCH_MODEL_REGISTRY[arch].build_model(model_args(arch, **overrides), _Task(src, tgt))
