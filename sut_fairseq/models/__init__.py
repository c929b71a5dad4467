"""fairseq models of the plugin, registered on import: ``sut_transformer`` and its presets,
``sut_classifier`` (encoder-only classification) and its presets, ``transformer_classifier``
(fairseq's transformer encoder under the same head) and the ``baselines`` archs.
"""
from . import baselines, sut_classifier, sut_transformer, transformer_classifier  # noqa: F401
