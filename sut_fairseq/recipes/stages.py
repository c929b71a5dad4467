"""The numbered stages of a recipe and the options that select them.

    --stage S        first stage to run (name or number; default 1, data)
    --stop-stage S   last stage to run (default 4, report)
    --dry-run        print every command of the selected stages, run nothing

A stage that finds its work done (a run's ``train.json`` or ``result.json``) skips it,
so a recipe interrupted anywhere is resumed by running the same command again, and
``--stage evaluate`` re-uses the trainings of an earlier call.
"""
import argparse
import time
from typing import Callable, Dict, List

from .commands import RecipeError

STAGES = ("data", "train", "evaluate", "report")


def _stage(text: str) -> str:
    if text.isdigit() and 1 <= int(text) <= len(STAGES):
        return STAGES[int(text) - 1]
    if text in STAGES:
        return text
    choices = ", ".join(f"{i} {name}" for i, name in enumerate(STAGES, 1))
    raise argparse.ArgumentTypeError(f"unknown stage {text!r}: choose from {choices}")


def recipe_parser(doc: str) -> argparse.ArgumentParser:
    """The argument parser of a recipe script: its docstring's first paragraph as the
    description, the rest (usage, stages, files) as the epilog, kept as written."""
    paragraphs = doc.split("\n\n")
    return argparse.ArgumentParser(description=paragraphs[0], epilog="\n\n".join(paragraphs[1:]),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_stage_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--stage``, ``--stop-stage`` and ``--dry-run`` to a recipe's parser."""
    names = ", ".join(f"{i} {name}" for i, name in enumerate(STAGES, 1))
    parser.add_argument("--stage", type=_stage, default=STAGES[0],
                        help=f"first stage to run ({names}; default: data)")
    parser.add_argument("--stop-stage", type=_stage, default=STAGES[-1],
                        help="last stage to run (default: report)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands of the selected stages, run nothing")


def selected_stages(args: argparse.Namespace) -> List[str]:
    """The stages from ``args.stage`` to ``args.stop_stage``; a range that runs backwards
    is an error (``SystemExit`` with the two stages named)."""
    first, last = STAGES.index(args.stage), STAGES.index(args.stop_stage)
    if first > last:
        raise SystemExit(f"error: --stage {args.stage} comes after --stop-stage {args.stop_stage}")
    return list(STAGES[first:last + 1])


def run_stages(args: argparse.Namespace, handlers: Dict[str, Callable[[], None]]) -> int:
    """Run the selected stages in order, each announced as ``=== stage N: NAME``.
    ``handlers`` maps every stage name to a function of no arguments. A
    :class:`RecipeError` stops the recipe with ``error: ...`` (``SystemExit``); returns 0."""
    missing = [name for name in STAGES if name not in handlers]
    if missing:
        raise ValueError(f"a recipe must handle every stage; missing {missing}")
    start = time.time()
    try:
        for name in selected_stages(args):
            print(f"=== stage {STAGES.index(name) + 1}: {name}" + (" (dry run)" if args.dry_run else ""),
                  flush=True)
            handlers[name]()
    except RecipeError as err:
        raise SystemExit(f"error: {err}")
    if not args.dry_run:
        print(f"=== done in {time.time() - start:.0f} s", flush=True)
    return 0


def run_grid(args: argparse.Namespace, data: Callable[[], None], runs: Callable[[], list],
             train: Callable, evaluate: Callable, report: Callable[[], None]) -> int:
    """:func:`run_stages` for a recipe over a grid: ``runs()`` lists the runs (tuples of
    arguments), stage 2 calls ``train(*run)`` and stage 3 ``evaluate(*run)`` for each."""
    return run_stages(args, {
        "data": data,
        "train": lambda: [train(*run) for run in runs()],
        "evaluate": lambda: [evaluate(*run) for run in runs()],
        "report": report,
    })
