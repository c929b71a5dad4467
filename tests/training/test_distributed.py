"""Data-parallel training (issue 9), on CPU with the gloo backend.

* Real ``fairseq-train``, two local processes (``--distributed-world-size 2
  --distributed-rank R --distributed-init-method tcp://127.0.0.1:PORT
  --distributed-no-spawn --distributed-backend gloo --device-id 0 --cpu --ddp-backend
  legacy_ddp``), ``sut_tiny`` with halting, MoE, sampled experts, dropout and the MIM/ACT
  losses: both ranks end with identical parameters and Adam moments, and between them
  they trained on every example exactly once in the epoch, half of the batches each.
* PyTorch DDP (what fairseq's default ``--ddp-backend pytorch_ddp`` uses on GPUs), two
  processes, ``find_unused_parameters=False``: no "Expected to have finished reduction"
  error although each rank's batches leave experts unchosen and positions halted, and
  one rank's batch is a single token.
* Why that holds: every parameter receives a gradient (possibly zero) from every batch.

Two things of fairseq 0.12 shape the test (see docs/distributed.md):

* ``--ddp-backend pytorch_ddp`` cannot run on CPU for any model (fairseq passes
  ``device_ids=[device_id]`` to ``DistributedDataParallel``, which torch refuses for a CPU
  module; fairseq's own ``transformer`` fails the same way), so the fairseq run uses
  ``legacy_ddp`` and the PyTorch DDP path is checked directly.
* fairseq writes checkpoints on rank 0 only and lowers the other ranks' logging to
  WARNING. The test therefore runs the real ``fairseq_cli.train.cli_main`` under a wrapper
  (``RUNNER`` below, test-only) that lets every rank save into its own ``--save-dir`` and
  records the example ids of the batches each rank trained on.
"""
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import make_model, randomise_halting
from sut_fairseq.data.reverse_task import write_reverse_task
from sut_fairseq.demo import fairseq_tool
from sut_fairseq.user_dir import user_dir

ENV = dict(os.environ, OMP_NUM_THREADS="1")
N_TRAIN = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(commands, timeout=240):
    """Start one process per rank, wait for all; kill the rest if one fails or hangs."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for c in commands]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outputs.append((p.returncode, out, err))
            if p.returncode != 0:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (code, out, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} failed:\n{out[-2000:]}\n{err[-4000:]}"
    assert len(outputs) == len(commands)
    return outputs


# ---- why no --find-unused-parameters is needed ----------------------------------------------

def _criterion(model, act_weight=0.0):
    from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
        SUTLabelSmoothedCrossEntropyCriterion,
    )

    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    return SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, mim_weight=0.01,
                                                 act_weight=act_weight)


def _sample(B, S, T, seed=0, padding_row=False):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    if padding_row:
        src[0] = 1  # a source row that is entirely padding
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    target = torch.cat([prev[:, 1:], torch.full((B, 1), 2)], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((B,), S),
                          "prev_output_tokens": prev}, "target": target, "ntokens": B * T}


def _parameters_without_gradient(model, sample):
    model.train()
    model.zero_grad()
    loss, _, _ = _criterion(model)(model, sample)
    loss.backward()
    return [n for n, p in model.named_parameters() if p.grad is None]


BATCHES = {
    "ordinary": lambda: _sample(3, 7, 5),
    "one token": lambda: _sample(1, 1, 1),  # most experts unchosen
    "padding row": lambda: _sample(2, 5, 4, padding_row=True),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("halting", ["normal", "all halt after step 1", "never halt"])
def test_every_parameter_gets_a_gradient(batch, halting):
    """The condition for DDP without ``find_unused_parameters``: all experts live in single
    tensors (an unchosen expert gets a zero gradient row), every step uses the same block,
    and the halting unit stays in the graph through L_ACT even with ``--act-weight 0`` and
    when every position halts after step 1 (then the output no longer depends on it)."""
    model = make_model(dropout=0.1, sample_topk=1)
    randomise_halting(model)
    bias = {"normal": None, "all halt after step 1": 30.0, "never halt": -30.0}[halting]
    if bias is not None:
        for side in (model.encoder.side, model.decoder.side):
            with torch.no_grad():
                side.halting.unit.fc2.bias.fill_(bias)
    assert _parameters_without_gradient(model, BATCHES[batch]()) == []


def test_halting_units_and_routers_get_a_nonzero_gradient():
    """With MIM and ACT weight 0 the halting units reach the loss only through the halted
    states S (Eq. 3) and the routers only through their gates: both must receive a
    gradient that is not zero everywhere (a unit cut off from the output would get an
    all-zero gradient through the ACT term and still pass the test above)."""
    from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (
        SUTLabelSmoothedCrossEntropyCriterion,
    )

    model = make_model(dropout=0.1, sample_topk=1).train()
    randomise_halting(model)
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    no_aux = SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1)  # MIM and ACT weight 0
    loss, _, _ = no_aux(model, BATCHES["ordinary"]())
    loss.backward()
    watched = {n: p for n, p in model.named_parameters() if ".halting.unit." in n or ".router." in n}
    assert any(".halting.unit." in n for n in watched) and any(".router." in n for n in watched)
    zero = [n for n, p in watched.items() if not p.grad.abs().sum() > 0]
    assert zero == []


# with one step the halting rule is 'none': no halting unit left without a gradient
def test_one_step_model_has_no_parameter_without_gradient():
    model = make_model(encoder_layers=1, decoder_layers=1)
    assert _parameters_without_gradient(model, _sample(2, 5, 4)) == []


DDP_SCRIPT = r"""
import json
import sys
import torch
import torch.distributed as dist
from types import SimpleNamespace

rank, port = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
from fairseq.distributed import ModuleProxyWrapper
from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import SUTLabelSmoothedCrossEntropyCriterion
from sut_fairseq.models.standalone import build_model

torch.manual_seed(0)  # the same initial parameters on both ranks
model = build_model("sut_tiny", dict_size=40, share_all_embeddings=True, sample_topk=1,
                    dropout=0.1, halting_threshold=0.8)
with torch.no_grad():  # positions halt at different steps
    for side in (model.encoder.side, model.decoder.side):
        side.halting.unit.fc2.weight.normal_(0, 0.3)
# as fairseq's pytorch_ddp backend wraps it, minus the device_ids a CPU module cannot take
ddp = ModuleProxyWrapper(torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False))
criterion = SUTLabelSmoothedCrossEntropyCriterion(
    SimpleNamespace(target_dictionary=model.decoder.dictionary), False, 0.1,
    mim_weight=0.01, act_weight=0.0)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
for it in range(4):
    B, S, T = (1, 1, 1) if (rank == 1 and it == 1) else (3, 5 + 2 * rank, 4)
    src = torch.randint(4, 40, (B, S), generator=g)
    if B > 1:
        src[0, :2] = 1  # left padding
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    target = torch.randint(4, 40, (B, T), generator=g)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(1).sum(1),
                            "prev_output_tokens": prev}, "target": target, "ntokens": B * T}
    ddp.train()
    loss, _, _ = criterion(ddp, sample)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
sums = [None, None]
dist.all_gather_object(sums, (flat.sum().item(), flat.abs().sum().item()))
print("CHECKSUMS " + json.dumps(sums), flush=True)
dist.barrier()
# gloo's background threads can abort the interpreter's teardown ("terminate called
# without an active exception") after all work is done: leave without it
import os
os._exit(0)
"""


def test_pytorch_ddp_without_find_unused_parameters():
    port = free_port()
    outputs = run_ranks([[sys.executable, "-c", DDP_SCRIPT, str(rank), str(port)]
                         for rank in range(2)], timeout=180)
    for _, out, err in outputs:
        assert "Expected to have finished reduction" not in err
        line = [l for l in out.splitlines() if l.startswith("CHECKSUMS ")][-1]
        rank0, rank1 = json.loads(line.split(" ", 1)[1])
        assert rank0 == rank1  # synchronised parameters


# ---- real fairseq-train, two processes --------------------------------------------------

RUNNER = r"""
import json
import sys

import fairseq_cli.train as train  # first: it sets fairseq's logging format
from fairseq.trainer import Trainer

# fairseq writes checkpoints on the data-parallel master only: let every rank write its own
Trainer.should_save_checkpoint_on_current_rank = property(lambda self: True)
record, seen = sys.argv[1], []
_train_step = Trainer.train_step


def train_step(self, samples, raise_oom=False):
    # example ids of this rank's batches ({} = no batch left: fairseq runs a zero-weight dummy)
    seen.append([s["id"].tolist() for s in samples if s])
    return _train_step(self, samples, raise_oom)


Trainer.train_step = train_step
sys.argv = ["fairseq-train"] + sys.argv[2:]
try:
    train.cli_main()
finally:
    with open(record, "w") as f:
        json.dump(seen, f)
"""


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    prefixes = write_reverse_task(str(root / "text"), seed=7, sizes={"train": N_TRAIN, "valid": 40})
    dest = str(root / "bin")
    proc = subprocess.run([fairseq_tool("fairseq-preprocess"), "--source-lang", "src",
                           "--target-lang", "tgt", "--trainpref", prefixes["train"],
                           "--validpref", prefixes["valid"], "--destdir", dest,
                           "--joined-dictionary", "--workers", "1"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dest


def train_options(data_bin, save_dir, rank, port):
    return [
        data_bin, "--user-dir", user_dir(), "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", "sut_tiny", "--share-all-embeddings", "--dropout", "0.1", "--sample-topk", "1",
        "--halting-threshold", "0.9",
        "--criterion", "sut_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--mim-weight", "0.01", "--act-weight", "0.001",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--lr", "2e-3",
        "--max-tokens", "512", "--max-epoch", "1", "--seed", "2",
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--num-workers", "0",
        "--log-format", "json", "--log-interval", "1",
        "--cpu", "--ddp-backend", "legacy_ddp", "--distributed-backend", "gloo",
        "--distributed-world-size", "2", "--distributed-rank", str(rank),
        "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn",
        "--device-id", "0",
    ]


@pytest.fixture(scope="module")
def two_ranks(data_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_run")
    port = free_port()
    commands = []
    for rank in range(2):
        os.makedirs(root / f"rank{rank}")  # fairseq creates the save dir on rank 0 only
        commands.append([sys.executable, "-c", RUNNER, str(root / f"seen{rank}.json"),
                         *train_options(data_bin, str(root / f"rank{rank}"), rank, port)])
    outputs = run_ranks(commands)
    seen = [json.load(open(root / f"seen{rank}.json")) for rank in range(2)]
    return root, outputs, seen


def test_fairseq_train_two_ranks_hold_identical_parameters(two_ranks):
    root, outputs, _ = two_ranks
    log = outputs[0][1] + outputs[0][2]
    assert "training on 2 devices" in log
    assert "Expected to have finished reduction" not in log
    states = [torch.load(root / f"rank{r}" / "checkpoint_last.pt", map_location="cpu") for r in range(2)]
    updates = [s["optimizer_history"][-1]["num_updates"] for s in states]
    assert updates[0] == updates[1] >= 3
    for key, value in states[0]["model"].items():
        assert torch.equal(value, states[1]["model"][key]), key
    for a, b in zip(states[0]["last_optimizer_state"]["state"].values(),
                    states[1]["last_optimizer_state"]["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    # identical because the gradients were averaged, not because nothing moved: Adam's
    # moments are non-zero for every parameter (experts and halting units included)
    for state in states[0]["last_optimizer_state"]["state"].values():
        assert state["exp_avg_sq"].sum() > 0


def test_fairseq_train_each_rank_saw_half_of_the_batches(two_ranks):
    _, outputs, seen = two_ranks
    assert len(seen[0]) == len(seen[1])  # one train_step per update on both ranks
    batches = [[ids for step in rank for ids in step] for rank in seen]
    n_batches = len(batches[0]) + len(batches[1])
    assert len(seen[0]) == -(-n_batches // 2)  # updates = ceil(batches / 2)
    assert abs(len(batches[0]) - len(batches[1])) <= 1  # the odd one out is a dummy batch
    ids = [{i for b in rank for i in b} for rank in batches]
    assert ids[0].isdisjoint(ids[1])
    assert ids[0] | ids[1] == set(range(N_TRAIN))  # the whole epoch, each example once
    assert sum(len(b) for rank in batches for b in rank) == N_TRAIN
    # the logged batch size is summed over both ranks
    log = outputs[0][1] + outputs[0][2]
    bsz = [int(json.loads(l.split("| train_inner | ", 1)[1])["bsz"])
           for l in log.splitlines() if "| train_inner | " in l]
    assert sum(bsz) == N_TRAIN and len(bsz) == len(seen[0])
