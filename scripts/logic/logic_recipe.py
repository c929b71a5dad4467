"""The logical-inference recipe (paper Table 5, Figure 4): models, configurations, command
lines, split names, the paper's numbers and small helpers.

What is this task's own; the stages, command handling, scoring and summaries come from
the shared recipe layer ``sut_fairseq.recipes`` (re-exported here for the scripts in
``scripts/logic/``).

Models (``configs/logic/MODEL.json``, over ``configs/logic/common.json``):

* ``sut`` -- SUT, ``--arch sut_logic`` (MoMHA (12, 4, 2, 32, W=1), FFD (12, 4, 128), d 128,
  12/12 steps, stick-breaking halting);
* ``ut-halting`` -- UT with halting: ``sut_logic`` with E = k = 1 for attention and FFD;
* ``ut-no-halting`` -- the same with ``--encoder-halting none --decoder-halting none``;
* ``transformer`` -- fairseq's ``--arch transformer`` at d 128, 4 heads, FFN 512, 6+6 layers.

The recurrent-transformer halting paper's logic models (its Table 2; trained with
``--models``, not by default): ``gut`` (gated UT, global transition-aware halting, up to 15
encoder steps), ``tlb`` (chunks of 10, 10 memory slots, 2 steps per chunk) and ``gutlb``
(TLB's chunks with GUT's block and halting, up to 5 steps per chunk), each the dense UT at
the logic size (``sut_logic`` with E = k = 1), the decoder reading the token outputs as the
paper's classifiers do; ``tlb-memory``: TLB whose decoder reads the memory alone.

Configurations (``common.json`` ``configs``): ``full`` (paper scale, one GPU) and
``reduced`` (2 CPU cores, under an hour of training per model on one core). Every model
gets the same ``--max-update`` budget (the same batches); ``--stop-time-hours`` caps the
wall-clock time.

Setups (``table5.py --setup``, docs/logic.md#the-classify-setup): ``classify`` (the
default) trains the recurrent-transformers paper's encoder-only Siamese classifiers of
``configs/logic/classify/`` (``CLASSIFY_MODELS``: ``ut``, ``gut``, ``tlb``, ``gutlb`` and the
``sut`` and ``transformer`` baselines; ``--task sut_classification``) on ``prepare.py --format classify``'s data
in ``DATA/classify/PROTOCOL/`` and scores each test split with fairseq-validate; ``seq2seq``
is the translation setup above (the SUT paper's Table 5, ``MODELS`` and
``RECURRENT_MODELS``).

Data layout (``data-prep/logic/prepare.py --binarize``): for the standard protocol, test
bucket 0 is the binarized split ``test`` and bucket k (1..12) is ``test{k}``, with text
files ``test{k}.src/.tgt``; for the compositional protocols A/B/C the one test file
``test.src/.tgt`` is split ``test``.
"""
import os
import sys
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

from sut_fairseq.recipes import (RecipeError, atomic_path, flag_value, format_command,  # noqa: F401
                                 load_json, merge_flags, parse_flags, run, show, tool, user_dir,
                                 write_json_atomic, write_text_atomic)
from sut_fairseq.recipes import classify
from sut_fairseq.recipes.grid import ModelGrid
from sut_fairseq.recipes.numbers import parse_numbers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO, "configs", "logic")
DATA_PREP = os.path.join(REPO, "data-prep", "logic")

#: paper Table 5's models: what table5.py trains by default
MODELS = ("sut", "ut-halting", "ut-no-halting", "transformer")
#: the recurrent-transformer halting paper's logic models (its Table 2)
RECURRENT_MODELS = ("gut", "tlb", "gutlb", "tlb-memory")
ALL_MODELS = MODELS + RECURRENT_MODELS
#: the classify setup's models (configs/logic/classify/): the recurrent-transformers
#: paper's Table 2, the SUT and fairseq's transformer encoder as baselines
CLASSIFY_MODELS = ("ut", "gut", "tlb", "gutlb", "sut", "transformer")
#: why a seq2seq model has no classify config
NOT_CLASSIFIABLE = {
    "ut-halting": "the classify setup's UT is 'ut' (stick-breaking halting, 15 steps)",
    "ut-no-halting": "the classify setup has no UT without halting",
    "tlb-memory": "the classify setup's 'tlb' reads the memory mean already",
}
PROTOCOLS = ("standard", "A", "B", "C")
COMPOSITIONAL = ("A", "B", "C")
#: Buckets (operator counts) of the standard protocol's test files.
ALL_BUCKETS = tuple(range(13))
#: The buckets paper Table 5 reports (trained on 0..6).
REPORT_BUCKETS = tuple(range(7, 13))

#: Paper Table 5 (accuracy %): operator counts 7..12 and compositional splits A/B/C.
#: The LSTM row is Bowman et al. (2015), the Transformer row Shen et al. (2019), as the
#: paper quotes them.
PAPER_TABLE5 = OrderedDict([
    ("SUT", {7: 98, 8: 97, 9: 94, 10: 90, 11: 88, 12: 81, "A": 97, "B": 94, "C": 52}),
    ("LSTM", {7: 88, 8: 84, 9: 80, 10: 78, 11: 71, 12: 69, "A": 80, "B": 60, "C": 59}),
    ("Transformer", {7: 51, 8: 52, 9: 51, 10: 51, 11: 51, 12: 48, "A": 53, "B": 51, "C": 51}),
])

#: The recurrent-transformers paper's Table 2 (logic, accuracy %, "our implementations":
#: the mean of 3 runs; operator counts 7..12), the classify setup's report.
PAPER_TABLE2 = OrderedDict([
    ("Transformer", {7: 90.88, 8: 81.26, 9: 72.56, 10: 64.71, 11: 58.45, 12: 53.88}),
    ("UT", {7: 76.65, 8: 65.47, 9: 57.4, 10: 51.02, 11: 50.08, 12: 46.62}),
    ("GUT", {7: 96.36, 8: 84.84, 9: 74.80, 10: 66.81, 11: 58.99, 12: 51.97}),
    ("TLB", {7: 76.66, 8: 69.83, 9: 66.22, 10: 60.09, 11: 55.36, 12: 49.75}),
    ("GUTLB", {7: 76.17, 8: 71.39, 9: 67.37, 10: 60.87, 11: 57.95, 12: 52.36}),
])
PAPER = {"seq2seq": PAPER_TABLE5, "classify": PAPER_TABLE2}

#: fairseq-generate for the relation token: greedy, every example of the split
#: (``--required-batch-size-multiple 1``: otherwise this fairseq drops up to 7 per split),
#: at most 2 output tokens before the forced </s> (the reference is one token; a second
#: token makes the answer wrong; an untrained model would otherwise decode up to 200).
GENERATE_FLAGS = ["--beam", "1", "--required-batch-size-multiple", "1",
                  "--max-len-a", "0", "--max-len-b", "2", "--num-workers", "0"]
DEFAULT_GENERATE_BATCH = 256


# --------------------------------------------------------------------------- configs

#: configs/logic: common.json and one MODEL.json per model (``sut_fairseq.recipes.grid``).
GRID = ModelGrid(CONFIG_DIR, ALL_MODELS)
load_common, load_model, label, has_halting = GRID.common, GRID.model, GRID.label, GRID.has_halting
model_arch_flags = GRID.model_arch_flags
#: configs/logic/classify: the classify setup's grid
CLASSIFY_GRID = classify.classify_grid(CONFIG_DIR, CLASSIFY_MODELS)


def grid_for(setup: str) -> ModelGrid:
    """The grid of a setup (``classify`` or ``seq2seq``)."""
    return CLASSIFY_GRID if setup == "classify" else GRID


def check_models(models: Sequence[str], setup: str) -> None:
    """Refuse a model the setup has no config for, saying why."""
    why = NOT_CLASSIFIABLE if setup == "classify" else {
        m: f"a model of the classify setup (configs/logic/classify/{m}.json)" for m in CLASSIFY_MODELS}
    classify.check_models(models, grid_for(setup), setup, why)


def is_sut_transformer(model: str) -> bool:
    """Whether the model is one of the plugin's (its halting threshold can be set)."""
    return load_model(model)["arch"] != "transformer"


def is_chunked(model: str) -> bool:
    """Whether the model's encoder runs chunk-wise (TLB, GUTLB): its halting is one
    decision per chunk, which the per-position halting analysis does not read."""
    return flag_value(load_model(model)["model_flags"], "--encoder-chunk-size") is not None


# --------------------------------------------------------------------------- splits

def parse_buckets(text: str) -> List[int]:
    """``"7..12"``, ``"0-12"``, ``"7,9,12"`` or ``"all"`` -> sorted bucket numbers."""
    text = text.strip()
    if text == "all":
        return list(ALL_BUCKETS)
    try:
        buckets = parse_numbers(text)
    except ValueError as err:
        raise RecipeError(f"buckets must lie in 0..12: {err}") from None
    if any(b not in ALL_BUCKETS for b in buckets):
        raise RecipeError(f"buckets must lie in 0..12, got {text!r}")
    return buckets


def eval_splits(protocol: str, buckets: Sequence[int] = REPORT_BUCKETS) -> List[Dict]:
    """What to score for ``protocol``: ``[{"key", "subset", "text", "bucket"}]`` where
    ``subset`` is the binarized split name, ``text`` the prefix of its text files in
    prepare.py's ``--out`` and ``key`` the name it has in results (the bucket number as a
    string, or the protocol letter)."""
    if protocol == "standard":
        return [{"key": str(k), "subset": "test" if k == 0 else f"test{k}", "text": f"test{k}",
                 "bucket": k} for k in buckets]
    if protocol in COMPOSITIONAL:
        return [{"key": protocol, "subset": "test", "text": "test", "bucket": None}]
    raise RecipeError(f"unknown protocol {protocol!r}: choose from {', '.join(PROTOCOLS)}")


# --------------------------------------------------------------------------- commands

def train_flags(model: str, config: str, seed: int = 1, save_dir: Optional[str] = None,
                stop_time_hours: Optional[float] = None, max_update: Optional[int] = None,
                cpu: bool = False, extra: Sequence[str] = ()) -> List[str]:
    """Every fairseq-train option after ``DATA`` for one run (merged: later wins)."""
    return GRID.train_flags(model, config, seed, save_dir, stop_time_hours, max_update, cpu, extra)


def train_command(model: str, data_bin: str, config: str, seed: int = 1,
                  save_dir: Optional[str] = None, stop_time_hours: Optional[float] = None,
                  max_update: Optional[int] = None, cpu: bool = False,
                  extra: Sequence[str] = (), required: bool = True) -> List[str]:
    """fairseq-train for one model and configuration."""
    return GRID.train_command(model, data_bin, config, seed, save_dir, stop_time_hours,
                              max_update, cpu, extra, required)


def generate_command(data_bin: str, checkpoint: str, subset: str,
                     batch_size: int = DEFAULT_GENERATE_BATCH, cpu: bool = False,
                     extra: Sequence[str] = (), required: bool = True) -> List[str]:
    """Greedy fairseq-generate over one whole split."""
    return GRID.generate_command(data_bin, checkpoint, subset, batch_size, GENERATE_FLAGS, cpu,
                                 extra, required)


def generate_data_command(out: str, pairs: int = 500_000, seed: int = 1,
                          overwrite: bool = False) -> List[str]:
    return [sys.executable, os.path.join(DATA_PREP, "generate.py"), "--out", out,
            "--pairs", str(pairs), "--seed", str(seed), "--no-progress",
            *(["--overwrite"] if overwrite else [])]


def prepare_command(original: str, out: str, protocol: str, overwrite: bool = False,
                    setup: str = "seq2seq") -> List[str]:
    """prepare.py --binarize for one protocol (``--format classify`` in the classify setup)."""
    return [sys.executable, os.path.join(DATA_PREP, "prepare.py"), "--data", original,
            "--out", out, "--protocol", protocol, "--binarize",
            *(["--format", "classify"] if setup == "classify" else []),
            *(["--overwrite"] if overwrite else [])]


def protocol_dir(data_dir: str, protocol: str, setup: str = "seq2seq") -> str:
    """Where prepare.py writes a protocol: ``DATA/PROTOCOL`` or ``DATA/classify/PROTOCOL``."""
    return os.path.join(data_dir, "classify", protocol) if setup == "classify" else os.path.join(data_dir, protocol)


def validate_command(data_bin: str, checkpoint: str, subsets: Sequence[str],
                     batch_size: int = DEFAULT_GENERATE_BATCH, cpu: bool = False,
                     extra: Sequence[str] = (), required: bool = True) -> List[str]:
    """fairseq-validate of a classify-setup checkpoint over every example of each split
    of ``subsets`` (one process)."""
    return classify.validate_command(CLASSIFY_GRID, data_bin, checkpoint, subsets, batch_size, cpu,
                                     extra, required)
