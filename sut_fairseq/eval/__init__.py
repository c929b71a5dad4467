"""Evaluation tools of the WMT'14 recipe (docs/wmt14.md).

* ``python -m sut_fairseq.eval.average_checkpoints``: average the N best checkpoints
  (fairseq's ``scripts/average_checkpoints.py``, which the fairseq wheel does not install).
* ``python -m sut_fairseq.eval.bleu``: tokenised BLEU with compound splitting and
  SacreBLEU on detokenised output.
"""
