"""fairseq models of the plugin: ``sut_transformer`` and its architecture presets."""
from . import sut_transformer, architectures  # noqa: F401  (registration)
