"""``--lr-scheduler inverse_sqrt_cooldown``: fairseq's inverse square root schedule with a
linear cool-down to zero over the last ``--cooldown-updates`` updates of ``--max-update``.

With W = ``--warmup-updates``, M = ``--max-update``, C = ``--cooldown-updates`` and
S = M - C (the update at which the cool-down starts)::

    lr(n) = lr_peak * n / W                       n < W     (fairseq's warm-up, from 0)
    lr(n) = lr_peak * sqrt(W / n)                 W <= n < S
    lr(n) = lr_peak * sqrt(W / S) * (M - n) / C   S <= n <= M

The rate is a function of the update number alone, so a run resumed from any checkpoint
follows the same curve, and a run trained to S with plain ``inverse_sqrt`` can be resumed
with this schedule (``--max-update S + C``) to add the cool-down: the rate is continuous
at S. Ending training at a rate of zero instead of mid-decay usually gains accuracy at no
cost in updates (docs/logic.md, "A learning-rate cool-down").
"""
from dataclasses import dataclass, field

from fairseq.optim.lr_scheduler import register_lr_scheduler
from fairseq.optim.lr_scheduler.inverse_square_root_schedule import (
    InverseSquareRootLRScheduleConfig,
    InverseSquareRootSchedule,
)
from omegaconf import II


@dataclass
class InverseSqrtCooldownConfig(InverseSquareRootLRScheduleConfig):
    cooldown_updates: int = field(
        default=0,
        metadata={"help": "decay the rate linearly to 0 over the last N updates of --max-update"},
    )
    max_update: int = II("optimization.max_update")


@register_lr_scheduler("inverse_sqrt_cooldown", dataclass=InverseSqrtCooldownConfig)
class InverseSqrtCooldownSchedule(InverseSquareRootSchedule):
    def __init__(self, cfg: InverseSqrtCooldownConfig, optimizer):
        max_update, cooldown = cfg.max_update, cfg.cooldown_updates
        if not max_update or max_update <= 0:
            raise ValueError("--lr-scheduler inverse_sqrt_cooldown needs --max-update "
                             f"(got {max_update}): the cool-down ends there")
        if not 0 < cooldown <= max_update - cfg.warmup_updates:
            raise ValueError(f"--cooldown-updates {cooldown}: allowed 1 to --max-update - "
                             f"--warmup-updates = {max_update - cfg.warmup_updates}")
        super().__init__(cfg, optimizer)
        self.cooldown_start = max_update - cooldown

    def step_update(self, num_updates):
        """The rate after ``num_updates`` updates (the equations in the module docstring)."""
        if num_updates < self.cooldown_start:
            return super().step_update(num_updates)
        start_lr = self.decay_factor * self.cooldown_start ** -0.5
        remaining = max(self.cfg.max_update - num_updates, 0)
        self.lr = start_lr * remaining / self.cfg.cooldown_updates
        self.optimizer.set_lr(self.lr)
        return self.lr
