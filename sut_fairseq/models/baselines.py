"""fairseq's own transformer at the scales of this plugin's presets, registered as
``--arch`` names of fairseq's ``transformer`` model (nothing of the plugin in it), so that
a recipe compares the SUT with the baseline the paper uses under one name.

| arch                   | d   | layers enc/dec | FFN   | heads | dropout (attention, activation) |
|------------------------|-----|----------------|-------|-------|---------------------------------|
| ``transformer_multi30k`` | 256 | 3/3          | 1,024 | 4     | 0.3 (0.1, 0.1)                  |

``transformer_multi30k`` is ``transformer_wmt_en_de`` at half its width and half its
depth, the baseline of ``sut_multi30k`` and ``ut_multi30k`` (docs/multi30k.md).
"""
from fairseq.models import register_model_architecture
from fairseq.models.transformer import base_architecture

from .architectures import _default


@register_model_architecture("transformer", "transformer_multi30k")
def transformer_multi30k(args):
    for side in ("encoder", "decoder"):
        _default(args, f"{side}_embed_dim", 256)
        _default(args, f"{side}_ffn_embed_dim", 1024)
        _default(args, f"{side}_attention_heads", 4)
        _default(args, f"{side}_layers", 3)
    _default(args, "dropout", 0.3)
    _default(args, "attention_dropout", 0.1)
    _default(args, "activation_dropout", 0.1)
    base_architecture(args)
