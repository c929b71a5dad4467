"""The early-exit rules' contract (``modules/exits.py``) beside their arithmetic (which
``test_exits.py`` checks against loops): the refusals and their whole messages, the
state's tensors on the input's device in the documented dtypes, the exit logits in the
main head's dtype, ``finish``'s one-hot weights worked by hand, and the strict ``H < S``
of the entropy rule at the boundary."""
import re

import pytest
import torch

from sut_fairseq.modules.exits import ExitHalting, ExitOutput, ExitState, check_entropy, check_patience

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


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), True, "0.5", None])
def test_an_entropy_threshold_outside_finite_nonnegative_numbers_is_refused(value):
    message = f"--exit-entropy={value!r} is invalid: must be a finite number >= 0 (nats; 0 = never exit)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_entropy(value)


@pytest.mark.parametrize("value", [0, 0.0, 2, 1.5])
def test_finite_nonnegative_entropy_thresholds_are_accepted(value):
    check_entropy(value)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_a_patience_that_is_not_a_nonnegative_integer_is_refused(value):
    message = f"--exit-patience={value!r} is invalid: must be an integer >= 0 (0 = never exit)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_patience(value)


def test_two_decoder_steps_are_enough_and_one_is_refused():
    assert ExitHalting("pabee", D, 2, patience=1, entropy=0.5).max_steps == 2
    with pytest.raises(ValueError, match=r"^exit rules need at least 2 decoder steps; got 1$"):
        ExitHalting("pabee", D, 1, patience=1, entropy=0.5)


def test_finish_puts_all_weight_on_the_last_executed_step():
    """Executed steps 1, 3 and 4 of L = 4 (the last position padding): one-hot weights at
    steps 1, 3, 4; zero on padding; the expected depth is the executed steps."""
    real = torch.tensor([[True, True], [True, False]])
    state = ExitState(torch.zeros(2, 2, D), real, torch.zeros(V, D))
    state.steps = torch.tensor([[1, 3], [4, 2]])
    result = ExitHalting("pabee", D, L, patience=1, entropy=0.5).finish(state, L)
    expected = torch.zeros(2, 2, L)
    expected[0, 0, 0] = expected[0, 1, 2] = expected[1, 0, 3] = 1.0
    assert torch.equal(result.weights, expected)
    assert result.expected_depth.tolist() == [[1.0, 3.0], [4.0, 0.0]]
    assert torch.equal(result.steps, state.steps) and result.max_steps == L


def test_finish_makes_its_weights_on_the_states_device():
    real = torch.ones(2, 3, dtype=torch.bool, device="meta")
    state = ExitState(torch.zeros(2, 3, D, device="meta"), real, torch.zeros(V, D, device="meta"))
    state.steps = torch.ones(2, 3, dtype=torch.long, device="meta")
    weights = ExitHalting("pabee", D, L, patience=1, entropy=0.5).finish(state, L).weights
    assert weights.device.type == "meta" and weights.dtype == torch.float32 and tuple(weights.shape) == (2, 3, L)


def test_an_entropy_equal_to_the_threshold_does_not_exit():
    """Exit when H < S, strictly: with a zero output projection every off-ramp predicts the
    uniform distribution, H = ln V exactly as decide computes it (float32); S = that H keeps
    every position running, the next float32 above it exits every one."""
    logp = torch.nn.functional.log_softmax(torch.zeros(1, V), -1)
    h_uniform = float(-(logp.exp() * logp).sum(-1))
    h = torch.randn(2, 3, D)
    running = torch.ones(2, 3, dtype=torch.bool)
    above = float(torch.nextafter(torch.tensor(h_uniform), torch.tensor(10.0)))  # next float32 up
    for threshold, still_running in ((h_uniform, True), (above, False)):
        rule = ExitHalting("entropy", D, L, patience=1, entropy=threshold).eval()
        state = rule.begin(h, running, weight=torch.zeros(V, D))
        left = rule.decide(h, running, state, 2)
        assert left.all() if still_running else not left.any(), threshold
