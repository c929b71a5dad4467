"""fairseq criterions of the plugin."""
from . import sut_classification, sut_label_smoothed_cross_entropy  # noqa: F401  (registration)
