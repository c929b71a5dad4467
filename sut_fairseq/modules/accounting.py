"""Executed-step accounting: how much of the maximum compute halting actually spent.

Every eval-mode forward of a ``sut_transformer`` adds, per side, the executed
(position, step) block applications and the maximum L × real positions to the model's
``StepMeter`` (expert rows = executed × Σ_layers k). ``fairseq-generate`` and
``fairseq-interactive`` print one summary line for the whole run when they exit, e.g.::

    | encoder steps executed 61.2% (1224/2000) | decoder steps executed 48.9% (...)

A chunked side (docs/chunked.md) also counts its chunks and the block applications on each
(the most steps one of its tokens executed). In training the criterion logs the same figures
per batch (``steps_enc``, ``chunk_steps_enc``, ...).
"""
import atexit
import os
import sys
from typing import Dict


class StepMeter:
    def __init__(self, expert_slots: Dict[str, int]):
        """expert_slots: side -> Σ over the block's expert layers of k (rows per step)."""
        self.expert_slots = expert_slots
        self.reset()

    def add(self, side: str, halting) -> None:
        """halting: a HaltingResult; a ChunkedHaltingResult also adds its chunks."""
        positions = int(halting.real.sum())
        self.executed[side] += int(halting.steps.sum())
        self.maximum[side] += positions * halting.max_steps
        self.positions[side] += positions
        if getattr(halting, "chunk_real", None) is not None:
            self.chunks[side] += int(halting.chunk_real.sum())
            self.chunk_steps[side] += int(halting.chunk_steps.sum())

    def reset(self) -> None:
        self.executed, self.maximum, self.positions, self.chunks, self.chunk_steps = (
            dict.fromkeys(self.expert_slots, 0) for _ in range(5))

    def fraction(self, side: str) -> float:
        return self.executed[side] / self.maximum[side] if self.maximum[side] else float("nan")

    def summary(self) -> str:
        parts = []
        for side, name in (("enc", "encoder"), ("dec", "decoder")):
            if self.maximum[side]:
                chunks = (f"; {self.executed[side] / self.positions[side]:.2f} steps per "
                          f"position, {self.chunk_steps[side] / self.chunks[side]:.2f} per "
                          f"chunk over {self.chunks[side]} chunks") if self.chunks[side] else ""
                parts.append(f"{name} steps executed {100 * self.fraction(side):.1f}% "
                             f"({self.executed[side]}/{self.maximum[side]}; "
                             f"{self.executed[side] * self.expert_slots[side]} expert rows{chunks})")
        return "| " + " | ".join(parts) if parts else ""


_METERS = []
#: fairseq's generation tools, as console scripts or as ``python -m fairseq_cli.X``
_GENERATION_TOOLS = ("fairseq-generate", "fairseq-interactive", "generate.py", "interactive.py")


def register_for_exit_summary(meter: StepMeter) -> None:
    """Print the meter's summary when a generation tool exits."""
    tool = os.path.basename(sys.argv[0]) if sys.argv else ""
    if tool in _GENERATION_TOOLS:
        if not _METERS:
            atexit.register(_print_summaries)
        _METERS.append(meter)  # strong reference: the model is gone by exit time


def _print_summaries() -> None:
    for meter in _METERS:
        if meter.summary():
            print(meter.summary(), flush=True)
