"""When the plugin registers with fairseq (``sut_fairseq/__init__.py``): at once when
fairseq is loaded before it (fairseq's ``--user-dir`` import, exercised by every test of a
fairseq command), else as soon as fairseq's own import finishes, whatever imports it; and
the pure-Python parts (the data generators, the recipes, ``user_dir``) import neither
torch nor fairseq. Each case runs in a fresh interpreter (the import order is the point)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

REGISTERED = """
import argparse, sys, torch
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.tasks import TASK_REGISTRY
from fairseq.optim.lr_scheduler import LR_SCHEDULER_REGISTRY
missing = [name for name, registry in (("sut_base", ARCH_MODEL_REGISTRY),
                                       ("transformer_classifier", ARCH_MODEL_REGISTRY),
                                       ("sut_label_smoothed_cross_entropy", CRITERION_REGISTRY),
                                       ("sut_classification", TASK_REGISTRY),
                                       ("inverse_sqrt_cooldown", LR_SCHEDULER_REGISTRY))
           if name not in registry]
assert not missing, missing
assert argparse.Namespace in torch.serialization.get_safe_globals()
print("registered")
"""


def python(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("first", [
    "import sut_fairseq",                                   # the package, then fairseq
    "from sut_fairseq.models.standalone import build_model",  # a module that imports fairseq itself
    "from sut_fairseq.modules.memory import ChunkMemory",     # one the registration imports again
], ids=["package-first", "model-module-first", "core-module-first"])
def test_the_plugin_is_registered_once_fairseq_is_loaded(first):
    assert python(first + "\nimport fairseq\n" + REGISTERED).strip().endswith("registered")


def test_the_pure_python_parts_import_neither_torch_nor_fairseq():
    out = python("import sys\n"
                 "import sut_fairseq.recipes, sut_fairseq.data.logic_inference, sut_fairseq.user_dir\n"
                 "print(sorted(m for m in ('torch', 'fairseq') if m in sys.modules))")
    assert out.strip() == "[]"
