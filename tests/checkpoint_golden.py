"""A checkpoint written by fairseq-train before the model's structure changed
(``fixtures/checkpoint_golden/``: ``sut_tiny`` trained for a few updates on the
sequence-reversal task, its dictionaries) and the beam search it gave then
(``data/checkpoint_golden.json``): ``tests/cli/test_checkpoint_golden.py`` loads it with
fairseq's own loader and checks that it still decodes to the same hypotheses and scores.

Recorded at the commit named in the JSON, before the sides became modules and the options
a dataclass (a checkpoint's parameter names and its pickled argument Namespace are what
that change must keep reading). Record again only at a commit that changes decoding or
the checkpoint format on purpose::

    python tests/checkpoint_golden.py --write
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "checkpoint_golden")
CHECKPOINT = os.path.join(FIXTURE, "checkpoint.pt")
GOLDEN = os.path.join(HERE, "data", "checkpoint_golden.json")
BEAM, MAX_LEN_B = 4, 12
#: the training: sut_tiny with global-mean halting on the decoder, so that the decoding
#: reads the cached prefix sums as well as the key/value buffer
TRAIN_ARGS = ["--decoder-halting", "global-mean", "--halting-threshold", "0.9"]


def _train(workdir: str) -> None:
    from sut_fairseq.data.reverse_task import write_reverse_task
    from sut_fairseq.demo import fairseq_tool, train_command

    prefixes = write_reverse_task(os.path.join(workdir, "text"), seed=5,
                                  sizes={"train": 400, "valid": 40, "test": 8})
    data_bin = os.path.join(workdir, "bin")
    subprocess.run([fairseq_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang",
                    "tgt", "--trainpref", prefixes["train"], "--validpref", prefixes["valid"],
                    "--destdir", data_bin, "--joined-dictionary", "--workers", "1"],
                   check=True, capture_output=True)
    save_dir = os.path.join(workdir, "ckpt")
    subprocess.run(train_command(data_bin, save_dir, 30, seed=2,
                                 extra=["--warmup-updates", "10", "--no-save-optimizer-state",
                                        "--no-last-checkpoints", *TRAIN_ARGS]),
                   check=True, capture_output=True)
    os.makedirs(FIXTURE, exist_ok=True)
    shutil.copy(os.path.join(save_dir, "checkpoint_best.pt"), CHECKPOINT)
    shutil.copy(os.path.join(data_bin, "dict.src.txt"), FIXTURE)
    shutil.copy(os.path.join(data_bin, "dict.tgt.txt"), FIXTURE)


def load():
    """The fixture's model (eval mode) and task, through fairseq's own loader."""
    import sut_fairseq.checkpoint_safety  # noqa: F401  (fairseq 0.12 checkpoints under torch >= 2.6)
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [CHECKPOINT], arg_overrides={"data": FIXTURE})
    return models[0].eval(), task


def sources(d):
    """Four sources of the reversal task's alphabet, left-padded; and their lengths."""
    g = torch.Generator().manual_seed(11)
    lengths = [9, 7, 5, 3]
    symbols = [i for i in range(d.nspecial, len(d))]
    src = torch.full((4, max(lengths)), d.pad(), dtype=torch.long)
    for i, n in enumerate(lengths):
        pick = torch.randint(len(symbols), (n - 1,), generator=g)
        src[i, src.size(1) - n:-1] = torch.tensor([symbols[j] for j in pick])
        src[i, -1] = d.eos()
    return src, torch.tensor(lengths)


def decode() -> list:
    """Per sentence, per hypothesis: tokens, the score and the positional scores."""
    from decoding_golden import beam_search

    model, task = load()
    return beam_search(model, task.target_dictionary, *sources(task.source_dictionary), BEAM, MAX_LEN_B)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"train and record {FIXTURE}, {GOLDEN}")
    args = parser.parse_args()
    if args.write:
        with tempfile.TemporaryDirectory() as workdir:
            _train(workdir)
    record = {"beam": BEAM, "max_len_b": MAX_LEN_B, "sentences": decode()}
    print([[len(h["tokens"]) for h in s] for s in record["sentences"]])
    if args.write:
        from decoding_golden import write_record

        write_record(GOLDEN, record)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
