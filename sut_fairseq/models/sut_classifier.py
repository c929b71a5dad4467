"""``sut_classifier``: an encoder-only classifier over the plugin's encoder
(docs/classification.md), as the recurrent-transformers paper trains its UT / GUT / TLB /
GUTLB on ListOps (one sequence) and logical inference (a Siamese pair).

    H = SUTEncoder(x)                          (B, T, d), padding mask P (B, T)
    mean:  u = Σ_{t real} H_t / #real          (B, d)
    end:   u = H_{t*},  t* = the last real position (the </s> fairseq-preprocess appends)
    pair:  u = pool(enc(x)), v = pool(enc(y)), f = [u; v; u·v; |u − v|]   (B, 4d)
    single: f = u                                                            (B, d)
    logits = W_2 dropout(tanh(W_1 f + b_1)) + b_2                          (B, C)

A pair runs through the encoder as one batch of 2B rows (right-padded to one length), so
the encoder's HaltingResult, and the criterion's L_ACT, cover both sentences. The pooled
rows are the encoder's output rows: under ``--tlb-encoder-out memory`` the k memory slots
(as the TLB code classifies from LN(M)), under ``both`` the real tokens, then the slots.
Every encoder option of ``sut_transformer`` applies; its decoder options must keep defaults.
"""
import torch
import torch.nn as nn
from fairseq.models import BaseFairseqModel, register_model, register_model_architecture

from .architectures import _set, base_architecture, sut_logic, sut_tiny
from .config import BASE_DEFAULTS, DECODER_FOLLOWS_ENCODER, SUTConfig
from .sut_transformer import SUTEncoder, SUTTransformerModel, build_embedding
from .validation import _check, _equal, _require, validate_args

POOLINGS = ("mean", "end")
#: options read only by the decoder (or by sharing with it), at their defaults here
DECODER_ONLY = ("share_all_embeddings", "share_decoder_input_output_embed", "exit_patience",
                "exit_entropy", "decoder_chunk_size", "decoder_memory_slots",
                "decoder_memory_update_layers", "decoder_chunk_positions", "max_target_positions")


def pool(states: torch.Tensor, padding_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """states (B, T, d), padding_mask (B, T) (True at padding; every row has a real
    position) -> (B, d): the mean over the real positions, or the state at the last real
    position (``end``; right or left padding alike)."""
    real = ~padding_mask
    if mode == "mean":
        summed = states.masked_fill(padding_mask.unsqueeze(-1), 0.0).sum(1)
        return summed / real.sum(1, keepdim=True).to(states.dtype)
    if mode == "end":
        positions = torch.arange(states.size(1), device=states.device)
        last = (positions * real).argmax(1)  # the largest real index
        return states[torch.arange(states.size(0), device=states.device), last]
    raise ValueError(f"--pooling={mode!r} is invalid: choose from {POOLINGS}")


def siamese_features(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[u; v; u·v; |u − v|]: (B, d) twice -> (B, 4d)."""
    return torch.cat([u, v, u * v, (u - v).abs()], dim=-1)


def stack_pair(src_tokens: torch.Tensor, pair_tokens: torch.Tensor, pad: int) -> torch.Tensor:
    """Right-padded (B, S1) and (B, S2) -> (2B, max(S1, S2)), the first sentences first."""
    width = max(src_tokens.size(1), pair_tokens.size(1))
    return torch.cat([nn.functional.pad(tokens, (0, width - tokens.size(1)), value=pad)
                      for tokens in (src_tokens, pair_tokens)], 0)


class ClassificationHead(nn.Module):
    """Linear(in, hidden) -> tanh -> dropout -> Linear(hidden, C). The paper does not state
    its classifier's activation; tanh is that of fairseq's sentence classification heads."""

    def __init__(self, in_dim: int, hidden_dim: int, num_classes: int, dropout: float):
        super().__init__()
        self.dense = nn.Linear(in_dim, hidden_dim)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(hidden_dim, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(features))))


@register_model("sut_classifier")
class SUTClassifierModel(BaseFairseqModel):
    """pooled SUT / UT encoder + MLP head; a Siamese head when the task has pairs."""

    @staticmethod
    def add_args(parser):
        SUTTransformerModel.add_args(parser)
        add_classifier_args(parser)

    @classmethod
    def build_model(cls, args, task):
        base_architecture(args)  # whatever the preset left unset
        classifier_defaults(args)
        validate_args(args)
        _refuse_decoder_options(args)
        dictionary = task.source_dictionary
        cfg = SUTConfig.from_namespace(args)
        encoder = SUTEncoder(cfg, dictionary, build_embedding(dictionary, cfg.encoder.embed_dim))
        return cls(encoder, build_head(args, task), args.pooling, task.pair)

    def __init__(self, encoder: nn.Module, head: ClassificationHead, pooling: str, pair: bool):
        super().__init__()
        self.encoder, self.head, self.pooling, self.pair = encoder, head, pooling, pair

    def forward(self, src_tokens, src_lengths, pair_tokens=None, pair_lengths=None):
        """src_tokens (B, S1) right-padded; pair_tokens (B, S2) for a pair model. Returns logits
        (B, C) and {"halting_encoder": HaltingResult over the B (pairs: 2B) encoded rows, or
        None without halting, "features": the head's input (B, d or 4d)}."""
        if self.pair != (pair_tokens is not None):
            raise ValueError(f"this model classifies {'pairs' if self.pair else 'single sentences'}"
                             f" but was given {'a pair' if pair_tokens is not None else 'one sentence'}")
        tokens, lengths = src_tokens, src_lengths
        if self.pair:
            tokens = stack_pair(src_tokens, pair_tokens, self.encoder.padding_idx)
            lengths = torch.cat([src_lengths, pair_lengths], 0)
        out = self.encoder(tokens, lengths)
        pooled = pool(out["encoder_out"][0].transpose(0, 1), out["encoder_padding_mask"][0],
                      self.pooling)
        features = siamese_features(*pooled.chunk(2, 0)) if self.pair else pooled
        halting = out["halting"][0] if "halting" in out else None
        return self.head(features), {"halting_encoder": halting, "features": features}

    def max_positions(self):
        return self.encoder.max_positions()


def add_classifier_args(parser) -> None:
    """The options of the pooling and the head (``sut_classifier``, ``transformer_classifier``)."""
    parser.add_argument("--pooling", choices=POOLINGS,
                        help="sentence vector: mean over the real positions, or the state "
                        "at the last one (end: the </s>; the paper's choice for GUT/GUTLB) "
                        "(default: mean)")
    parser.add_argument("--classifier-hidden-dim", type=int, metavar="N",
                        help="hidden width of the classification MLP (default: the encoder width)")


def build_head(args, task) -> ClassificationHead:
    """The head over the pooled width d (4d for pairs), after checking the head's options."""
    _require(args.pooling in POOLINGS, "--pooling", args.pooling, f"choose from {POOLINGS}")
    _check(args, "classifier_hidden_dim", lambda h: isinstance(h, int) and h >= 1,
           "must be a positive integer")
    d = args.encoder_embed_dim
    return ClassificationHead(4 * d if task.pair else d, args.classifier_hidden_dim,
                              task.num_classes, args.dropout)


def _refuse_decoder_options(args) -> None:
    """A classifier has no decoder: its options must keep the values the encoder-decoder
    would give them by default (so a checkpoint's filled-in arguments pass)."""
    for name in DECODER_ONLY:
        _check(args, name, _equal(BASE_DEFAULTS[name]), "sut_classifier has no decoder "
               f"(leave it at its default {BASE_DEFAULTS[name]!r})")
    for dec, enc in DECODER_FOLLOWS_ENCODER.items():
        _check(args, dec, _equal(getattr(args, enc)),
               "sut_classifier has no decoder (leave it unset)")


def classifier_defaults(args) -> None:
    """Mean pooling and an MLP of the encoder's width, where unset."""
    _set(args, pooling="mean", classifier_hidden_dim=args.encoder_embed_dim)


@register_model_architecture("sut_classifier", "sut_classifier")
def sut_classifier(args):
    """``sut_logic``'s encoder, mean pooling, MLP hidden d."""
    sut_logic(args)
    classifier_defaults(args)


@register_model_architecture("sut_classifier", "sut_classifier_tiny")
def sut_classifier_tiny(args):
    """``sut_tiny``'s encoder, for tests."""
    sut_tiny(args)
    classifier_defaults(args)
