"""Architecture presets (docs/model.md#presets). MoMHA is described by (E, k, H, D, W) and MoE-FFD by
(E, k, D); L = maximum steps per side. Any option given on the command line wins.

| preset      | MoMHA (E,k,H,D,W)      | FFD (E,k,D)     | d    | L enc/dec | halting |
|-------------|------------------------|-----------------|------|-----------|---------|
| sut_base    | (24, 4, 4, 64, 64)     | (24, 4, 512)    | 512  | 6/6       | SB      |
| sut_big     | (48, 4, 4, 64, 64)     | (48, 4, 512)    | 512  | 6/6       | SB, 1 sampled expert |
| ut_base     | (1, 1, 16, 64, 64)     | (1, 1, 3840)    | 1024 | 6/6       | SB      |
| ut_big      | (1, 1, 24, 64, 64)     | (1, 1, 3584)    | 1536 | 6/6       | SB      |
| ut_cfq      | (1, 1, 8, 64, T5 bias) | (1, 1, 1024)    | 512  | 12/12     | SB, pre-LN |
| sut_logic   | (12, 4, 2, 32, 1)      | (12, 4, 128)    | 128  | 12/12     | SB      |
| sut_tiny    | (4, 2, 2, 16, 4)       | (4, 2, 64)      | 64   | 3/3       | SB      |
| ut_cpvr     | (1, 1, 4, 16, none)    | (1, 1, 256)     | 64   | 16/16     | ACT 0.99, pre-LN |
| hyper_ut_cpvr | as ut_cpvr, hyper-modules M = 8, d_e = 32 on qkv, out, ffn | | 64 | 16/16 | ACT 0.99, pre-LN |
| tlb_logic   | (1, 1, 2, 32, 1)       | (1, 1, 128)     | 128  | 2/2       | none; encoder chunks g 10, k 10, U 1, pre-LN |
| gutlb_logic | (1, 1, 2, 32, 1)       | (1, 1, 128)     | 128  | 5/5       | global-mean + transition + gate; as tlb_logic |
| tlb_flipflop | (1, 1, 4, 16, 8)      | (1, 1, 256)     | 64   | 2/1       | none; encoder chunks g 8, k 4, U 2, memory out, pre-LN |
| gutlb_flipflop | (1, 1, 4, 16, 8)    | (1, 1, 256)     | 64   | 4/1       | global-mean + transition + gate; as tlb_flipflop |
| sut_multi30k | (12, 4, 4, 32, 32)    | (12, 4, 256)    | 256  | 3/3       | SB; dropouts 0.3 / 0.1 |
| ut_multi30k  | (1, 1, 8, 64, 32)     | (1, 1, 1920)    | 512  | 3/3       | SB; dropouts 0.3 / 0.1 |

The ``*_multi30k`` presets are ``sut_base`` / ``ut_base`` at half the width and half the
depth for Multi30k (docs/multi30k.md), beside ``transformer_multi30k`` (fairseq's
transformer, d 256, 3 + 3 layers, FFN 1,024, 4 heads; registered in ``baselines.py``): the
SUT has the transformer's parameter count (E = 12 shared experts instead of 24, since it
runs 3 steps rather than 6) and about 1.3x its static MACs, the UT about 3.3x, as the
paper's base models stand to ``transformer_wmt_en_de``.

The UT widths are not published; see README "Presets" for how they were chosen (parameter
count and static MAC ratio to ``transformer_wmt_en_de`` both close to the paper).

This module holds the presets as plain functions of the flat options (an argparse
Namespace, or hydra's ``DictConfig``); the defaults they fall back on are ``SUTConfig``'s
(``config.py``). ``models/sut_transformer.py`` registers the model and then every entry of
``PRESETS`` as an ``--arch`` (fairseq needs the model registered before its
architectures), so the dependency goes one way only, model -> presets.
"""
from .config import BASE_DEFAULTS, DECODER_FOLLOWS_ENCODER


def _default(args, name, value):
    if getattr(args, name, None) is None:
        setattr(args, name, value)


def _set(args, **values):
    for name, value in values.items():
        _default(args, name, value)


def base_architecture(args):
    """Fills every option still unset with ``SUTConfig``'s defaults (``sut_base``'s sizes);
    the decoder options of ``DECODER_FOLLOWS_ENCODER`` with the encoder's values."""
    _set(args, **BASE_DEFAULTS)
    _set(args, **{dec: getattr(args, enc) for dec, enc in DECODER_FOLLOWS_ENCODER.items()})


def _wmt_regularisation(args):
    _set(args, dropout=0.2, attention_dropout=0.2, activation_dropout=0.2, gating_dropout=0.2)


def sut_base(args):
    _wmt_regularisation(args)
    base_architecture(args)


def sut_big(args):
    _set(args, att_experts=48, ffd_experts=48, sample_topk=1)
    sut_base(args)


def _dense(args, embed_dim, heads, ffd_hidden):
    _set(args, encoder_embed_dim=embed_dim, att_experts=1, att_topk=1, att_heads=heads,
         att_head_dim=64, ffd_experts=1, ffd_topk=1, ffd_hidden_dim=ffd_hidden)


def ut_base(args):
    _dense(args, embed_dim=1024, heads=16, ffd_hidden=3840)
    sut_base(args)


def ut_big(args):
    _dense(args, embed_dim=1536, heads=24, ffd_hidden=3584)
    sut_base(args)


def ut_cfq(args):
    _dense(args, embed_dim=512, heads=8, ffd_hidden=1024)
    _set(args, rel_pos="t5", encoder_layers=12, encoder_normalize_before=True)
    base_architecture(args)


def sut_logic(args):
    _set(args, encoder_embed_dim=128, encoder_layers=12,
         att_experts=12, att_topk=4, att_heads=2, att_head_dim=32, rel_window=1,
         ffd_experts=12, ffd_topk=4, ffd_hidden_dim=128)
    base_architecture(args)


def sut_tiny(args):
    _set(args, encoder_embed_dim=64, encoder_layers=3,
         att_experts=4, att_topk=2, att_heads=2, att_head_dim=16, rel_window=4,
         ffd_experts=4, ffd_topk=2, ffd_hidden_dim=64)
    base_architecture(args)


def ut_cpvr(args):
    """The dense UT baseline of the Hyper-UT C-PVR experiment (docs/hyper_ut.md): d = 64,
    4 heads of 16, FFN 256, up to 16 steps per side, per-token ACT at 1 - ε = 0.99."""
    _set(args, encoder_embed_dim=64, encoder_layers=16,
         att_experts=1, att_topk=1, att_heads=4, att_head_dim=16, rel_pos="none",
         ffd_experts=1, ffd_topk=1, ffd_hidden_dim=256,
         encoder_halting="act", halting_threshold=0.99, encoder_normalize_before=True,
         dropout=0.1)
    base_architecture(args)


def hyper_ut_cpvr(args):
    """``ut_cpvr`` with hyper-modules (M = 8, d_e = 32) on qkv, out and ffn, both sides."""
    _set(args, hyper_modules=8, hyper_embed_dim=32)
    ut_cpvr(args)


def _tlb(args, **sizes):
    """Chunk-wise recurrence on the encoder (docs/chunked.md): dense (E = k = 1) pre-LN
    blocks, every real position runs every step (TLB) unless a GUTLB preset sets halting."""
    _set(args, att_experts=1, att_topk=1, ffd_experts=1, ffd_topk=1,
         encoder_halting="none", encoder_normalize_before=True, **sizes)


def tlb_logic(args):
    """TLB at ``sut_logic``'s size for logical inference: chunks of g = 10 real tokens,
    k = 10 memory slots, U = 1 write block, L = 2 steps per side (the GUTLB paper's
    logic settings)."""
    _tlb(args, encoder_chunk_size=10, encoder_memory_slots=10, encoder_memory_update_layers=1,
         encoder_layers=2)
    sut_logic(args)


def gutlb_logic(args):
    """``tlb_logic`` with GUT's global-mean, transition-aware halting and gated block, up to
    L = 5 steps per chunk."""
    _set(args, encoder_halting="global-mean", halting_transition=True, gated_ffn=True,
         encoder_layers=5)
    tlb_logic(args)


def tlb_flipflop(args):
    """Small TLB for the CPU flip-flop experiment (encoder-only use: the decoder reads
    only LN(M^N), one decoder step): d = 64, 4 heads of 16, FFN 256, chunks of g = 8,
    k = 4 slots, U = 2 write blocks, L = 2 steps; clipped relative positions over the
    chunk (W = 8) on top of the per-chunk sinusoidal positions."""
    _tlb(args, encoder_embed_dim=64, encoder_layers=2, decoder_layers=1,
         att_heads=4, att_head_dim=16, rel_window=8, ffd_hidden_dim=256,
         encoder_chunk_size=8, encoder_memory_slots=4, encoder_memory_update_layers=2,
         tlb_encoder_out="memory")
    base_architecture(args)


def gutlb_flipflop(args):
    """``tlb_flipflop`` with GUT's halting and gate, up to L = 4 steps per chunk."""
    _set(args, encoder_halting="global-mean", halting_transition=True, gated_ffn=True,
         encoder_layers=4)
    tlb_flipflop(args)


def _multi30k_regularisation(args):
    """A small corpus (29k pairs): dropout 0.3 on the residual stream, 0.1 elsewhere."""
    _set(args, dropout=0.3, attention_dropout=0.1, activation_dropout=0.1, gating_dropout=0.1)


def sut_multi30k(args):
    """``sut_base`` at half its width and depth for Multi30k: d 256, MoMHA (12, 4, 4, 32,
    32), MoE-FFD (12, 4, 256), 3/3 steps, stick-breaking halting."""
    _set(args, encoder_embed_dim=256, encoder_layers=3,
         att_experts=12, att_topk=4, att_heads=4, att_head_dim=32, rel_window=32,
         ffd_experts=12, ffd_topk=4, ffd_hidden_dim=256)
    _multi30k_regularisation(args)
    base_architecture(args)


def ut_multi30k(args):
    """``ut_base`` at half its width and depth for Multi30k: d 512, 8 heads of 64, FFN
    1,920, 3/3 steps, stick-breaking halting."""
    _dense(args, embed_dim=512, heads=8, ffd_hidden=1920)
    _set(args, encoder_layers=3, rel_window=32)
    _multi30k_regularisation(args)
    base_architecture(args)


#: ``--arch`` name -> preset, in registration order (``sut_transformer`` itself first).
PRESETS = {
    "sut_transformer": base_architecture,
    "sut_base": sut_base,
    "sut_big": sut_big,
    "ut_base": ut_base,
    "ut_big": ut_big,
    "ut_cfq": ut_cfq,
    "sut_logic": sut_logic,
    "sut_tiny": sut_tiny,
    "ut_cpvr": ut_cpvr,
    "hyper_ut_cpvr": hyper_ut_cpvr,
    "tlb_logic": tlb_logic,
    "gutlb_logic": gutlb_logic,
    "tlb_flipflop": tlb_flipflop,
    "gutlb_flipflop": gutlb_flipflop,
    "sut_multi30k": sut_multi30k,
    "ut_multi30k": ut_multi30k,
}
