"""Make ``fairseq-train ... --arch ARCH --criterion C --help`` list the options of the
chosen architecture, task and criterion.

Stock fairseq 0.12 adds those options only after a first parse, which ``--help`` never
gets past, so no model or criterion option ever appears in its help (not even for
fairseq's own transformer). When the plugin is imported (fairseq imports ``--user-dir``
before it builds its parser) we wrap ``fairseq.options.parse_args_and_arch``: only when
``-h``/``--help`` is on the command line, the chosen components' options are added to
the parser before fairseq prints the help and exits. The same wrapper lets ``--bf16`` run
on CUDA (``bf16_on_cuda.py``).
"""
import argparse
import sys

from fairseq import options

from .bf16_on_cuda import undo_implied_tpu

_original_parse_args_and_arch = options.parse_args_and_arch


def _add_component_options(parser: argparse.ArgumentParser, argv) -> None:
    from fairseq.dataclass.utils import gen_parser_from_dataclass
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.registry import REGISTRIES
    from fairseq.tasks import TASK_REGISTRY

    known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    arch = getattr(known, "arch", None)
    if arch in ARCH_MODEL_REGISTRY:
        group = parser.add_argument_group(f"Model-specific configuration ({arch})",
                                          argument_default=argparse.SUPPRESS)
        ARCH_MODEL_REGISTRY[arch].add_args(group)
    task = getattr(known, "task", None)
    if task in TASK_REGISTRY:
        TASK_REGISTRY[task].add_args(parser)
    for name, registry in REGISTRIES.items():
        choice = getattr(known, name, None)
        cls = registry["registry"].get(choice) if choice is not None else None
        if cls is None:
            continue
        if hasattr(cls, "add_args"):
            cls.add_args(parser)
        elif hasattr(cls, "__dataclass"):
            gen_parser_from_dataclass(parser, cls.__dataclass())


def parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    argv = sys.argv[1:] if input_args is None else input_args
    if any(a in ("-h", "--help") for a in argv):
        try:
            _add_component_options(parser, argv)
        except (argparse.ArgumentError, SystemExit, KeyError, ValueError):
            pass  # fall back to fairseq's own help
    parsed = _original_parse_args_and_arch(parser, input_args, *args, **kwargs)
    # --bf16 on CUDA (bf16_on_cuda.py): parsed is args, or (args, extra) with parse_known
    undo_implied_tpu(parsed[0] if isinstance(parsed, tuple) else parsed, argv)
    return parsed


def install() -> None:
    if options.parse_args_and_arch is not parse_args_and_arch:
        options.parse_args_and_arch = parse_args_and_arch
