"""The whole model trains with the Triton kernels (forced through the interpreter on CPU)
and matches the reference path's losses update by update."""
import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, sys
import torch
from types import SimpleNamespace
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from conftest import make_model
from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import SUTLabelSmoothedCrossEntropyCriterion

model = make_model(encoder_embed_dim=16, att_heads=2, att_head_dim=4, ffd_hidden_dim=8,
                   encoder_layers=2, decoder_layers=2, rel_window=2, halting_threshold=0.7,
                   dict_size=20).train()
crit = SUTLabelSmoothedCrossEntropyCriterion(
    SimpleNamespace(target_dictionary=model.decoder.dictionary), False, 0.1,
    mim_weight=0.1, act_weight=0.01)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
losses = []
for _ in range(3):
    src = torch.randint(4, 20, (2, 4), generator=g)
    src[0, 0] = 1
    prev = torch.randint(4, 20, (2, 3), generator=g)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(1).sum(1),
                            "prev_output_tokens": prev},
              "target": torch.randint(4, 20, (2, 3), generator=g), "ntokens": 6}
    loss, _, _ = crit(model, sample)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("LOSSES " + json.dumps(losses))
"""


def _losses(backend):
    env = {**os.environ, "SUT_KERNELS": backend, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("LOSSES ")][-1]
    return json.loads(line.split(" ", 1)[1])


def test_sut_tiny_trains_identically_through_the_interpreted_kernels():
    reference, triton = _losses("reference"), _losses("triton")
    assert len(triton) == 3
    for a, b in zip(reference, triton):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (reference, triton)
    assert reference[0] != reference[-1]  # the updates changed the model
