"""``sut_transformer``: the Sparse / dense Universal Transformer encoder-decoder.

One shared SUT block per side applied up to L = ``--encoder-layers`` /
``--decoder-layers`` times under a halting rule (``--encoder-halting`` /
``--decoder-halting``); with ``--encoder-chunk-size`` / ``--decoder-chunk-size`` a side
runs that recurrence chunk by chunk with a memory between chunks (TLB / GUTLB,
docs/chunked.md). Shapes: B batch, T / S target / source length, d width, H heads of size
D per expert, L maximum steps.
"""
import functools
import logging
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from fairseq import utils
from fairseq.models import (
    FairseqEncoder,
    FairseqEncoderDecoderModel,
    FairseqIncrementalDecoder,
    register_model,
    register_model_architecture,
)
from fairseq.modules import LayerNorm, PositionalEmbedding

from ..modules import chunk_cache
from ..modules.accounting import StepMeter, register_for_exit_summary
from ..modules.chunked_recurrence import (
    ChunkedHaltingResult,
    ChunkLayout,
    StepCap,
    chunked_recurrence,
    local_positions,
)
from ..modules.decoder_cache import BufferedKeyCache, CrossKV, DecoderState
from ..modules.dropout import Dropout
from ..modules.exits import EXIT_RULES, ExitHalting
from ..modules.halting import HALTING_RULES, build_halting
from ..modules.memory import ChunkMemory
from ..modules.recurrence import (
    HALTING_KV,
    RecurrenceStep,
    SideRecurrence,
    StepInputs,
    build_compiled,
    unsupported,
)
from ..modules.step_embedding import STEP_EMBEDDINGS, build_step_embedding
from ..modules.sut_block import SUTBlock
from .architectures import BASE_DEFAULTS, DECODER_FOLLOWS_ENCODER, PRESETS, base_architecture
from .validation import CHUNK_POSITIONS, TLB_ENCODER_OUT, validate_args

logger = logging.getLogger(__name__)


@register_model("sut_transformer")
class SUTTransformerModel(FairseqEncoderDecoderModel):
    """Sparse Universal Transformer (Tan et al., 2023); E = k = 1 gives the dense UT."""

    @staticmethod
    def add_args(parser):
        # fmt: off
        # sizes
        parser.add_argument("--encoder-embed-dim", type=int, metavar="N", help="encoder width d")
        parser.add_argument("--decoder-embed-dim", type=int, metavar="N", help="decoder width d")
        parser.add_argument("--encoder-layers", type=int, metavar="L",
                            help="maximum number of encoder steps (applications of the shared block)")
        parser.add_argument("--decoder-layers", type=int, metavar="L",
                            help="maximum number of decoder steps (applications of the shared block)")
        parser.add_argument("--share-all-embeddings", action="store_true",
                            help="share encoder, decoder and output embeddings (needs a joined dictionary)")
        parser.add_argument("--share-decoder-input-output-embed", action="store_true",
                            help="share decoder input and output embeddings")
        parser.add_argument("--encoder-normalize-before", action="store_true",
                            help="pre-LayerNorm encoder block (default: post-LN)")
        parser.add_argument("--decoder-normalize-before", action="store_true",
                            help="pre-LayerNorm decoder block (default: post-LN)")
        parser.add_argument("--activation-fn", choices=utils.get_available_activation_fns(),
                            help="activation of the feed-forward experts")
        # mixture of multi-head attention (E, k, H, D, W)
        parser.add_argument("--att-experts", type=int, metavar="E", help="attention experts E (1 = dense)")
        parser.add_argument("--att-topk", type=int, metavar="K", help="attention experts per query k")
        parser.add_argument("--att-heads", type=int, metavar="H", help="heads per attention expert H")
        parser.add_argument("--att-head-dim", type=int, metavar="D", help="dimension per head D")
        parser.add_argument("--rel-pos", choices=["clipped", "t5", "none"],
                            help="relative position term in self-attention: clipped learned "
                            "embeddings (window --rel-window), T5 bucketed bias, or none")
        parser.add_argument("--rel-window", type=int, metavar="W",
                            help="relative positions: offsets clipped to [-W, W] (2W+1 embeddings per head)")
        # mixture of feed-forward experts (E, k, D)
        parser.add_argument("--ffd-experts", type=int, metavar="E", help="feed-forward experts E (1 = dense)")
        parser.add_argument("--ffd-topk", type=int, metavar="K", help="feed-forward experts per position k")
        parser.add_argument("--ffd-hidden-dim", type=int, metavar="D", help="hidden size D of each expert")
        # routers
        parser.add_argument("--router-hidden-dim", type=int, metavar="N",
                            help="hidden width of the MLP routers (0 = the model width d)")
        parser.add_argument("--gating-dropout", type=float, metavar="P",
                            help="dropout on the routers' hidden activations")
        parser.add_argument("--sample-topk", type=int, metavar="N",
                            help="during training, sample N of the k experts from the router "
                            "distribution instead of taking the top ones (sut_big: 1)")
        # halting
        parser.add_argument("--encoder-halting", choices=HALTING_RULES,
                            help="halting rule of the encoder recurrence")
        parser.add_argument("--decoder-halting", choices=HALTING_RULES + EXIT_RULES,
                            help="halting rule of the decoder recurrence; 'pabee' / 'entropy': "
                            "early exits through an off-ramp after every step (docs/exits.md)")
        for side in ("encoder", "decoder"):
            parser.add_argument(f"--{side}-halting-kv", choices=HALTING_KV,
                                help=f"what the {side}'s self-attention keys and values at step l "
                                "are computed from: the halted mixture S_{l-1} of the earlier "
                                "steps (mixture; the SUT paper's Fig. 3 and Algorithm 1) or the "
                                "un-halted states h_{l-1} (state; GUT's Algorithm 3 and GUTLB's "
                                "Algorithm 4); the same under --*-halting none and the exit rules, "
                                "where S_l = h_l (docs/model.md#keys-and-values)")
        parser.add_argument("--exit-patience", type=int, metavar="P",
                            help="pabee: exit once the off-ramps' argmax has stayed unchanged "
                            "P times in a row (earliest exit after step P+1; 0 = never); change "
                            "after training with "
                            "--model-overrides \"{'exit_patience': 2}\"")
        parser.add_argument("--exit-entropy", type=float, metavar="S",
                            help="entropy: exit once the off-ramp's entropy (nats) is below S "
                            "(0 = never); change after training with "
                            "--model-overrides \"{'exit_entropy': 0.1}\"")
        parser.add_argument("--halting-threshold", type=float, metavar="A",
                            help="α_thresh in (0, 1]: a position stops once its cumulative halting "
                            "probability reaches it; change after training with "
                            "--model-overrides \"{'halting_threshold': 0.8}\"")
        parser.add_argument("--halting-transition", action="store_true",
                            help="the halting unit reads the last transition [x(h_{l-2}); "
                            "x(h_{l-1})] (GUT); with stick-breaking or global-mean")
        parser.add_argument("--gated-ffn", action="store_true",
                            help="GUT gate: h_l = G * block(h) + (1 - G) * h_{l-1}, "
                            "G = sigmoid(MLP(LN(attention output)))")
        parser.add_argument("--halting-dropout", type=float, metavar="P",
                            help="dropout inside the halting unit's MLP")
        parser.add_argument("--halting-bias-init", type=float, metavar="B",
                            help="initial bias of the halting unit's output layer: â = sigmoid(B) "
                            "at every position at initialisation (0: â = 0.5, the stick-breaking "
                            "weights of steps 1, 2, 3 ... start at 1/2, 1/4, 1/8 ...; negative B "
                            "spreads them over the later steps)")
        parser.add_argument("--encoder-step-embedding", choices=STEP_EMBEDDINGS,
                            help="UT step embedding added before every encoder step: the "
                            "sinusoid TE(l) of the step (timestep), or PE(position) + TE(l) "
                            "instead of the input positions (coordinate)")
        parser.add_argument("--decoder-step-embedding", choices=STEP_EMBEDDINGS,
                            help="UT step embedding added before every decoder step")
        # hyper-modules (Hyper-UT, docs/hyper_ut.md)
        parser.add_argument("--hyper-modules", type=int, metavar="M",
                            help="Hyper-UT: compose the weights of the chosen block components "
                            "per example (encoder) / per token (decoder) and per step as a soft "
                            "mixture of M weight embeddings (0 = off; needs dense experts)")
        parser.add_argument("--hyper-embed-dim", type=int, metavar="N",
                            help="width d_e of the weight embeddings (the generator of a "
                            "component has d_out·d_in·d_e weights)")
        parser.add_argument("--hyper-key-dim", type=int, metavar="N",
                            help="width d_k of the module keys of the attention router "
                            "(0 = the model width d)")
        parser.add_argument("--hyper-router-temp", type=float, metavar="T",
                            help="temperature τ of the hyper-module router's softmax")
        parser.add_argument("--hyper-components", type=str, metavar="LIST",
                            help="comma list of the components made hyper-modules: qkv "
                            "(self-attention query/key/value projections), out (self-attention "
                            "output projection), ffn (both feed-forward maps)")
        # chunk-wise recurrence (TLB / GUTLB, docs/chunked.md)
        for side in ("encoder", "decoder"):
            parser.add_argument(f"--{side}-chunk-size", type=int, metavar="G",
                                help=f"chunk-wise recurrence on the {side}: run the recurrence "
                                "over chunks of G real tokens one after the other, each reading a "
                                "memory written by the earlier chunks (0 = off)")
            parser.add_argument(f"--{side}-memory-slots", type=int, metavar="K",
                                help=f"memory slots k of the {side}'s chunk-wise recurrence "
                                "(0 = no memory: independent chunks)")
            parser.add_argument(f"--{side}-memory-update-layers", type=int, metavar="U",
                                help=f"unshared write blocks U of the {side}'s memory update")
            parser.add_argument(f"--{side}-chunk-positions", choices=CHUNK_POSITIONS,
                                help="sinusoidal input positions: restart at 0 in every chunk "
                                "(local) or count the real tokens of the sequence (global)")
        parser.add_argument("--tlb-encoder-out", choices=TLB_ENCODER_OUT,
                            help="with --encoder-chunk-size: what the decoder's cross-attention "
                            "reads: the chunk outputs (tokens), LN(M^N) of the final memory "
                            "(memory), or both on the key axis")
        parser.add_argument("--tlb-memory-reset", action="store_true",
                            help="test-time control: every chunk reads the initial memory M^0 "
                            "(set after training with --model-overrides "
                            "\"{'tlb_memory_reset': True}\")")
        parser.add_argument("--tlb-unshared", action="store_true",
                            help="with --encoder-chunk-size: each of the encoder's L steps per "
                            "chunk runs its own block (the TLB paper's Algorithm 2: L unshared "
                            "layers, L times the block's parameters) instead of one block "
                            "shared by the steps (docs/chunked.md#unshared-steps)")
        # execution
        parser.add_argument("--compile-step", action="store_true",
                            help="run each side's recurrence step as one torch.compile graph "
                            "(docs/performance.md#compiled-steps): the full forward of training "
                            "and validation; chunk-wise, hyper-module and early-exit sides and "
                            "incremental decoding keep the eager step")
        parser.add_argument("--compile-loop", action="store_true",
                            help="like --compile-step, but all L steps of a side as one compiled "
                            "graph (unrolled, no host read between steps, no early exit; exact: "
                            "steps after every position halted change nothing); meant for GPUs "
                            "(docs/performance.md#compiled-steps)")
        # regularisation and positions
        parser.add_argument("--dropout", type=float, metavar="P", help="dropout on sub-layer outputs")
        parser.add_argument("--attention-dropout", type=float, metavar="P", help="dropout on attention weights")
        parser.add_argument("--activation-dropout", type=float, metavar="P",
                            help="dropout after the feed-forward activation")
        parser.add_argument("--max-source-positions", type=int, metavar="N", help="longest source")
        parser.add_argument("--max-target-positions", type=int, metavar="N", help="longest target")
        # fmt: on
        for action in parser._group_actions if hasattr(parser, "_group_actions") else parser._actions:
            if action.dest in BASE_DEFAULTS and action.help:
                action.help += f" (default: {BASE_DEFAULTS[action.dest]}; presets may differ)"
            elif action.dest in DECODER_FOLLOWS_ENCODER and action.help:
                action.help += f" (default: as --{DECODER_FOLLOWS_ENCODER[action.dest].replace('_', '-')})"

    @classmethod
    def build_model(cls, args, task):
        base_architecture(args)
        validate_args(args)
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        if args.share_all_embeddings:
            if src_dict != tgt_dict:
                raise ValueError("--share-all-embeddings requires a joined dictionary "
                                 "(fairseq-preprocess --joined-dictionary)")
            encoder_embed = build_embedding(src_dict, args.encoder_embed_dim)
            decoder_embed = encoder_embed
            args.share_decoder_input_output_embed = True
        else:
            encoder_embed = build_embedding(src_dict, args.encoder_embed_dim)
            decoder_embed = build_embedding(tgt_dict, args.decoder_embed_dim)
        encoder = SUTEncoder(args, src_dict, encoder_embed)
        decoder = SUTDecoder(args, tgt_dict, decoder_embed)
        model = cls(encoder, decoder)
        register_for_exit_summary(model.step_meter)
        return model

    def __init__(self, encoder, decoder):
        super().__init__(encoder, decoder)
        self.step_meter = StepMeter({"enc": expert_slots(encoder.block), "dec": expert_slots(decoder.block)})
        encoder.step_meter = decoder.step_meter = self.step_meter

    def set_halting_threshold(self, threshold: float) -> None:
        """Change α_thresh of both sides after training (what --model-overrides does at load)."""
        for halting in (self.encoder.halting, self.decoder.halting):
            if hasattr(halting, "unit"):
                from ..modules.halting import check_threshold

                check_threshold(threshold)
                halting.threshold = threshold


# The ``--arch`` presets (models/architectures.py), registered once the model is.
for _arch, _preset in PRESETS.items():
    register_model_architecture("sut_transformer", _arch)(_preset)
del _arch, _preset


def expert_slots(block) -> int:
    """Expert rows one executed (position, step) costs: Σ over expert layers of k (a
    hyper-module sub-layer, which has no expert router, counts 1)."""
    layers = [block.self_attn, block.cross_attn, block.ffd]
    return sum(m.router.top_k if hasattr(m, "router") else 1 for m in layers if m is not None)


def build_embedding(dictionary, dim: int) -> nn.Embedding:
    """Token embedding N(0, d^-1/2), zero padding row (as fairseq's transformer)."""
    emb = nn.Embedding(len(dictionary), dim, padding_idx=dictionary.pad())
    nn.init.normal_(emb.weight, mean=0, std=dim ** -0.5)
    nn.init.constant_(emb.weight[dictionary.pad()], 0)
    return emb


def init_recurrent_side(side: nn.Module, args, embed_tokens: nn.Embedding, decoder: bool) -> None:
    """What the encoder and the decoder share: scaled token embeddings + sinusoidal
    positions, dropout, the shared block, the halting rule, the recurrence (``recurrence``:
    the step with its key/value source and Hyper-UT mixture, ``modules/recurrence.py``),
    (pre-LN) the final norm and the compiled step (``--compile-step``)."""
    prefix = "decoder" if decoder else "encoder"
    d = getattr(args, f"{prefix}_embed_dim")
    normalize_before = getattr(args, f"{prefix}_normalize_before")
    max_positions = args.max_target_positions if decoder else args.max_source_positions
    side.padding_idx = embed_tokens.padding_idx
    side.num_steps = getattr(args, f"{prefix}_layers")
    side.embed_tokens = embed_tokens
    side.embed_scale = d ** 0.5
    side.embed_positions = PositionalEmbedding(max_positions, d, side.padding_idx)
    side.dropout = Dropout(args.dropout)
    side.block = SUTBlock(args, decoder=decoder)
    # with a single step nothing is ever decided: no halting unit (it would get no
    # gradient, which PyTorch DDP rejects)
    rule = getattr(args, f"{prefix}_halting") if side.num_steps > 1 else "none"
    if rule in EXIT_RULES:
        side.halting = ExitHalting(rule, d, side.num_steps, args.exit_patience, args.exit_entropy)
    else:
        side.halting = build_halting(rule, d, args.halting_dropout,
                                     args.halting_threshold, normalize_before,
                                     transition=args.halting_transition, causal=decoder,
                                     bias_init=args.halting_bias_init)
    side.step_embedding = build_step_embedding(getattr(args, f"{prefix}_step_embedding"), d)
    side.kv_from_state = getattr(args, f"{prefix}_halting_kv") == "state"
    blocks = [side.block]
    if not decoder and args.tlb_unshared:  # steps 2..L's own blocks (step 1 runs ``block``)
        side.later_blocks = nn.ModuleList(SUTBlock(args, decoder=False)
                                          for _ in range(side.num_steps - 1))
        blocks += list(side.later_blocks)
    side.recurrence = SideRecurrence(RecurrenceStep(blocks, side.halting, side.step_embedding,
                                                    side.kv_from_state, decoder), side.num_steps)
    side.final_norm = LayerNorm(d) if normalize_before else None
    init_chunks(side, args, prefix, d)
    side.compiled_step = None
    if args.compile_step or args.compile_loop:
        reasons = unsupported(args, prefix)
        if reasons:
            logger.warning("--compile-step: the %s keeps the eager step (not covered: %s)",
                           prefix, ", ".join(reasons))
        else:
            side.compiled_step = build_compiled(
                side.recurrence.step, prefix, max_steps=side.num_steps if args.compile_loop else None)


def run_recurrence(side: nn.Module, x: torch.Tensor, inputs: StepInputs, rule=None, **options):
    """The side's recurrence over h_0 = x (B, T, d) (``SideRecurrence.run``: compiled in a
    full forward when ``--compile-step`` covers the side; ``options``: ``on_early_exit``,
    ``prefix_in``). Returns S_L, the HaltingResult and the final HaltingState."""
    return side.recurrence.run(x, inputs, rule, compiled=side.compiled_step, **options)


def step_embedding_table(side: nn.Module, like: torch.Tensor) -> Optional[torch.Tensor]:
    """TE(1..L) (L, d) of the side's step embedding, or None."""
    emb = side.step_embedding
    return None if emb is None else emb.table(side.num_steps, like)


def init_chunks(side: nn.Module, args, prefix: str, d: int) -> None:
    """Chunk-wise recurrence (docs/chunked.md): chunk size g (0 = off), positions, the
    memory (M^0 and its update; the block holds the memory attention), the reset control,
    and GUTLB's step cap (global-mean halting: at most min(L, n_c + 1) steps)."""
    side.chunk_size = getattr(args, f"{prefix}_chunk_size")
    side.memory = None
    if not side.chunk_size:
        return
    side.chunk_local_positions = getattr(args, f"{prefix}_chunk_positions") == "local"
    side.memory_reset = bool(args.tlb_memory_reset)
    side.cap_steps = getattr(side.halting, "rule", None) == "global-mean"
    slots = getattr(args, f"{prefix}_memory_slots")
    if slots > 0:
        reads_out = prefix == "encoder" and args.tlb_encoder_out != "tokens"
        side.memory = ChunkMemory(d, slots, getattr(args, f"{prefix}_memory_update_layers"),
                                  args.att_heads, args.att_head_dim, args.dropout,
                                  args.attention_dropout, args.activation_dropout,
                                  out_norm=reads_out)


def chunk_positions(side: nn.Module, tokens: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Sinusoidal input positions (B, T, d) of a chunked side: the token's slot in its chunk
    (``local``) or its index among the real tokens (``global``, fairseq's own)."""
    if not side.chunk_local_positions:
        return side.embed_positions(tokens)
    return local_positions(side.embed_positions, slot, tokens.ne(side.padding_idx), side.chunk_size)


class ChunkSteps:
    """``(C_0, real_c, M^c, rule) -> (S_L, HaltingResult, state)`` for
    ``chunked_recurrence``: the side's recurrence over one chunk (keys of the frozen rows
    kept), reading the memory with keys and values of M^c projected once per chunk, and
    the side's other block inputs (``inputs``: the decoder's cross-attention keys, values
    and mask)."""

    def __init__(self, side: nn.Module, **inputs):
        self.side, self.inputs = side, inputs

    def __call__(self, x: torch.Tensor, real: torch.Tensor, M: Optional[torch.Tensor], rule):
        memory_kv = None if M is None else self.side.recurrence.step.memory_kv(M)
        inputs = StepInputs(self_padding_mask=~real, real=real, memory_kv=memory_kv, **self.inputs)
        return self.side.recurrence.run(x, inputs, rule)


class SUTEncoder(FairseqEncoder):
    def __init__(self, args, dictionary, embed_tokens: nn.Embedding):
        super().__init__(dictionary)
        self.max_source_positions = args.max_source_positions
        init_recurrent_side(self, args, embed_tokens, decoder=False)
        self.tlb_encoder_out = args.tlb_encoder_out

    def forward(self, src_tokens: torch.Tensor, src_lengths: Optional[torch.Tensor] = None,
                return_all_hiddens: bool = False):
        """src_tokens: (B, S). Returns fairseq's encoder-out dict; ``encoder_out`` is
        [S_L as (S, B, d)], ``halting`` is [HaltingResult]."""
        if self.chunk_size:
            return self.forward_chunks(src_tokens, src_lengths)
        pad = src_tokens.eq(self.padding_idx)
        emb = self.step_embedding
        positions = self.embed_positions(src_tokens)
        x = self.embed_scale * self.embed_tokens(src_tokens) + (
            positions if emb is None else emb.input_positions(positions))
        x = self.dropout(x)

        coords = None if emb is None else emb.positions(src_tokens, self.padding_idx, x)
        inputs = StepInputs(self_padding_mask=pad, real=~pad, coords=coords,
                            te_table=step_embedding_table(self, x))
        S, halting, _ = run_recurrence(self, x, inputs)
        if not self.training and getattr(self, "step_meter", None) is not None:
            self.step_meter.add("enc", halting)
        if self.final_norm is not None:
            S = self.final_norm(S)
        return {
            "encoder_out": [S.transpose(0, 1)],
            "encoder_padding_mask": [pad],
            "src_lengths": [] if src_lengths is None else [src_lengths],
            "halting": [halting],
        }

    def forward_chunks(self, src_tokens: torch.Tensor, src_lengths: Optional[torch.Tensor] = None):
        """Chunk-wise recurrence (docs/chunked.md). ``encoder_out`` is (S', B, d): the chunk
        outputs S_L (S' = S), LN_out(M^N) (S' = k) or both on the key axis (S' = S + k),
        as ``--tlb-encoder-out`` says; ``halting`` is [ChunkedHaltingResult]."""
        pad = src_tokens.eq(self.padding_idx)
        layout = ChunkLayout(~pad, self.chunk_size)
        x = self.embed_scale * self.embed_tokens(src_tokens) + chunk_positions(self, src_tokens, layout.slot)
        x = self.dropout(x)
        reads_out = self.memory is not None and self.tlb_encoder_out != "tokens"
        S, halting = chunked_recurrence(
            ChunkSteps(self), x, layout, self.halting, self.num_steps, self.memory,
            memory_reset=self.memory_reset, write_last=reads_out, cap_steps=self.cap_steps)
        if not self.training and getattr(self, "step_meter", None) is not None:
            self.step_meter.add("enc", halting)
        rows, masks = [], []
        if self.tlb_encoder_out != "memory":
            rows.append(S if self.final_norm is None else self.final_norm(S))
            masks.append(pad)
        if reads_out:
            rows.append(self.memory.output(halting.final_memory))
            masks.append(pad.new_zeros(pad.size(0), self.memory.slots))
        return {
            "encoder_out": [torch.cat(rows, 1).transpose(0, 1)],
            "encoder_padding_mask": [torch.cat(masks, 1)],
            "src_lengths": [] if src_lengths is None else [src_lengths],
            "halting": [halting],
        }

    def reorder_encoder_out(self, encoder_out: Dict[str, List], new_order: torch.Tensor):
        return {
            "encoder_out": [encoder_out["encoder_out"][0].index_select(1, new_order)],
            "encoder_padding_mask": [encoder_out["encoder_padding_mask"][0].index_select(0, new_order)],
            "src_lengths": [x.index_select(0, new_order) for x in encoder_out["src_lengths"]],
            "halting": encoder_out["halting"],
        }

    def max_positions(self):
        return self.max_source_positions


class SUTDecoder(FairseqIncrementalDecoder):
    def __init__(self, args, dictionary, embed_tokens: nn.Embedding):
        super().__init__(dictionary)
        self.max_target_positions = args.max_target_positions
        init_recurrent_side(self, args, embed_tokens, decoder=True)
        d = args.decoder_embed_dim
        self.output_projection = nn.Linear(d, len(dictionary), bias=False)
        if args.share_decoder_input_output_embed:
            self.output_projection.weight = embed_tokens.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0, std=d ** -0.5)

    def forward(self, prev_output_tokens: torch.Tensor, encoder_out=None,
                incremental_state=None, features_only: bool = False, **unused):
        """prev_output_tokens: (B, T). Returns logits (B, T, V) (or (B, 1, V) when
        incremental) and ``{"attn": [None], "inner_states": [...], "halting_encoder":
        HaltingResult, "halting_decoder": HaltingResult}``, plus ``"decoder_exits":
        ExitOutput`` with ``--decoder-halting pabee|entropy`` (an exited position's logits
        are its off-ramp's; ``features_only`` returns the frozen states, see ExitOutput)."""
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        if not features_only:
            x = self.output_layer(x)
            if extra.get("decoder_exits") is not None:  # exited positions emit their off-ramp
                x = extra["decoder_exits"].apply(x)
        return x, extra

    @property
    def caches_prefix_sums(self) -> bool:
        """Global-mean halting reads causal prefix sums over the earlier positions, which
        incremental decoding keeps in its cache (zero sums before the first position)."""
        return getattr(self.halting, "rule", None) == "global-mean"

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         **unused):
        if self.chunk_size:
            return self.chunk_features(prev_output_tokens, encoder_out, incremental_state)
        # positions of the whole prefix, then the last one when incremental: fairseq's
        # incremental positions count padding (wrong for left-padded prefixes)
        positions = self.embed_positions(prev_output_tokens)
        emb = self.step_embedding  # None unless --decoder-step-embedding
        coords = None if emb is None else emb.positions(prev_output_tokens, self.padding_idx, positions)
        # padding keys of self-attention over the whole prefix (B, T), incremental included:
        # the causal mask alone hides right padding, not left padding (--left-pad-target)
        key_pad = prev_output_tokens.eq(self.padding_idx)
        q_start = 0
        if incremental_state is not None:
            q_start = prev_output_tokens.size(1) - 1
            prev_output_tokens = prev_output_tokens[:, -1:]
            positions = positions[:, -1:]
            coords = None if coords is None else coords[:, -1:]
        real = prev_output_tokens.ne(self.padding_idx)
        x = self.embed_scale * self.embed_tokens(prev_output_tokens) + (
            positions if emb is None else emb.input_positions(positions))
        x = self.dropout(x)

        inputs = dict(self_padding_mask=key_pad, real=real, q_start=q_start, coords=coords,
                      te_table=step_embedding_table(self, x),
                      **self._cross_inputs(encoder_out, incremental_state))
        exits = isinstance(self.halting, ExitHalting)  # off-ramps read the output projection
        rule = self.halting.bind(self.output_projection.weight) if exits else self.halting
        if incremental_state is None:
            S, halting, state = run_recurrence(self, x, StepInputs(**inputs), rule)
        else:  # per step l: the earlier positions' keys/values (L, B, H, t, D) and prefix sums
            cache = self.decoder_state(incremental_state)
            prefix_in = cache.prefix
            if prefix_in is None and self.caches_prefix_sums:
                # the first position: zero sums, so that a position that halts early (the
                # early-exit hook) continues them for the steps it skipped
                prefix_in = chunk_cache.empty_prefix(x, self.num_steps)
            keys = BufferedKeyCache(cache.kv, q_start, prefix_in=prefix_in)
            # Hyper-UT: step l's (Σ h_{l-1}, count) over the earlier positions
            inputs = StepInputs(cache=keys, hyper_prefix_in=cache.hyper_prefix, **inputs)
            S, halting, state = run_recurrence(
                self, x, inputs, rule, prefix_in=keys.prefix_in,
                on_early_exit=functools.partial(self.recurrence.step.freeze, inputs=inputs))
        if not self.training and getattr(self, "step_meter", None) is not None:
            self.step_meter.add("dec", halting)
        if incremental_state is not None:
            cache.prefix = {**state.prefix_out, **keys.frozen_prefix} if state.prefix_out else None
            cache.hyper_prefix = inputs.hyper_prefix_out or None
        if self.final_norm is not None:
            S = self.final_norm(S)
        extra = {
            "attn": [None],
            "inner_states": [S.transpose(0, 1)],
            "halting_encoder": encoder_out["halting"][0] if "halting" in encoder_out else None,
            "halting_decoder": halting,
        }
        if exits:  # ExitOutput: exit steps, off-ramp logits, training states h_1..h_{L-1}
            extra["decoder_exits"] = state.output
        return S, extra

    def chunk_features(self, prev_output_tokens, encoder_out, incremental_state=None):
        """Chunk-wise recurrence (docs/chunked.md): position t attends causally within its
        chunk, reads the memory M^c of the completed chunks, then the encoder output."""
        cross = self._cross_inputs(encoder_out, incremental_state)
        if incremental_state is not None:
            S, halting = self.chunk_step(prev_output_tokens, self.decoder_state(incremental_state), cross)
        else:
            real = prev_output_tokens.ne(self.padding_idx)
            layout = ChunkLayout(real, self.chunk_size)
            x = self.embed_scale * self.embed_tokens(prev_output_tokens) + chunk_positions(
                self, prev_output_tokens, layout.slot)
            S, halting = chunked_recurrence(
                ChunkSteps(self, **cross), self.dropout(x), layout, self.halting,
                self.num_steps, self.memory, memory_reset=self.memory_reset,
                cap_steps=self.cap_steps, causal=True)
        if not self.training and getattr(self, "step_meter", None) is not None:
            self.step_meter.add("dec", halting)
        if self.final_norm is not None:
            S = self.final_norm(S)
        return S, {
            "attn": [None],
            "inner_states": [S.transpose(0, 1)],
            "halting_encoder": encoder_out["halting"][0] if "halting" in encoder_out else None,
            "halting_decoder": halting,
        }

    def chunk_step(self, prev_output_tokens, saved: DecoderState, cross):
        """One incremental decoding step of a chunked decoder: the new token (the last of
        ``prev_output_tokens``) against its chunk's cached keys and values (right-aligned,
        ``modules/chunk_cache.py``, kept in ``saved.chunk``) and the memory of the completed chunks. Returns S_L
        (B, 1, d) and a ``ChunkedHaltingResult`` whose per-chunk fields count the chunks the
        new tokens open and the block applications they add to their chunk."""
        g, L = self.chunk_size, self.num_steps
        token = prev_output_tokens[:, -1:]
        real = token.ne(self.padding_idx)  # (B, 1)
        x = self.embed_scale * self.embed_tokens(token)
        cache = saved.chunk
        if cache is None:
            cache = chunk_cache.start(x, L, self.block.self_attn.num_heads,
                                      self.block.self_attn.head_dim, g, self.memory,
                                      prefix=self.caches_prefix_sums)
        slot = cache["count"].unsqueeze(1)
        positions = (local_positions(self.embed_positions, slot, real, g) if self.chunk_local_positions
                     else self.embed_positions(prev_output_tokens)[:, -1:])
        x = self.dropout(x + positions)
        memory_kv = None
        if self.memory is not None:
            M = self.memory.begin(x) if self.memory_reset else cache["memory"]
            memory_kv = self.block.memory_attn.project_kv(M)
        # the new token after its chunk's earlier tokens (their keys/values cached per step)
        keys = chunk_cache.StepKeyCache(L, cache["self_k"], cache["self_v"], prefix_in=cache.get("prefix"))
        inputs = StepInputs(cache=keys, self_padding_mask=chunk_cache.key_padding(cache, g),
                            real=real, q_start=g - 1, memory_kv=memory_kv, **cross)
        rule = StepCap(self.halting, (slot + 2).clamp(max=L)) if self.cap_steps else self.halting
        S, halting, state = run_recurrence(
            self, x, inputs, rule, prefix_in=keys.prefix_in,
            on_early_exit=functools.partial(self.recurrence.step.freeze, inputs=inputs))
        prefix = None if keys.prefix_in is None else {**keys.prefix_in, **state.prefix_out,
                                                      **keys.frozen_prefix}
        saved.chunk, opened, raised = chunk_cache.advance(cache, keys.new_k, keys.new_v, S, real[:, 0],
                                                          halting.steps[:, 0], g, self.memory, prefix)
        return S, ChunkedHaltingResult(
            weights=halting.weights, expected_depth=halting.expected_depth, steps=halting.steps,
            real=halting.real, max_steps=L, chunk_real=opened.unsqueeze(1),
            chunk_depth=halting.expected_depth, chunk_steps=raised.unsqueeze(1), memories=[])

    def output_layer(self, features: torch.Tensor) -> torch.Tensor:
        return self.output_projection(features)

    # ---- incremental decoding state: one ``DecoderState`` (``modules/decoder_cache.py``)
    # under fairseq's incremental_state, reordered as one object ----
    def decoder_state(self, incremental_state) -> DecoderState:
        """This decoder's state in fairseq's ``incremental_state`` (made at the first call)."""
        state = self.get_incremental_state(incremental_state, "sut_state")
        if state is None:
            state = DecoderState(self.num_steps)
            self.set_incremental_state(incremental_state, "sut_state", state)
        return state

    def _cross_inputs(self, encoder_out, incremental_state) -> Dict[str, torch.Tensor]:
        """The block's cross-attention inputs: keys/values (B_kv, H, S, D) of the encoder
        output and its padding mask (B_kv, S); incremental decoding projects them at the
        first position, once per sentence under beam search (``CrossKV``)."""
        enc = encoder_out["encoder_out"][0].transpose(0, 1)  # (B, S, d_enc)
        enc_pad = encoder_out["encoder_padding_mask"][0]
        if incremental_state is None:
            k, v = self.block.cross_kv(enc)
            return dict(cross_k=k, cross_v=v, cross_padding_mask=enc_pad)
        state = self.decoder_state(incremental_state)
        if state.cross is None:
            state.cross = CrossKV.project(self.block, enc, enc_pad, getattr(self, "_beam_size", 1))
        cross = state.cross
        return dict(cross_k=cross.k, cross_v=cross.v, cross_padding_mask=cross.padding)

    def reorder_incremental_state(self, incremental_state, new_order: torch.Tensor):
        state = self.get_incremental_state(incremental_state, "sut_state")
        if state is not None:
            state.reorder(new_order)

    def max_positions(self):
        return self.max_target_positions
