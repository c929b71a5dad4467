"""Tools that analyse a trained model or its outputs (docs/analysis.md, docs/exits.md).

* ``python -m sut_fairseq.analysis.macs``: MACs, static (all L steps) or executed on data.
* ``python -m sut_fairseq.analysis.halting_analysis``: teacher-forced halting analysis.
* ``python -m sut_fairseq.analysis.halting_depth``: mean halting depth per test split
  (depth per operator count, per hop).
* ``python -m sut_fairseq.analysis.sweep``: the α_thresh sweep (skipped steps against the
  task metric, trade-off curve, halting heat map), and with ``exit_sweep`` the early-exit
  sweep over PABEE patience and entropy thresholds.
* ``python -m sut_fairseq.analysis.offramps``: teacher-forced accuracy of every off-ramp.
* ``python -m sut_fairseq.analysis.expert_report``: expert–token co-occurrence.
* ``plots``: the figures, and files written atomically.

The model core (``models``, ``modules``, ``ops``, ``kernels``, ``criterions``, ``tasks``)
imports nothing from here (``tests/cli/test_package_layers.py``). Importing this package
imports none of its modules.
"""
