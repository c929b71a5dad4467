"""Two CPU cores for one training: one process with two threads, or two gloo processes
(data parallel, ``--ddp-backend legacy_ddp``) with one thread each?

Both run real ``fairseq-train`` on the same logical-inference data with the same tokens
per update: ``--max-tokens T`` in the single process, ``T / 2`` per rank in the two ranks.
The speed is fairseq's own ``ups`` (updates per second), averaged over the log lines after
the first ``--warmup`` updates. Prints one line per setting and the ratio.

    python benchmarks/cpu_parallel.py [--arch sut_logic] [--updates 120] [--max-tokens 2048]
        [--data DIR]   # binarized logic data; default: generated into a temporary folder

Without ``--data`` it generates 20,000 logic pairs (``data-prep/logic/generate.py``) and
prepares the standard protocol (``prepare.py --binarize``), about 15 s. Model options are
the logic recipe's (``configs/logic``: pre-LN, dropout as the preset).
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile

from sut_fairseq.demo import fairseq_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPS = re.compile(r"\bnum_updates=(\d+).*?\bups=([\d.]+)|\bups=([\d.]+).*?\bnum_updates=(\d+)")


def make_data(work: str) -> str:
    original, out = os.path.join(work, "original"), os.path.join(work, "standard")
    for command in ([sys.executable, os.path.join(ROOT, "data-prep", "logic", "generate.py"),
                     "--out", original, "--pairs", "20000", "--seed", "1", "--no-progress"],
                    [sys.executable, os.path.join(ROOT, "data-prep", "logic", "prepare.py"),
                     "--data", original, "--out", out, "--protocol", "standard", "--binarize"]):
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.path.join(out, "bin")


def train_args(data: str, arch: str, max_tokens: int, updates: int, save_dir: str):
    return [fairseq_tool("fairseq-train"), data, "--user-dir", os.path.join(ROOT, "sut_fairseq"),
            "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
            "--arch", arch, "--share-all-embeddings",
            "--encoder-normalize-before", "--decoder-normalize-before",
            "--criterion", "sut_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--mim-weight", "0.01", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
            "--weight-decay", "0.1", "--lr", "7e-4", "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", "1000", "--max-tokens", str(max_tokens),
            "--required-batch-size-multiple", "1", "--max-update", str(updates),
            "--disable-validation", "--no-save", "--save-dir", save_dir,
            "--log-format", "simple", "--log-interval", "10", "--num-workers", "0",
            "--seed", "1", "--cpu"]


def ups_after(log: str, warmup: int) -> float:
    """Mean of fairseq's ``ups`` over the log lines past ``warmup`` updates."""
    values = []
    for line in log.splitlines():
        m = UPS.search(line)
        if m:
            n = int(m.group(1) or m.group(4))
            ups = float(m.group(2) or m.group(3))
            if n > warmup:
                values.append(ups)
    if not values:
        raise SystemExit(f"no training log lines past update {warmup}:\n{log[-2000:]}")
    return statistics.mean(values)


def run(commands, threads: int):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    for c in commands:
        print("+ " + " ".join(c), flush=True)
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for c in commands]
    logs = [p.communicate()[0] for p in procs]
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise SystemExit(f"fairseq-train failed (exit {p.returncode}):\n{log[-3000:]}")
    return logs[0]  # rank 0 logs the training meters


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sut_logic")
    parser.add_argument("--updates", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20, help="updates left out of the average")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per update in all")
    parser.add_argument("--data", default=None, help="binarized logic data (default: generated)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        data = args.data or make_data(work)
        one = train_args(data, args.arch, args.max_tokens, args.updates, os.path.join(work, "a"))
        ups_threads = ups_after(run([one], threads=2), args.warmup)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = [train_args(data, args.arch, args.max_tokens // 2, args.updates, os.path.join(work, "b"))
                 + ["--ddp-backend", "legacy_ddp", "--distributed-backend", "gloo",
                    "--distributed-world-size", "2", "--distributed-rank", str(r),
                    "--distributed-init-method", f"tcp://127.0.0.1:{port}",
                    "--distributed-no-spawn", "--device-id", "0"] for r in (0, 1)]
        ups_ranks = ups_after(run(ranks, threads=1), args.warmup)
    print(f"{args.arch}, {args.max_tokens} tokens per update, updates {args.warmup}-{args.updates}:")
    print(f"one process, 2 threads:        {ups_threads:.3f} updates/s")
    print(f"two gloo processes, 1 thread:  {ups_ranks:.3f} updates/s")
    print(f"two processes / two threads: {ups_ranks / ups_threads:.2f}")


if __name__ == "__main__":
    main()
