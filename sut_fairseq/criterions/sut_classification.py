"""``sut_classification``: cross-entropy over the ``sut_classifier``'s logits plus the SUT
auxiliary losses of its encoder (``auxiliary.py``, docs/classification.md).

    loss = Σ_sentences CE(logits_i, y_i) + scale · (mim_weight · Σ_routers L_MIM
                                                    + act_weight · L_ACT_enc
                                                    + switch_weight · Σ_routers L_switch)

sample_size = the batch's sentences, so fairseq's update divides by it (the CE per
sentence); ``--aux-loss-scale per-token`` gives scale = sample_size (each weight acts per
sentence), ``reference`` scale = 1. As in ``sut_label_smoothed_cross_entropy`` the
auxiliary terms are added in training only: a validation ``loss`` is the CE alone.

Logged: ``loss`` and ``nll_loss`` (the CE per sentence, base 2, as fairseq's losses),
``accuracy`` (% of sentences whose argmax is the label; ``--best-checkpoint-metric
accuracy --maximize-best-checkpoint-metric`` selects by it), ``ncorrect`` /
``nsentences`` in the logging outputs, and ``mim``, ``switch``, ``act_enc``,
``steps_enc`` (and ``chunk_steps_enc``) as the seq2seq criterion (``mim`` and ``switch``
alone for ``transformer_classifier``, whose encoder has no halting).
"""
import math

import torch.nn.functional as F
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.logging import metrics

from ..compiler import compiles_steps
from .auxiliary import AuxLossConfig, auxiliary_losses, reduce_auxiliary_metrics
from .losses import record_routing


@register_criterion("sut_classification", dataclass=AuxLossConfig)
class SUTClassificationCriterion(FairseqCriterion):
    def __init__(self, task, mim_weight=0.0, act_weight=0.0, switch_weight=0.0,
                 aux_loss_scale="per-token"):
        super().__init__(task)
        self.mim_weight, self.act_weight, self.switch_weight = mim_weight, act_weight, switch_weight
        self.aux_loss_scale = str(aux_loss_scale)

    def forward(self, model, sample, reduce=True):
        """Summed loss over the batch's sentences, sample_size (sentences), logging output.
        ``reduce=False``: the per-sentence CE (B,), nothing auxiliary added."""
        with record_routing(model) as router_stats:
            logits, extra = model(**sample["net_input"])
        target = sample["target"].view(-1)  # (B, 1) from the task, or (B,)
        ce = F.cross_entropy(logits.float(), target, reduction="sum" if reduce else "none")
        loss = ce
        sample_size = target.numel()
        halting = extra["halting_encoder"]  # None: an encoder without halting
        if halting is None and self.act_weight:
            raise ValueError(f"--act-weight={self.act_weight!r} is invalid: the model's encoder "
                             "has no halting (leave it at 0)")
        terms = auxiliary_losses(router_stats, {} if halting is None else {"enc": halting}, ce,
                                 (self.mim_weight, self.act_weight, self.switch_weight),
                                 compiled=compiles_steps(model))
        if model.training and reduce:
            scale = sample_size if self.aux_loss_scale == "per-token" else 1.0
            loss = ce + scale * terms.aux
        ncorrect = logits.argmax(-1).eq(target).sum().item()
        logging_output = {
            "loss": loss.data.sum(),  # reduce=False: the sentences' sum all the same
            "nll_loss": ce.data.sum(),
            "ntokens": sample["ntokens"],
            "nsentences": sample_size,
            "sample_size": sample_size,
            "ncorrect": ncorrect,
            **terms.logging_output(sample_size),
        }
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size = total("sample_size")
        if sample_size == 0:
            return
        metrics.log_scalar("loss", total("loss") / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", total("nll_loss") / sample_size / math.log(2), sample_size,
                           round=3)
        metrics.log_scalar("accuracy", 100.0 * total("ncorrect") / total("nsentences"),
                           total("nsentences"), round=2)
        reduce_auxiliary_metrics(logging_outputs)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
