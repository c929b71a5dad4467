"""``fairseq-hydra-train`` from ``configs/hydra/sut_base.yaml``, as fairseq's own models are
trained from YAML: the options keep their flat names under ``model:``, the preset named by
``model._name`` fills the rest, and the model built is the one ``fairseq-train --arch``
builds from the same options. On ``sut_tiny`` (``model._name=sut_tiny``), four updates."""
import os
import subprocess

import pytest
import torch

import sut_fairseq.checkpoint_safety  # noqa: F401  (fairseq 0.12 checkpoints under torch >= 2.6)
from sut_fairseq.data.reverse_task import write_reverse_task
from sut_fairseq.demo import fairseq_tool
from sut_fairseq.user_dir import user_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(command):
    """Run from the repository root (under ``make mutation`` mutmut's work directory, whose
    setup.cfg the mutated code's trampolines read), hydra not changing directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, f"{command[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def hydra_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hydra")
    prefixes = write_reverse_task(str(root / "text"), seed=3, sizes={"train": 200, "valid": 20, "test": 8})
    data = str(root / "bin")
    _run([fairseq_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
          "--trainpref", prefixes["train"], "--validpref", prefixes["valid"], "--destdir", data,
          "--joined-dictionary", "--workers", "1"])
    save_dir = str(root / "checkpoints")
    log = _run([fairseq_tool("fairseq-hydra-train"), "--config-dir", os.path.join(REPO, "configs", "hydra"),
                "--config-name", "sut_base", f"task.data={data}", "task.source_lang=src",
                "task.target_lang=tgt", f"common.user_dir={user_dir()}", "model._name=sut_tiny",
                "+model.halting_threshold=0.9", "+model.decoder_layers=2",
                "optimization.max_update=4", "optimization.update_freq=[1]",
                "dataset.max_tokens=1024", "dataset.num_workers=0", "dataset.validate_interval=100",
                f"checkpoint.save_dir={save_dir}", f"hydra.run.dir={root / 'hydra'}", "hydra.job.chdir=False"])
    return data, os.path.join(save_dir, "checkpoint_last.pt"), log


def test_hydra_train_builds_the_preset_with_the_yaml_options(hydra_run):
    _, checkpoint, log = hydra_run
    assert "num_updates 4" in log or "num_updates=4" in log
    state = torch.load(checkpoint, weights_only=True)
    model_cfg = state["cfg"]["model"]
    assert model_cfg["_name"] == "sut_tiny"
    assert model_cfg["encoder_layers"] == 3 and model_cfg["decoder_layers"] == 2  # preset; YAML
    assert model_cfg["halting_threshold"] == 0.9 and model_cfg["share_all_embeddings"] is True
    # the same parameters as fairseq-train --arch sut_tiny with the same options builds
    from sut_fairseq.models.standalone import build_model

    argparse_model = build_model("sut_tiny", dict_size=state["model"]["encoder.side.embed_tokens.weight"].size(0),
                                 share_all_embeddings=True, decoder_layers=2)
    expected = {n: tuple(p.shape) for n, p in argparse_model.state_dict().items()}
    assert {n: tuple(p.shape) for n, p in state["model"].items()} == expected


def test_the_hydra_checkpoint_decodes_with_fairseq_generate(hydra_run):
    data, checkpoint, _ = hydra_run
    out = _run([fairseq_tool("fairseq-generate"), data, "--user-dir", user_dir(), "--path", checkpoint,
                "--gen-subset", "valid", "--beam", "2", "--batch-size", "20", "--source-lang", "src",
                "--target-lang", "tgt", "--num-workers", "0"])
    assert "Generate valid with beam=2" in out
    assert "decoder steps executed" in out
