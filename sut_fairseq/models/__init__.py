"""fairseq models of the plugin: ``sut_transformer`` and its architecture presets, and
``sut_classifier`` (encoder-only classification) and its presets, and
``transformer_classifier`` (fairseq's transformer encoder under the same head).

Importing ``sut_transformer`` registers the model and then every preset of
``architectures.PRESETS`` as an ``--arch``.
"""
from . import baselines, sut_classifier, sut_transformer, transformer_classifier  # noqa: F401  (registration)
