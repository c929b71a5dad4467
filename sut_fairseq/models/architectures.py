"""Architecture presets: plain functions of the flat options (an argparse Namespace or
hydra's ``DictConfig``) that fill what is still unset (an option given on the command line
wins), the rest falling back on ``SUTConfig``'s defaults. Their sizes, parameter counts and
how the UT widths were chosen: README "Presets", docs/model.md#presets. ``sut_transformer.py``
registers each entry of ``PRESETS`` as an ``--arch`` once the model is registered.
"""
from .config import BASE_DEFAULTS, DECODER_FOLLOWS_ENCODER


def _set(args, **values):
    """Give each option still unset (None) its value."""
    for name, value in values.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def base_architecture(args):
    """Fills every option still unset with ``SUTConfig``'s defaults (``sut_base``'s sizes);
    the decoder options of ``DECODER_FOLLOWS_ENCODER`` with the encoder's values."""
    _set(args, **BASE_DEFAULTS)
    _set(args, **{dec: getattr(args, enc) for dec, enc in DECODER_FOLLOWS_ENCODER.items()})


def sut_base(args):
    """``SUTConfig``'s sizes with WMT'14's dropout 0.2 everywhere."""
    _set(args, dropout=0.2, attention_dropout=0.2, activation_dropout=0.2, gating_dropout=0.2)
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
    """The dense UT baseline of the Hyper-UT C-PVR experiment (docs/hyper_ut.md)."""
    _set(args, encoder_embed_dim=64, encoder_layers=16,
         att_experts=1, att_topk=1, att_heads=4, att_head_dim=16, rel_pos="none",
         ffd_experts=1, ffd_topk=1, ffd_hidden_dim=256,
         encoder_halting="act", halting_threshold=0.99, encoder_normalize_before=True, dropout=0.1)
    base_architecture(args)


def hyper_ut_cpvr(args):
    _set(args, hyper_modules=8, hyper_embed_dim=32)
    ut_cpvr(args)


def _tlb(args, **sizes):
    """Chunk-wise recurrence on the encoder (docs/chunked.md): dense (E = k = 1) pre-LN
    blocks, every real position runs every step (TLB) unless a GUTLB preset sets halting."""
    _set(args, att_experts=1, att_topk=1, ffd_experts=1, ffd_topk=1,
         encoder_halting="none", encoder_normalize_before=True, **sizes)


def tlb_logic(args):
    """TLB at ``sut_logic``'s size with the GUTLB paper's logic settings (g = k = 10, U = 1,
    L = 2)."""
    _tlb(args, encoder_chunk_size=10, encoder_memory_slots=10, encoder_memory_update_layers=1,
         encoder_layers=2)
    sut_logic(args)


def gutlb_logic(args):
    """``tlb_logic`` with GUT's global-mean, transition-aware halting and gated block."""
    _set(args, encoder_halting="global-mean", halting_transition=True, gated_ffn=True,
         encoder_layers=5)
    tlb_logic(args)


def tlb_flipflop(args):
    """Small TLB for the CPU flip-flop experiment, used encoder-only: the one decoder step
    reads only LN(M^N)."""
    _tlb(args, encoder_embed_dim=64, encoder_layers=2, decoder_layers=1,
         att_heads=4, att_head_dim=16, rel_window=8, ffd_hidden_dim=256,
         encoder_chunk_size=8, encoder_memory_slots=4, encoder_memory_update_layers=2,
         tlb_encoder_out="memory")
    base_architecture(args)


def gutlb_flipflop(args):
    _set(args, encoder_halting="global-mean", halting_transition=True, gated_ffn=True,
         encoder_layers=4)
    tlb_flipflop(args)


def _multi30k_regularisation(args):
    """A small corpus (29k pairs): dropout 0.3 on the residual stream, 0.1 elsewhere."""
    _set(args, dropout=0.3, attention_dropout=0.1, activation_dropout=0.1, gating_dropout=0.1)


def sut_multi30k(args):
    """``sut_base`` at half its width and depth for Multi30k (docs/multi30k.md), with the
    parameter count of ``transformer_multi30k`` (``baselines.py``): E = 12 shared experts
    rather than 24, as it runs 3 steps rather than 6."""
    _set(args, encoder_embed_dim=256, encoder_layers=3,
         att_experts=12, att_topk=4, att_heads=4, att_head_dim=32, rel_window=32,
         ffd_experts=12, ffd_topk=4, ffd_hidden_dim=256)
    _multi30k_regularisation(args)
    base_architecture(args)


def ut_multi30k(args):
    """``ut_base`` at half its width and depth for Multi30k."""
    _dense(args, embed_dim=512, heads=8, ffd_hidden=1920)
    _set(args, encoder_layers=3, rel_window=32)
    _multi30k_regularisation(args)
    base_architecture(args)


#: ``--arch`` name -> preset, in registration order (``sut_transformer`` itself first).
PRESETS = {"sut_transformer": base_architecture, **{preset.__name__: preset for preset in (
    sut_base, sut_big, ut_base, ut_big, ut_cfq, sut_logic, sut_tiny, ut_cpvr, hyper_ut_cpvr,
    tlb_logic, gutlb_logic, tlb_flipflop, gutlb_flipflop, sut_multi30k, ut_multi30k)}}
