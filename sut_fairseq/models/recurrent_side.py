"""``RecurrentSide``: what the encoder and the decoder share, as one module built from the
model's ``SUTConfig`` and its own side's ``SideConfig``.

    x   = sqrt(d) · E[tokens] + PE(positions)       (or the step embedding's positions)
    S_L = the recurrence of the shared block over h_0 = dropout(x)   (modules/recurrence.py)
    out = LN(S_L) under pre-LN, else S_L

It holds the embeddings, the shared block (and ``--tlb-unshared``'s later blocks), the
halting rule, the step embedding, the final norm, the chunk memory and the recurrence.
"""
import logging
from typing import Optional

import torch
import torch.nn as nn
from fairseq.modules import LayerNorm, PositionalEmbedding

from ..compiler import CompiledFunction, mark_dynamic
from ..modules.chunked_recurrence import ChunkLayout, chunked_recurrence, local_positions
from ..modules.dropout import Dropout
from ..modules.exits import EXIT_RULES, ExitHalting
from ..modules.halting import build_halting
from ..modules.memory import ChunkMemory
from ..modules.recurrence import RecurrenceStep, SideRecurrence, StepInputs, build_compiled, unsupported
from ..modules.step_embedding import build_step_embedding
from ..modules.sut_block import SUTBlock
from .config import SideConfig, SUTConfig

logger = logging.getLogger(__name__)

#: the side's submodules, ``{encoder,decoder}.side.NAME`` in checkpoints (older ones:
#: ``{encoder,decoder}.NAME``, which ``upgrade_state_dict_named`` renames)
SIDE_MODULES = ("embed_tokens", "embed_positions", "block", "later_blocks", "halting",
                "step_embedding", "final_norm", "memory")


class RecurrentSide(nn.Module):
    """One side of the model (module docstring). ``decoder``: causal self-attention,
    cross-attention, causal halting decisions and the exit rules."""

    def __init__(self, cfg: SUTConfig, side: SideConfig, embed_tokens: nn.Embedding, decoder: bool,
                 max_positions: int):
        super().__init__()
        name = "decoder" if decoder else "encoder"
        d = side.embed_dim
        self.padding_idx = embed_tokens.padding_idx
        self.num_steps = side.layers
        self.embed_tokens = embed_tokens
        self.embed_scale = d ** 0.5
        self.embed_positions = PositionalEmbedding(max_positions, d, self.padding_idx)
        self.dropout = Dropout(cfg.dropout)
        self.block = SUTBlock(cfg, decoder=decoder)
        # with a single step nothing is ever decided: no halting unit (it would get no
        # gradient, which PyTorch DDP rejects)
        rule = side.halting if self.num_steps > 1 else "none"
        if rule in EXIT_RULES:
            self.halting = ExitHalting(rule, d, self.num_steps, cfg.exit_patience, cfg.exit_entropy)
        else:
            self.halting = build_halting(rule, d, cfg.halting_dropout, cfg.halting_threshold,
                                         side.normalize_before, transition=cfg.halting_transition,
                                         causal=decoder, bias_init=cfg.halting_bias_init)
        self.step_embedding = build_step_embedding(side.step_embedding, d)
        self.kv_from_state = side.halting_kv == "state"
        blocks = [self.block]
        if not decoder and cfg.tlb_unshared:  # steps 2..L's own blocks (step 1 runs ``block``)
            self.later_blocks = nn.ModuleList(SUTBlock(cfg, decoder=False)
                                              for _ in range(self.num_steps - 1))
            blocks += list(self.later_blocks)
        self.recurrence = SideRecurrence(RecurrenceStep(blocks, self.halting, self.step_embedding,
                                                        self.kv_from_state, decoder), self.num_steps)
        self.final_norm = LayerNorm(d) if side.normalize_before else None
        # chunk-wise recurrence (docs/chunked.md; g = 0: off): the memory M^0 and its update (the
        # block holds the memory attention); GUTLB's cap of min(L, n_c + 1) steps per chunk
        self.chunk_size = side.chunk_size
        self.memory = None
        if self.chunk_size:
            self.chunk_local_positions = side.chunk_positions == "local"
            self.memory_reset = bool(cfg.tlb_memory_reset)
            self.cap_steps = getattr(self.halting, "rule", None) == "global-mean"
            if side.memory_slots > 0:
                reads_out = not decoder and cfg.tlb_encoder_out != "tokens"
                self.memory = ChunkMemory(d, side.memory_slots, side.memory_update_layers,
                                          cfg.att_heads, cfg.att_head_dim, cfg.dropout,
                                          cfg.attention_dropout, cfg.activation_dropout,
                                          out_norm=reads_out)
        self.compiled_step = None
        self.compiled_input: Optional[CompiledFunction] = None  # input_states, compiled
        self.step_meter = None  # the model's StepMeter (evaluation forwards count their steps)
        if cfg.compile_step or cfg.compile_loop:
            reasons = unsupported(cfg, name)
            if reasons:
                logger.warning("--compile-step: the %s keeps the eager step (not covered: %s)",
                               name, ", ".join(reasons))
            else:
                self.compiled_step = build_compiled(
                    self.recurrence.step, name, max_steps=self.num_steps if cfg.compile_loop else None)
                self.compiled_input = CompiledFunction(self.input_states, f"{name}'s input embedding",
                                                       follows=self.compiled_step)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """sqrt(d) · E[tokens] + the input positions (B, T, d), before dropout: PE(t), or
        the step embedding's (none under ``coordinate``)."""
        emb = self.step_embedding
        return self.embed_scale * self.embed_tokens(tokens) + (
            positions if emb is None else emb.input_positions(positions))

    def input_states(self, tokens: torch.Tensor):
        """A full forward's inputs from tokens (B, T): h_0 = dropout(``embed``) (B, T, d),
        the input positions (B, T, d), the padding (B, T) bool and the real positions."""
        pad = tokens.eq(self.padding_idx)
        positions = self.embed_positions(tokens)
        return self.dropout(self.embed(tokens, positions)), positions, pad, ~pad

    def inputs_of(self, tokens: torch.Tensor):
        """``input_states``, compiled with the side's step (``--compile-step``,
        ``--compile-loop``: one graph instead of a dozen kernels and their backward)."""
        if self.compiled_input is None:
            return self.input_states(tokens)
        return self.compiled_input.run(tokens.device, mark_dynamic(tokens))

    def chunk_positions(self, tokens: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Sinusoidal input positions (B, T, d) of a chunked side: the token's slot in its
        chunk (``local``) or its index among the real tokens (``global``, fairseq's own)."""
        if not self.chunk_local_positions:
            return self.embed_positions(tokens)
        return local_positions(self.embed_positions, slot, tokens.ne(self.padding_idx), self.chunk_size)

    def step_embedding_table(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """TE(1..L) (L, d) of the side's step embedding, or None."""
        emb = self.step_embedding
        return None if emb is None else emb.table(self.num_steps, like)

    def run(self, x: torch.Tensor, inputs: StepInputs, rule=None, **options):
        """``SideRecurrence.run`` over h_0 = x (B, T, d), compiled in a full forward when
        ``--compile-step`` covers the side. Returns S_L, the HaltingResult, the HaltingState."""
        return self.recurrence.run(x, inputs, rule, compiled=self.compiled_step, **options)

    def run_chunks(self, tokens: torch.Tensor, real: torch.Tensor, inputs: dict, **options):
        """``chunked_recurrence`` over tokens (B, T) with real positions ``real`` (B, T): each
        chunk's recurrence reads the memory with keys and values of M^c projected once per
        chunk, and ``inputs`` (the decoder's cross-attention keys, values and mask). Returns
        S_L and the ChunkedHaltingResult."""
        def run_chunk(x: torch.Tensor, real: torch.Tensor, M: Optional[torch.Tensor], rule):
            memory_kv = None if M is None else self.recurrence.step.memory_kv(M)
            step_inputs = StepInputs(self_padding_mask=~real, real=real, memory_kv=memory_kv, **inputs)
            return self.recurrence.run(x, step_inputs, rule)

        layout = ChunkLayout(real, self.chunk_size)
        x = self.embed(tokens, self.chunk_positions(tokens, layout.slot))
        return chunked_recurrence(run_chunk, self.dropout(x), layout, self.halting, self.num_steps,
                                  self.memory, memory_reset=self.memory_reset,
                                  cap_steps=self.cap_steps, **options)

    def upgrade_state_dict_named(self, state_dict: dict, name: str) -> None:
        """Rename an older checkpoint's ``encoder.block...`` to ``encoder.side.block...`` in
        place (``name``: ``encoder.side`` / ``decoder.side``)."""
        owner = name[: -len("side")]  # "encoder."
        for key in list(state_dict):
            if key.startswith(owner) and key[len(owner):].partition(".")[0] in SIDE_MODULES:
                state_dict[f"{name}.{key[len(owner):]}"] = state_dict.pop(key)

    def output(self, S: torch.Tensor) -> torch.Tensor:
        """The side's output: LN(S_L) under pre-LN, else S_L."""
        return S if self.final_norm is None else self.final_norm(S)
