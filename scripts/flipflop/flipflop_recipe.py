"""The flip-flop recipe (the recurrent-transformers paper's Table 3, at CPU scale): models,
data, the subset and memory-reset evaluations, the paper's numbers and the checks of the
CPU experiment.

What is this task's own; the stages, commands, scoring and summaries come from the shared
recipe layer (``sut_fairseq.recipes.split_grid`` over ``sut_fairseq.recipes``).

Models (``configs/flipflop/MODEL.json`` over ``configs/flipflop/common.json``): ``ut``
(stick-breaking halting), ``gut`` (gated block, global transition-aware halting), ``tlb``
(chunk-wise recurrence with memory), ``gutlb`` (GUT inside TLB's chunks) and
``sut-chunked`` (the SUT's experts inside TLB's chunks). The chunk-wise models need the
options ``--encoder-chunk-size`` and friends of the model (docs/chunked.md).

Data (``data-prep/flipflop/generate.py --binarize``): ``DATA/bin`` holds ``train``,
``valid`` and one test split per (length, p_i); ``DATA/stats.json`` maps each test split
to its binarized name; ``DATA/SPLIT.meta.jsonl`` gives, per test example, the token
indices of the last write, of the last carrier of the answer (the last write or a later
read) and of the final read.
"""
import json
import os
from typing import Dict, List, Optional, Sequence

from sut_fairseq.data import flipflop
from sut_fairseq.recipes import RecipeError, flag_value
from sut_fairseq.recipes.scoring import exact_matches
from sut_fairseq.recipes.split_grid import SplitTask

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("ut", "gut", "tlb", "gutlb", "sut-chunked")
TASK = SplitTask("flipflop", os.path.join(REPO, "configs", "flipflop"), MODELS,
                 os.path.join(REPO, "data-prep", "flipflop", "generate.py"), {"cpu": "small", "full": "paper"},
                 lambda name: [flipflop.setting_name(*s) for s in flipflop.CONFIGS[name].test_settings()])
GRID = TASK.grid

#: The chunk size that defines the subset for the models without chunks (the CPU
#: models' g), so that every row of the report covers the same examples.
DEFAULT_SUBSET_CHUNK = 8
#: fairseq-generate options of the memory-reset control (a test-only switch of the model:
#: the memory is reset to its initial value before every chunk).
RESET_OVERRIDES = ["--model-overrides", "{'tlb_memory_reset': True}"]

#: The paper's Table 3 (accuracy %, mean of 3 runs; trained at length 512 with p_i 0.8),
#: keyed by (length, p_i).
PAPER_TABLE3 = {
    "UT": {(512, 0.1): 100, (512, 0.8): 92.81, (512, 0.98): 59.1,
           (1024, 0.1): 100, (1024, 0.8): 91.65, (1024, 0.98): 58.44},
    "GUT": {(512, 0.1): 99.15, (512, 0.8): 91.34, (512, 0.98): 73.08,
            (1024, 0.1): 99.24, (1024, 0.8): 88.48, (1024, 0.98): 70.91},
    "TLB": {(512, 0.1): 100, (512, 0.8): 100, (512, 0.98): 93.45,
            (1024, 0.1): 100, (1024, 0.8): 100, (1024, 0.98): 95.70},
    "GUTLB": {(512, 0.1): 83.19, (512, 0.8): 99.97, (512, 0.98): 89.07,
              (1024, 0.1): 83.42, (1024, 0.8): 99.94, (1024, 0.98): 90.09},
}

#: Pass thresholds of the CPU experiment (ours, not the paper's): accuracy at the training
#: length and at twice it with p_i 0.8, the memory-reset control on the subset (judged on
#: subsets of at least ``reset_subset_min_size`` examples: at p_i 0.1 the subset holds a
#: handful, whose accuracy passes or fails by chance), and GUTLB against TLB.
CHECKS = {"train_length_min": 95.0, "double_length_min": 90.0, "reset_subset_max": 60.0,
          "reset_subset_min_size": 100, "gutlb_gap_max": 3.0}


def chunk_size(command: Sequence[str]) -> int:
    """The encoder chunk size g of a fairseq-train command (0: no chunks)."""
    value = flag_value(command, "--encoder-chunk-size")
    return int(value) if value else 0


def read_meta(data_dir: str, split: str) -> List[Dict]:
    """The per-example records of ``DATA/SPLIT.meta.jsonl``."""
    path = os.path.join(data_dir, f"{split}.meta.jsonl")
    if not os.path.isfile(path):
        raise RecipeError(f"missing file: {path} (generate the data with data-prep/flipflop/generate.py)")
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def subset(meta: Sequence[Dict], g: int) -> List[bool]:
    """Per example: does the answer lie only in chunks of ``g`` tokens before the final
    read's, i.e. the bit of the last write or of a later read (the last carrier) is in an
    earlier chunk? Only then must it pass through a chunk-wise model's memory."""
    if meta and "carrier" not in meta[0]:
        raise RecipeError("the .meta.jsonl records have no 'carrier' field: regenerate the data "
                          "with data-prep/flipflop/generate.py --overwrite")
    return [flipflop.bit_before_read_chunk(m["carrier"], m["read"], g) for m in meta]


def subset_accuracy(correct: Sequence[bool], mask: Sequence[bool]) -> Optional[float]:
    """Accuracy (%) over the examples of ``mask``; None for an empty subset."""
    if len(correct) != len(mask):
        raise RecipeError(f"{len(correct)} scored examples but {len(mask)} meta records")
    picked = [c for c, m in zip(correct, mask) if m]
    return 100.0 * sum(picked) / len(picked) if picked else None


def split_extra(args, model, run_dir, split, output, score) -> Dict:
    """The flip-flop fields of one test split: accuracy on the examples whose answer lies
    only in chunks before the read's, and for a chunked model the memory-reset control (a second
    fairseq-generate with the memory reset before every chunk), overall and on that subset."""
    g = chunk_size(TASK.trained_command(args, model, run_dir)[1])
    reset_output = os.path.join(run_dir.dir, f"generate-{split}-reset.txt")
    binarized = TASK.splits_to_score(args)[split]
    if args.dry_run:
        if g:
            TASK.generate(args, run_dir, binarized, reset_output, RESET_OVERRIDES)
        return {}
    reference = os.path.join(args.data_dir, f"{split}.tgt")
    mask = subset(read_meta(args.data_dir, split), g or args.subset_chunk_size)
    fields = {"chunk_size": g, "subset_chunk_size": g or args.subset_chunk_size,
              "subset_size": sum(mask),
              "subset_accuracy": subset_accuracy(exact_matches(output, reference), mask),
              "reset_accuracy": None, "reset_subset_accuracy": None}
    if g:
        TASK.generate(args, run_dir, binarized, reset_output, RESET_OVERRIDES)
        reset = exact_matches(reset_output, reference)
        fields.update(reset_accuracy=100.0 * sum(reset) / len(reset),
                      reset_subset_accuracy=subset_accuracy(reset, mask))
        print(f"   {split} with the memory reset every chunk: accuracy {fields['reset_accuracy']:.2f}%, "
              f"on the {fields['subset_size']} examples whose answer lies only before the read's "
              f"chunk {fields['reset_subset_accuracy']}", flush=True)
    return fields


def setting(split: str, stats: Dict) -> Optional[tuple]:
    """``(length, p_i)`` of a test split, from ``stats.json``."""
    s = stats.get("settings", {}).get(split)
    return None if s is None else (s["length"], s["p_ignore"])
