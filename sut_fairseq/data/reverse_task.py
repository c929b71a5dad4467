"""A small generated seq2seq task for the demo and the end-to-end tests: reverse a
sequence of symbols.

Source: ``n`` symbols drawn uniformly from ``a, b, ...`` (n uniform in [min_len, max_len]);
target: the same symbols in reverse order. Each output position must find the source
token at the mirrored position, so the task needs attention and position information,
and it is learnt by ``sut_tiny`` in a few CPU minutes. Files are written atomically.
"""
import os
import random
from typing import Dict, List, Tuple

from .atomic import write_lines_atomic

SPLITS = {"train": 20000, "valid": 500, "test": 1000}


def reverse_examples(n: int, rng: random.Random, vocab_size: int = 12, min_len: int = 3,
                     max_len: int = 10) -> List[Tuple[str, str]]:
    """n (source, target) pairs of space-separated symbols."""
    if not 1 <= vocab_size <= 26:
        raise ValueError(f"vocab_size must be in [1, 26]; got {vocab_size}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len; got {min_len}, {max_len}")
    symbols = [chr(ord("a") + i) for i in range(vocab_size)]
    pairs = []
    for _ in range(n):
        seq = [rng.choice(symbols) for _ in range(rng.randint(min_len, max_len))]
        pairs.append((" ".join(seq), " ".join(reversed(seq))))
    return pairs


def write_reverse_task(directory: str, seed: int = 1, sizes: Dict[str, int] = None,
                       **kwargs) -> Dict[str, str]:
    """Write ``{split}.src`` / ``{split}.tgt`` for every split; returns split -> prefix."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    prefixes = {}
    for split, n in (sizes or SPLITS).items():
        pairs = reverse_examples(n, rng, **kwargs)
        prefix = os.path.join(directory, split)
        write_lines_atomic(prefix + ".src", (s for s, _ in pairs))
        write_lines_atomic(prefix + ".tgt", (t for _, t in pairs))
        prefixes[split] = prefix
    return prefixes
