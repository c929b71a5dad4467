"""The C-PVR recipe (the Hyper-UT paper's accuracy and depth per hop): models, data,
command lines and the scoring of one run.

What is this task's own; the stages, commands, scoring and summaries come from the shared
recipe layer ``sut_fairseq.recipes``.

Models (``configs/cpvr/MODEL.json`` over ``configs/cpvr/common.json``), all with ACT
halting on both sides:

* ``ut`` -- dense UT, ``--arch ut_cpvr`` (d 64, 4 heads, FFN 256, up to 16 steps);
* ``sut`` -- the SUT of the same active size (MoMHA E 8 k 2, MoE-FFD E 8 k 2);
* ``hyper-ut`` -- Hyper-UT, ``--arch hyper_ut_cpvr`` (M 8 weight embeddings, d_e 32).

Data (``data-prep/cpvr/generate.py --binarize``): ``DATA/bin`` holds ``train``, ``valid``
and one test split per hop n; ``DATA/stats.json`` maps each test hop to its binarized
split name (hop 1 -> ``test``, hop n -> ``test{n-1}``) and ``DATA/baselines.json`` holds
the shortcut baselines' accuracy per hop.
"""
import os
import sys
from typing import Dict, List

from sut_fairseq.recipes import RecipeError, load_json
from sut_fairseq.recipes.grid import ModelGrid
from sut_fairseq.recipes.scoring import exact_match

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRID = ModelGrid(os.path.join(REPO, "configs", "cpvr"), ("ut", "sut", "hyper-ut"))
DATA_PREP = os.path.join(REPO, "data-prep", "cpvr", "generate.py")

#: Greedy decoding of the one label token (at most 2 tokens before the forced </s>: a
#: second token makes the answer wrong) over every example of a split.
GENERATE_FLAGS = ["--beam", "1", "--required-batch-size-multiple", "1",
                  "--max-len-a", "0", "--max-len-b", "2", "--num-workers", "0"]
DEFAULT_GENERATE_BATCH = 512
#: Hops over which the depth must rise (Spearman's rho is computed over them).
DEPTH_HOPS = tuple(range(1, 7))


def generate_data_command(out: str, data_config: str = "small", overwrite: bool = False,
                          extra: List[str] = ()) -> List[str]:
    return [sys.executable, DATA_PREP, "--config", data_config, "--out", out, "--binarize",
            "--no-progress", *(["--overwrite"] if overwrite else []), *extra]


def data_complete(data_dir: str) -> bool:
    """Whether generate.py --binarize finished here (stats, baselines and the dictionary)."""
    return all(os.path.exists(os.path.join(data_dir, name)) for name in
               ("stats.json", "baselines.json", os.path.join("bin", "dict.src.txt")))


def test_splits(data_dir: str) -> Dict[int, str]:
    """``{hop: binarized split name}`` of the data's test hops, from ``stats.json``."""
    stats = load_json(os.path.join(data_dir, "stats.json"))
    splits = stats.get("binarized_test_splits")
    if not splits:
        raise RecipeError(f"{data_dir}/stats.json has no binarized_test_splits: was the data "
                          "generated with --binarize?")
    return {int(n): name for n, name in splits.items()}


def score_split(generate_output: str, reference: str) -> Dict:
    """Exact match of the one label token (the scorer refuses unless every line of the
    split was scored once and each T- line is its reference)."""
    result = exact_match(generate_output, reference)
    result["accuracy"] = result["exact_match"]
    return result
