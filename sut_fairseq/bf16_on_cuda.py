"""``fairseq-train --bf16`` on a CUDA GPU.

fairseq 0.12's argument post-processing makes ``--bf16`` imply ``--tpu``
(``fairseq/options.py``: ``if args.bf16: args.tpu = True``), and ``--tpu`` then asks
torch_xla for the device: without torch_xla, ``fairseq-train --bf16`` stops before the
first update. When the plugin is loaded (``--user-dir``), the parsed arguments get that one
implication undone where it cannot have been meant: ``--bf16`` given, ``--tpu`` not on the
command line, and torch_xla not installed. The run then trains in bf16 on the GPU with
fairseq's own ``FP16Optimizer`` in its bf16 mode (fp32 master weights), exactly as
``--fp16`` does with fp16. Nothing changes with torch_xla installed or with ``--tpu``.
"""
import importlib.util
import logging
from typing import Sequence

logger = logging.getLogger(__name__)


def torch_xla_installed() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def undo_implied_tpu(args, argv: Sequence[str]) -> None:
    """Set ``args.tpu = False`` when fairseq turned it on only because of ``--bf16``."""
    if not (getattr(args, "bf16", False) and getattr(args, "tpu", False)):
        return
    if "--tpu" in argv or torch_xla_installed():
        return
    args.tpu = False
    logger.info("--bf16 without torch_xla: training in bfloat16 on %s (fairseq's implied "
                "--tpu undone by sut_fairseq)", "the CPU" if getattr(args, "cpu", False) else "CUDA")
