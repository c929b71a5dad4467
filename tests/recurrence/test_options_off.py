"""With the step-embedding and early-exit options off (their defaults), ``sut_tiny`` is
identical to the model before those options existed (to
floating-point rounding).

``tests/fixtures/sut_tiny_options_off.pt`` holds the outputs of ``reference_outputs()``
computed by the code before the options were added (same seed, same inputs): the
parameters' names and the state dict's shapes, the encoder output, the teacher-forced
decoder logits and executed steps (eval mode, halting at α_thresh 0.6 with randomised
halting units so that positions stop at different steps), the incremental decoder logits,
and the training-mode logits and gradients of a few parameters (dropout 0.1 under a fixed
seed). Everything runs on one CPU thread (``torch.set_num_threads(1)``). Step counts are
compared exactly, floating-point outputs to 1e-5: the last bits depend on which GEMM
kernels the CPU gets, and two machines that report the same torch version and CPU
capability (the fixture records both) were seen to differ by up to 1.4e-6 on logits of
size ~5, while a changed computation moves them by far more than 1e-5.

A deliberate numerical change to the shared layers must regenerate the file, with the
reason in its commit: ``python tests/options_off_reference.py --write``.
"""
import torch

from options_off_reference import (FIXTURE, NOT_TENSORS, compare, current_name, environment,
                                   reference_outputs)


def test_sut_tiny_with_new_options_off_is_bit_identical_to_before():
    expected = torch.load(FIXTURE, weights_only=True)
    got = {**reference_outputs(), "environment": environment()}
    # the same parameters in the same order, under the names the loader gives old checkpoints
    assert got["param_names"] == [current_name(n) for n in expected["param_names"]]
    assert got["state_shapes"] == [(current_name(n), s) for n, s in expected["state_shapes"]]
    assert sorted(got) == sorted(expected)
    compare(got, expected, [k for k in expected if k not in NOT_TENSORS])


def test_explicit_off_values_are_the_defaults():
    """Passing the off values explicitly gives the same model as not passing them."""
    expected = torch.load(FIXTURE, weights_only=True)
    got = reference_outputs(encoder_step_embedding="none", decoder_step_embedding="none",
                            decoder_halting="stick-breaking")
    compare(got, expected, ["decoder_logits", "decoder_steps", "incremental_logits", "train_logits"])
