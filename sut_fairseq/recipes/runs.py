"""One run of a recipe's grid and the files it leaves in its directory::

    DIR/train.log       fairseq-train's output (appended to by a resumed training)
    DIR/checkpoints/    checkpoint_last.pt (resumes), checkpoint_best.pt (evaluated)
    DIR/train.json      written when training has finished: the train stage is done
    DIR/result.json     written when the run is scored: the evaluate stage is done

The two JSON files are what makes every stage resumable: :meth:`RunDir.train` and
:meth:`RunDir.needs_evaluation` skip a run whose file exists (unless ``force``).
"""
import os
import shlex
import shutil
import time
from typing import Optional, Sequence

from .commands import RecipeError, flag_value, run, show
from .files import load_json, write_json_atomic
from .stages import add_stage_arguments


class RunDir:
    def __init__(self, path: str, title: str):
        self.dir, self.title = path, title
        self.save_dir = os.path.join(path, "checkpoints")
        self.train_log = os.path.join(path, "train.log")
        self.train_json = os.path.join(path, "train.json")
        self.result = os.path.join(path, "result.json")
        self.checkpoint = os.path.join(self.save_dir, "checkpoint_best.pt")

    def train(self, command: Sequence[str], force: bool = False,
              dry_run: bool = False) -> Optional[float]:
        """Run the training ``command`` (its output appended to train.log) unless the run
        has trained before; ``force`` deletes the run first. Returns the seconds it took, or
        None when nothing ran (0.0 when the run had finished before, :meth:`finished`).
        The caller writes train.json."""
        print(self.title, flush=True)
        if dry_run:
            show(command, self.train_log)
            return None
        if force and os.path.isdir(self.dir):
            shutil.rmtree(self.dir)
        if os.path.exists(self.train_json) or os.path.exists(self.result):
            print(f"   trained before: {self.train_json} (--force to redo)")
            return None
        os.makedirs(self.dir, exist_ok=True)
        if os.path.exists(os.path.join(self.save_dir, "checkpoint_last.pt")):
            if self.finished(command):
                print(f"   finished before: train.log reached --max-update {flag_value(command, '--max-update')} "
                      "(not resumed: fairseq-train would train one update more)", flush=True)
                return 0.0
            command, dropped = resume_command(command)
            print("   resuming from checkpoints/checkpoint_last.pt"
                  + (f" (dropped {' '.join(dropped)}: they set up the first call)" if dropped else ""),
                  flush=True)
        start = time.time()
        run(command, self.train_log, append=True)
        return time.time() - start

    def finished(self, command: Sequence[str]) -> bool:
        """Whether train.log has reached the command's ``--max-update``. fairseq-train
        resumed from such a run's checkpoint_last.pt trains one more update (and saves and
        validates it) before it sees the limit, so a finished run is not resumed."""
        from .train_log import parse_train_log

        limit = flag_value(command, "--max-update")
        if not limit or not os.path.exists(self.train_log):
            return False
        updates = parse_train_log(self.train_log)["updates"]
        return updates is not None and updates >= int(limit)

    def needs_evaluation(self, force: bool = False, dry_run: bool = False) -> bool:
        """Whether the evaluate stage should score this run: not when it has a result.json
        (unless ``force``); a run that has not trained is an error. Always True for a dry
        run (its commands are printed)."""
        print(self.title, flush=True)
        if dry_run:
            return True
        if os.path.exists(self.result) and not force:
            print(f"   done before: {self.result} (--force to redo)")
            return False
        if not os.path.exists(self.train_json):
            raise RecipeError(f"{self.dir} has no train.json: run the train stage first")
        return True

    def trained(self) -> dict:
        """train.json's content."""
        return load_json(self.train_json)

    def cleanup(self) -> None:
        """Delete the checkpoints (once the run is scored)."""
        shutil.rmtree(self.save_dir, ignore_errors=True)

    def write_result(self, result: dict, cleanup: bool = False) -> None:
        """Finish the evaluate stage: add to ``result`` what train.json says (parameters,
        updates, best validation accuracy, and all of it as ``train``) and the run
        directory, write result.json atomically, and with ``cleanup`` delete the
        checkpoints."""
        trained = self.trained()
        result.update({"params": trained.get("params"), "updates": trained.get("updates"),
                       "best_valid_accuracy": trained.get("best_valid_accuracy"),
                       "train": trained, "run_dir": os.path.abspath(self.dir)})
        write_json_atomic(self.result, result)
        if cleanup:
            self.cleanup()
        print(f"   -> {self.result}", flush=True)


# fairseq-train options that start a run from someone else's checkpoint: right on the first
# call, wrong on a resumed one (fairseq loads --restore-file X in place of the run's own
# checkpoint_last.pt, and the resets would restart the schedule and the data order).
_FIRST_CALL_VALUED = ("--restore-file", "--finetune-from-model")
_FIRST_CALL_FLAGS = ("--reset-optimizer", "--reset-lr-scheduler", "--reset-dataloader",
                     "--reset-meters")


def resume_command(command: Sequence[str]):
    """``command`` without the options that only belong to a run's first call
    (``--restore-file X``, ``--finetune-from-model X``, ``--reset-*``), so that a resumed
    fairseq-train continues from the run's own ``checkpoint_last.pt``. Returns (the command,
    the dropped words)."""
    kept, dropped, words = [], [], list(command)
    i = 0
    while i < len(words):
        word = words[i]
        name = word.split("=", 1)[0]
        if name in _FIRST_CALL_VALUED:
            takes_next = "=" not in word and i + 1 < len(words)
            dropped += words[i:i + 1 + takes_next]
            i += 1 + takes_next
            continue
        if word in _FIRST_CALL_FLAGS:
            dropped.append(word)
        else:
            kept.append(word)
        i += 1
    return kept, dropped


def train_grid_run(grid, args, model: str, seed: int, run_dir: RunDir, data_bin: Optional[str] = None,
                   wrap=None, details=None) -> None:
    """The train stage of one run of a grid recipe (``grid``: a ``ModelGrid``):
    fairseq-train on ``data_bin`` (default ``DATA/bin``) with the configuration, budget and
    extra options of ``args`` (resumed when interrupted), then ``train.json``: what the log
    says (parameters, updates, stop reason), the command, the configuration and the best
    validation accuracy. ``wrap``: the command as run (e.g. pinned to a core, under GNU
    time; train.json records the fairseq-train command itself); ``details``: a function of
    the run directory returning more fields for train.json."""
    from .train_log import best_valid, parse_train_log

    data_bin = data_bin or os.path.join(args.data_dir, "bin")
    command = grid.train_command(
        model, data_bin, args.config, seed, run_dir.save_dir,
        args.stop_time_hours, args.max_update, args.cpu, shlex.split(args.train_args),
        required=not args.dry_run)
    seconds = run_dir.train(wrap(command) if wrap else command, args.force, args.dry_run)
    if seconds is None:
        return
    trained = parse_train_log(run_dir.train_log)
    trained.update({"seconds_this_call": round(seconds, 1), "command": command,
                    "config": args.config, "best_valid_accuracy": best_valid(run_dir.train_log, "accuracy")})
    trained.update(details(run_dir) if details else {})
    write_json_atomic(run_dir.train_json, trained)
    print(f"   trained: {trained['updates']} updates, best validation accuracy "
          f"{trained['best_valid_accuracy']} ({trained['stop_reason']})", flush=True)


def add_grid_arguments(parser) -> None:
    """The options every grid recipe shares: ``--force``, ``--cleanup``, ``--train-args``,
    ``--generate-args``."""
    parser.add_argument("--force", action="store_true", help="redo the selected stages of every run")
    parser.add_argument("--cleanup", action="store_true",
                        help="delete each run's checkpoints once it is scored")
    parser.add_argument("--train-args", default="", help="extra fairseq-train options (one string)")
    parser.add_argument("--generate-args", default="", help="extra fairseq-generate options (one string)")


def add_budget_arguments(parser) -> None:
    """The training budget every model of a grid shares: ``--max-update``,
    ``--stop-time-hours`` (defaults: the configuration's) and ``--cpu``."""
    parser.add_argument("--max-update", type=int, default=None,
                        help="update budget of every model (default: the configuration's)")
    parser.add_argument("--stop-time-hours", type=float, default=None,
                        help="wall-clock cap of every model (default: the configuration's)")
    parser.add_argument("--cpu", action="store_true", help="pass --cpu to fairseq-train/-generate")


def parse_grid_args(parser, argv=None):
    """Add the grid's options (:func:`add_grid_arguments`) and the stages'
    (``--stage``, ``--stop-stage``, ``--dry-run``) to a recipe's parser and parse ``argv``."""
    add_grid_arguments(parser)
    add_stage_arguments(parser)
    return parser.parse_args(argv)
