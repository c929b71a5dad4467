"""The recipe layer: one template that every task recipe (``scripts/TASK/``) fills in.

A recipe reproduces a table of a paper in four numbered stages::

    1 data      prepare and binarize the task's data (the task's own data-prep script)
    2 train     fairseq-train every run of the grid on the same budget
    3 evaluate  fairseq-generate on the test splits and score every example
    4 report    one table (markdown + JSON) and a PNG beside the paper's numbers

``--stage`` / ``--stop-stage`` run a range of them, ``--dry-run`` prints every command
instead of running it (:mod:`.stages`). A stage skips what an earlier call finished
(a run with its ``train.json`` is not trained again, one with its ``result.json`` not
evaluated again), so a recipe is resumed by running it again. The parts:

* :mod:`.commands` -- fairseq option lists (merge, look up), the console scripts, printing
  and running commands;
* :mod:`.files` -- JSON configs, atomic writes, per-run results under a work directory;
* :mod:`.scoring` -- the scorer API (relation accuracy, exact match, BLEU), which refuses
  to score unless every example of the split was scored exactly once;
* :mod:`.train_log` -- what a fairseq-train log says (parameters, updates, best
  validation metric);
* :mod:`.summary` -- means over seeds, markdown tables, line plots;
* :mod:`.grid`, :mod:`.runs` -- the model grid of ``configs/TASK/`` and one run's directory;
* :mod:`.generated` -- the shared command line of the generators of ``data-prep/flipflop``
  and ``data-prep/listops`` (output directory, ``stats.json``, binarized test splits);
* :mod:`.split_grid` -- all four stages for generated data with named test splits and a
  one-token target (the flip-flop and ListOps recipes), and their classify setup
  (``ClassifySplitTask``);
* :mod:`.classify` -- the classify setup of the logic and ListOps recipes (``--setup``):
  the encoder-only classifier's grid, fairseq-validate per test split and its score.

A task keeps only what is its own: its data-prep, its configs (``configs/TASK/``), its
metric and its paper numbers (``scripts/TASK/TASK_recipe.py``). docs/architecture.md
shows where this layer sits in the package.
"""
from .commands import (RecipeError, flag_value, flag_values, format_command, merge_flags,
                       parse_flags, run, show, tool, user_dir)
from .files import (atomic_path, load_json, load_results, write_json_atomic, write_lines_atomic,
                    write_text_atomic)
from .stages import STAGES, add_stage_arguments, recipe_parser, run_grid, run_stages, selected_stages

__all__ = [
    "RecipeError", "flag_value", "flag_values", "format_command", "merge_flags", "parse_flags",
    "run", "show", "tool", "user_dir", "atomic_path", "load_json", "load_results",
    "write_json_atomic", "write_lines_atomic", "write_text_atomic", "STAGES",
    "add_stage_arguments", "recipe_parser", "run_grid", "run_stages", "selected_stages",
]
