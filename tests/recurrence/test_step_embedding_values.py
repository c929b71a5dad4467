"""The step embedding's small functions (``modules/step_embedding.py``): where the
sinusoids are made (the device of their input: meta here, which a CPU run can check, and
CUDA in a GPU run), ``step_kv_bias`` against a float64 loop over heads with its
documented (1, H, 1, D) shape, and the errors of ``sinusoid`` and ``build_step_embedding``
with their whole messages. The values of TE and PE are in test_step_embedding.py."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import make_model  # noqa: E402
from sut_fairseq.modules.step_embedding import (  # noqa: E402
    STEP_EMBEDDINGS, StepEmbedding, build_step_embedding, sinusoid, step_kv_bias)

DEVICES = ["meta", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", [torch.arange(5), torch.tensor(3.0), torch.arange(6).view(2, 3)],
                         ids=["long (5,)", "float ()", "long (2, 3)"])
def test_sinusoid_is_made_on_its_inputs_device(device, index):
    """sinusoid(index, d): index.shape + (d,) in float64 on index's device (and on CUDA
    the CPU's values)."""
    got = sinusoid(index.to(device), 7)
    assert got.device.type == device and got.shape == (*index.shape, 7) and got.dtype == torch.float64
    if device != "meta":
        torch.testing.assert_close(got.cpu(), sinusoid(index, 7), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_timestep_is_made_on_the_device_and_in_the_dtype_of_like(device, dtype):
    """TE(l) (d,) on ``like``'s device, in its dtype, so that ``add`` works on states there."""
    emb = StepEmbedding("timestep", 8)
    like = torch.zeros(2, 3, 8, device=device, dtype=dtype)
    te = emb.timestep(3, like)
    assert te.device.type == device and te.dtype == dtype and te.shape == (8,)
    out = emb.add(like, 3, None)
    assert out.device.type == device and out.dtype == dtype and out.shape == (2, 3, 8)
    if device != "meta":
        torch.testing.assert_close(te.cpu(), emb.timestep(3, like.cpu()), rtol=0, atol=0)


def test_step_kv_bias_is_w_te_per_head_shaped_1_h_1_d():
    """step_kv_bias(block, TE): k[0, h, 0, i] = Σ_j W_k[h·D + i, j] TE_j (v alike), as a
    (1, H, 1, D) tensor, the key the per-step vector adds to every key (B, H, T, D):
    k_proj(S + TE) − k_proj(S) per head (float64, random projections)."""
    model = make_model().double()
    block = model.encoder.side.block
    attn = block.self_attn
    H, D = attn.num_heads, attn.head_dim
    assert H >= 2, "the test needs several heads"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for proj in (attn.k_proj, attn.v_proj):
            proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen, dtype=torch.float64))
            proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen, dtype=torch.float64))
    d = attn.k_proj.weight.size(1)
    te = StepEmbedding("timestep", d).timestep(5, torch.zeros((), dtype=torch.float64))
    bk, bv = step_kv_bias(block, te)
    for got, proj in ((bk, attn.k_proj), (bv, attn.v_proj)):
        assert got.shape == (1, H, 1, D)
        W = proj.weight.detach()
        ref = torch.tensor([[sum(W[h * D + i, j].item() * te[j].item() for j in range(d))
                             for i in range(D)] for h in range(H)], dtype=torch.float64)
        torch.testing.assert_close(got[0, :, 0, :].detach(), ref, rtol=1e-10, atol=1e-10)
        # what it stands for: the change of every key (B, H, T, D) when TE is added to S
        S = torch.randn(2, 3, d, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            diff = (proj(S + te) - proj(S)).view(2, 3, H, D).transpose(1, 2)
        torch.testing.assert_close(diff, got.detach().expand(2, H, 3, D), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dim", [0, -1])
def test_a_sinusoid_narrower_than_one_is_refused_with_its_width(dim):
    with pytest.raises(ValueError, match=rf"^sinusoid width must be >= 1; got {dim}$"):
        sinusoid(torch.arange(3), dim)


def test_build_step_embedding_none_a_side_embedding_or_a_refusal_naming_the_choices():
    assert build_step_embedding("none", 8) is None
    for mode in ("timestep", "coordinate"):
        emb = build_step_embedding(mode, 8)
        assert isinstance(emb, StepEmbedding) and (emb.mode, emb.embed_dim) == (mode, 8)
    with pytest.raises(ValueError) as error:
        build_step_embedding("learned", 8)
    assert str(error.value) == (
        "unknown step embedding 'learned'; choose from ('none', 'timestep', 'coordinate')")
    assert STEP_EMBEDDINGS == ("none", "timestep", "coordinate")


def test_the_table_is_one_row_per_step_on_the_states_device_and_dtype():
    """``StepEmbedding.table(L, like)``: (L, d), row l - 1 = TE(l) as ``timestep`` gives it,
    in ``like``'s dtype and on its device (a meta tensor shows the device is followed)."""
    emb = StepEmbedding("timestep", 6)
    like = torch.zeros((), dtype=torch.float64)
    table = emb.table(4, like)
    assert table.shape == (4, 6) and table.dtype == torch.float64
    assert torch.equal(table, torch.stack([emb.timestep(l, like) for l in range(1, 5)]))
    on_meta = emb.table(4, torch.empty(0, dtype=torch.float16, device="meta"))
    assert on_meta.device.type == "meta" and on_meta.dtype == torch.float16 and on_meta.shape == (4, 6)
