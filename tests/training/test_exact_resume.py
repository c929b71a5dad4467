"""Exact resume (issue 9): ``sut_tiny`` trained for N updates in one ``fairseq-train`` run
equals N/2 updates, a stop, and N/2 more resumed from ``save_dir/checkpoint_last.pt``
(fairseq's default ``--restore-file``), with dropout, gating and halting dropout, sampled
experts (``--sample-topk 1``), stick-breaking halting, MoE and the MIM/ACT losses on.

Randomness needs nothing from the plugin: fairseq re-seeds torch before every update
with ``--seed`` + number of updates, and the checkpoint holds the model, the Adam state,
the learning-rate scheduler and the data iterator's position.

The one trap is fairseq's, not the plugin's: by default (``--update-epoch-batch-itr
False``) fairseq 0.12 builds the training batches once, when the epoch iterator is first
created, with ``numpy_seed(seed + epoch)``, and re-uses them every later epoch (only their
order is reshuffled). ``LanguagePairDataset.ordered_indices`` breaks ties between
equal-length pairs with a random permutation, so a run started fresh groups the pairs into
batches with the epoch-1 seed, while a run resumed in epoch e >= 2 groups them with the
epoch-e seed: the batches have the same sizes but other sentences, and the losses after
the resume differ (in a 20-update run resumed in epoch 2, loss 3.786 instead of
3.836 on the first update after the resume). ``--update-epoch-batch-itr True`` rebuilds the batches every epoch with that
epoch's seed in both cases, and the resume becomes exact (bit-identical parameters). A
resume inside epoch 1 is exact either way.

fairseq's JSON log rounds losses to 3 decimals, so beyond comparing every logged
per-update figure, the test compares the final parameters and Adam moments of both runs
(max |difference| <= 1e-6; they are in fact identical).
"""
import json
import os
import re
import subprocess

import pytest
import torch

from sut_fairseq.data.reverse_task import write_reverse_task
from sut_fairseq.demo import fairseq_tool
from sut_fairseq.user_dir import user_dir

N = 16
ENV = dict(os.environ, OMP_NUM_THREADS="1")
TIMING = {"wps", "ups", "wall", "train_wall", "gb_free"}


def _run(command, timeout=300):
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, f"{command[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    prefixes = write_reverse_task(str(root / "text"), seed=5, sizes={"train": 240, "valid": 24})
    dest = str(root / "bin")
    _run([fairseq_tool("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
          "--trainpref", prefixes["train"], "--validpref", prefixes["valid"],
          "--destdir", dest, "--joined-dictionary", "--workers", "1"])
    return dest


def _train(data_bin, save_dir, max_update, *extra):
    return _run([
        fairseq_tool("fairseq-train"), data_bin, "--user-dir", user_dir(),
        "--task", "translation", "-s", "src", "-t", "tgt", "--arch", "sut_tiny",
        "--share-all-embeddings", "--dropout", "0.1", "--attention-dropout", "0.1",
        "--activation-dropout", "0.1", "--gating-dropout", "0.1", "--halting-dropout", "0.1",
        "--sample-topk", "1", "--criterion", "sut_label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--mim-weight", "0.01", "--act-weight", "0.001",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
        "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
        "--max-tokens", "384", "--max-update", str(max_update), "--seed", "3",
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--num-workers", "0", "--cpu",
        "--log-format", "json", "--log-interval", "1", *extra])


def _updates(log):
    """The per-update JSON records, keyed by num_updates, without the timing figures."""
    records = {}
    for line in log.splitlines():
        if "| train_inner | " in line:
            record = json.loads(line.split("| train_inner | ", 1)[1])
            records[int(record["num_updates"])] = {k: v for k, v in record.items() if k not in TIMING}
    return records


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def _max_difference(a, b):
    """Max |a - b| over every tensor of two (nested) states; other leaves must be equal."""
    fa, fb = dict(_flatten(a)), dict(_flatten(b))
    assert fa.keys() == fb.keys()
    worst = 0.0
    for key, x in fa.items():
        if torch.is_tensor(x):
            assert x.shape == fb[key].shape, key
            worst = max(worst, (x.double() - fb[key].double()).abs().max().item() if x.numel() else 0.0)
        else:
            assert x == fb[key], (key, x, fb[key])
    return worst


@pytest.fixture(scope="module")
def runs(data_bin, tmp_path_factory):
    flag = ["--update-epoch-batch-itr", "True"]
    one_go = str(tmp_path_factory.mktemp("one_go"))
    halves = str(tmp_path_factory.mktemp("halves"))
    return {
        "one_go": (one_go, _train(data_bin, one_go, N, *flag)),
        "first": (halves, _train(data_bin, halves, N // 2, *flag)),
        "second": (halves, _train(data_bin, halves, N, *flag)),
    }


def test_resumed_run_logs_the_same_updates(runs):
    one_go, first, second = (_updates(runs[k][1]) for k in ("one_go", "first", "second"))
    assert sorted(one_go) == list(range(1, N + 1))
    assert sorted(first) == list(range(1, N // 2 + 1))
    assert sorted(second) == list(range(N // 2 + 1, N + 1))  # it resumed, not restarted
    loaded = re.search(r"Loaded checkpoint \S*checkpoint_last\.pt \(epoch (\d+) @ (\d+) updates\)",
                       runs["second"][1])
    assert loaded and int(loaded.group(2)) == N // 2
    assert int(loaded.group(1)) >= 2, "the resume must happen after epoch 1 to test the trap"
    for u in range(1, N + 1):
        resumed = first.get(u) or second[u]
        assert resumed == one_go[u], (u, resumed, one_go[u])
    for key in ("loss", "mim", "act_enc", "act_dec", "gnorm"):
        assert key in one_go[N]


def test_resumed_run_ends_with_the_same_parameters_and_optimizer_state(runs):
    a = torch.load(os.path.join(runs["one_go"][0], "checkpoint_last.pt"), map_location="cpu")
    b = torch.load(os.path.join(runs["second"][0], "checkpoint_last.pt"), map_location="cpu")
    assert a["optimizer_history"][-1]["num_updates"] == b["optimizer_history"][-1]["num_updates"] == N
    assert _max_difference(a["model"], b["model"]) <= 1e-6
    assert _max_difference(a["last_optimizer_state"], b["last_optimizer_state"]) <= 1e-6
    assert a["extra_state"]["train_iterator"] == b["extra_state"]["train_iterator"]


def test_default_batches_depend_on_the_epoch_the_iterator_was_created_in(data_bin):
    """The cause of the trap, without training: the epoch-2 batches of an iterator created in
    epoch 1 (a fresh run) are not those of one created in epoch 2 (a run resumed there),
    unless the batches are rebuilt every epoch (``--update-epoch-batch-itr True``)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def epoch2_batches(start_epoch, rebuild):
        args = options.parse_args_and_arch(options.get_training_parser(), [
            data_bin, "--user-dir", user_dir(), "--task", "translation", "-s", "src", "-t", "tgt",
            "--arch", "sut_tiny", "--max-tokens", "384", "--seed", "3"])
        task = tasks.setup_task(convert_namespace_to_omegaconf(args).task)
        task.load_dataset("train")

        def iterator(epoch):
            return task.get_batch_iterator(task.dataset("train"), max_tokens=384, seed=3,
                                           epoch=epoch, update_epoch_batch_itr=rebuild)
        itr = iterator(start_epoch)
        if start_epoch == 1:
            for _ in itr.next_epoch_itr(shuffle=True):  # consume epoch 1
                pass
            if rebuild:  # what fairseq-train does at every epoch with the flag
                itr = iterator(2)
        return [sorted(b["id"].tolist()) for b in itr.next_epoch_itr(shuffle=True)]

    fresh, resumed = epoch2_batches(1, False), epoch2_batches(2, False)
    assert [len(b) for b in fresh] == [len(b) for b in resumed]  # same sizes ...
    assert fresh != resumed  # ... other sentences
    assert epoch2_batches(1, True) == epoch2_batches(2, True)
