#!/usr/bin/env python3
"""Reproduce the paper's Table 1 (five models) or Table 2 (SUT base and its four ablations)
on WMT'14 En-De -- the four stages of the shared recipe template (``sut_fairseq.recipes``):
1 data, 2 train, 3 evaluate, 4 report.

    python scripts/wmt14/tables.py {1,2} --prep data/wmt14_en_de [--ngpus 8]
        [--max-tokens 8192] [--ckpt checkpoints/wmt14] [--runs NAME ...]
        [--subword bpe|spm] [--prep-args "..."] [--eval-args "..."] [--stage S]
        [--stop-stage S] [--dry-run]
        [--force] [-- train.py options, e.g. -- --precision bf16 -- --max-update 100]

Stages (``--stage``/``--stop-stage``, by name or number):

* *data*: ``data-prep/wmt14_en_de/prepare.py --workdir PREP`` when ``PREP/data-bin`` is
  missing (``--prep-args`` adds its options, e.g. ``"--local-dir DIR --no-download"``);
  with ``--subword spm`` the SentencePiece path, ``prepare.py --subword spm`` into
  ``PREP/data-bin-spm`` (docs/wmt14.md), which the train and evaluate stages then read
  (evaluate.py decodes with the ``spm.model`` it finds there and scores SacreBLEU);
* *train*: ``train.py`` for every run into ``CKPT/RUN`` (fairseq resumes from
  ``checkpoint_last.pt``, so a finished run returns at once); Table 2's full row re-uses
  ``CKPT/sut_base`` when Table 1 trained it;
* *evaluate*: ``evaluate.py`` (average the 5 best checkpoints, beam 8, both BLEUs, MACs)
  for every run without its ``CKPT/RUN/eval.json`` (``--force`` redoes them);
* *report*: the table from every ``eval.json`` (Table 2 adds the best validation
  ``nll_loss`` of each run's ``train.log``), printed and written to ``CKPT/tableN.md``.

Runs: Table 1 ``transformer ut_base sut_base ut_big sut_big``; Table 2 ``sut_base`` and
``sut_base-ABLATION`` for each of ``configs/wmt14/ablations.json``; ``--runs`` picks some.
The update frequency follows from ``--ngpus`` and ``--max-tokens`` (``train.py``). Every
command is printed before it runs; ``--dry-run`` only prints them.
"""
import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wmt14_recipe as recipe  # noqa: E402
from sut_fairseq.recipes import add_stage_arguments, run_stages, write_text_atomic  # noqa: E402
from sut_fairseq.recipes.summary import markdown_table  # noqa: E402
from sut_fairseq.recipes.train_log import best_valid  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def runs(table: int):
    """{run name: (model, ablation or None)} of a table, in the paper's order."""
    if table == 1:
        return {model: (model, None) for model in recipe.MODELS}
    return {"sut_base": ("sut_base", None),
            **{f"sut_base-{name}": ("sut_base", name) for name in recipe.load_ablations()}}


def data_bin(args) -> str:
    """The binarized data of the chosen subword model: PREP/data-bin or PREP/data-bin-spm."""
    return os.path.join(args.prep, "data-bin" if args.subword == "bpe" else "data-bin-spm")


def prepare(args):
    """Stage 1."""
    if os.path.isdir(data_bin(args)):
        print(f"   {data_bin(args)} is prepared")
        return
    subword = [] if args.subword == "bpe" else ["--subword", "spm"]
    recipe.run([sys.executable, os.path.join(recipe.REPO, "data-prep", "wmt14_en_de", "prepare.py"),
                "--workdir", args.prep, *subword, *shlex.split(args.prep_args)], dry_run=args.dry_run)


def train(args, name, model, ablation):
    """Stage 2 for one run."""
    save_dir = os.path.join(args.ckpt, name)
    if args.table == 2 and ablation is None and os.path.exists(os.path.join(save_dir, "checkpoint_last.pt")):
        print(f"   {name}: re-using {save_dir} (Table 1's; delete it to retrain)")
        return
    recipe.run([sys.executable, os.path.join(HERE, "train.py"), model,
                *(["--ablation", ablation] if ablation else []),
                "--data", data_bin(args), "--ngpus", str(args.ngpus),
                "--max-tokens", str(args.max_tokens), "--save-dir", save_dir,
                *(["--dry-run"] if args.dry_run else []), *args.train_extra])


def evaluate(args, name):
    """Stage 3 for one run."""
    save_dir = os.path.join(args.ckpt, name)
    if os.path.exists(os.path.join(save_dir, "eval.json")) and not (args.force or args.dry_run):
        print(f"   {name}: evaluated before ({save_dir}/eval.json; --force to redo)")
        return
    recipe.run([sys.executable, os.path.join(HERE, "evaluate.py"), "--checkpoint-dir", save_dir,
                "--data", data_bin(args), "--prep-dir", args.prep,
                "--name", name, *shlex.split(args.eval_args), *(["--dry-run"] if args.dry_run else [])])


def report(args, names):
    """Stage 4: the table from the runs' eval.json."""
    table = os.path.join(args.ckpt, f"table{args.table}.md")
    if args.dry_run:
        print(f"   would write {table} from {args.ckpt}/RUN/eval.json")
        return
    header = ["model", "params", "BLEU (tok., compound split)", "SacreBLEU", "MACs"]
    header += ["best valid nll_loss"] if args.table == 2 else []
    rows = []
    for name in names:
        path = os.path.join(args.ckpt, name, "eval.json")
        if not os.path.exists(path):
            print(f"   {name}: no eval.json, left out")
            continue
        r = recipe.load_json(path)
        row = [name, f"{r['params'] / 1e6:.1f}M ({r['params']:,})", f"{r['bleu_tokenized']:.2f}",
               f"{r['sacrebleu']:.2f}", str(r["macs"])]
        if args.table == 2:
            log = os.path.join(args.ckpt, name, "train.log")
            nll = best_valid(log, "nll_loss", maximize=False) if os.path.exists(log) else None
            row.append("–" if nll is None else f"{nll:.3f}")
        rows.append(row)
    text = markdown_table(header, rows)
    write_text_atomic(table, text + "\n")
    print("\n" + text + f"\n\nwritten {table}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:  # everything after the first "--" goes to train.py (which passes what
        # follows its own "--" on to fairseq-train)
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("table", type=int, choices=[1, 2], help="paper table")
    parser.add_argument("--prep", required=True, help="prepare.py's --workdir (data-bin/, tok/, raw/)")
    parser.add_argument("--subword", choices=["bpe", "spm"], default="bpe",
                        help="subword model: the paper's Moses + BPE (PREP/data-bin) or SentencePiece "
                             "(PREP/data-bin-spm, SacreBLEU on detokenised output)")
    parser.add_argument("--prep-args", default="", help="data stage: extra prepare.py options (one string)")
    parser.add_argument("--eval-args", default="", help="evaluate stage: extra evaluate.py options (one string)")
    parser.add_argument("--ngpus", type=int, default=1, help="GPUs in the job (all nodes)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens per GPU per batch")
    parser.add_argument("--ckpt", default=os.path.join("checkpoints", "wmt14"), help="checkpoint root")
    parser.add_argument("--runs", nargs="+", default=None, help="a subset of the table's runs")
    parser.add_argument("--force", action="store_true", help="evaluate stage: redo evaluated runs")
    add_stage_arguments(parser)
    args = parser.parse_args(argv)
    args.train_extra = extra
    table_runs = runs(args.table)
    names = args.runs or list(table_runs)
    unknown = [n for n in names if n not in table_runs]
    if unknown:
        parser.error(f"--runs {unknown[0]!r} is not a run of Table {args.table}: "
                     f"choose from {', '.join(table_runs)}")
    return run_stages(args, {
        "data": lambda: prepare(args),
        "train": lambda: [train(args, n, *table_runs[n]) for n in names],
        "evaluate": lambda: [evaluate(args, n) for n in names],
        "report": lambda: report(args, names),
    })


if __name__ == "__main__":
    sys.exit(main())
