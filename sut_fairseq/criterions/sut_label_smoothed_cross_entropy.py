"""``sut_label_smoothed_cross_entropy``: label-smoothed CE + the SUT auxiliary losses
(docs/model.md#losses).

    loss = Σ_tokens CE_ls + scale · (mim_weight · Σ_routers L_MIM
                                      + act_weight · (L_ACT_enc + L_ACT_dec)
                                      + switch_weight · Σ_routers L_switch)

fairseq divides the summed loss by ``sample_size`` (target tokens, or sentences with
``--sentence-avg``) before the update. With ``--aux-loss-scale per-token`` (default)
``scale = sample_size``, so each weight acts per target token, exactly as written.
``--aux-loss-scale reference`` uses ``scale = 1`` as the official SUT code did (it added
batch-mean auxiliary losses to a token-summed loss), so a published weight such as
``--miloss 0.1`` acts at about 0.1 / tokens-per-batch: use it to reuse the paper's weights
as published.

The label-smoothed CE itself is computed from the logits by ``ops.label_smoothed_ce``
(the same value as fairseq's, with a single (tokens, vocabulary) gradient buffer).

The auxiliary terms are training objectives: in eval mode (fairseq's validation) ``loss``
is the label-smoothed CE alone, so ``--best-checkpoint-metric loss``, ``--patience`` and
``valid_loss`` compare models by what they predict, whatever their auxiliary weights.

Logged separately (in training and validation): ``mim``, ``switch``, ``act_enc``,
``act_dec`` (expected steps, Eq. 4) and ``steps_enc`` / ``steps_dec`` (executed block
applications per real position). A side with chunk-wise recurrence (docs/chunked.md)
averages its ACT term over real chunks instead of positions (the mean over chunks of the
chunk's expected depth) and also logs ``chunk_steps_enc`` / ``chunk_steps_dec`` (block
applications per chunk).

Early-exit models (``--decoder-halting pabee|entropy``, off-ramps o_l = W_out LN_l(h_l)
after steps l < L, the main head o_L) train their off-ramps with ``--exit-loss``, CE_l
being the label-smoothed CE of o_l summed over target tokens:

* ``none`` (default): the main head's CE only (the off-ramps get no gradient);
* ``weighted`` (PABEE): ``loss = Σ_{l=1..L} l · CE_l / Σ_{l=1..L} l`` for all parameters;
* ``offramps`` (DeeBERT's second stage, from a trained model): ``loss = Σ_{l<L} CE_l``
  with the states h_l and W_out detached, so only the off-ramps' LayerNorms learn and
  everything else stays frozen (no gradient; the MIM / ACT / switch weights must be 0).
  The freeze relies on the optimiser skipping parameters without a gradient, as fairseq's
  fp32 optimisers and ``--memory-efficient-fp16`` / ``--memory-efficient-bf16`` / ``--amp``
  do. ``--fp16`` / ``--bf16`` alone train through fairseq's ``FP16Optimizer``, which gives
  every such parameter a zero gradient: weight decay (and Adam moments restored from the
  first stage) would then move the "frozen" model, so that combination is refused
  (``tests/exits/test_offramps_freeze.py``).

In training, ``exit_loss_1`` .. ``exit_loss_L`` log CE_l per target token (base 2, as
``loss``). At validation nothing changes: ``loss`` is the CE of what the model emits, the
exited positions' off-ramps included.
"""
import math
from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.dataclass import ChoiceEnum
from fairseq.logging import metrics
from omegaconf import II

from ..compiler import compiles_steps
from .auxiliary import AuxLossConfig, auxiliary_losses, reduce_auxiliary_metrics
from .losses import record_routing
from ..ops.label_smoothed_ce import label_smoothed_cross_entropy

EXIT_LOSSES = ChoiceEnum(["none", "weighted", "offramps"])


@dataclass
class SUTCriterionConfig(AuxLossConfig, LabelSmoothedCrossEntropyCriterionConfig):
    # the auxiliary weights and --aux-loss-scale: AuxLossConfig (auxiliary.py)
    exit_loss: EXIT_LOSSES = field(default="none", metadata={
        "help": "early-exit models (--decoder-halting pabee|entropy): weighted = "
                "sum_l l*CE_l / sum_l l over the off-ramps and the main head (PABEE); "
                "offramps = sum_{l<L} CE_l, off-ramps only, the rest frozen (DeeBERT stage 2)"})
    # fairseq's precision options (interpolated from --fp16 etc., not options of their own):
    # they choose the optimiser wrapper, which decides whether --exit-loss offramps freezes
    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")
    memory_efficient_fp16: bool = II("common.memory_efficient_fp16")
    memory_efficient_bf16: bool = II("common.memory_efficient_bf16")
    amp: bool = II("common.amp")


@register_criterion("sut_label_smoothed_cross_entropy", dataclass=SUTCriterionConfig)
class SUTLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, mim_weight=0.0, act_weight=0.0, switch_weight=0.0,
                 aux_loss_scale="per-token", exit_loss="none", fp16=False, bf16=False,
                 memory_efficient_fp16=False, memory_efficient_bf16=False, amp=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.mim_weight, self.act_weight, self.switch_weight = mim_weight, act_weight, switch_weight
        self.aux_loss_scale = str(aux_loss_scale)
        self.exit_loss = str(exit_loss)
        if self.exit_loss == "offramps" and (mim_weight or act_weight or switch_weight):
            raise ValueError(
                "--exit-loss offramps trains the off-ramps only, with the rest of the model "
                f"frozen; the auxiliary losses would train it: got --mim-weight {mim_weight}, "
                f"--act-weight {act_weight}, --switch-weight {switch_weight} (set them to 0)")
        flattened = (fp16 or bf16) and not (memory_efficient_fp16 or memory_efficient_bf16 or amp)
        if self.exit_loss == "offramps" and flattened:
            flag = "--bf16" if bf16 else "--fp16"
            raise ValueError(
                f"--exit-loss offramps cannot train with {flag}: fairseq's FP16Optimizer "
                "gives the frozen parameters zero gradients, so --weight-decay (and Adam "
                "moments restored from the first stage) would change the frozen model; use "
                f"--memory-efficient-{flag[2:]} (it skips parameters without a gradient) or fp32")

    def forward(self, model, sample, reduce=True):
        with record_routing(model) as router_stats:
            net_output = model(**sample["net_input"])
        loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]

        extra = net_output[1]
        halting = {"enc": extra["halting_encoder"], "dec": extra["halting_decoder"]}
        terms = auxiliary_losses(router_stats, halting, loss,
                                 (self.mim_weight, self.act_weight, self.switch_weight),
                                 compiled=compiles_steps(model))
        aux = terms.aux
        exit_logs = {}
        if model.training and self.exit_loss != "none":
            loss, exit_logs = self.exit_losses(model, net_output, sample, loss)
        # validation's ``loss`` is the label-smoothed CE alone; ``--exit-loss offramps``
        # trains nothing but the off-ramps (even a zero-weighted term would give the
        # routers zero gradients, and the optimiser would then update them)
        if model.training and self.exit_loss != "offramps":
            scale = sample_size if self.aux_loss_scale == "per-token" else 1.0
            loss = loss + scale * aux

        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
            **terms.logging_output(sample_size),
            **exit_logs,
        }
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = n_correct.data
            logging_output["total"] = total.data
        return loss, sample_size, logging_output

    def exit_losses(self, model, net_output, sample, main_loss):
        """The ``--exit-loss`` objective from the training states h_1 .. h_{L-1} and the
        main head's summed CE ``main_loss`` (= CE_L). Returns (loss, logs) with logs
        ``exit_loss_l`` = CE_l (summed over target tokens) for l = 1 .. L."""
        exits = net_output[1].get("decoder_exits")
        if exits is None:
            raise ValueError(f"--exit-loss {self.exit_loss} needs a model with off-ramps: "
                             "--decoder-halting pabee or entropy (and --decoder-layers >= 2)")
        decoder = model.decoder
        weight = decoder.output_projection.weight
        frozen = self.exit_loss == "offramps"  # DeeBERT stage 2: only the off-ramps learn
        if frozen:
            weight = weight.detach()
        step_losses = []
        for l, h in enumerate(exits.hidden, start=1):
            logits = decoder.side.halting.offramp(h.detach() if frozen else h, l, weight)
            flat_logits, target = self._logits_and_target(model, (logits, None), sample)
            step_losses.append(label_smoothed_cross_entropy(flat_logits, target, self.eps,
                                                            self.padding_idx)[0])
        L = len(step_losses) + 1
        if frozen:  # Σ_{l<L} CE_l
            loss = sum(step_losses[1:], step_losses[0])
        else:  # Σ_{l<=L} l · CE_l / Σ_{l<=L} l
            loss = sum((l * ce for l, ce in enumerate(step_losses, start=1)), L * main_loss)
            loss = loss / (L * (L + 1) / 2)
        logs = {f"exit_loss_{l}": ce.data for l, ce in enumerate(step_losses + [main_loss], start=1)}
        return loss, logs

    def _logits_and_target(self, model, net_output, sample):
        """(N, V) logits and (N,) targets after ``--ignore-prefix-size``."""
        logits, target = net_output[0], model.get_targets(sample, net_output)
        if self.ignore_prefix_size > 0:
            logits = logits[:, self.ignore_prefix_size:, :]
            target = target[:, self.ignore_prefix_size:]
        return logits.reshape(-1, logits.size(-1)), target.reshape(-1)

    def compute_loss(self, model, net_output, sample, reduce=True):
        """Summed (CE_ls, NLL) from the logits (the SUT decoders output plain logits, no
        adaptive softmax); ``reduce=False``: fairseq's per-token losses."""
        if not reduce:
            return super().compute_loss(model, net_output, sample, reduce=reduce)
        logits, target = self._logits_and_target(model, net_output, sample)
        return label_smoothed_cross_entropy(logits, target, self.eps, self.padding_idx)

    def compute_accuracy(self, model, net_output, sample):
        logits, target = self._logits_and_target(model, net_output, sample)
        mask = target.ne(self.padding_idx)
        n_correct = logits.argmax(1).masked_select(mask).eq(target.masked_select(mask)).sum()
        return n_correct, mask.sum()

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_auxiliary_metrics(logging_outputs)

        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size = total("sample_size")  # > 0: fairseq's reduce above divides by it
        exit_keys = {key for log in logging_outputs for key in log if key.startswith("exit_loss_")}
        for key in sorted(exit_keys, key=lambda k: int(k.rsplit("_", 1)[1])):
            # CE_l per target token in base 2, as ``loss``
            metrics.log_scalar(key, total(key) / sample_size / math.log(2), sample_size, round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
