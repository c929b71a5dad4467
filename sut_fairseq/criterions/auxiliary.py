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
from typing import Dict, List, Optional, Tuple

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics

from ..compiler import CompiledFunction
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
    (0-d), L_ACT per side, the sides' HaltingResults (for the step counts), ``aux``: their
    weighted sum with the criterion's weights (``weighted_terms``), and ``logs``:
    every logged quantity of the forward in one vector (``log_names``), read from the
    device at once by ``logging_output``."""

    mim: torch.Tensor
    switch: torch.Tensor
    act: Dict[str, torch.Tensor]
    halting: Dict[str, HaltingResult]
    aux: Optional[torch.Tensor] = None
    logs: Optional[torch.Tensor] = None

    def weighted(self, mim_weight: float, act_weight: float, switch_weight: float) -> torch.Tensor:
        """aux (``weighted_terms``) of these terms."""
        return weighted_terms(self.mim, self.switch, self.act, (mim_weight, act_weight, switch_weight))

    def logging_output(self, sample_size) -> dict:
        """``mim`` / ``switch`` times sample_size; per side ``act_<side>`` (L_ACT times its
        units), ``act_units_<side>``, ``steps_<side>`` (executed block applications),
        ``positions_<side>`` (real positions) and, for a chunked side, ``chunks_<side>`` /
        ``chunk_steps_<side>``: sums, so that fairseq can add them over batches and workers.
        One host read (``logs``)."""
        logs = self.logs if self.logs is not None else log_vector(self.mim, self.switch, self.act,
                                                                  self.halting)
        values = dict(zip(log_names(self.halting), logs.tolist()))
        log = {}
        for name, value in values.items():
            if name in ("mim", "switch"):
                log[name] = value * sample_size
            elif name.startswith("act_") and not name.startswith("act_units_"):
                log[name] = value * int(values[f"act_units_{name[4:]}"])
            else:  # counts
                log[name] = int(value)
        return log


def weighted_terms(mim: torch.Tensor, switch: torch.Tensor, act: Dict[str, torch.Tensor],
                   weights: Tuple[float, float, float]) -> torch.Tensor:
    """aux = mim_weight · MIM + act_weight · Σ_sides ACT + switch_weight · switch, ``weights``
    = (mim_weight, act_weight, switch_weight). The ACT term stays at weight 0 (it keeps the
    halting units in the graph, as DDP without ``find_unused_parameters`` needs); a router
    term of weight 0 is left out (no backward through it; the routers reach the loss
    through their gates)."""
    mim_weight, act_weight, switch_weight = weights
    aux = act_weight * sum(act.values(), torch.zeros_like(mim))
    if mim_weight:
        aux = mim_weight * mim + aux
    if switch_weight:
        aux = aux + switch_weight * switch
    return aux


def log_names(halting: Dict[str, HaltingResult]) -> List[str]:
    """The entries of ``log_vector``: mim, switch, then per side act, act_units, steps,
    positions, and chunks / chunk_steps for a chunked side."""
    names = ["mim", "switch"]
    for side, result in halting.items():
        names += [f"act_{side}", f"act_units_{side}", f"steps_{side}", f"positions_{side}"]
        if getattr(result, "chunk_real", None) is not None:
            names += [f"chunks_{side}", f"chunk_steps_{side}"]
    return names


def log_vector(mim: torch.Tensor, switch: torch.Tensor, act: Dict[str, torch.Tensor],
               halting: Dict[str, HaltingResult]) -> torch.Tensor:
    """The logged quantities (``log_names``) as one fp64 vector, without a gradient (counts
    are exact in fp64 up to 2^53)."""
    values = [mim, switch]
    for side, result in halting.items():
        values += [act[side], result.act_units(), result.steps.sum(), result.num_positions()]
        if getattr(result, "chunk_real", None) is not None:
            values += [result.chunk_real.sum(), result.chunk_steps.sum()]
    return torch.stack([v.detach().to(torch.float64) for v in values])


def auxiliary_terms(sums: List[torch.Tensor], experts: Tuple[int, ...],
                    halting: Dict[str, HaltingResult], like: torch.Tensor,
                    weights: Tuple[float, float, float]):
    """(L_MIM, L_switch, {side: L_ACT}, aux, ``log_vector``) from the routers' statistics
    ``sums`` (each (2 E + 2,), E = ``experts`` in the same order) and the sides' halting
    results; aux = ``weighted_terms`` with ``weights``; ``like``: the main loss (the sums
    start at its dtype, fp32 or wider). A function of tensors, so that a model with a
    compiled step compiles it into one graph."""
    zero = like.new_zeros(())
    groups = stack_stats([RouterStats.of_sums(s, E) for s, E in zip(sums, experts)])
    mim = sum((mim_loss(g).sum() for g in groups), zero)
    switch = sum((switch_loss(g).sum() for g in groups), zero)
    act = {side: result.act_loss() for side, result in halting.items()}
    aux = weighted_terms(mim, switch, act, weights)
    return mim, switch, act, aux, log_vector(mim, switch, act, halting)


#: ``auxiliary_terms`` compiled, for the models that compile their steps
COMPILED_TERMS = CompiledFunction(auxiliary_terms, "criterion's auxiliary terms")


def auxiliary_losses(router_stats: List[RouterStats], halting: Dict[str, HaltingResult],
                     like: torch.Tensor, weights: Tuple[float, float, float] = (0.0, 0.0, 0.0),
                     compiled: bool = False) -> AuxiliaryLosses:
    """The terms from the statistics ``record_routing`` collected during the forward and
    the sides' halting results (side -> HaltingResult); ``like``: the main loss (dtype and
    device of the sums); ``weights``: (mim, act, switch) of ``AuxiliaryLosses.aux``.
    ``compiled``: through ``COMPILED_TERMS`` (a model with a compiled step: a few kernels
    instead of a few dozen; eager where it cannot compile)."""
    args = ([s.sums for s in router_stats], tuple(s.num_experts for s in router_stats), halting,
            like, tuple(float(w) for w in weights))
    mim, switch, act, aux, logs = (COMPILED_TERMS.run(like.device, *args) if compiled
                                   else auxiliary_terms(*args))
    return AuxiliaryLosses(mim=mim, switch=switch, act=act, halting=halting, aux=aux, logs=logs)


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
