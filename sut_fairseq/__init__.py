"""sut-fairseq: Sparse Universal Transformer (SUT) and Universal Transformer (UT) for fairseq.

Importing the package (fairseq does so for ``--user-dir``) registers the model
``sut_transformer`` with its presets, the criterion ``sut_label_smoothed_cross_entropy``,
the encoder-only classifiers (models ``sut_classifier`` and ``transformer_classifier``,
task and criterion ``sut_classification``) and the learning-rate schedule ``inverse_sqrt_cooldown``, and
allow-lists the classes
fairseq checkpoints pickle so that ``torch.load(weights_only=True)`` (torch >= 2.6) can
read them, and makes ``fairseq-train --help`` list the chosen architecture's and
criterion's options.

The registration runs as soon as fairseq is loaded: at once when fairseq is already
imported (fairseq's ``--user-dir`` import, or a script that imported fairseq first),
otherwise as soon as fairseq is loaded and no module of the package is still being
imported (``_RegisterWhenFairseqIsLoaded``). So the
pure-Python parts, ``sut_fairseq.data`` (the task generators), ``sut_fairseq.recipes`` and
``sut_fairseq.user_dir``, import neither torch nor fairseq: a data-preparation script or a
recipe's dry run starts in a tenth of a second instead of the seconds those imports take.
"""
import importlib.abc
import importlib.machinery
import logging
import sys

# fairseq's speech task logs "Please install tensorboardX" at INFO on import; every script
# that imports this package would print it
logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.WARNING)

__version__ = "0.1.0"
_registered = False


def register() -> None:
    """Register the plugin's models, criterions, tasks and schedule with fairseq, allow-list
    the checkpoints' classes and install the ``--help`` listing (once; needs fairseq)."""
    global _registered
    if _registered:
        return
    _registered = True
    from . import checkpoint_safety  # noqa: F401  (must run before fairseq loads a checkpoint)
    from . import cli_help, criterions, models, optim, tasks  # noqa: F401  (registration)

    cli_help.install()


class _RegisterWhenFairseqIsLoaded(importlib.abc.MetaPathFinder):
    """Runs ``register()`` once fairseq is loaded and no module of this package is in the
    middle of its own import: it finds ``fairseq`` and this package's submodules with the
    path finder and wraps their loaders' ``exec_module`` to count the package's modules
    being executed (a submodule that imports fairseq must finish before the registration
    imports it again). Leaves ``sys.meta_path`` once the plugin is registered."""

    depth = 0

    def find_spec(self, name, path=None, target=None):
        if _registered or not (name == "fairseq" or name.startswith(__name__ + ".")):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute, finder = spec.loader.exec_module, self

        def exec_module(module):
            ours = name != "fairseq"
            finder.depth += ours
            try:
                execute(module)
            finally:
                finder.depth -= ours
            if finder.depth == 0 and "fairseq" in sys.modules and not _registered:
                sys.meta_path.remove(finder)
                register()

        spec.loader.exec_module = exec_module
        return spec


if "fairseq" in sys.modules:
    register()
else:
    sys.meta_path.insert(0, _RegisterWhenFairseqIsLoaded())
