"""What ``SUTBlock`` builds from the options (``modules/sut_block.py``): each side's width
and LayerNorm placement, the options each sub-layer receives, relative positions, the
hyper-module sub-layers and the chunk memory's attention. The arithmetic of the
sub-layers is tested in their own files; here, that every option reaches the right one."""
import pytest

from conftest import make_model
from sut_fairseq.modules.hyper_block import HyperFeedForward, HyperSelfAttention
from sut_fairseq.modules.memory import MemoryAttention
from sut_fairseq.modules.moe_ffd import MoEFeedForward
from sut_fairseq.modules.momha import MixtureOfMultiHeadAttention
from sut_fairseq.modules.relative_position import ClippedRelativePosition, T5RelativeBias


def _blocks(**overrides):
    model = make_model("sut_tiny", **overrides)
    return model.encoder.block, model.decoder.block


def test_each_side_its_own_layer_norm_placement_and_the_attention_options():
    enc, dec = _blocks(encoder_normalize_before=False, decoder_normalize_before=True,
                       attention_dropout=0.25, gating_dropout=0.125, sample_topk=1,
                       rel_pos="clipped", rel_window=3)
    assert enc.normalize_before is False and dec.normalize_before is True
    for attn, causal in ((enc.self_attn, False), (dec.self_attn, True), (dec.cross_attn, False)):
        assert isinstance(attn, MixtureOfMultiHeadAttention) and attn.causal is causal
        assert attn.attention_dropout == 0.25
        assert attn.router.dropout.p == 0.125 and attn.router.sample_topk == 1
    for attn in (enc.self_attn, dec.self_attn):
        assert isinstance(attn.relative, ClippedRelativePosition) and attn.relative.window == 3
    assert dec.cross_attn.relative is None  # relative positions: self-attention only
    assert enc.cross_attn is None and isinstance(enc.ffd, MoEFeedForward)
    assert enc.memory_attn is None and dec.memory_attn is None


@pytest.mark.parametrize("rel_pos,kind", [("none", type(None)), ("t5", T5RelativeBias)])
def test_relative_position_choice(rel_pos, kind):
    enc, dec = _blocks(rel_pos=rel_pos)
    assert isinstance(enc.self_attn.relative, kind) and isinstance(dec.self_attn.relative, kind)
    if rel_pos == "t5":
        assert enc.self_attn.relative.bidirectional is True
        assert dec.self_attn.relative.bidirectional is False


@pytest.mark.parametrize("components,hyper_attn,hyper_ffd",
                         [("qkv", True, False), ("out", True, False), ("ffn", False, True),
                          ("qkv,out,ffn", True, True)])
def test_hyper_module_sub_layers_follow_the_components(components, hyper_attn, hyper_ffd):
    enc, dec = _blocks(hyper_modules=4, hyper_components=components, attention_dropout=0.25,
                       att_heads=2, att_head_dim=16, att_experts=1, att_topk=1, ffd_experts=1,
                       ffd_topk=1, rel_pos="none")
    for block, causal in ((enc, False), (dec, True)):
        attn = block.self_attn
        assert isinstance(attn, HyperSelfAttention) is hyper_attn
        assert isinstance(block.ffd, HyperFeedForward) is hyper_ffd
        assert block.hyper_attn is hyper_attn and block.hyper_ffd is hyper_ffd
        if hyper_attn:
            assert (attn.num_heads, attn.head_dim, attn.causal) == (2, 16, causal)
            assert attn.attention_dropout == 0.25
    assert isinstance(dec.cross_attn, MixtureOfMultiHeadAttention)  # never a hyper-module


@pytest.mark.parametrize("chunk,slots,has_memory", [(1, 1, True), (4, 2, True), (4, 0, False)])
def test_the_chunk_memory_attention(chunk, slots, has_memory):
    enc, dec = _blocks(encoder_chunk_size=chunk, encoder_memory_slots=slots,
                       encoder_normalize_before=True, attention_dropout=0.25,
                       att_heads=2, att_head_dim=16, tlb_encoder_out="tokens")
    if has_memory:
        memory = enc.memory_attn
        assert isinstance(memory, MemoryAttention)
        assert (memory.num_heads, memory.head_dim, memory.attention_dropout) == (2, 16, 0.25)
        assert memory.q_proj.in_features == 64 and memory.out_proj.out_features == 64
    else:
        assert enc.memory_attn is None
    assert dec.memory_attn is None


def test_each_side_its_own_width_and_cross_attention_reads_the_encoder_width():
    """A decoder narrower than the encoder: its block works at d_dec, its cross-attention
    projects keys/values from d_enc."""
    from sut_fairseq.models.standalone import build_model

    model = build_model("sut_tiny", dict_size=40, share_all_embeddings=False, decoder_embed_dim=32)
    enc, dec = model.encoder.block, model.decoder.block
    assert enc.self_attn_norm.normalized_shape == (64,) and dec.self_attn_norm.normalized_shape == (32,)
    assert dec.cross_attn.k_proj.in_features == 64
    assert dec.cross_attn.q_weight.shape[1] == 32 and dec.ffd.w1.shape[1] == 32
