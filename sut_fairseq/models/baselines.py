"""fairseq's own transformer at the scales of this plugin's presets, registered as
``--arch`` names of fairseq's ``transformer`` model (nothing of the plugin in it), so that
a recipe compares the SUT with the paper's baseline under one name.
"""
from fairseq.models import register_model_architecture
from fairseq.models.transformer import base_architecture

from .architectures import _set


@register_model_architecture("transformer", "transformer_multi30k")
def transformer_multi30k(args):
    """``transformer_wmt_en_de`` at half its width and depth, the baseline of
    ``sut_multi30k`` and ``ut_multi30k`` (docs/multi30k.md)."""
    for side in ("encoder", "decoder"):
        _set(args, **{f"{side}_embed_dim": 256, f"{side}_ffn_embed_dim": 1024,
                      f"{side}_attention_heads": 4, f"{side}_layers": 3})
    _set(args, dropout=0.3, attention_dropout=0.1, activation_dropout=0.1)
    base_architecture(args)
