"""The CFQ recipe (paper Table 4): the two UT variants, the training and decoding
command lines, the reduced (smoke) configuration, and the paper's numbers.

What is this task's own; stages, commands, scoring and summaries come from the shared
recipe layer ``sut_fairseq.recipes``.

Variants (both on ``--arch ut_cfq``: E = k = 1, 8 heads of 64, FFD 1024, d = 512,
T5 bucketed relative bias, pre-LN, 12/12 steps):

* ``no-halting`` -- "UT w/o halting": ``--encoder-halting none --decoder-halting none``
  (every step always runs; no ACT loss);
* ``halting`` -- "UT with halting": stick-breaking halting on both sides (the preset's
  default, alpha_thresh 0.999) with the ACT loss.

The optimisation settings below are ours: the paper's appendix, which would give them,
is missing. They are ordinary Transformer-on-CFQ settings; the paper tuned
on the MCD1 dev set, and so should anyone trying to match its numbers.
"""
import os
import sys
from typing import Dict, List, Sequence

from sut_fairseq.recipes import tool, user_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPLITS = ("mcd1", "mcd2", "mcd3", "random_split")
MCD_SPLITS = ("mcd1", "mcd2", "mcd3")
SEEDS = (1, 2, 3, 4, 5)

VARIANTS: Dict[str, Dict] = {
    "no-halting": {
        "label": "UT w/o halting",
        "args": ["--encoder-halting", "none", "--decoder-halting", "none", "--act-weight", "0"],
    },
    "halting": {
        "label": "UT with halting",
        "args": ["--encoder-halting", "stick-breaking", "--decoder-halting", "stick-breaking",
                 "--act-weight", "0.001"],
    },
}

#: Paper Table 4 (exact match %, mean ± std over 5 seeds): MCD1, MCD2, MCD3, Avg.
PAPER_TABLE4 = {
    "no-halting": {"mcd1": (71.0, 3.5), "mcd2": (48.6, 2.3), "mcd3": (51.3, 0.2), "avg": (56.9, 1.5)},
    "halting": {"mcd1": (72.4, 3.5), "mcd2": (51.1, 1.8), "mcd3": (51.7, 2.3), "avg": (58.4, 1.2)},
}

#: Full-size training (a GPU run): architecture, loss, optimisation, validation.
FULL_ARGS: List[str] = [
    "--arch", "ut_cfq", "--share-all-embeddings",
    "--dropout", "0.1", "--attention-dropout", "0.1", "--activation-dropout", "0.1",
    "--criterion", "sut_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--mim-weight", "0", "--report-accuracy",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
    "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
    "--max-tokens", "4096", "--max-update", "50000",
    # validate (and decode the dev set) every 2,500 updates, not at every (short) epoch
    "--validate-interval", "1000000", "--validate-interval-updates", "2500",
    "--save-interval", "1000000", "--save-interval-updates", "2500", "--keep-interval-updates", "1",
    "--no-epoch-checkpoints",
    "--log-format", "simple", "--log-interval", "100",
]

#: Reduced configuration for a CPU smoke run (e.g. on the test fixture): a tiny ut_cfq,
#: a few updates, one validation at the end, short decodes. Appended after FULL_ARGS
#: (argparse keeps the last value).
SMOKE_ARGS: List[str] = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
    "--att-heads", "2", "--att-head-dim", "16", "--ffd-hidden-dim", "64",
    "--lr", "2e-3", "--warmup-updates", "2", "--max-tokens", "1024", "--max-update", "6",
    "--validate-interval-updates", "0", "--save-interval-updates", "0",
    "--num-workers", "0", "--log-interval", "1",
]
#: Greedy validation decoding; the smoke run caps the output length (untrained models
#: otherwise decode the default 200 tokens).
EVAL_ARGS_FULL = '{"beam": 1}'
EVAL_ARGS_SMOKE = '{"beam": 1, "max_len_a": 0, "max_len_b": 40}'
GENERATE_SMOKE_ARGS = ["--max-len-a", "0", "--max-len-b", "40"]


def prepare_command(data: str, splits: Sequence[str], source: Sequence[str] = ()) -> List[str]:
    """``data-prep/cfq/prepare.py`` for the given splits into ``data`` (replacing it):
    ``source`` is ``["--cfq-dir", DIR]``, ``["--archive", FILE]`` or empty (download)."""
    return [sys.executable, os.path.join(REPO, "data-prep", "cfq", "prepare.py"), *source,
            "--out", data, "--split", *splits, "--binarize", "--overwrite"]


def train_command(data_bin: str, save_dir: str, variant: str, seed: int, smoke: bool = False,
                  extra: Sequence[str] = (), required: bool = True) -> List[str]:
    """fairseq-train for one run: exact match on the dev set picks checkpoint_best.pt."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return [
        tool("fairseq-train", required), data_bin, "--user-dir", user_dir(),
        "--task", "translation_exact_match", "--source-lang", "src", "--target-lang", "tgt",
        *FULL_ARGS, *VARIANTS[variant]["args"], *(SMOKE_ARGS if smoke else ()),
        "--eval-exact-match", "--eval-exact-match-args", EVAL_ARGS_SMOKE if smoke else EVAL_ARGS_FULL,
        "--best-checkpoint-metric", "exact_match", "--maximize-best-checkpoint-metric",
        # fairseq otherwise drops up to 7 dev examples per pass (batch multiple of 8)
        "--required-batch-size-multiple", "1",
        "--seed", str(seed), "--save-dir", save_dir, *extra,
    ]


def generate_command(data_bin: str, checkpoint: str, subset: str = "test", smoke: bool = False,
                     extra: Sequence[str] = (), required: bool = True) -> List[str]:
    """Greedy fairseq-generate over a whole split (every example scored)."""
    return [
        tool("fairseq-generate", required), data_bin, "--user-dir", user_dir(),
        "--task", "translation_exact_match", "--source-lang", "src", "--target-lang", "tgt",
        "--path", checkpoint, "--gen-subset", subset, "--beam", "1",
        "--batch-size", "256", "--required-batch-size-multiple", "1", "--num-workers", "0",
        *(GENERATE_SMOKE_ARGS if smoke else ()), *extra,
    ]
