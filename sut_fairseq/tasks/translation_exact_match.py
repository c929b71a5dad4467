"""``--task translation_exact_match``: fairseq's ``translation`` task plus sequence-level
exact-match accuracy on the validation set, in the spirit of ``--eval-bleu``.

    fairseq-train DATA --user-dir sut_fairseq --task translation_exact_match \\
        --eval-exact-match [--eval-exact-match-print-samples] \\
        --best-checkpoint-metric exact_match --maximize-best-checkpoint-metric ...

With ``--eval-exact-match`` every validation batch is also decoded (greedily: beam 1,
unless ``--eval-exact-match-args`` says otherwise, e.g. ``'{"beam": 4}'``) and
``exact_match`` -- the percentage of validation sequences whose hypothesis equals the
reference token for token -- is logged with the validation statistics, where
``--best-checkpoint-metric exact_match`` can select checkpoints by it. A reference
holding ``<unk>`` never counts as matched. Everything else is the translation task's.
"""
import json
import logging
from argparse import Namespace
from dataclasses import dataclass, field
from typing import List, Sequence

from fairseq import metrics, utils
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

logger = logging.getLogger(__name__)


@dataclass
class TranslationExactMatchConfig(TranslationConfig):
    eval_exact_match: bool = field(default=False, metadata={
        "help": "decode the validation set in valid_step and log exact_match (percent of "
                "sequences equal to the reference)"})
    eval_exact_match_args: str = field(default='{"beam": 1}', metadata={
        "help": "generation arguments for --eval-exact-match as JSON (default greedy: "
                "'{\"beam\": 1}')"})
    eval_exact_match_print_samples: bool = field(default=False, metadata={
        "help": "log the first hypothesis and reference of every validation batch"})


def sequence_matches(hypothesis: Sequence[int], reference: Sequence[int], eos: int, unk: int) -> bool:
    """Token-for-token equality, ignoring a final EOS; a reference with ``unk`` never
    matches."""
    hyp, ref = list(hypothesis), list(reference)
    if hyp and hyp[-1] == eos:
        hyp.pop()
    if ref and ref[-1] == eos:
        ref.pop()
    return unk not in ref and hyp == ref


@register_task("translation_exact_match", dataclass=TranslationExactMatchConfig)
class TranslationExactMatchTask(TranslationTask):
    cfg: TranslationExactMatchConfig

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        if self.cfg.eval_exact_match:
            try:
                gen_args = json.loads(self.cfg.eval_exact_match_args or "{}")
            except json.JSONDecodeError as err:
                raise ValueError(f"--eval-exact-match-args is not JSON: {err}") from None
            gen_args.setdefault("beam", 1)
            self.exact_match_generator = self.build_generator([model], Namespace(**gen_args))
        return model

    def valid_step(self, sample, model, criterion):
        loss, sample_size, logging_output = super().valid_step(sample, model, criterion)
        if self.cfg.eval_exact_match:
            correct, total = self._exact_match(sample, model)
            logging_output["_em_correct"] = correct
            logging_output["_em_total"] = total
        return loss, sample_size, logging_output

    def _exact_match(self, sample, model):
        gen_out = self.inference_step(self.exact_match_generator, [model], sample, prefix_tokens=None)
        eos, unk, pad = self.tgt_dict.eos(), self.tgt_dict.unk(), self.tgt_dict.pad()
        correct = 0
        for i, hypotheses in enumerate(gen_out):
            hyp = hypotheses[0]["tokens"].int().cpu()
            ref = utils.strip_pad(sample["target"][i], pad).int().cpu()
            correct += sequence_matches(hyp.tolist(), ref.tolist(), eos, unk)
            if i == 0 and self.cfg.eval_exact_match_print_samples:
                logger.info("exact-match example hypothesis: " + self.tgt_dict.string(hyp))
                logger.info("exact-match example reference:  " + self.tgt_dict.string(ref))
        return correct, len(gen_out)

    def reduce_metrics(self, logging_outputs: List[dict], criterion):
        super().reduce_metrics(logging_outputs, criterion)
        if not self.cfg.eval_exact_match:
            return
        total = sum(int(log.get("_em_total", 0)) for log in logging_outputs)
        if total == 0:
            return  # training batches
        correct = sum(int(log.get("_em_correct", 0)) for log in logging_outputs)
        # Summed meters (weight 1): .sum accumulates over the batches of a validation run.
        metrics.log_scalar("_em_correct", correct)
        metrics.log_scalar("_em_total", total)

        def exact_match(meters):
            n = meters["_em_total"].sum
            return round(100.0 * meters["_em_correct"].sum / n, 2) if n > 0 else 0.0

        metrics.log_derived("exact_match", exact_match)
