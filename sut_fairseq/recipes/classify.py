"""The ``classify`` setup of the logic and ListOps recipes (issue #52): the paper's
encoder-only classifier (``--task sut_classification --arch sut_classifier``,
docs/classification.md) in place of the ``seq2seq`` (translation) setup.

A recipe with ``--setup classify`` takes its models from ``configs/TASK/classify/``
(one ``common.json`` and one ``MODEL.json`` each, as :mod:`.grid` reads them), trains
them on the classification layout of its data (``input0/``, ``input1/`` for pairs,
``label/``) and scores every test split of a run with one ``fairseq-validate`` (the
checkpoint loaded once)::

    fairseq-validate BIN --user-dir ... --task sut_classification --path CKPT
        --valid-subset SPLIT1,SPLIT2,... --batch-size N --required-batch-size-multiple 1

whose line per split, ``valid on 'SPLIT' subset | ... | accuracy A | ... | steps_enc S |
... | bsz B``, gives the accuracy (%), the mean executed encoder steps and the number of
examples scored (``bsz``: the sentences of the whole split, one aggregation), which must
equal the split's lines (:func:`score_validate_output`).
"""
import os
import re
from typing import Dict, List, Optional, Sequence

from .commands import RecipeError, merge_flags, tool, user_dir
from .grid import ModelGrid

SETUPS = ("classify", "seq2seq")
#: fairseq-validate over every example of a split, in this process's data loader
VALIDATE_FLAGS = ["--required-batch-size-multiple", "1", "--num-workers", "0"]
_VALID_LINE = re.compile(r"valid on '([^']+)' subset \| (.*)$")


def add_setup_argument(parser, default: str = "classify") -> None:
    """``--setup classify|seq2seq``."""
    parser.add_argument("--setup", choices=SETUPS, default=default,
                        help="classify: the encoder-only classifier (--task sut_classification, "
                             "configs/TASK/classify/; the recurrent-transformers paper's setup); "
                             f"seq2seq: the translation setup (configs/TASK/) (default: {default})")


def check_models(models: Sequence[str], grid: ModelGrid, setup: str, why: Dict[str, str]) -> None:
    """Refuse a model the setup's grid lacks, naming it, the reason (``why[model]``,
    when known) and the setup's models."""
    for model in models:
        if model not in grid.models:
            reason = why.get(model, f"it has no config in {grid.config_dir}")
            raise RecipeError(f"--models {model} is not available with --setup {setup}: {reason}; "
                              f"choose from {', '.join(grid.models)}")


def refuse_options(args, setup: str, options: Dict[str, str]) -> None:
    """Refuse options set away from their defaults that the setup does not use
    (``options``: the attribute -> why)."""
    for name, why in options.items():
        if getattr(args, name, None):
            raise RecipeError(f"--{name.replace('_', '-')} {getattr(args, name)!r} does not apply "
                              f"to --setup {setup}: {why}")


def validate_command(grid: ModelGrid, data_bin: str, checkpoint: str, subsets: Sequence[str],
                     batch_size: int, cpu: bool = False, extra: Sequence[str] = (),
                     required: bool = True) -> List[str]:
    """fairseq-validate over every example of each split of ``subsets``, one after the
    other in one process, with the grid's task options."""
    if isinstance(subsets, str) or not subsets or any("," in s for s in subsets):
        raise RecipeError(f"validate_command: {list(subsets)!r} is not a list of split names")
    merged = merge_flags(grid.common()["task"],
                         ["--path", checkpoint, "--valid-subset", ",".join(subsets),
                          "--batch-size", str(batch_size)],
                         VALIDATE_FLAGS, ["--cpu"] if cpu else [], list(extra))
    return [tool("fairseq-validate", required), data_bin, "--user-dir", user_dir(), *merged]


def read_validate_output(path: str, subset: str) -> Dict[str, float]:
    """The numbers of the last ``valid on 'SUBSET' subset | k v | ...`` line of a
    fairseq-validate output (RecipeError naming the file when there is none)."""
    found = None
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            match = _VALID_LINE.search(line.rstrip("\n"))
            if match and match.group(1) == subset:
                found = match.group(2)
    if found is None:
        raise RecipeError(f"{path}: no \"valid on '{subset}' subset\" line (did fairseq-validate fail?)")
    values = {}
    for item in found.split(" | "):
        key, _, value = item.strip().partition(" ")
        try:
            values[key] = float(value)
        except ValueError:
            continue
    return values


def count_lines(path: str) -> int:
    with open(path, encoding="utf-8") as handle:
        return sum(1 for _ in handle)


def score_validate_output(path: str, subset: str, reference: str) -> Dict:
    """One split's score from fairseq-validate's output: ``accuracy`` (%), ``total``,
    ``lines``, ``correct`` (accuracy · total / 100, rounded: exact while the split has
    fewer than 10,000 examples, the accuracy being printed to 0.01 %) and
    ``mean_encoder_steps`` (``steps_enc``; None when not logged). Refused (RecipeError)
    unless fairseq-validate scored as many examples as ``reference`` (the split's text
    file) has lines."""
    values = read_validate_output(path, subset)
    lines = count_lines(reference)
    total = int(round(values.get("bsz", -1)))
    if total != lines:
        raise RecipeError(f"{path}: fairseq-validate scored {total} examples of {subset} but "
                          f"{reference} has {lines} lines (examples skipped or dropped?)")
    accuracy = values["accuracy"]
    return {"accuracy": accuracy, "total": total, "lines": lines,
            "correct": int(round(accuracy * total / 100.0)),
            "mean_encoder_steps": values.get("steps_enc"),
            "validate_output": os.path.abspath(path), "reference": os.path.abspath(reference)}


def classify_grid(config_dir: str, models: Sequence[str]) -> ModelGrid:
    """The classify setup's grid: ``CONFIG_DIR/classify/``."""
    return ModelGrid(os.path.join(config_dir, "classify"), models)


def overrides(threshold: Optional[float]) -> List[str]:
    """``--model-overrides`` for an evaluation halting threshold (none when None)."""
    return [] if threshold is None else ["--model-overrides", repr({"halting_threshold": threshold})]
