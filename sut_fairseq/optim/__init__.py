"""Learning-rate schedules the plugin registers with fairseq (``--lr-scheduler NAME``)."""
from . import inverse_sqrt_cooldown  # noqa: F401  (registration)
