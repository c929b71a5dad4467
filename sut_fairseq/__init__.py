"""sut-fairseq: Sparse Universal Transformer (SUT) and Universal Transformer (UT) for fairseq.

Importing the package (fairseq does so for ``--user-dir``) registers the model
``sut_transformer`` with its presets and the criterion
``sut_label_smoothed_cross_entropy``, and allow-lists the classes fairseq checkpoints
pickle so that ``torch.load(weights_only=True)`` (torch >= 2.6) can read them, and makes
``fairseq-train --help`` list the chosen architecture's and criterion's options.
"""
from . import checkpoint_safety  # noqa: F401  (must run before fairseq loads a checkpoint)
from . import cli_help, criterions, models, tasks  # noqa: F401  (registration)

cli_help.install()

__version__ = "0.1.0"
