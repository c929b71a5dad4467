"""The criteria's auxiliary terms as one compiled function (``criterions/auxiliary.py``'s
``COMPILED_TERMS``, used by a model with a compiled step): the same losses, aux, logged
values and gradients as the eager terms; the logged values read in one host read; a
compiler failure falls back to the eager terms with one warning."""
import logging

import pytest
import torch

from sut_fairseq import compiler
from sut_fairseq.criterions import auxiliary
from sut_fairseq.criterions.losses import mim_loss, record_routing, switch_loss

WEIGHTS = (0.3, 0.2, 0.1)  # mim, act, switch


def _forward(model, seed=0):
    """The router statistics and halting results of one training forward of ``model``."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (3, 6), generator=g)
    prev = torch.randint(4, 40, (3, 5), generator=g)
    src[0, :2] = 1  # padding
    with record_routing(model) as stats:
        _, extra = model(src_tokens=src, src_lengths=torch.full((3,), 6), prev_output_tokens=prev)
    return stats, {"enc": extra["halting_encoder"], "dec": extra["halting_decoder"]}


def _model(**overrides):
    from conftest import make_model, randomise_halting

    model = make_model(att_experts=4, att_topk=2, ffd_experts=4, ffd_topk=2, encoder_layers=3,
                       decoder_layers=3, **overrides)
    randomise_halting(model)
    return model.train()


@pytest.fixture
def fresh_terms(monkeypatch):
    """A new ``COMPILED_TERMS`` (no graph of another test's), traced by aot_eager."""
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")
    terms = compiler.CompiledFunction(auxiliary.auxiliary_terms, "criterion's auxiliary terms")
    monkeypatch.setattr(auxiliary, "COMPILED_TERMS", terms)
    return terms


def test_compiled_terms_equal_the_eager_terms_and_their_gradients(fresh_terms):
    model = _model()
    stats, halting = _forward(model)
    loss = torch.zeros(())
    eager = auxiliary.auxiliary_losses(stats, halting, loss, WEIGHTS)
    compiled = auxiliary.auxiliary_losses(stats, halting, loss, WEIGHTS, compiled=True)
    assert fresh_terms.compiled is not None and not fresh_terms.failed
    for name in ("mim", "switch", "aux", "logs"):
        torch.testing.assert_close(getattr(compiled, name), getattr(eager, name), msg=name)
    assert compiled.logging_output(13) == pytest.approx(eager.logging_output(13))
    # independent of the module's sums: the routers' losses one by one, the sides' L_ACT
    torch.testing.assert_close(compiled.mim, sum(mim_loss(s) for s in stats))
    torch.testing.assert_close(compiled.switch, sum(switch_loss(s) for s in stats))
    act = sum(h.act_loss() for h in halting.values())
    torch.testing.assert_close(compiled.aux, 0.3 * compiled.mim + 0.2 * act + 0.1 * compiled.switch)
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(eager.aux, params, retain_graph=True, allow_unused=True)
    got = torch.autograd.grad(compiled.aux, params, allow_unused=True)
    assert sum(g is not None for g in want) > 0
    for w, g in zip(want, got):
        assert (w is None) == (g is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_the_logged_values_are_the_counts_of_the_halting_results(fresh_terms):
    stats, halting = _forward(_model())
    terms = auxiliary.auxiliary_losses(stats, halting, torch.zeros(()), WEIGHTS, compiled=True)
    log = terms.logging_output(7)
    for side, result in halting.items():
        assert log[f"steps_{side}"] == result.steps.sum().item() and isinstance(log[f"steps_{side}"], int)
        assert log[f"positions_{side}"] == result.real.sum().item()
        assert log[f"act_units_{side}"] == result.real.sum().item()
        assert log[f"act_{side}"] == pytest.approx(result.act_loss().item() * result.real.sum().item())
    assert log["positions_enc"] == 3 * 6 - 2 and log["positions_dec"] == 15
    assert log["mim"] == pytest.approx(terms.mim.item() * 7) and log["switch"] == pytest.approx(terms.switch.item() * 7)


def test_the_logging_output_reads_the_device_once(monkeypatch):
    stats, halting = _forward(_model())
    terms = auxiliary.auxiliary_losses(stats, halting, torch.zeros(()), WEIGHTS)
    reads = []
    item, tolist = torch.Tensor.item, torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append("item") or item(self))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append("tolist") or tolist(self))
    terms.logging_output(5)
    assert reads == ["tolist"]


def test_a_compiler_failure_falls_back_to_the_eager_terms(fresh_terms, monkeypatch, caplog):
    import torch._dynamo.exc as exc

    def broken(*args, **kwargs):
        raise exc.Unsupported("no tracing here")

    stats, halting = _forward(_model())
    monkeypatch.setattr(fresh_terms, "compiled", broken)
    with caplog.at_level(logging.WARNING):
        terms = auxiliary.auxiliary_losses(stats, halting, torch.zeros(()), WEIGHTS, compiled=True)
        again = auxiliary.auxiliary_losses(stats, halting, torch.zeros(()), WEIGHTS, compiled=True)
    eager = auxiliary.auxiliary_losses(stats, halting, torch.zeros(()), WEIGHTS)
    assert fresh_terms.failed
    torch.testing.assert_close(terms.aux, eager.aux)
    torch.testing.assert_close(again.logs, eager.logs)
    warnings = [r.getMessage() for r in caplog.records if "auxiliary terms" in r.getMessage()]
    assert warnings == ["--compile-step: compiling the criterion's auxiliary terms failed "
                        "(Unsupported: no tracing here); running it eagerly from now on"]


def test_the_criteria_compile_their_terms_only_for_a_model_whose_steps_compile():
    from conftest import make_model

    assert compiler.compiles_steps(make_model(compile_step=True))
    assert compiler.compiles_steps(make_model(compile_loop=True))
    assert not compiler.compiles_steps(make_model())
    assert not compiler.compiles_steps(torch.nn.Linear(2, 2))
    failed = make_model(compile_step=True)
    failed.encoder.side.compiled_step.failed = True  # compiling it failed: the decoder's still runs
    assert compiler.compiles_steps(failed)
    failed.decoder.side.compiled_step.failed = True  # neither: the criterion stays eager, unsaid
    assert not compiler.compiles_steps(failed)
