"""The early-exit rules' contract (``modules/exits.py``) beyond their arithmetic (which
``test_exits.py`` checks against loops): the refusals and their whole messages, the
state's tensors on the input's device in the documented dtypes, and the exit logits in
the main head's dtype."""
import re

import pytest
import torch

from sut_fairseq.modules.exits import ExitHalting, ExitOutput, ExitState

L, D, V = 4, 8, 11


@pytest.mark.parametrize("step", [0, L, L + 1])
def test_an_offramp_outside_steps_1_to_L_minus_1_is_refused(step):
    rule = ExitHalting("pabee", D, L, patience=1, entropy=0.5)
    message = f"off-ramps follow steps 1..{L - 1}; got step {step}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        rule.offramp(torch.zeros(2, D), step, torch.zeros(V, D))


def test_every_offramp_step_in_range_gives_logits():
    rule = ExitHalting("entropy", D, L, patience=1, entropy=0.5)
    for step in range(1, L):
        assert rule.offramp(torch.zeros(3, D), step, torch.zeros(V, D)).shape == (3, V)


def test_begin_without_the_output_projection_is_refused():
    rule = ExitHalting("pabee", D, L, patience=1, entropy=0.5)
    message = "the exit rules need the output projection: use ExitHalting.bind(weight)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        rule.begin(torch.zeros(2, 3, D), torch.ones(2, 3, dtype=torch.bool))


def test_the_state_lives_on_the_input_device_in_its_dtypes():
    """On the meta device, so that a tensor made on the default device (the CPU) shows."""
    B, T = 2, 3
    h = torch.zeros(B, T, D, device="meta")
    state = ExitState(h, torch.ones(B, T, dtype=torch.bool, device="meta"), torch.zeros(V, D, device="meta"))
    for name, tensor, shape in (("prev_pred", state.prev_pred, (B * T,)), ("count", state.count, (B * T,)),
                                ("exit_step", state.output.exit_step, (B, T))):
        assert tensor.device.type == "meta", name
        assert tensor.dtype == torch.long and tuple(tensor.shape) == shape, name
    assert state.output.logits is None and state.output.hidden == []


@pytest.mark.parametrize("main_dtype", [torch.bfloat16, torch.float64])
def test_exit_logits_take_the_main_heads_dtype(main_dtype):
    exit_step = torch.tensor([[0, 2], [1, 0]])
    exit_logits = torch.arange(2 * 2 * V, dtype=torch.float32).view(2, 2, V)
    main = torch.full((2, 2, V), -1.0, dtype=main_dtype)
    out = ExitOutput(exit_step, exit_logits).apply(main)
    assert out.dtype == main_dtype
    assert torch.equal(out[0, 1], exit_logits[0, 1].to(main_dtype)) and (out[0, 0] == -1).all()
