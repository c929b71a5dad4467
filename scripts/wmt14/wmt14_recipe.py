"""The WMT'14 recipe's own parts: the configs in ``configs/wmt14/``, the models of Table 1,
the Table 2 ablations and the update-frequency arithmetic. Commands, stages, scoring and
summaries come from the shared recipe layer ``sut_fairseq.recipes`` (re-exported here for
the scripts in ``scripts/wmt14/``)."""
import math
import os
from typing import Dict

from sut_fairseq.recipes import (RecipeError, flag_values, format_command, load_json,  # noqa: F401
                                 merge_flags, parse_flags, run, show, tool, user_dir)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO, "configs", "wmt14")
MODELS = ("transformer", "ut_base", "sut_base", "ut_big", "sut_big")  # Table 1 order


def load_config(name: str, config_dir: str = CONFIG_DIR) -> dict:
    return load_json(os.path.join(config_dir, name))


def load_model(model: str, config_dir: str = CONFIG_DIR) -> dict:
    if model not in MODELS:
        raise RecipeError(f"unknown model {model!r}: choose from {', '.join(MODELS)}")
    return load_config(f"{model}.json", config_dir)


def load_ablations(config_dir: str = CONFIG_DIR) -> Dict[str, dict]:
    return load_config("ablations.json", config_dir)["ablations"]


# --------------------------------------------------------------------------- batch size

def update_freq(ngpus: int, max_tokens: int, paper_gpus: int = 32, paper_max_tokens: int = 8192) -> int:
    """ceil(paper_gpus * paper_max_tokens / (ngpus * max_tokens)): the gradient accumulation
    that makes the effective batch at least the paper's."""
    if ngpus < 1 or max_tokens < 1:
        raise RecipeError(f"--ngpus ({ngpus}) and --max-tokens ({max_tokens}) must be positive")
    return max(1, math.ceil(paper_gpus * paper_max_tokens / (ngpus * max_tokens)))


def batch_note(ngpus: int, max_tokens: int, freq: int, paper_gpus: int = 32,
               paper_max_tokens: int = 8192, explicit: bool = False) -> str:
    paper = paper_gpus * paper_max_tokens
    effective = ngpus * max_tokens * freq
    how = ("given" if explicit else
           f"ceil({paper_gpus}*{paper_max_tokens} / ({ngpus}*{max_tokens})) = {freq}")
    note = (f"update-freq {freq} ({how}): {ngpus} GPU(s) x {max_tokens} tokens x {freq} = "
            f"{effective:,} tokens per update (paper: {paper_gpus} x {paper_max_tokens} = {paper:,})")
    if effective != paper:
        note += f"; {effective / paper:.3f} x the paper's batch"
    return note
