"""The options of ``sut_transformer`` (and ``sut_classifier``'s encoder) as one dataclass.

``SUTConfig`` holds the shared options and one ``SideConfig`` per side. On the command line,
in checkpoints and under hydra's ``model:`` the options keep their flat names
(``--encoder-X`` / ``--decoder-X`` for each field X of ``SideConfig``), generated from the
dataclass as fairseq's ``TransformerConfig`` does. Each default is ``sut_base``'s; the
decoder's ``follows_encoder`` fields default to the encoder's value. Presets
(``architectures.py``) fill unset options before these defaults; ``from_namespace`` builds
the dataclass from the filled flat namespace, and ``cfg.encoder_layers`` etc. still read.
"""
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict

from fairseq import utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..modules.exits import EXIT_RULES
from ..modules.halting import HALTING_RULES
from ..modules.recurrence import HALTING_KV
from ..modules.step_embedding import STEP_EMBEDDINGS

REL_POS = ("clipped", "t5", "none")
CHUNK_POSITIONS = ("local", "global")
TLB_ENCODER_OUT = ("tokens", "memory", "both")
DEFAULT_MAX_POSITIONS = 1024
SIDES = ("encoder", "decoder")


def option(default, help: str, follows_encoder: bool = False):
    """A field whose help states its default; ``follows_encoder``: the decoder's = the encoder's."""
    shown = f"{default}; the decoder's: the encoder's" if follows_encoder else default
    help = f"{help} (default: {shown}; presets may differ)"
    return field(default=default, metadata={"help": help, "follows_encoder": follows_encoder})


@dataclass
class SideConfig(FairseqDataclass):
    """The options of one side, ``--encoder-X`` / ``--decoder-X`` on the command line."""

    embed_dim: int = option(512, "width d", True)
    layers: int = option(6, "maximum number of steps L (applications of the shared block)", True)
    normalize_before: bool = option(False, "pre-LayerNorm block (else post-LN)", True)
    halting: ChoiceEnum(HALTING_RULES + EXIT_RULES) = option(
        "stick-breaking", "halting rule of the recurrence; on the decoder also 'pabee' / "
        "'entropy': early exits through an off-ramp after every step (docs/exits.md)", True)
    halting_kv: ChoiceEnum(HALTING_KV) = option(
        "mixture", "what the self-attention keys and values at step l are computed from: the "
        "halted mixture S_{l-1} of the earlier steps (mixture; the SUT paper's Fig. 3 and "
        "Algorithm 1) or the un-halted states h_{l-1} (state; GUT's Algorithm 3 and GUTLB's "
        "Algorithm 4); the same under halting none and the exit rules, where S_l = h_l "
        "(docs/model.md#keys-and-values)", True)
    step_embedding: ChoiceEnum(STEP_EMBEDDINGS) = option(
        "none", "UT step embedding added before every step: the sinusoid TE(l) of the step "
        "(timestep), or PE(position) + TE(l) instead of the input positions (coordinate)", True)
    chunk_size: int = option(0, "chunk-wise recurrence (TLB / GUTLB, docs/chunked.md): run the "
                             "recurrence over chunks of G real tokens one after the other, each "
                             "reading a memory written by the earlier chunks (0 = off)")
    memory_slots: int = option(10, "memory slots k of the chunk-wise recurrence (0 = no "
                               "memory: independent chunks)")
    memory_update_layers: int = option(1, "unshared write blocks U of the memory update")
    chunk_positions: ChoiceEnum(CHUNK_POSITIONS) = option(
        "local", "sinusoidal input positions of a chunked side: restart at 0 in every chunk "
        "(local) or count the real tokens of the sequence (global)")


@dataclass
class SUTConfig(FairseqDataclass):
    """Every option of the model (module docstring); shapes and symbols: docs/model.md."""

    encoder: SideConfig = field(default_factory=SideConfig)
    decoder: SideConfig = field(default_factory=SideConfig)
    share_all_embeddings: bool = option(
        False, "share encoder, decoder and output embeddings (needs a joined dictionary)")
    share_decoder_input_output_embed: bool = option(
        False, "share decoder input and output embeddings")
    activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = option(
        "gelu", "activation of the feed-forward experts")
    # mixture of multi-head attention (E, k, H, D, W)
    att_experts: int = option(24, "attention experts E (1 = dense)")
    att_topk: int = option(4, "attention experts per query k")
    att_heads: int = option(4, "heads per attention expert H")
    att_head_dim: int = option(64, "dimension per head D")
    rel_pos: ChoiceEnum(REL_POS) = option(
        "clipped", "relative position term in self-attention: clipped learned embeddings "
        "(window --rel-window), T5 bucketed bias, or none")
    rel_window: int = option(64, "relative positions: offsets clipped to [-W, W] (2W+1 "
                             "embeddings per head)")
    # mixture of feed-forward experts (E, k, D)
    ffd_experts: int = option(24, "feed-forward experts E (1 = dense)")
    ffd_topk: int = option(4, "feed-forward experts per position k")
    ffd_hidden_dim: int = option(512, "hidden size D of each expert")
    # routers
    router_hidden_dim: int = option(0, "hidden width of the MLP routers (0 = the model width d)")
    gating_dropout: float = option(0.0, "dropout on the routers' hidden activations")
    sample_topk: int = option(0, "during training, sample N of the k experts from the router "
                              "distribution instead of taking the top ones (sut_big: 1)")
    # halting
    halting_threshold: float = option(
        0.999, "α_thresh in (0, 1]: a position stops once its cumulative halting probability "
        "reaches it; change after training with --model-overrides \"{'halting_threshold': 0.8}\"")
    halting_transition: bool = option(
        False, "the halting unit reads the last transition [x(h_{l-2}); x(h_{l-1})] (GUT); "
        "with stick-breaking or global-mean")
    gated_ffn: bool = option(False, "GUT gate: h_l = G * block(h) + (1 - G) * h_{l-1}, "
                             "G = sigmoid(MLP(LN(attention output)))")
    halting_dropout: float = option(0.0, "dropout inside the halting unit's MLP")
    halting_bias_init: float = option(
        0.0, "initial bias B of the halting unit's output layer: â = sigmoid(B) at every "
        "position at initialisation (0: â = 0.5, the stick-breaking weights of steps 1, 2, 3 "
        "... start at 1/2, 1/4, 1/8 ...; negative B spreads them over the later steps)")
    exit_patience: int = option(3, "pabee: exit once the off-ramps' argmax has stayed unchanged P "
                                "times in a row (earliest exit after step P+1; 0 = never); change "
                                "after training with --model-overrides \"{'exit_patience': 2}\"")
    exit_entropy: float = option(
        0.1, "entropy: exit once the off-ramp's entropy (nats) is below S (0 = never); change "
        "after training with --model-overrides \"{'exit_entropy': 0.1}\"")
    # hyper-modules (Hyper-UT, docs/hyper_ut.md)
    hyper_modules: int = option(
        0, "Hyper-UT: compose the weights of the chosen block components per example "
        "(encoder) / per token (decoder) and per step as a soft mixture of M weight embeddings "
        "(0 = off; needs dense experts)")
    hyper_embed_dim: int = option(128, "width d_e of the weight embeddings (the generator of a "
                                  "component has d_out·d_in·d_e weights)")
    hyper_key_dim: int = option(0, "width d_k of the module keys of the attention router "
                                "(0 = the model width d)")
    hyper_router_temp: float = option(1.0, "temperature τ of the hyper-module router's softmax")
    hyper_components: str = option(
        "qkv,out,ffn", "comma list of the components made hyper-modules: qkv (self-attention "
        "query/key/value projections), out (self-attention output projection), ffn (both "
        "feed-forward maps)")
    # chunk-wise recurrence (TLB / GUTLB, docs/chunked.md); per side: SideConfig
    tlb_encoder_out: ChoiceEnum(TLB_ENCODER_OUT) = option(
        "both", "with --encoder-chunk-size: what the decoder's cross-attention reads: the chunk "
        "outputs (tokens), LN(M^N) of the final memory (memory), or both on the key axis")
    tlb_memory_reset: bool = option(
        False, "test-time control: every chunk reads the initial memory M^0 (set after "
        "training with --model-overrides \"{'tlb_memory_reset': True}\")")
    tlb_unshared: bool = option(
        False, "with --encoder-chunk-size: each of the encoder's L steps per chunk runs its own "
        "block (the TLB paper's Algorithm 2: L unshared layers, L times the block's "
        "parameters) instead of one block shared by the steps (docs/chunked.md#unshared-steps)")
    # execution
    compile_step: bool = option(False, "run each side's recurrence step as one torch.compile "
                                "graph (docs/performance.md#compiled-steps): the full forward of "
                                "training and validation; chunk-wise, hyper-module and early-exit "
                                "sides and incremental decoding keep the eager step")
    compile_loop: bool = option(
        False, "like --compile-step, but all L steps of a side as one compiled graph "
        "(unrolled, no host read between steps, no early exit; exact: steps after every "
        "position halted change nothing); meant for GPUs (docs/performance.md#compiled-steps)")
    flex_attention: bool = option(
        False, "on CUDA, the self-attention of every step as one FlexAttention kernel, the "
        "relative term and the masks inside it (docs/gpu-step.md#flexattention); needs "
        "--attention-dropout 0; a CPU runs the usual attention")
    # regularisation and positions
    dropout: float = option(0.1, "dropout on sub-layer outputs")
    attention_dropout: float = option(0.0, "dropout on attention weights")
    activation_dropout: float = option(0.0, "dropout after the feed-forward activation")
    max_source_positions: int = option(DEFAULT_MAX_POSITIONS, "longest source")
    max_target_positions: int = option(DEFAULT_MAX_POSITIONS, "longest target")

    def __getattr__(self, name: str):
        """Flat names of the side options: ``cfg.encoder_layers`` is ``cfg.encoder.layers``."""
        side, _, rest = name.partition("_")
        if side in SIDES and rest in SIDE_FIELDS and side in self.__dict__:
            return getattr(self.__dict__[side], rest)
        raise AttributeError(f"{type(self).__name__} has no option {name!r}")

    @classmethod
    def from_namespace(cls, args) -> "SUTConfig":
        """From filled flat options (argparse's, a checkpoint's or hydra's ``DictConfig``)."""
        sides = {side: SideConfig(**{f: getattr(args, f"{side}_{f}") for f in SIDE_FIELDS})
                 for side in SIDES}
        shared = {f.name: getattr(args, f.name) for f in options(cls) if f.name not in SIDES}
        return cls(**sides, **shared)


def options(cls) -> list:
    """The dataclass's option fields (not FairseqDataclass's ``_name``)."""
    return [f for f in fields(cls) if not f.name.startswith("_")]


SIDE_FIELDS = tuple(f.name for f in options(SideConfig))


def flat_defaults() -> Dict[str, Any]:
    """Flat option -> ``--arch sut_transformer``'s default (not the decoder's that follow the
    encoder)."""
    shared = {f.name: f.default for f in options(SUTConfig) if f.default is not MISSING}
    sides = {f"{side}_{f.name}": f.default for f in options(SideConfig) for side in SIDES
             if side == "encoder" or not f.metadata["follows_encoder"]}
    return {**shared, **sides}


BASE_DEFAULTS = flat_defaults()
#: decoder option -> the encoder option whose value it takes by default
DECODER_FOLLOWS_ENCODER = {f"decoder_{f.name}": f"encoder_{f.name}" for f in options(SideConfig)
                           if f.metadata["follows_encoder"]}
