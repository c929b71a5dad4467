"""The seq2seq model's assembly (``models/sut_transformer.py``): what the encoder and the
decoder hold beside their sides, the output projection, the step meter's expert slots."""
import pytest
import torch

from conftest import make_model
from sut_fairseq.models.standalone import build_model


def assert_drawn_from_normal(w: torch.Tensor, std: float):
    """Thousands of entries of w: mean 0 and standard deviation ``std`` (within 2 %)."""
    assert abs(w.mean().item()) < 0.01 and w.std().item() == pytest.approx(std, rel=0.02)


def test_the_encoder_and_decoder_hold_their_dictionary_and_position_limits():
    model = build_model("sut_tiny", dict_size=40, joined=False, tgt_dict_size=48,
                        max_source_positions=77, max_target_positions=66)
    assert len(model.encoder.dictionary) == 40 and len(model.decoder.dictionary) == 48
    assert model.encoder.max_positions() == 77 and model.decoder.max_positions() == 66
    assert model.max_positions() == (77, 66)


def test_each_side_embeds_its_own_dictionary_unless_all_embeddings_are_shared():
    apart = build_model("sut_tiny", dict_size=40, joined=False, tgt_dict_size=48)
    enc, dec = apart.encoder.side.embed_tokens, apart.decoder.side.embed_tokens
    assert enc is not dec and (enc.num_embeddings, dec.num_embeddings) == (40, 48)
    assert dec.embedding_dim == apart.decoder.output_projection.weight.size(1)
    shared = build_model("sut_tiny", dict_size=40, share_all_embeddings=True)
    assert shared.encoder.side.embed_tokens is shared.decoder.side.embed_tokens
    assert shared.decoder.output_projection.weight is shared.encoder.side.embed_tokens.weight


def test_sharing_all_embeddings_needs_one_joined_dictionary():
    with pytest.raises(ValueError) as error:
        build_model("sut_tiny", dict_size=40, joined=False, tgt_dict_size=48, share_all_embeddings=True)
    assert str(error.value) == ("--share-all-embeddings requires a joined dictionary "
                                "(fairseq-preprocess --joined-dictionary)")


@pytest.mark.parametrize("shared", [True, False], ids=["tied", "untied"])
def test_the_output_projection_is_the_embedding_or_its_own_normal_init_without_bias(shared):
    """Tied (--share-decoder-input-output-embed): the decoder's embedding matrix itself.
    Untied: a (V, d) matrix of its own, no bias, drawn from N(0, d^-1/2) as fairseq's
    transformer draws it."""
    torch.manual_seed(0)
    model = build_model("sut_tiny", dict_size=2000, joined=False, tgt_dict_size=3000,
                        share_decoder_input_output_embed=shared)
    proj, emb = model.decoder.output_projection, model.decoder.side.embed_tokens
    assert proj.bias is None
    assert (proj.weight is emb.weight) == shared
    if not shared:
        w, d = proj.weight.detach(), proj.weight.size(1)
        assert w.shape == (3000, d)
        assert_drawn_from_normal(w, d ** -0.5)


def test_the_token_embedding_is_normal_with_a_zero_padding_row():
    torch.manual_seed(0)
    model = build_model("sut_tiny", dict_size=4000)
    w, d = model.encoder.side.embed_tokens.weight.detach(), model.encoder.side.embed_tokens.embedding_dim
    pad = model.encoder.dictionary.pad()
    assert not w[pad].any()
    rest = torch.cat([w[:pad], w[pad + 1:]])
    assert_drawn_from_normal(rest, d ** -0.5)


def test_the_step_meter_counts_each_expert_layers_k_and_one_per_hyper_module():
    """Expert rows per executed position and step: Σ k over the block's expert layers
    (sut_tiny: k = 2 everywhere; the decoder has cross-attention), and 1 for a hyper-module
    (no router) beside a dense cross-attention."""
    assert make_model().step_meter.expert_slots == {"enc": 2 + 2, "dec": 2 + 2 + 2}
    hyper = make_model(att_experts=1, att_topk=1, ffd_experts=1, ffd_topk=1, hyper_modules=4,
                       hyper_embed_dim=16, attention_dropout=0, rel_pos="none")
    assert hyper.step_meter.expert_slots == {"enc": 1 + 1, "dec": 1 + 1 + 1}
    wide = make_model(att_experts=4, att_topk=3, ffd_experts=4, ffd_topk=1)
    assert wide.step_meter.expert_slots == {"enc": 3 + 1, "dec": 3 + 3 + 1}
