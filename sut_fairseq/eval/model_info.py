"""Facts about a trained checkpoint for the results tables: parameter count and MACs.

    python -m sut_fairseq.eval.model_info CHECKPOINT --data DATA_BIN
"""
import argparse
import importlib.util
import re
import shlex
import subprocess
import sys
from typing import Optional

MACS_MODULE = "sut_fairseq.analysis.macs"
DEFAULT_MACS_COMMAND = "{python} -m sut_fairseq.analysis.macs --path {checkpoint} --data {data} --max-sentences 200"


def count_parameters(checkpoint: str, data_bin: Optional[str] = None) -> int:
    """Parameters of the model stored in ``checkpoint``, counted as in the paper's tables
    (``sum(p.numel() for p in model.parameters())``: a shared embedding counts once).
    The model is rebuilt by fairseq from the checkpoint's own configuration; ``data_bin``
    replaces the data directory recorded at training time (the dictionary is read there)."""
    import sut_fairseq  # noqa: F401  (registers the architectures, allow-lists Namespace)
    from fairseq import checkpoint_utils

    overrides = {"data": data_bin} if data_bin else {}
    models, _ = checkpoint_utils.load_model_ensemble([checkpoint], arg_overrides=overrides)
    return sum(p.numel() for p in models[0].parameters())


def macs_available() -> bool:
    try:
        return importlib.util.find_spec(MACS_MODULE) is not None
    except ModuleNotFoundError:
        return False


def measure_macs(checkpoint: str, data_bin: str, command: str = DEFAULT_MACS_COMMAND) -> str:
    """The MACs column: the
    last number followed by an optional unit (K/M/G) on the last output line of
    ``command`` that mentions MACs (or "n/a (reason)" when that fails)."""
    if not macs_available():
        return "n/a"
    cmd = command.format(python=shlex.quote(sys.executable), checkpoint=shlex.quote(checkpoint),
                         data=shlex.quote(data_bin))
    print("+ " + cmd, flush=True)
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"n/a (sut_fairseq.analysis.macs failed: exit {proc.returncode})"
    for line in reversed(proc.stdout.splitlines()):
        if "mac" in line.lower():
            numbers = re.findall(r"(\d[\d,]*(?:\.\d+)?)\s*([KMG]?)", line)
            if numbers:
                value, unit = numbers[-1]
                return value + unit
    return "n/a (no MACs figure in sut_fairseq.analysis.macs output)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Parameter count and MACs of a checkpoint")
    parser.add_argument("checkpoint")
    parser.add_argument("--data", default=None, help="data-bin directory holding the dictionary")
    args = parser.parse_args(argv)
    print(f"parameters {count_parameters(args.checkpoint, args.data)}")
    print(f"MACs {measure_macs(args.checkpoint, args.data or '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
