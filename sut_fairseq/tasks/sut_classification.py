"""``--task sut_classification``: one sentence, or a pair of sentences, -> one label, for
the encoder-only ``sut_classifier`` (docs/classification.md).

Data layout (that of fairseq's ``sentence_prediction`` task)::

    DATA/input0/{dict.txt, train.bin/.idx, valid.bin/.idx, ...}   first sentences
    DATA/input1/{dict.txt, ...}                                   second sentences (pairs)
    DATA/label/{dict.txt, train.bin/.idx, ...}                     one label per line

each made by ``fairseq-preprocess --only-source --trainpref ... --destdir DATA/input0``
(input1 with ``--srcdict DATA/input0/dict.txt``: one dictionary for both sentences).
The task reads pairs when ``DATA/input1`` exists. Unlike ``sentence_prediction`` the two
sentences of a pair are not concatenated: a batch's ``net_input`` holds ``src_tokens``
(B, S1), ``src_lengths`` (B,) and, for pairs, ``pair_tokens`` (B, S2), ``pair_lengths``
(B,), all right-padded, each sentence ending in the </s> fairseq-preprocess appended.
``target`` (B, 1), as ``sentence_prediction``'s, is the label's index among the label
dictionary's symbols (0 .. C-1).
"""
import logging
import os
import re
from dataclasses import dataclass, field

import numpy as np
from fairseq.data import (
    ConcatSentencesDataset,
    Dictionary,
    IdDataset,
    NestedDictionaryDataset,
    NumelDataset,
    NumSamplesDataset,
    OffsetTokensDataset,
    RightPadDataset,
    SortDataset,
    StripTokenDataset,
    data_utils,
)
from fairseq.dataclass import FairseqDataclass
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II, MISSING

from ..models.config import DEFAULT_MAX_POSITIONS

logger = logging.getLogger(__name__)


@dataclass
class SUTClassificationConfig(FairseqDataclass):
    data: str = field(default=MISSING, metadata={
        "help": "directory holding input0/, label/ and, for pairs, input1/"})
    num_classes: int = field(default=-1, metadata={
        "help": "number of classes; must equal the labels in label/dict.txt (-1: take it "
                "from there)"})
    max_positions: int = field(default=DEFAULT_MAX_POSITIONS, metadata={
        "help": "longest sentence (tokens, </s> included); longer examples are refused, or "
                "skipped with --skip-invalid-size-inputs-valid-test"})
    seed: int = II("common.seed")


def label_count(labels: Dictionary) -> int:
    """The labels of a label dictionary: its symbols after the specials, less the
    ``madeupwordNNNN`` fillers fairseq-preprocess appends to reach a multiple of
    ``--padding-factor`` (they come last, so the labels are indices 0 .. C-1)."""
    return sum(1 for symbol in labels.symbols[labels.nspecial:]
               if not re.fullmatch(r"madeupword\d{4}", symbol))


def _require_file(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: expected {what}")


@register_task("sut_classification", dataclass=SUTClassificationConfig)
class SUTClassificationTask(FairseqTask):
    cfg: SUTClassificationConfig

    def __init__(self, cfg: SUTClassificationConfig, dictionary: Dictionary,
                 label_dictionary: Dictionary, pair: bool):
        super().__init__(cfg)
        self.dictionary, self.label_dictionary, self.pair = dictionary, label_dictionary, pair
        self.num_classes = label_count(label_dictionary)

    @classmethod
    def setup_task(cls, cfg: SUTClassificationConfig, **kwargs):
        for sub, what in (("input0", "the first sentences' dictionary (fairseq-preprocess "
                                     "--only-source --destdir DATA/input0)"),
                          ("label", "the labels' dictionary (fairseq-preprocess --only-source "
                                    "--destdir DATA/label)")):
            _require_file(os.path.join(cfg.data, sub, "dict.txt"), what)
        dictionary = Dictionary.load(os.path.join(cfg.data, "input0", "dict.txt"))
        labels = Dictionary.load(os.path.join(cfg.data, "label", "dict.txt"))
        pair = os.path.isdir(os.path.join(cfg.data, "input1"))
        found = label_count(labels)
        if cfg.num_classes != -1 and cfg.num_classes != found:
            raise ValueError(f"--num-classes={cfg.num_classes} is invalid: "
                             f"{os.path.join(cfg.data, 'label', 'dict.txt')} holds {found} labels")
        if found < 2:
            raise ValueError(f"{os.path.join(cfg.data, 'label', 'dict.txt')} holds {found} "
                             "label(s): a classifier needs at least 2")
        logger.info("[input] dictionary: %d types; %d classes; %s", len(dictionary), found,
                    "sentence pairs (input1/ found)" if pair else "single sentences")
        return cls(cfg, dictionary, labels, pair)

    def load_dataset(self, split: str, combine: bool = False, **kwargs):
        """``split`` of input0 (and input1) and label as one shuffled NestedDictionaryDataset
        (sizes: the longer sentence of each example)."""
        first = self._load(split, "input0", self.dictionary, combine)
        second = self._load(split, "input1", self.dictionary, combine) if self.pair else None
        labels = self._load(split, "label", self.label_dictionary, combine)
        if second is not None and len(second) != len(first):
            raise ValueError(f"{split}: input0 holds {len(first)} sentences, input1 {len(second)}")
        if len(labels) != len(first):
            raise ValueError(f"{split}: input0 holds {len(first)} sentences, label {len(labels)}")
        pad = self.dictionary.pad()
        net_input = {"src_tokens": RightPadDataset(first, pad_idx=pad),
                     "src_lengths": NumelDataset(first, reduce=False)}
        sizes, all_tokens = first.sizes, first
        if second is not None:
            net_input["pair_tokens"] = RightPadDataset(second, pad_idx=pad)
            net_input["pair_lengths"] = NumelDataset(second, reduce=False)
            sizes, all_tokens = np.maximum(first.sizes, second.sizes), ConcatSentencesDataset(first, second)
        # the label's symbol -> 0 .. C-1 (as sentence_prediction: drop </s>, shift by nspecial)
        target = OffsetTokensDataset(
            StripTokenDataset(labels, id_to_strip=self.label_dictionary.eos()),
            offset=-self.label_dictionary.nspecial)
        dataset = NestedDictionaryDataset({
            "id": IdDataset(),
            "net_input": net_input,
            "target": target,
            "nsentences": NumSamplesDataset(),
            "ntokens": NumelDataset(all_tokens, reduce=True),
        }, sizes=[sizes])
        with data_utils.numpy_seed(self.cfg.seed):
            shuffle = np.random.permutation(len(dataset))
        self.datasets[split] = SortDataset(dataset, sort_order=[shuffle])
        logger.info("loaded %s: %d examples", split, len(dataset))
        return self.datasets[split]

    def _load(self, split: str, sub: str, dictionary: Dictionary, combine: bool):
        path = os.path.join(self.cfg.data, sub, split)
        dataset = data_utils.load_indexed_dataset(path, dictionary, combine=combine)
        if dataset is None:
            raise FileNotFoundError(f"{path}.bin/.idx not found: expected the {split} split of "
                                    f"{sub} (fairseq-preprocess --only-source --destdir "
                                    f"{os.path.join(self.cfg.data, sub)})")
        return dataset

    def max_positions(self):
        return self.cfg.max_positions

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary
