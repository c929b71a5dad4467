"""``make demo``: generated data -> fairseq-preprocess -> fairseq-train -> fairseq-generate.

Trains ``sut_tiny`` (stick-breaking halting on both sides, MIM and ACT losses on) through
the stock fairseq command-line tools with ``--user-dir`` on the sequence-reversal task of
``sut_fairseq.data.reverse_task``, decodes the test split and prints exact-match
accuracy next to the chance level. Every command is printed before it runs.

    python -m sut_fairseq.demo [--workdir demo-output] [--max-update 800] [--seed 1]
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time

from .data.reverse_task import write_reverse_task
from .eval.generate_output import exact_match, read_generate_output
from .recipes.commands import tool as fairseq_tool  # the console script beside this Python
from .user_dir import user_dir


def run(command, log_path=None):
    print("+ " + " ".join(shlex.quote(c) for c in command), flush=True)
    if log_path is None:
        subprocess.run(command, check=True)
        return
    with open(log_path, "w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.stdout.write(open(log_path).read()[-3000:])
        raise SystemExit(f"error: {command[0]} failed (exit {proc.returncode}); log: {log_path}")


def train_command(data_bin, save_dir, max_update, seed, arch="sut_tiny", extra=()):
    """The fairseq-train command line of the demo (also used by the end-to-end tests)."""
    return [
        fairseq_tool("fairseq-train"), data_bin, "--user-dir", user_dir(),
        "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
        "--arch", arch, "--share-all-embeddings", "--dropout", "0.1",
        "--criterion", "sut_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--mim-weight", "0.01", "--act-weight", "0.001", "--report-accuracy",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
        "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "200",
        "--max-tokens", "2048", "--max-update", str(max_update), "--seed", str(seed),
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--num-workers", "0",
        "--log-format", "simple", "--log-interval", "100", *extra,
    ]


def generate_command(data_bin, checkpoint, subset="test", overrides=None):
    command = [
        fairseq_tool("fairseq-generate"), data_bin, "--user-dir", user_dir(),
        "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
        "--path", checkpoint, "--gen-subset", subset, "--beam", "1",
        "--batch-size", "256", "--required-batch-size-multiple", "1", "--num-workers", "0",
    ]
    if overrides:
        command += ["--model-overrides", overrides]
    return command


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="demo-output", help="where data, checkpoints and logs go")
    parser.add_argument("--max-update", type=int, default=800, help="training updates")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    start = time.time()
    text, data_bin = os.path.join(args.workdir, "text"), os.path.join(args.workdir, "data-bin")
    save_dir = os.path.join(args.workdir, "checkpoints")
    for path in (data_bin, save_dir):  # a demo run always starts from scratch
        shutil.rmtree(path, ignore_errors=True)

    print(f"[1/4] generating the sequence-reversal task in {text}", flush=True)
    prefixes = write_reverse_task(text, seed=args.seed)
    n_test = sum(1 for _ in open(prefixes["test"] + ".tgt"))

    print("[2/4] binarising with fairseq-preprocess", flush=True)
    run([fairseq_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", prefixes["train"], "--validpref", prefixes["valid"],
         "--testpref", prefixes["test"], "--destdir", data_bin, "--joined-dictionary",
         "--workers", "1"], os.path.join(args.workdir, "preprocess.log"))

    print(f"[3/4] training sut_tiny for {args.max_update} updates "
          f"(log: {args.workdir}/train.log)", flush=True)
    train_log = os.path.join(args.workdir, "train.log")
    run(train_command(data_bin, save_dir, args.max_update, args.seed), train_log)
    for line in open(train_log):
        if "| valid on" in line:
            last_valid = line.strip()
    print("    last validation: " + last_valid.split("|", 3)[-1].strip()[:200])

    print("[4/4] decoding the test split with fairseq-generate", flush=True)
    gen_out = os.path.join(args.workdir, "generate-test.txt")
    run(generate_command(data_bin, os.path.join(save_dir, "checkpoint_last.pt")), gen_out)
    examples = read_generate_output(gen_out)
    if len(examples) != n_test:
        raise SystemExit(f"error: fairseq-generate scored {len(examples)} of {n_test} test examples")
    accuracy = exact_match(examples)
    chance = 1.0 / 12 ** 3  # guessing even the shortest (3-symbol) reversal
    summary = [l for l in open(gen_out) if "steps executed" in l or "Generate test" in l]
    print("".join(summary), end="")
    print(f"\nRESULT: exact-match accuracy {100 * accuracy:.1f}% on {n_test} test sequences "
          f"(chance < {100 * chance:.2f}%); demo took {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
