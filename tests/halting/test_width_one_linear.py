"""The halting unit's last layer (d -> 1) as a product and a sum instead of a width-1
GEMM (#48 item 2): the same logits and gradients as ``nn.Linear`` in fp32."""
import contextlib

import pytest
import torch

from conftest import make_model, randomise_halting
from old_code import assert_same_as_old
from sut_fairseq.modules import halting
from sut_fairseq.modules.halting import width_one_linear


def _old(a, linear):
    """The code before: ``nn.Linear(d, 1)``, a GEMM of width 1."""
    return linear(a).squeeze(-1).float()


@contextlib.contextmanager
def old_halting_unit():
    before = halting.width_one_linear
    halting.width_one_linear = _old
    try:
        yield
    finally:
        halting.width_one_linear = before


def test_equals_the_linear_layer_with_its_gradients():
    linear = torch.nn.Linear(16, 1)
    torch.nn.init.normal_(linear.weight)
    a = torch.randn(3, 5, 16, requires_grad=True)
    new = width_one_linear(a, linear)
    assert new.shape == (3, 5) and new.dtype == torch.float32
    grads_new = torch.autograd.grad(new.sin().sum(), [a, linear.weight, linear.bias])
    old = _old(a, linear)
    grads_old = torch.autograd.grad(old.sin().sum(), [a, linear.weight, linear.bias])
    torch.testing.assert_close(new, old, atol=1e-6, rtol=1e-6)
    for n, o in zip(grads_new, grads_old):
        torch.testing.assert_close(n, o, atol=1e-5, rtol=1e-5)


def test_bf16_input_gives_an_fp32_logit():
    linear = torch.nn.Linear(8, 1)
    a = torch.randn(4, 8).bfloat16()
    assert width_one_linear(a, linear).dtype == torch.float32


@pytest.mark.parametrize("rule,transition", [("stick-breaking", False), ("global-mean", True),
                                             ("act", False)])
@pytest.mark.parametrize("compiled_branch", [False, True])
def test_model_outputs_and_gradients_equal_the_old_code(request, rule, transition, compiled_branch):
    model = make_model(encoder_halting=rule, decoder_halting=rule, halting_transition=transition,
                       halting_threshold=0.8, encoder_layers=4, decoder_layers=4)
    randomise_halting(model, seed=3)
    if compiled_branch:  # decide's branch of a compiled step (sut::masked_linear)
        request.getfixturevalue("compiling_branch")
    g = torch.Generator().manual_seed(0)
    src, prev = torch.randint(4, 40, (3, 7), generator=g), torch.randint(4, 40, (3, 6), generator=g)
    assert_same_as_old(model, src, prev, old_halting_unit)
