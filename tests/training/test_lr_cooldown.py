"""``--lr-scheduler inverse_sqrt_cooldown`` (sut_fairseq/optim/inverse_sqrt_cooldown.py),
built from fairseq-train's own argument parser, against the closed form."""
import math

import pytest
import torch


def build(*flags):
    """(scheduler, optimizer) as fairseq-train builds them from ``flags``."""
    import sut_fairseq  # noqa: F401  (registers the scheduler)
    from fairseq import optim, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.optim.lr_scheduler import build_lr_scheduler

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["data", "--arch", "transformer", "--optimizer", "adam",
                                                "--lr", "7e-4", *flags])
    cfg = convert_namespace_to_omegaconf(args)
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = optim.build_optimizer(cfg.optimizer, params)
    return build_lr_scheduler(cfg.lr_scheduler, optimizer), optimizer


def closed_form(n, peak=7e-4, warmup=1000, max_update=13000, cooldown=3000):
    if n < warmup:
        return peak * n / warmup
    start = max_update - cooldown
    if n < start:
        return peak * math.sqrt(warmup / n)
    return peak * math.sqrt(warmup / start) * (max_update - n) / cooldown


FLAGS = ["--lr-scheduler", "inverse_sqrt_cooldown", "--warmup-updates", "1000",
         "--max-update", "13000", "--cooldown-updates", "3000"]


def test_rate_follows_the_closed_form():
    scheduler, optimizer = build(*FLAGS)
    for n in (0, 1, 500, 999, 1000, 1001, 5000, 9999, 10000, 10001, 11500, 12999, 13000):
        got = scheduler.step_update(n)
        assert got == pytest.approx(closed_form(n), rel=1e-12, abs=1e-15), n
        assert optimizer.get_lr() == pytest.approx(got, rel=1e-12, abs=1e-15)
    assert scheduler.step_update(13000) == 0.0
    # continuous at the start of the cool-down; falls by the same amount every update
    assert scheduler.step_update(9999) == pytest.approx(scheduler.step_update(10000), rel=2e-4)
    steps = [scheduler.step_update(n) - scheduler.step_update(n + 1) for n in (10000, 11000, 12998)]
    assert steps[0] == pytest.approx(steps[1]) == pytest.approx(steps[2])


def test_equals_inverse_sqrt_before_the_cooldown():
    """A run trained with plain inverse_sqrt resumes onto this schedule without a jump."""
    cooled, _ = build(*FLAGS)
    plain, _ = build("--lr-scheduler", "inverse_sqrt", "--warmup-updates", "1000", "--max-update", "13000")
    for n in (0, 10, 999, 1000, 4321, 9999, 10000):
        assert cooled.step_update(n) == pytest.approx(plain.step_update(n), rel=1e-12, abs=1e-15), n
    assert cooled.step_update(11000) < plain.step_update(11000)


@pytest.mark.parametrize("flags,message", [
    (["--max-update", "13000", "--cooldown-updates", "0"], "--cooldown-updates 0: allowed 1 to"),
    (["--max-update", "13000", "--cooldown-updates", "12500"], "allowed 1 to --max-update - --warmup-updates = 12000"),
    (["--cooldown-updates", "3000"], "needs --max-update"),
])
def test_bad_settings_are_named(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        build("--lr-scheduler", "inverse_sqrt_cooldown", "--warmup-updates", "1000", *flags)
