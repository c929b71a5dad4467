#!/usr/bin/env python3
"""Evaluate one WMT'14 En-De run and print its Table-1 row (docs/wmt14.md).

    python scripts/wmt14/evaluate.py --checkpoint-dir checkpoints/wmt14/sut_base \\
        --data DATA_BIN --prep-dir WORKDIR [--name sut_base] [--num-best 5] \\
        [--beam 8] [--lenpen 0.4] [--table results.md] [--dry-run]

1. average the --num-best best checkpoints by validation NLL
   (``checkpoint.best_nll_loss_*.pt``, from --keep-best-checkpoints) with
   ``python -m sut_fairseq.eval.average_checkpoints`` -> DIR/averaged_best5.pt
   (or use --checkpoint FILE as it is);
2. decode newstest2014 with fairseq-generate, beam 8, length penalty 0.4, --remove-bpe
   -> DIR/generate-test.txt; the hypotheses in test-set order -> DIR/hyp.tok.de, and
   detokenised -> DIR/hyp.detok.de; every test sentence must be decoded;
3. score (a) tokenised BLEU with compound splitting against WORKDIR/tok/newstest2014.de and
   (b) SacreBLEU on the detokenised output against WORKDIR/raw/newstest2014.de
   (``python -m sut_fairseq.eval.bleu``), with their signatures;
4. print ``| model | params | BLEU | SacreBLEU | MACs |`` (parameters counted from the
   checkpoint's model; MACs from ``python -m sut_fairseq.analysis.macs`` when it exists, else n/a),
   append it to --table, and write DIR/eval.json.

Data prepared with ``prepare.py --subword spm`` (``data-bin-spm/``, which holds the
SentencePiece model ``spm.model``; ``--subword auto``, the default, recognises it):

2. decode with ``--bpe sentencepiece --sentencepiece-model DATA/spm.model`` (no
   --remove-bpe): fairseq-generate's ``D-`` lines, the hypotheses decoded from pieces to
   untokenised text, in test-set order -> DIR/hyp.detok.de. The model is checked first: a missing or unreadable model, one
   whose pieces differ from DATA/dict.{en,de}.txt, or SentencePiece pieces in the
   dictionary without a model is an error naming the files (never decoded as BPE);
3. score SacreBLEU of DIR/hyp.detok.de against WORKDIR/raw/newstest2014.de (signature
   printed); the tokenised compound-split BLEU column is ``n/a`` (it is the BPE path's
   figure, comparable with the paper);
4. as above, with ``"subword": "spm"`` in DIR/eval.json.

Commands are printed before they run; --dry-run only prints them (after the checks of
the subword model).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wmt14_recipe as recipe  # noqa: E402

TABLE_HEADER = ("| model | params | BLEU (tok., compound split) | SacreBLEU | MACs |\n"
                "|---|---|---|---|---|\n")


def commands(args, spm_model=None):
    """(average command or None, checkpoint to decode, generate command, generate output);
    ``spm_model``: decode SentencePiece pieces with this model instead of removing BPE."""
    d = args.checkpoint_dir
    if args.checkpoint:
        average, checkpoint = None, args.checkpoint
    else:
        checkpoint = os.path.join(d, f"averaged_best{args.num_best}.pt")
        average = [sys.executable, "-m", "sut_fairseq.eval.average_checkpoints",
                   "--inputs", d, "--num-best", str(args.num_best), "--metric", args.metric,
                   "--output", checkpoint]
    generate = [recipe.tool("fairseq-generate", required=not args.dry_run), args.data,
                "--user-dir", recipe.user_dir(), "--task", "translation",
                "--source-lang", "en", "--target-lang", "de",
                "--path", checkpoint, "--gen-subset", args.subset,
                "--beam", str(args.beam), "--lenpen", str(args.lenpen)]
    if spm_model:
        generate += ["--bpe", "sentencepiece", "--sentencepiece-model", spm_model]
    else:
        generate.append("--remove-bpe")
    generate += ["--max-tokens", str(args.max_tokens), "--required-batch-size-multiple", "1"]
    if args.cpu:
        generate.append("--cpu")
    elif args.fp16:
        generate.append("--fp16")
    generate += args.generate_args
    return average, checkpoint, generate, os.path.join(d, f"generate-{args.subset}.txt")


def references(args):
    tok = args.tok_ref or (os.path.join(args.prep_dir, "tok", "newstest2014.de") if args.prep_dir else None)
    raw = args.raw_ref or os.path.join(args.prep_dir, "raw", "newstest2014.de")
    return tok, raw


def append_row(table: str, row: str) -> None:
    new = not os.path.exists(table) or os.path.getsize(table) == 0
    with open(table, "a", encoding="utf-8") as handle:
        if new:
            handle.write(TABLE_HEADER)
        handle.write(row + "\n")


def show_plan(average, generate, gen_out, score_cmd) -> int:
    """``--dry-run``: print the commands the evaluation would run."""
    if average:
        recipe.show(average)
    recipe.show(generate, gen_out)
    recipe.show(score_cmd)
    return 0


def decode(average, generate, gen_out) -> None:
    """Average the best checkpoints (if asked) and run fairseq-generate into ``gen_out``."""
    from sut_fairseq.eval import average_checkpoints

    if average:
        # the printed command, run in this process (it has imported torch and fairseq already)
        recipe.show(average)
        if average_checkpoints.main(average[3:]) != 0:
            raise recipe.RecipeError("checkpoint averaging failed")
    recipe.run(generate, gen_out)


def record(args, checkpoint: str, tokenised_cell: str, sacre, result: dict) -> int:
    """Parameters and MACs of ``checkpoint``, the table row (printed, appended to
    ``--table``) and ``eval.json`` (``result`` plus the fields every evaluation has)."""
    from sut_fairseq.eval.model_info import count_parameters, measure_macs
    from sut_fairseq.recipes import write_json_atomic

    params = count_parameters(checkpoint, args.data)
    macs = measure_macs(checkpoint, args.data)
    name = args.name or os.path.basename(os.path.normpath(args.checkpoint_dir))
    row = f"| {name} | {params / 1e6:.1f}M ({params:,}) | {tokenised_cell} | {sacre.score:.2f} | {macs} |"
    print("\n" + TABLE_HEADER + row)
    print(f"SacreBLEU signature: {sacre.signature}")
    result = {"model": name, "checkpoint": checkpoint, "params": params, "macs": macs, **result,
              "sacrebleu": sacre.score, "sacrebleu_detail": sacre.detail,
              "sacrebleu_signature": sacre.signature, "beam": args.beam, "lenpen": args.lenpen}
    write_json_atomic(os.path.join(args.checkpoint_dir, "eval.json"), result)
    if args.table:
        append_row(args.table, row)
    return 0


def evaluate(args) -> int:
    subword, spm_model = recipe.subword_of(args.data, args.subword, args.spm_model)
    if subword == "spm":
        print(f"subword model: SentencePiece {spm_model} (matches {args.data}/dict.{{en,de}}.txt)")
        return evaluate_spm(args, spm_model)
    average, checkpoint, generate, gen_out = commands(args)
    tok_ref, raw_ref = references(args)
    if tok_ref is None:
        raise recipe.RecipeError(f"{args.data} holds BPE data: give --prep-dir or --tok-ref "
                                 "for the tokenised BLEU")
    hyp_tok = os.path.join(args.checkpoint_dir, "hyp.tok.de")
    hyp_detok = os.path.join(args.checkpoint_dir, "hyp.detok.de")
    score_cmd = [sys.executable, "-m", "sut_fairseq.eval.bleu", "--hyp", hyp_tok,
                 "--tok-ref", tok_ref, "--raw-ref", raw_ref, "--compound-split", args.compound_split]
    if args.dry_run:
        return show_plan(average, generate, gen_out, score_cmd)

    for path, what in ((tok_ref, "tokenised reference"), (raw_ref, "raw reference")):
        if not os.path.isfile(path):
            raise recipe.RecipeError(f"missing {what} {path} (run data-prep/wmt14_en_de/prepare.py, "
                                     "or pass --tok-ref/--raw-ref)")
    from sut_fairseq.eval import bleu
    from sut_fairseq.recipes import scoring, write_lines_atomic

    decode(average, generate, gen_out)
    recipe.show(score_cmd)  # run in this process; refuses unless every test sentence was decoded
    try:
        hyps, tok, sacre, detok = scoring.bleu(gen_out, tok_ref, raw_ref, "de", args.compound_split)
    except ValueError as err:
        raise recipe.RecipeError(str(err))
    write_lines_atomic(hyp_tok, hyps)
    write_lines_atomic(hyp_detok, detok)
    print(bleu.format_scores(tok, sacre))
    return record(args, checkpoint, f"{tok.score:.2f}", sacre, {
        "bleu_tokenized": tok.score, "bleu_tokenized_detail": tok.detail,
        "bleu_tokenized_signature": tok.signature, "sentences": len(hyps)})


def detokenised_hypotheses(path: str) -> dict:
    """``{id: text}`` of the first ``D-id`` line per example of a fairseq-generate output:
    the best hypothesis after ``--bpe``/``--tokenizer`` decoding (``H-`` lines hold the
    pieces). ValueError naming the file when an example with an ``H-`` line has none."""
    found, hyp_ids = {}, set()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            tag, _, rest = line.rstrip("\n").partition("\t")
            kind, dash, index = tag.partition("-")
            if not dash or not index.isdigit():
                continue
            if kind == "H":
                hyp_ids.add(int(index))
            elif kind == "D" and int(index) not in found:
                found[int(index)] = rest.partition("\t")[2]
    missing = sorted(hyp_ids - set(found))
    if missing:
        raise ValueError(f"{path}: {len(missing)} examples have no D- line (e.g. id {missing[0]})")
    return found


def evaluate_spm(args, spm_model: str) -> int:
    """Steps 1-4 for data of the SentencePiece path (module doc)."""
    average, checkpoint, generate, gen_out = commands(args, spm_model)
    _, raw_ref = references(args)
    hyp_detok = os.path.join(args.checkpoint_dir, "hyp.detok.de")
    score_cmd = ["sacrebleu", raw_ref, "--input", hyp_detok]
    if args.dry_run:
        return show_plan(average, generate, gen_out, score_cmd)
    if not os.path.isfile(raw_ref):
        raise recipe.RecipeError(f"missing raw reference {raw_ref} (run data-prep/wmt14_en_de/"
                                 "prepare.py, or pass --raw-ref)")
    from sut_fairseq.eval import bleu
    from sut_fairseq.recipes import scoring, write_lines_atomic

    decode(average, generate, gen_out)
    recipe.show(score_cmd)  # run in this process; refuses unless every test sentence was decoded
    try:
        examples, raw_refs = scoring.aligned(gen_out, raw_ref, check_targets=False)
        detok = detokenised_hypotheses(gen_out)
        hyps = [detok[e.id] for e in examples]
        sacre = bleu.sacrebleu_score(hyps, raw_refs)
    except ValueError as err:
        raise recipe.RecipeError(str(err))
    write_lines_atomic(hyp_detok, hyps)
    print(f"SacreBLEU (SentencePiece-decoded vs raw reference): {sacre.score:.2f}\n"
          f"    {sacre.detail}\n    signature: {sacre.signature}")
    return record(args, checkpoint, "n/a (spm)", sacre, {
        "subword": "spm", "spm_model": os.path.abspath(spm_model), "bleu_tokenized": None,
        "sentences": len(hyps)})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--checkpoint-dir", required=True, help="the run's --save-dir")
    parser.add_argument("--data", required=True, help="data-bin directory")
    parser.add_argument("--prep-dir", default=None,
                        help="data-prep workdir (for tok/ and raw/newstest2014.de)")
    parser.add_argument("--tok-ref", default=None, help="tokenised reference (default PREP/tok/newstest2014.de)")
    parser.add_argument("--raw-ref", default=None, help="raw reference (default PREP/raw/newstest2014.de)")
    parser.add_argument("--checkpoint", default=None, help="decode this file instead of averaging")
    parser.add_argument("--num-best", type=int, default=5, help="checkpoints to average (paper: 5)")
    parser.add_argument("--metric", default="nll_loss", help="--best-checkpoint-metric used in training")
    parser.add_argument("--name", default=None, help="model name in the row (default: directory name)")
    parser.add_argument("--subset", default="test", help="binarized split to decode (test = newstest2014)")
    parser.add_argument("--beam", type=int, default=8)
    parser.add_argument("--lenpen", type=float, default=0.4)
    parser.add_argument("--max-tokens", type=int, default=8192, help="fairseq-generate batch size in tokens")
    parser.add_argument("--cpu", action="store_true", help="decode on CPU")
    parser.add_argument("--fp16", action="store_true", help="decode in fp16")
    parser.add_argument("--compound-split", choices=["atat", "reference"], default="atat",
                        help="see sut_fairseq/eval/bleu.py")
    parser.add_argument("--subword", choices=("auto", "bpe", "spm"), default="auto",
                        help="how DATA was prepared: auto = spm when DATA/spm.model exists "
                        "(prepare.py --subword spm), else bpe")
    parser.add_argument("--spm-model", default=None,
                        help="SentencePiece model to decode with (default DATA/spm.model); "
                        "checked against DATA/dict.{en,de}.txt")
    parser.add_argument("--table", default=None, help="append the row to this markdown file")
    parser.add_argument("--generate-args", nargs=argparse.REMAINDER, default=[],
                        help="further fairseq-generate options (must come last)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    if not args.prep_dir and not (args.raw_ref and (args.tok_ref or args.subword == "spm")):
        parser.error("give --prep-dir, or both --tok-ref and --raw-ref (--raw-ref alone with "
                     "--subword spm)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return evaluate(args)
    except recipe.RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
