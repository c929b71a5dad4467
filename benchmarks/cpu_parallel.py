"""Two CPU cores for one training: one process with two threads, or two gloo processes
(data parallel, ``--ddp-backend legacy_ddp``) with one thread each?

Both run real ``fairseq-train`` on the same logical-inference data with the same tokens
per update: ``--max-tokens T`` in the single process, ``T / 2`` per rank in the two ranks.
The speed is fairseq's own ``ups`` (updates per second), averaged over the log lines after
the first ``--warmup`` updates. Prints one line per setting and the ratio.

    python benchmarks/cpu_parallel.py [--model sut] [--updates 120] [--max-tokens 2048]
        [--data DIR]   # binarized logic data; default: generated into a temporary folder
        [--pairs 20000]  # pairs generated without --data

Without ``--data`` it generates ``--pairs`` logic pairs (``data-prep/logic/generate.py``) and
prepares the standard protocol (``prepare.py --binarize``), about 15 s for 20,000. The training
command is the logic recipe's ``reduced`` one for ``--model`` (``scripts/logic/train.py``:
configs/logic/MODEL.json over common.json), with validation and checkpoints off and the
update budget and tokens per update of this benchmark.
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "logic"))
import logic_recipe as recipe  # noqa: E402

UPS = re.compile(r"\bnum_updates=(\d+).*?\bups=([\d.]+)|\bups=([\d.]+).*?\bnum_updates=(\d+)")


def make_data(work: str, pairs: int) -> str:
    original, out = os.path.join(work, "original"), os.path.join(work, "standard")
    for command in ([sys.executable, os.path.join(ROOT, "data-prep", "logic", "generate.py"),
                     "--out", original, "--pairs", str(pairs), "--seed", "1", "--no-progress"],
                    [sys.executable, os.path.join(ROOT, "data-prep", "logic", "prepare.py"),
                     "--data", original, "--out", out, "--protocol", "standard", "--binarize"]):
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.path.join(out, "bin")


def train_args(data: str, model: str, max_tokens: int, updates: int, save_dir: str):
    """The recipe's reduced fairseq-train command for ``model``, without validation or
    checkpoints, ``updates`` updates of ``max_tokens`` tokens, logging every 10."""
    return recipe.train_command(
        model, data, "reduced", seed=1, save_dir=save_dir, max_update=updates, cpu=True,
        extra=["--max-tokens", str(max_tokens), "--disable-validation", "--no-save",
               "--log-interval", "10"])


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
    parser.add_argument("--model", default="sut", choices=recipe.MODELS,
                        help="a logic recipe model (configs/logic)")
    parser.add_argument("--updates", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20, help="updates left out of the average")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per update in all")
    parser.add_argument("--data", default=None, help="binarized logic data (default: generated)")
    parser.add_argument("--pairs", type=int, default=20000, help="logic pairs generated without --data")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        data = args.data or make_data(work, args.pairs)
        one = train_args(data, args.model, args.max_tokens, args.updates, os.path.join(work, "a"))
        ups_threads = ups_after(run([one], threads=2), args.warmup)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = [train_args(data, args.model, args.max_tokens // 2, args.updates, os.path.join(work, "b"))
                 + ["--ddp-backend", "legacy_ddp", "--distributed-backend", "gloo",
                    "--distributed-world-size", "2", "--distributed-rank", str(r),
                    "--distributed-init-method", f"tcp://127.0.0.1:{port}",
                    "--distributed-no-spawn", "--device-id", "0"] for r in (0, 1)]
        ups_ranks = ups_after(run(ranks, threads=1), args.warmup)
    print(f"{args.model}, {args.max_tokens} tokens per update, updates {args.warmup}-{args.updates}:")
    print(f"one process, 2 threads:        {ups_threads:.3f} updates/s")
    print(f"two gloo processes, 1 thread:  {ups_ranks:.3f} updates/s")
    print(f"two processes / two threads: {ups_ranks / ups_threads:.2f}")


if __name__ == "__main__":
    main()
