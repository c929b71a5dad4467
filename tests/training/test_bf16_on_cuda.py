"""``--bf16`` without torch_xla: the plugin undoes fairseq 0.12's implied ``--tpu`` when it
parses fairseq-train's arguments (``sut_fairseq/bf16_on_cuda.py``), so the stock command
trains in bf16 on a GPU (the CUDA run: ``tests/gpu/test_gpu_train.py``). Parsed here the way
``fairseq_cli.train`` does: the parser first (which imports ``--user-dir``), then the
arguments."""
import os
import subprocess
import sys

import pytest

from sut_fairseq.user_dir import user_dir

PARSE = """
import json, sys
from fairseq import options
parser = options.get_training_parser()
args = options.parse_args_and_arch(parser)
print(json.dumps({"bf16": args.bf16, "tpu": args.tpu}))
"""


def _parsed(*flags, xla=False):
    env = dict(os.environ)
    if xla:  # a stand-in torch_xla package: only its presence is asked
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "fixtures", "fake_xla"),
                                             env.get("PYTHONPATH", "")])
    argv = ["data", "--user-dir", user_dir(), "--task", "translation", "--arch", "sut_tiny", *flags]
    proc = subprocess.run([sys.executable, "-c", PARSE, *argv], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_bf16_without_torch_xla_does_not_imply_tpu():
    parsed, log = _parsed("--bf16")
    assert parsed == {"bf16": True, "tpu": False}
    assert "implied --tpu undone" in log


@pytest.mark.parametrize("flags, xla", [(("--bf16", "--tpu"), False), (("--bf16",), True)])
def test_an_explicit_tpu_or_torch_xla_keeps_fairseqs_behaviour(flags, xla):
    parsed, _ = _parsed(*flags, xla=xla)
    assert parsed == {"bf16": True, "tpu": True}


def test_without_bf16_nothing_changes():
    parsed, _ = _parsed("--fp16")
    assert parsed == {"bf16": False, "tpu": False}
