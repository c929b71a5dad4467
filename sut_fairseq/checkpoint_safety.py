"""Let ``torch.load(weights_only=True)`` read fairseq 0.12 checkpoints, safely.

fairseq 0.12 pickles the training ``argparse.Namespace`` into every checkpoint; torch >= 2.6
refuses unknown globals under ``weights_only=True`` (its default), so stock
``fairseq-generate`` cannot load any checkpoint. We allow-list exactly the classes these
checkpoints contain (found with ``torch.serialization.get_unsafe_globals_in_checkpoint``;
``tests/cli/test_end_to_end.py`` checks the list is complete) and never fall back to
``weights_only=False``.
"""
import argparse

import torch

CHECKPOINT_GLOBALS = [argparse.Namespace]

if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals(CHECKPOINT_GLOBALS)
