"""sut-fairseq: Sparse Universal Transformer (SUT) and Universal Transformer (UT) for fairseq.

Importing the package (fairseq does so for ``--user-dir``) registers the model
``sut_transformer`` with its presets, the criterion ``sut_label_smoothed_cross_entropy``,
the encoder-only classifiers (models ``sut_classifier`` and ``transformer_classifier``,
task and criterion ``sut_classification``) and the learning-rate schedule ``inverse_sqrt_cooldown``, and
allow-lists the classes
fairseq checkpoints pickle so that ``torch.load(weights_only=True)`` (torch >= 2.6) can
read them, and makes ``fairseq-train --help`` list the chosen architecture's and
criterion's options.
"""
import logging

# fairseq's speech task logs "Please install tensorboardX" at INFO on import; every script
# that imports this package would print it
logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.WARNING)

from . import checkpoint_safety  # noqa: F401  (must run before fairseq loads a checkpoint)
from . import cli_help, criterions, models, optim, tasks  # noqa: F401  (registration)

cli_help.install()

__version__ = "0.1.0"
