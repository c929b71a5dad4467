"""``transformer_classifier``: fairseq's own ``TransformerEncoder`` (L unshared layers, no
halting) under ``sut_classifier``'s pooling and head, the transformer baseline of the
recurrent-transformers paper's classify setup (docs/classification.md#the-transformer-baseline).

    H = TransformerEncoder(x)                  (B, T, d), padding mask P (B, T)
    u = pool(H, P)  (mean / end, as ``sut_classifier``)
    logits = head(u), or head([u; v; u·v; |u − v|]) for a pair

Its options are fairseq's ``transformer``'s encoder options (its decoder options are read by
nothing) and the classifier's ``--pooling`` / ``--classifier-hidden-dim``.
"""
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerEncoder, TransformerModel
from fairseq.models.transformer import base_architecture as transformer_base_architecture

from .sut_classifier import SUTClassifierModel, add_classifier_args, build_head, classifier_defaults


@register_model("transformer_classifier")
class TransformerClassifierModel(SUTClassifierModel):
    """pooled fairseq ``TransformerEncoder`` + MLP head; a Siamese head when the task has
    pairs. The forward is ``sut_classifier``'s (its ``halting_encoder`` is None)."""

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_classifier_args(parser)

    @classmethod
    def build_model(cls, args, task):
        transformer_classifier(args)
        dictionary = task.source_dictionary
        embed_tokens = TransformerModel.build_embedding(args, dictionary, args.encoder_embed_dim)
        encoder = TransformerEncoder(args, dictionary, embed_tokens)
        return cls(encoder, build_head(args, task), args.pooling, task.pair)


@register_model_architecture("transformer_classifier", "transformer_classifier")
def transformer_classifier(args):
    """fairseq's ``transformer`` defaults (d 512, 6 layers, 8 heads, FFN 2048, post-LN),
    mean pooling, MLP hidden d."""
    transformer_base_architecture(args)
    classifier_defaults(args)
