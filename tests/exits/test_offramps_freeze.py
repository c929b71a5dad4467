"""``--exit-loss offramps`` freezes everything but the off-ramps by giving the rest no
gradient. That holds only where the optimiser skips parameters without a gradient:
fairseq's ``FP16Optimizer`` (``--fp16`` / ``--bf16``) fills them with zeros, so weight
decay moves the "frozen" model. The criterion refuses that combination, built through
fairseq's own configuration (the precision flags reach it by interpolation); the
memory-efficient wrappers and fp32 keep the frozen parameters bit for bit, checked here
through fairseq's optimiser wrappers on the CPU.
"""
from types import SimpleNamespace

import pytest
import torch

import sut_fairseq  # noqa: F401  (registers the criterion)
from conftest import make_model
from fairseq import criterions, optim, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import SUTLabelSmoothedCrossEntropyCriterion

PAD = 1


def fairseq_cfg(*flags, exit_loss="offramps"):
    """The root config ``fairseq-train`` builds for ``sut_tiny`` with Adam (lr 0.1, weight
    decay 0.1), the SUT criterion with ``--exit-loss`` and the extra ``flags``."""
    cli = ["/dev/null", "--task", "translation", "--arch", "sut_tiny", "--optimizer", "adam",
           "--lr", "0.1", "--weight-decay", "0.1", "--criterion", "sut_label_smoothed_cross_entropy",
           "--label-smoothing", "0.1", "--exit-loss", exit_loss, *flags]
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=cli)
    return convert_namespace_to_omegaconf(args)


def build_criterion(cfg, model):
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    return criterions.build_criterion(cfg.criterion, task)


@pytest.mark.parametrize("flags,named", [(["--fp16"], "--fp16"), (["--bf16"], "--bf16")])
def test_offramps_with_the_fp16_optimizer_is_refused_naming_the_options(flags, named):
    model = make_model(decoder_halting="pabee", decoder_layers=3)
    with pytest.raises(ValueError) as error:
        build_criterion(fairseq_cfg(*flags), model)
    message = str(error.value)
    assert f"--exit-loss offramps cannot train with {named}" in message
    assert f"--memory-efficient-{named[2:]}" in message and "--weight-decay" in message


@pytest.mark.parametrize("flags,exit_loss", [
    ([], "offramps"), (["--fp16", "--memory-efficient-fp16"], "offramps"),
    (["--bf16", "--memory-efficient-bf16"], "offramps"), (["--amp"], "offramps"),
    (["--fp16"], "weighted"), (["--bf16"], "none")])
def test_combinations_where_the_freeze_holds_or_nothing_is_frozen_are_accepted(flags, exit_loss):
    model = make_model(decoder_halting="pabee", decoder_layers=3)
    criterion = build_criterion(fairseq_cfg(*flags, exit_loss=exit_loss), model)
    assert isinstance(criterion, SUTLabelSmoothedCrossEntropyCriterion)
    assert criterion.exit_loss == exit_loss


def _sample(seed=0, B=2, S=5, T=4):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (B, S), generator=g)
    prev = torch.randint(4, 40, (B, T), generator=g)
    prev[:, 0] = 2
    target = torch.cat([prev[:, 1:], torch.full((B, 1), 2)], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((B,), S),
                          "prev_output_tokens": prev},
            "target": target, "ntokens": B * T}


def train_offramps(wrapper, flags, dtype, steps=3):
    """``steps`` updates of ``--exit-loss offramps`` on a pabee model of 3 decoder steps
    in ``dtype``, through fairseq's optimiser ``wrapper`` (``None``: the plain fp32
    optimiser) built from ``flags``. Returns {name: (before, after)} of every parameter."""
    cfg = fairseq_cfg(*flags)
    model = make_model(decoder_halting="pabee", decoder_layers=3, encoder_layers=2).train().to(dtype)
    # built directly: the criterion refuses --fp16 / --bf16 (the point of this file)
    criterion = SUTLabelSmoothedCrossEntropyCriterion(
        SimpleNamespace(target_dictionary=model.decoder.dictionary), False, 0.1, exit_loss="offramps")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optim.build_optimizer(cfg.optimizer, params) if wrapper is None else wrapper.build_optimizer(cfg, params)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(steps):
        opt.zero_grad()
        loss, _, _ = criterion(model, _sample(seed=step))
        opt.backward(loss)
        opt.step()
    return {n: (before[n], p.detach()) for n, p in model.named_parameters()}


def _offramp(name):
    return name.startswith("decoder.side.halting.norms.")


@pytest.fixture
def cpu_flat_buffer(monkeypatch):
    """fairseq's flattened fp32 buffer asks for the current CUDA device; on the CPU the
    parameters' device index is None, which is where the buffer then lives."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)


@pytest.mark.parametrize("flags,dtype", [(["--fp16"], torch.float16), (["--bf16"], torch.bfloat16)])
def test_the_fp16_optimizer_moves_parameters_that_got_no_gradient(cpu_flat_buffer, flags, dtype):
    """Why the combination is refused: the frozen weights decay (the flattened --fp16
    buffer and the per-parameter --bf16 copies alike)."""
    result = train_offramps(optim.FP16Optimizer, flags, dtype)
    moved = [n for n, (a, b) in result.items() if not _offramp(n) and not torch.equal(a, b)]
    assert len(moved) > 10, moved
    weight = result["decoder.side.block.ffd.up.weight"]
    assert (weight[1].float().norm() < weight[0].float().norm()), "weight decay shrinks them"


@pytest.mark.parametrize("wrapper,flags,dtype", [
    (optim.MemoryEfficientFP16Optimizer, ["--fp16", "--memory-efficient-fp16"], torch.float16),
    (optim.MemoryEfficientFP16Optimizer, ["--bf16", "--memory-efficient-bf16"], torch.bfloat16),
    (None, [], torch.float32)], ids=["memory-efficient-fp16", "memory-efficient-bf16", "fp32"])
def test_accepted_optimisers_keep_the_frozen_model_bit_identical(cpu_flat_buffer, wrapper, flags, dtype):
    result = train_offramps(wrapper, flags, dtype)
    frozen = {n: v for n, v in result.items() if not _offramp(n)}
    trained = {n: v for n, v in result.items() if _offramp(n)}
    assert len(trained) == 4  # LN_1, LN_2: weight and bias
    assert all(torch.equal(a, b) for a, b in frozen.values()), [
        n for n, (a, b) in frozen.items() if not torch.equal(a, b)]
    assert all(not torch.equal(a, b) for a, b in trained.values())
