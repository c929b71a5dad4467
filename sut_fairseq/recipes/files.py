"""A recipe's files: JSON configs, atomic writes, and the per-run results under a work
directory (``WORK/RUN.../seedN/result.json``, one JSON object per finished run)."""
import glob
import json
import os
from typing import Dict, List, Sequence

from ..data.atomic import atomic_path, write_json_atomic, write_lines_atomic, write_text_atomic
from .commands import RecipeError

__all__ = ["atomic_path", "write_json_atomic", "write_lines_atomic", "write_text_atomic",
           "load_json", "load_results"]


def load_json(path: str) -> dict:
    """A JSON file; a missing or malformed one is a :class:`RecipeError` naming it."""
    if not os.path.isfile(path):
        raise RecipeError(f"missing file: {path}")
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as err:
            raise RecipeError(f"{path}: malformed JSON: {err}") from None


def load_results(work_dir: str, required: Sequence[str],
                 pattern: str = os.path.join("*", "*", "seed*", "result.json")) -> List[Dict]:
    """Every ``result.json`` under ``work_dir`` matching ``pattern``, in path order, each
    with ``_path`` added; one lacking a ``required`` key is a :class:`RecipeError`."""
    results = []
    for path in sorted(glob.glob(os.path.join(work_dir, pattern))):
        result = load_json(path)
        missing = [key for key in required if key not in result]
        if missing:
            raise RecipeError(f"{path}: no {missing[0]!r}")
        result["_path"] = path
        results.append(result)
    return results
