"""``sut_transformer``: the Sparse / dense Universal Transformer encoder-decoder.

One shared SUT block per side applied up to L = ``--encoder-layers`` / ``--decoder-layers``
times under a halting rule, or chunk by chunk with a memory between chunks under
``--{encoder,decoder}-chunk-size`` (TLB / GUTLB, docs/chunked.md). Shapes: B batch, T / S
target / source length, d width, H heads of size D per expert, L maximum steps.

Each side is a ``RecurrentSide`` (``recurrent_side.py``); the encoder and decoder here add
fairseq's encoder-out dict, the output projection and the incremental state.
"""
import functools
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from fairseq import utils
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import (FairseqEncoder, FairseqEncoderDecoderModel, FairseqIncrementalDecoder,
                            register_model, register_model_architecture)
from fairseq.modules import SinusoidalPositionalEmbedding

from ..modules import chunk_cache
from ..modules.accounting import StepMeter, register_for_exit_summary
from ..modules.chunked_recurrence import ChunkedHaltingResult, StepCap, local_positions
from ..modules.decoder_cache import BufferedKeyCache, CrossKV, DecoderState, reorder_encoder_rows
from ..modules.exits import ExitHalting
from ..modules.halting import check_threshold
from ..modules.recurrence import StepInputs
from .architectures import PRESETS, base_architecture
from .config import SUTConfig
from .recurrent_side import RecurrentSide
from .validation import validate_args


@register_model("sut_transformer")
class SUTTransformerModel(FairseqEncoderDecoderModel):
    """Sparse Universal Transformer (Tan et al., 2023); E = k = 1 gives the dense UT."""

    @staticmethod
    def add_args(parser):
        """``SUTConfig``'s options, flat and with no argparse default (the preset fills them)."""
        gen_parser_from_dataclass(parser, SUTConfig(), delete_default=True, with_prefix="")

    @classmethod
    def build_model(cls, args, task):
        base_architecture(args)
        validate_args(args)
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        if args.share_all_embeddings:
            if src_dict != tgt_dict:
                raise ValueError("--share-all-embeddings requires a joined dictionary "
                                 "(fairseq-preprocess --joined-dictionary)")
            args.share_decoder_input_output_embed = True
        cfg = SUTConfig.from_namespace(args)
        encoder_embed = build_embedding(src_dict, cfg.encoder.embed_dim)
        decoder_embed = (encoder_embed if cfg.share_all_embeddings
                         else build_embedding(tgt_dict, cfg.decoder.embed_dim))
        model = cls(SUTEncoder(cfg, src_dict, encoder_embed), SUTDecoder(cfg, tgt_dict, decoder_embed))
        register_for_exit_summary(model.step_meter)
        return model

    def __init__(self, encoder, decoder):
        super().__init__(encoder, decoder)
        self.step_meter = StepMeter({"enc": expert_slots(encoder.side.block),
                                     "dec": expert_slots(decoder.side.block)})
        encoder.side.step_meter = decoder.side.step_meter = self.step_meter

    def set_beam_size(self, beam_size: int) -> None:
        """Called by fairseq's generator (``EnsembleModel.set_decoder_beam_size``, for beams
        of two or more): the incremental decoder keeps the encoder's keys and values once
        per sentence rather than once per beam row (``decoder_cache.CrossKV``)."""
        self.decoder.set_beam_size(beam_size)

    def set_halting_threshold(self, threshold: float) -> None:
        """Change α_thresh of both sides after training (what --model-overrides does at load)."""
        for halting in (self.encoder.side.halting, self.decoder.side.halting):
            if hasattr(halting, "unit"):
                check_threshold(threshold)
                halting.threshold = threshold


for _arch, _preset in PRESETS.items():
    register_model_architecture("sut_transformer", _arch)(_preset)
del _arch, _preset


def expert_slots(block) -> int:
    """Expert rows per executed (position, step): Σ over the layers of k (hyper-modules: 1)."""
    layers = [block.self_attn, block.cross_attn, block.ffd]
    return sum(m.router.top_k if hasattr(m, "router") else 1 for m in layers if m is not None)


def build_embedding(dictionary, dim: int) -> nn.Embedding:
    """Token embedding N(0, d^-1/2), zero padding row (as fairseq's transformer)."""
    emb = nn.Embedding(len(dictionary), dim, padding_idx=dictionary.pad())
    nn.init.normal_(emb.weight, mean=0, std=dim ** -0.5)
    nn.init.constant_(emb.weight[dictionary.pad()], 0)
    return emb


def meter(side: RecurrentSide, key: str, halting) -> None:
    """Count an evaluation forward's executed steps (``StepMeter``, the end-of-run summary)."""
    if not side.training and side.step_meter is not None:
        side.step_meter.add(key, halting)


def last_position(embed_positions: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``embed_positions(tokens)[:, -1:]`` (B, 1, d) for tokens (B, T): the last column's
    position counted over the real tokens of the prefix, only its row of the sinusoid table
    looked up (not the B x T rows of the whole prefix)."""
    if (not isinstance(embed_positions, SinusoidalPositionalEmbedding)
            or embed_positions.weights.size(0) < embed_positions.padding_idx + 1 + tokens.size(1)):
        return embed_positions(tokens)[:, -1:]  # (the module grows its table first)
    last = utils.make_positions(tokens, embed_positions.padding_idx)[:, -1]
    return embed_positions.weights.index_select(0, last).unsqueeze(1)


def encoder_out_dict(out: torch.Tensor, padding_mask: torch.Tensor, src_lengths, halting) -> dict:
    """fairseq's encoder-out dict of the output rows (B, S', d) and their mask (B, S')."""
    return {"encoder_out": [out.transpose(0, 1)], "encoder_padding_mask": [padding_mask],
            "src_lengths": [] if src_lengths is None else [src_lengths], "halting": [halting]}


class SUTEncoder(FairseqEncoder):
    def __init__(self, cfg: SUTConfig, dictionary, embed_tokens: nn.Embedding):
        super().__init__(dictionary)
        self.padding_idx = embed_tokens.padding_idx
        self.max_source_positions = cfg.max_source_positions
        self.side = RecurrentSide(cfg, cfg.encoder, embed_tokens, decoder=False,
                                  max_positions=cfg.max_source_positions)
        self.tlb_encoder_out = cfg.tlb_encoder_out

    def forward(self, src_tokens: torch.Tensor, src_lengths: Optional[torch.Tensor] = None,
                return_all_hiddens: bool = False):
        """src_tokens: (B, S). Returns fairseq's encoder-out dict; ``encoder_out`` is
        [S_L as (S, B, d)], ``halting`` is [HaltingResult]."""
        side = self.side
        if side.chunk_size:
            return self.forward_chunks(src_tokens, src_lengths)
        x, _, pad, real = side.inputs_of(src_tokens)
        emb = side.step_embedding
        coords = None if emb is None else emb.positions(src_tokens, self.padding_idx, x)
        inputs = StepInputs(self_padding_mask=pad, real=real, coords=coords,
                            te_table=side.step_embedding_table(x))
        S, halting, _ = side.run(x, inputs)
        meter(side, "enc", halting)
        return encoder_out_dict(side.output(S), pad, src_lengths, halting)

    def forward_chunks(self, src_tokens: torch.Tensor, src_lengths: Optional[torch.Tensor] = None):
        """Chunk-wise recurrence (docs/chunked.md). ``encoder_out`` is (S', B, d): the chunk
        outputs S_L (S' = S), LN_out(M^N) (S' = k) or both on the key axis (S' = S + k),
        as ``--tlb-encoder-out`` says; ``halting`` is [ChunkedHaltingResult]."""
        side = self.side
        pad = src_tokens.eq(self.padding_idx)
        reads_out = side.memory is not None and self.tlb_encoder_out != "tokens"
        S, halting = side.run_chunks(src_tokens, ~pad, {}, write_last=reads_out)
        meter(side, "enc", halting)
        rows, masks = [], []
        if self.tlb_encoder_out != "memory":
            rows.append(side.output(S))
            masks.append(pad)
        if reads_out:
            rows.append(side.memory.output(halting.final_memory))
            masks.append(pad.new_zeros(pad.size(0), side.memory.slots))
        return encoder_out_dict(torch.cat(rows, 1), torch.cat(masks, 1), src_lengths, halting)

    def reorder_encoder_out(self, encoder_out: Dict[str, List], new_order: torch.Tensor):
        """Row b of the result is row ``new_order[b]``; under beam search a reorder within
        the sentences copies nothing (``decoder_cache.reorder_encoder_rows``)."""
        return reorder_encoder_rows(encoder_out, new_order)

    def max_positions(self):
        return self.max_source_positions


class SUTDecoder(FairseqIncrementalDecoder):
    def __init__(self, cfg: SUTConfig, dictionary, embed_tokens: nn.Embedding):
        super().__init__(dictionary)
        self.padding_idx = embed_tokens.padding_idx
        self.max_target_positions = cfg.max_target_positions
        self.side = RecurrentSide(cfg, cfg.decoder, embed_tokens, decoder=True,
                                  max_positions=cfg.max_target_positions)
        d = cfg.decoder.embed_dim
        self.output_projection = nn.Linear(d, len(dictionary), bias=False)
        if cfg.share_decoder_input_output_embed:
            self.output_projection.weight = embed_tokens.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0, std=d ** -0.5)

    def forward(self, prev_output_tokens: torch.Tensor, encoder_out=None,
                incremental_state=None, features_only: bool = False, **unused):
        """prev_output_tokens: (B, T). Returns logits (B, T, V) ((B, 1, V) when incremental)
        and ``{"attn": [None], "inner_states": [...], "halting_encoder", "halting_decoder"}``,
        plus ``"decoder_exits": ExitOutput`` under an exit rule (an exited position's logits
        are its off-ramp's; ``features_only`` returns the frozen states, see ExitOutput)."""
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        if not features_only:
            x = self.output_layer(x)
            if extra.get("decoder_exits") is not None:  # exited positions emit their off-ramp
                x = extra["decoder_exits"].apply(x)
        return x, extra

    @property
    def caches_prefix_sums(self) -> bool:
        """Global-mean halting reads causal prefix sums, which incremental decoding caches."""
        return getattr(self.side.halting, "rule", None) == "global-mean"

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         **unused):
        side = self.side
        if side.chunk_size:
            S, halting = self.chunk_features(prev_output_tokens, encoder_out, incremental_state)
            S = side.output(S)
            return S, self._extra(S, encoder_out, halting)
        emb = side.step_embedding  # None unless --decoder-step-embedding
        q_start = 0
        if incremental_state is None:
            x, positions, key_pad, real = side.inputs_of(prev_output_tokens)
            coords = None if emb is None else emb.positions(prev_output_tokens, self.padding_idx, positions)
        else:
            # positions counted over the whole prefix, the last one's embedded: fairseq's
            # incremental positions count padding (wrong for left-padded prefixes)
            positions = last_position(side.embed_positions, prev_output_tokens)
            coords = None if emb is None else emb.positions(prev_output_tokens, self.padding_idx, positions)
            # padding keys of self-attention over the whole prefix (B, T): the causal mask
            # alone hides right padding, not left padding (--left-pad-target)
            key_pad = prev_output_tokens.eq(self.padding_idx)
            q_start = prev_output_tokens.size(1) - 1
            prev_output_tokens = prev_output_tokens[:, -1:]
            coords = None if coords is None else coords[:, -1:]
            real = prev_output_tokens.ne(self.padding_idx)
            x = side.dropout(side.embed(prev_output_tokens, positions))
        inputs = dict(self_padding_mask=key_pad, real=real, q_start=q_start, coords=coords,
                      te_table=side.step_embedding_table(x),
                      **self._cross_inputs(encoder_out, incremental_state))
        exits = isinstance(side.halting, ExitHalting)  # off-ramps read the output projection
        rule = side.halting.bind(self.output_projection.weight) if exits else side.halting
        if incremental_state is None:
            S, halting, state = side.run(x, StepInputs(**inputs), rule)
        else:  # per step l: the earlier positions' keys/values (L, B, H, t, D) and prefix sums
            cache = self.decoder_state(incremental_state)
            prefix_in = cache.prefix
            if prefix_in is None and self.caches_prefix_sums:
                # the first position: zero sums, so that a position that halts early (the
                # early-exit hook) continues them for the steps it skipped
                prefix_in = chunk_cache.empty_prefix(x, side.num_steps)
            keys = BufferedKeyCache(cache.kv, q_start, prefix_in=prefix_in)
            # Hyper-UT: step l's (Σ h_{l-1}, count) over the earlier positions
            inputs = StepInputs(cache=keys, hyper_prefix_in=cache.hyper_prefix, **inputs)
            S, halting, state = side.run(
                x, inputs, rule, prefix_in=keys.prefix_in,
                on_early_exit=functools.partial(side.recurrence.step.freeze, inputs=inputs))
            cache.prefix = {**state.prefix_out, **keys.frozen_prefix} if state.prefix_out else None
            cache.hyper_prefix = inputs.hyper_prefix_out or None
        meter(side, "dec", halting)
        S = side.output(S)
        extra = self._extra(S, encoder_out, halting)
        if exits:  # ExitOutput: exit steps, off-ramp logits, training states h_1..h_{L-1}
            extra["decoder_exits"] = state.output
        return S, extra

    @staticmethod
    def _extra(S, encoder_out, halting) -> dict:
        halting_encoder = encoder_out["halting"][0] if "halting" in encoder_out else None
        return {"attn": [None], "inner_states": [S.transpose(0, 1)],
                "halting_encoder": halting_encoder, "halting_decoder": halting}

    def chunk_features(self, prev_output_tokens, encoder_out, incremental_state=None):
        """Chunk-wise recurrence (docs/chunked.md): position t attends causally within its
        chunk, reads the memory M^c of the completed chunks, then the encoder output.
        Returns S_L and the ChunkedHaltingResult."""
        side = self.side
        cross = self._cross_inputs(encoder_out, incremental_state)
        if incremental_state is not None:
            S, halting = self.chunk_step(prev_output_tokens, self.decoder_state(incremental_state), cross)
        else:
            real = prev_output_tokens.ne(self.padding_idx)
            S, halting = side.run_chunks(prev_output_tokens, real, cross, causal=True)
        meter(side, "dec", halting)
        return S, halting

    def chunk_step(self, prev_output_tokens, saved: DecoderState, cross):
        """One incremental step of a chunked decoder: the new (last) token against its chunk's
        cached keys and values (``saved.chunk``, ``modules/chunk_cache.py``) and the memory of
        the completed chunks. Returns S_L (B, 1, d) and a ``ChunkedHaltingResult`` counting
        the chunks the new tokens open and the block applications they add to their chunk."""
        side = self.side
        g, L = side.chunk_size, side.num_steps
        token = prev_output_tokens[:, -1:]
        real = token.ne(self.padding_idx)  # (B, 1)
        x = side.embed_scale * side.embed_tokens(token)
        cache = saved.chunk
        if cache is None:
            cache = chunk_cache.start(x, L, side.block.self_attn.num_heads,
                                      side.block.self_attn.head_dim, g, side.memory,
                                      prefix=self.caches_prefix_sums)
        slot = cache["count"].unsqueeze(1)
        positions = (local_positions(side.embed_positions, slot, real, g) if side.chunk_local_positions
                     else side.embed_positions(prev_output_tokens)[:, -1:])
        x = side.dropout(x + positions)
        memory_kv = None
        if side.memory is not None:
            M = side.memory.begin(x) if side.memory_reset else cache["memory"]
            memory_kv = side.block.memory_attn.project_kv(M)
        # the new token after its chunk's earlier tokens (their keys/values cached per step)
        keys = chunk_cache.StepKeyCache(L, cache["self_k"], cache["self_v"], prefix_in=cache.get("prefix"))
        inputs = StepInputs(cache=keys, self_padding_mask=chunk_cache.key_padding(cache, g),
                            real=real, q_start=g - 1, memory_kv=memory_kv, **cross)
        rule = StepCap(side.halting, (slot + 2).clamp(max=L)) if side.cap_steps else side.halting
        S, halting, state = side.run(
            x, inputs, rule, prefix_in=keys.prefix_in,
            on_early_exit=functools.partial(side.recurrence.step.freeze, inputs=inputs))
        prefix = None if keys.prefix_in is None else {**keys.prefix_in, **state.prefix_out,
                                                      **keys.frozen_prefix}
        saved.chunk, opened, raised = chunk_cache.advance(cache, keys.new_k, keys.new_v, S, real[:, 0],
                                                          halting.steps[:, 0], g, side.memory, prefix)
        return S, ChunkedHaltingResult(
            weights=halting.weights, expected_depth=halting.expected_depth, steps=halting.steps,
            real=halting.real, max_steps=L, chunk_real=opened.unsqueeze(1),
            chunk_depth=halting.expected_depth, chunk_steps=raised.unsqueeze(1), memories=[])

    def output_layer(self, features: torch.Tensor) -> torch.Tensor:
        return self.output_projection(features)

    def decoder_state(self, incremental_state) -> DecoderState:
        """This decoder's ``DecoderState`` (``modules/decoder_cache.py``) in fairseq's
        ``incremental_state``, made at the first call and reordered as one object."""
        state = self.get_incremental_state(incremental_state, "sut_state")
        if state is None:
            state = DecoderState(self.side.num_steps)
            self.set_incremental_state(incremental_state, "sut_state", state)
        return state

    def _cross_inputs(self, encoder_out, incremental_state) -> Dict[str, torch.Tensor]:
        """The block's cross-attention inputs: keys/values (B_kv, H, S, D) of the encoder
        output and its padding mask (B_kv, S); incremental decoding projects them at the
        first position, once per sentence under beam search (``CrossKV``)."""
        enc = encoder_out["encoder_out"][0].transpose(0, 1)  # (B, S, d_enc)
        enc_pad = encoder_out["encoder_padding_mask"][0]
        if incremental_state is None:
            k, v = self.side.block.cross_kv(enc)
            return dict(cross_k=k, cross_v=v, cross_padding_mask=enc_pad)
        state = self.decoder_state(incremental_state)
        if state.cross is None:
            beam = getattr(self, "_beam_size", 1)
            state.cross = CrossKV.project(self.side.block, enc, enc_pad, beam)
        cross = state.cross
        return dict(cross_k=cross.k, cross_v=cross.v, cross_padding_mask=cross.padding)

    def reorder_incremental_state(self, incremental_state, new_order: torch.Tensor):
        state = self.get_incremental_state(incremental_state, "sut_state")
        if state is not None:
            state.reorder(new_order)

    def max_positions(self):
        return self.max_target_positions
