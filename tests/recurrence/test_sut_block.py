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
    return model.encoder.side.block, model.decoder.side.block


def test_each_side_its_own_layer_norm_placement_and_the_attention_options():
    enc, dec = _blocks(encoder_normalize_before=False, decoder_normalize_before=True,
                       attention_dropout=0.25, gating_dropout=0.125, sample_topk=1,
                       rel_pos="clipped", rel_window=3, activation_dropout=0.375)
    assert enc.normalize_before is False and dec.normalize_before is True
    for block in (enc, dec):
        assert block.ffd.activation_dropout.p == 0.375
        assert block.ffd.router.dropout.p == 0.125 and block.ffd.router.sample_topk == 1
        assert block.gate is None and block.hyper is False and block.hyper_kv is False
    for attn, causal in ((enc.self_attn, False), (dec.self_attn, True), (dec.cross_attn, False)):
        assert isinstance(attn, MixtureOfMultiHeadAttention) and attn.causal is causal
        assert attn.attention_dropout == 0.25
        assert attn.router.dropout.p == 0.125 and attn.router.sample_topk == 1
    for attn in (enc.self_attn, dec.self_attn):
        assert isinstance(attn.relative, ClippedRelativePosition) and attn.relative.window == 3
    assert dec.cross_attn.relative is None  # relative positions: self-attention only
    assert not any(a.flex for a in (enc.self_attn, dec.self_attn, dec.cross_attn))


def test_flex_attention_reaches_the_self_attention_only():
    enc, dec = _blocks(flex_attention=True, attention_dropout=0.0)
    assert enc.self_attn.flex and dec.self_attn.flex
    assert not dec.cross_attn.flex  # cross-attention keeps SDPA (no relative term, shared keys)
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
                       activation_dropout=0.375,
                       att_heads=2, att_head_dim=16, att_experts=1, att_topk=1, ffd_experts=1,
                       ffd_topk=1, rel_pos="none")
    for block, causal in ((enc, False), (dec, True)):
        attn = block.self_attn
        assert isinstance(attn, HyperSelfAttention) is hyper_attn
        assert isinstance(block.ffd, HyperFeedForward) is hyper_ffd
        assert block.hyper_attn is hyper_attn and block.hyper_ffd is hyper_ffd
        assert block.hyper is True
        assert block.hyper_kv is ("qkv" in components)
        if hyper_ffd:
            assert block.ffd.activation_dropout.p == 0.375
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
    enc, dec = model.encoder.side.block, model.decoder.side.block
    assert enc.self_attn_norm.normalized_shape == (64,) and dec.self_attn_norm.normalized_shape == (32,)
    assert dec.cross_attn.k_proj.in_features == 64
    assert dec.cross_attn.q_proj.weight.shape[1] == 32 and dec.ffd.up.weight.shape[1] == 32


# --- the block's forward against a composition of its sub-layers, written out ----------

import torch  # noqa: E402


def _reference_block(block, h, k, v, running, pad=None, q_start=0, cross=None, z=None, memory=None):
    """x = h + A(LN(h)) [+ M(x)] [+ C(LN(x))], out = x + F(LN(x)) (pre-LN), or each
    sub-layer LN(x + f(x)) (post-LN); GUT's gate: G(x) ⊙ out + (1 − G(x)) ⊙ h."""
    pre = block.normalize_before
    zs = () if z is None else (z,)

    def sub(x, norm, f):
        return x + f(norm(x)) if pre else norm(x + f(x))

    x = sub(h, block.self_attn_norm,
            lambda q: block.self_attn(q, k, v, running, pad, q_start, *(zs if block.hyper_attn else ())))
    if memory is not None:
        x = x + block.memory_attn(x, *memory)
    if cross is not None:
        x = sub(x, block.cross_attn_norm, lambda q: block.cross_attn(q, cross[0], cross[1], running, None))
    out = sub(x, block.ffd_norm, lambda q: block.ffd(q, running, *(zs if block.hyper_ffd else ())))
    if block.gate is not None:
        g = block.gate(x)
        out = g * out + (1.0 - g) * h
    return out


@pytest.mark.parametrize("pre,gated", [(True, True), (False, False), (True, False)])
def test_encoder_block_forward_against_the_written_out_composition(pre, gated):
    from sut_fairseq.modules.sut_block import FeedForwardGate

    torch.manual_seed(0)
    block = make_model("sut_tiny", encoder_normalize_before=pre, gated_ffn=gated).encoder.side.block
    assert isinstance(block.gate, FeedForwardGate) if gated else block.gate is None
    h, S = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    running = torch.ones(2, 5, dtype=torch.bool)
    k, v = block.self_kv(S)
    norm_S = block.self_attn_norm(S) if pre else S
    k_ref, v_ref = block.self_attn.project_kv(norm_S)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(block(h, k, v, running), _reference_block(block, h, k, v, running))


def test_decoder_block_queries_start_at_position_zero_by_default():
    torch.manual_seed(0)
    model = make_model("sut_tiny")
    block = model.decoder.side.block
    h = torch.randn(2, 4, 64)
    running = torch.ones(2, 4, dtype=torch.bool)
    k, v = block.self_kv(h)
    cross = block.cross_kv(torch.randn(2, 3, 64))
    got = block(h, k, v, running, cross_k=cross[0], cross_v=cross[1])
    torch.testing.assert_close(got, _reference_block(block, h, k, v, running, q_start=0, cross=cross))


@pytest.mark.parametrize("components", ["qkv,out,ffn", "ffn"])
def test_hyper_block_passes_the_example_embedding_to_its_hyper_sub_layers(components):
    torch.manual_seed(0)
    block = make_model("sut_tiny", hyper_modules=4, hyper_components=components, att_experts=1,
                       att_topk=1, ffd_experts=1, ffd_topk=1, rel_pos="none").encoder.side.block
    h, S, z = torch.randn(2, 5, 64), torch.randn(2, 5, 64), torch.randn(2, 64)
    running = torch.ones(2, 5, dtype=torch.bool)
    k, v = block.self_kv(S, z)
    if block.hyper_attn:
        k_ref, v_ref = block.self_attn.project_kv(block.self_attn_norm(S) if block.normalize_before else S, z)
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)
    got = block(h, k, v, running, hyper_z=z)
    torch.testing.assert_close(got, _reference_block(block, h, k, v, running, z=z))
    other = block(h, k, v, running, hyper_z=torch.randn(2, 64))
    assert not torch.allclose(got, other)  # the output depends on z


def test_chunk_memory_is_read_after_self_attention():
    torch.manual_seed(0)
    block = make_model("sut_tiny", encoder_chunk_size=4, encoder_memory_slots=2,
                       encoder_normalize_before=True, tlb_encoder_out="tokens").encoder.side.block
    h, S, M = torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    running = torch.ones(2, 4, dtype=torch.bool)
    k, v = block.self_kv(S)
    memory = block.memory_attn.project_kv(M)
    got = block(h, k, v, running, memory_kv=memory)
    torch.testing.assert_close(got, _reference_block(block, h, k, v, running, memory=memory))
    assert not torch.allclose(got, block(h, k, v, running))
