"""The SUT auxiliary losses as every criterion of the plugin adds them to its main loss
(docs/model.md#losses): their options, their values from one forward, their logging.

    aux = mim_weight · Σ_routers L_MIM + act_weight · Σ_sides L_ACT
          + switch_weight · Σ_routers L_switch
    loss = main + scale · aux      (training only; scale = sample_size, or 1 with
                                    --aux-loss-scale reference)

A side is "enc" or "dec" (the classifier has "enc" only); its L_ACT is
``HaltingResult.act_loss()`` (the mean over real positions, or over real chunks for a
chunked side, of the expected depth). ``sut_label_smoothed_cross_entropy`` and
``sut_classification`` both use this module, so the two add and log the same terms.
"""
from dataclasses import dataclass, field
from typing import Dict, List

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics

from .losses import mim_loss, stack_stats, switch_loss
from ..modules.halting import HaltingResult
from ..modules.router import RouterStats

AUX_LOSS_SCALES = ChoiceEnum(["per-token", "reference"])


@dataclass
class AuxLossConfig(FairseqDataclass):
    mim_weight: float = field(default=0.0, metadata={
        "help": "weight of the mutual-information routing loss L_MIM = H(e|x) - H(e)"})
    act_weight: float = field(default=0.0, metadata={
        "help": "weight of the ACT loss (expected number of steps, summed over the sides: "
                "encoder + decoder, or the classifier's encoder)"})
    switch_weight: float = field(default=0.0, metadata={
        "help": "weight of the Switch-Transformer load-balancing loss (ablation of MIM)"})
    aux_loss_scale: AUX_LOSS_SCALES = field(default="per-token", metadata={
        "help": "per-token: the auxiliary weights act per unit of sample_size (target "
                "token; sentence for sut_classification); reference: as the official SUT "
                "code, weight / tokens-per-batch"})


@dataclass
class AuxiliaryLosses:
    """The unweighted terms of one forward: L_MIM and L_switch summed over the routers
    (0-d), L_ACT per side, and the sides' HaltingResults (for the step counts)."""

    mim: torch.Tensor
    switch: torch.Tensor
    act: Dict[str, torch.Tensor]
    halting: Dict[str, HaltingResult]

    def weighted(self, mim_weight: float, act_weight: float, switch_weight: float) -> torch.Tensor:
        """aux = mim_weight · MIM + act_weight · Σ_sides ACT + switch_weight · switch. The ACT
        term stays at weight 0 (it keeps the halting units in the graph, as DDP without
        ``find_unused_parameters`` needs); a router term of weight 0 is left out (no backward
        through it; the routers reach the loss through their gates)."""
        aux = act_weight * sum(self.act.values(), torch.zeros_like(self.mim))
        if mim_weight:
            aux = mim_weight * self.mim + aux
        if switch_weight:
            aux = aux + switch_weight * self.switch
        return aux

    def logging_output(self, sample_size) -> dict:
        """``mim`` / ``switch`` times sample_size; per side ``act_<side>`` (L_ACT times its
        units), ``act_units_<side>``, ``steps_<side>`` (executed block applications),
        ``positions_<side>`` (real positions) and, for a chunked side, ``chunks_<side>`` /
        ``chunk_steps_<side>``: sums, so that fairseq can add them over batches and workers."""
        log = {"mim": self.mim.item() * sample_size, "switch": self.switch.item() * sample_size}
        for side, halting in self.halting.items():
            units = halting.act_units().item()
            log[f"act_{side}"] = self.act[side].item() * units
            log[f"act_units_{side}"] = units
        for side, halting in self.halting.items():
            log[f"steps_{side}"] = halting.steps.sum().item()
            log[f"positions_{side}"] = halting.num_positions().item()
        for side, halting in self.halting.items():
            if getattr(halting, "chunk_real", None) is not None:
                log[f"chunks_{side}"] = halting.chunk_real.sum().item()
                log[f"chunk_steps_{side}"] = halting.chunk_steps.sum().item()
        return log


def auxiliary_losses(router_stats: List[RouterStats], halting: Dict[str, HaltingResult],
                     like: torch.Tensor) -> AuxiliaryLosses:
    """The terms from the statistics ``record_routing`` collected during the forward and
    the sides' halting results (side -> HaltingResult); ``like``: the main loss (dtype and
    device of the sums)."""
    zero = like.new_zeros(())  # the sums' start: at least the loss's dtype (fp32 or wider)
    groups = stack_stats(router_stats)  # a few kernels for all routers, not per router
    return AuxiliaryLosses(
        mim=sum((mim_loss(g).sum() for g in groups), zero),
        switch=sum((switch_loss(g).sum() for g in groups), zero),
        act={side: result.act_loss() for side, result in halting.items()},
        halting=halting,
    )


def reduce_auxiliary_metrics(logging_outputs) -> None:
    """Log ``mim`` / ``switch`` per unit of sample_size, and per side with positions (an
    encoder-only model has no ``dec`` entries) ``act_<side>`` per halting unit,
    ``steps_<side>`` per real position and ``chunk_steps_<side>`` per chunk, each weighted
    by its own denominator."""

    def total(key):
        return sum(log.get(key, 0) for log in logging_outputs)

    sample_size = total("sample_size")  # > 0: fairseq's reduce of the main loss divides by it
    metrics.log_scalar("mim", total("mim") / sample_size, sample_size, round=4)
    metrics.log_scalar("switch", total("switch") / sample_size, sample_size, round=4)
    for side in ("enc", "dec"):
        positions = total(f"positions_{side}")
        units = total(f"act_units_{side}")  # real positions, or real chunks if chunked
        if positions > 0:
            metrics.log_scalar(f"act_{side}", total(f"act_{side}") / units, units, round=3)
            metrics.log_scalar(f"steps_{side}", total(f"steps_{side}") / positions, positions, round=3)
        chunks = total(f"chunks_{side}")
        if chunks > 0:
            metrics.log_scalar(f"chunk_steps_{side}", total(f"chunk_steps_{side}") / chunks,
                               chunks, round=3)
