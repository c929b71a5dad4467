"""ListOps, the recurrent-transformers paper's Table 1 at CPU scale: this task's part of
the recipe (``table1.py``), i.e. its models, its data and the paper's numbers; stages,
commands, scoring and summaries are the shared ``sut_fairseq.recipes.split_grid``.

The five models are the MODEL.json files of ``configs/listops/``, each over its
``common.json``: the UT with stick-breaking halting, GUT (gated block, one global
transition-aware halting decision per sequence and step), TLB (chunks of 20 tokens read
with 20 memory slots), GUTLB (GUT's block and halting per TLB chunk) and ``sut-chunked``
(the SUT's MoMHA / MoE-FFD experts in TLB's chunks); docs/chunked.md has the chunk options.

``data-prep/listops/generate.py --binarize`` writes the data: train, valid and the test
splits in ``DATA/bin`` (``test-iid`` is binarized split ``test``, the k-th
generalisation split ``test{k}``, as ``DATA/stats.json`` records beside each split's
label balance).

Two setups (``table1.py --setup``, docs/listops.md#the-classify-setup): ``classify`` (the
default; ``CLASSIFY_TASK``) trains the encoder-only classifiers of
``configs/listops/classify/`` (the five models and fairseq's transformer encoder) on
``data-prep/listops/classify.py``'s layout
(``DATA/classify``) and scores with fairseq-validate, runs in ``WORK/classify``;
``seq2seq`` (``TASK``) is the translation setup above.
"""
import os

from sut_fairseq.data import listops
from sut_fairseq.recipes.split_grid import ClassifySplitTask, SplitTask

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("ut", "gut", "tlb", "gutlb", "sut-chunked")
#: the classify setup's models (configs/listops/classify/): the paper's four, the chunked SUT
#: and fairseq's transformer encoder as baselines
CLASSIFY_MODELS = MODELS + ("transformer",)
TASK = SplitTask("listops", os.path.join(REPO, "configs", "listops"), MODELS,
                 os.path.join(REPO, "data-prep", "listops", "generate.py"), {"cpu": "small", "full": "paper"},
                 lambda name: listops.CONFIGS[name].test_names())
GRID = TASK.grid
CLASSIFY_TASK = ClassifySplitTask("listops", os.path.join(REPO, "configs", "listops"), CLASSIFY_MODELS,
                                  os.path.join(REPO, "data-prep", "listops", "generate.py"),
                                  os.path.join(REPO, "data-prep", "listops", "classify.py"),
                                  {"cpu": "small", "full": "paper"},
                                  lambda name: listops.CONFIGS[name].test_names())
TASKS = {"classify": CLASSIFY_TASK, "seq2seq": TASK}

#: The paper's Table 1 (accuracy %, mean of 3 runs; trained on length <= 100, depth <= 20,
#: arguments <= 5), keyed by this repository's split names.
PAPER_TABLE1 = {
    "UT": {"test-iid": 65.8, "test-len200-300": 14.1, "test-len500-600": 10.3,
           "test-len900-1000": 10.0, "test-args10": 13.9, "test-args15": 10.7},
    "GUT": {"test-iid": 83.2, "test-len200-300": 17.6, "test-len500-600": 11.1,
            "test-len900-1000": 10.5, "test-args10": 16.2, "test-args15": 14.2},
    "TLB": {"test-iid": 58.3, "test-len200-300": 37.7, "test-len500-600": 30.5,
            "test-len900-1000": 25.0, "test-args10": 37.3, "test-args15": 37.0},
    "GUTLB": {"test-iid": 63.6, "test-len200-300": 35.8, "test-len500-600": 28.4,
              "test-len900-1000": 21.0, "test-args10": 34.5, "test-args15": 33.8},
}
