"""fairseq-train on a CUDA device: ``sut_tiny`` trained on the generated reversal task in
fp32, ``--fp16`` and ``--bf16`` (80 updates each: finite losses that go down). fairseq 0.12
makes ``--bf16`` imply ``--tpu``; the plugin undoes that one implication where torch_xla is
missing (``sut_fairseq/bf16_on_cuda.py``), so the stock command trains in bf16 on CUDA;
without the plugin it does not.

Marked ``gpu`` and skipped without a CUDA device. Kept apart from ``test_gpu.py`` (the
kernels and layers) because each run is a fairseq-train process that compiles and
autotunes the Triton kernels afresh (35-65 s each on an H100): the two files are the
``tests`` and ``tests-train`` stages of ``scripts/gpu/validate.py``, each of which fits one
10-minute device command with the install.

    pytest -m gpu tests/gpu/test_gpu_train.py
"""
import math
import os
import re
import subprocess

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with pytest -m gpu on a GPU machine)"),
]


@pytest.fixture(scope="module")
def reverse_bin(tmp_path_factory):
    from sut_fairseq.data.reverse_task import write_reverse_task
    from sut_fairseq.demo import fairseq_tool

    root = tmp_path_factory.mktemp("gpu_train")
    prefixes = write_reverse_task(str(root / "text"), seed=3,
                                  sizes={"train": 1500, "valid": 80, "test": 20})
    dest = str(root / "bin")
    proc = subprocess.run(
        [fairseq_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", prefixes["train"], "--validpref", prefixes["valid"],
         "--testpref", prefixes["test"], "--destdir", dest, "--joined-dictionary", "--workers", "1"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dest


def _train_losses(log: str):
    """The training loss of every ``train_inner`` line (nan/inf kept as such)."""
    return [float(m) for m in re.findall(r"train_inner\b.*?\bloss=([^,\s]+)", log)]


def _fairseq_train(data_bin, save_dir, precision, updates=80, plugin=True):
    from sut_fairseq.demo import train_command

    flags = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}[precision]
    command = train_command(data_bin, str(save_dir), updates, seed=1,
                            extra=["--log-interval", "10", "--max-tokens", "1024",
                                   "--warmup-updates", "20", *flags])
    if not plugin:  # fairseq's own transformer and criterion, no --user-dir
        for option in ("--user-dir", "--mim-weight", "--act-weight"):  # the plugin's options
            i = command.index(option)
            command = command[:i] + command[i + 2:]
        for option, stock in (("--arch", "transformer"), ("--criterion", "label_smoothed_cross_entropy")):
            command[command.index(option) + 1] = stock
    env = {k: v for k, v in os.environ.items() if k != "SUT_KERNELS"}  # auto: Triton on CUDA
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_fairseq_train_on_cuda(reverse_bin, tmp_path, precision):
    """80 updates of sut_tiny on the GPU: every logged loss finite, the last one well
    below the first."""
    rc, log = _fairseq_train(reverse_bin, tmp_path, precision)
    assert rc == 0, f"fairseq-train failed:\n{log[-4000:]}"
    assert "CUDA enviroments for all 1 workers" in log, "fairseq-train did not train on the GPU"
    if precision != "fp32":
        assert f"'{precision}': True" in log  # the configuration fairseq printed
    losses = _train_losses(log)
    assert len(losses) >= 5, log[-3000:]
    assert all(math.isfinite(l) for l in losses), losses
    assert losses[-1] < 0.85 * losses[0], losses


def test_without_the_plugin_bf16_needs_torch_xla(reverse_bin, tmp_path):
    """Why the plugin undoes ``--tpu``: ``fairseq-train --bf16`` of fairseq's own transformer,
    without ``--user-dir``, does not run on a GPU without torch_xla. If this starts to pass,
    fairseq no longer implies --tpu and ``bf16_on_cuda`` can go."""
    try:
        import torch_xla  # noqa: F401
        pytest.skip("torch_xla is installed")
    except ImportError:
        pass
    rc, log = _fairseq_train(reverse_bin, tmp_path, "bf16", updates=2, plugin=False)
    assert rc != 0 and "get_tpu_device" in log, log[-3000:]
