"""The one recurrence step (``modules/recurrence.py``) against the two it replaced: the
outputs, halting decisions, incremental logits and every parameter's gradient (as random
projections) that the eager ``SideStep`` and the compiled ``RecurrenceStep`` of commit
4d2ca68 gave from the same weights (``one_step_reference.py``), within 1e-5 in fp32, for
``sut_tiny``, a logic-sized model, GUT with keys/values of h, ACT with both step
embeddings under pre-LN, the chunked, Hyper-UT and early-exit models; compiled
(``aot_eager``) where ``--compile-step`` covers the model."""
import pytest
import torch

from one_step_reference import COMPILED, FIXTURE, VARIANTS, key, outputs


@pytest.fixture(scope="module")
def recorded():
    return torch.load(FIXTURE)


def _compare(got, expected):
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        if want.dtype in (torch.long, torch.bool):
            assert torch.equal(got[name], want), name
        else:  # projections of a gradient sum ~1e3 products: relative to the largest
            atol = 1e-5 * max(1.0, want.abs().max().item()) if name.startswith("grad/") else 1e-5
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_eager_step_equals_the_step_it_replaced(variant, recorded):
    _compare(outputs(variant), recorded[key(variant, False)])


@pytest.mark.slow
@pytest.mark.parametrize("variant", COMPILED)
def test_the_compiled_step_equals_the_compiled_step_it_replaced(variant, recorded, monkeypatch):
    monkeypatch.setenv("SUT_COMPILE_BACKEND", "aot_eager")
    _compare(outputs(variant, compiled=True), recorded[key(variant, True)])
