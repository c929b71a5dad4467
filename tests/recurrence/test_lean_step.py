"""#48 item 4 in the compiled step, against the code each change replaces: outputs and
every parameter's gradient within 1e-4 in fp32 (the compiled path's modules, uncompiled)."""
import contextlib

import pytest
import torch

from conftest import make_model, randomise_halting
from old_code import assert_same_as_old
from sut_fairseq.modules.recurrence import KeyValueCarry, build_compiled
from sut_fairseq.ops.masked_linear_op import masked_linear


def _compiled_path_model(overrides):
    """A model whose sides run the compiled step's modules (``TensorStep``), uncompiled."""
    model = make_model(encoder_layers=4, decoder_layers=4, halting_threshold=0.8, **overrides)
    randomise_halting(model, seed=5)
    for side, name in ((model.encoder.side, "encoder"), (model.decoder.side, "decoder")):
        side.compiled_step = build_compiled(side.recurrence.step, name)
        side.compiled_step.compiled = side.compiled_step.step
    return model


def _old_carry(self, block, x, running):
    """Before #48: the key and value projections as two masked linear maps."""
    x = block.self_attn_norm(x) if block.normalize_before else x
    attn = block.self_attn
    changed = torch.ones_like(running) if self.changed is None else self.changed
    keep = changed.unsqueeze(-1)
    k, v = masked_linear(x, attn.k_proj, changed), masked_linear(x, attn.v_proj, changed)
    if self.changed is not None:
        k, v = torch.where(keep, k, self.k_rows), torch.where(keep, v, self.v_rows)
    self.changed, self.k_rows, self.v_rows = running, k, v
    heads = (*x.shape[:2], attn.num_heads, attn.head_dim)
    return k.view(heads).transpose(1, 2), v.view(heads).transpose(1, 2)


@contextlib.contextmanager
def _old_kv():
    new = KeyValueCarry.__call__
    KeyValueCarry.__call__ = _old_carry
    try:
        yield
    finally:
        KeyValueCarry.__call__ = new


@pytest.mark.parametrize("overrides", [{}, dict(encoder_normalize_before=True, decoder_normalize_before=True)],
                         ids=["post-ln", "pre-ln"])
def test_keys_and_values_as_one_product_equal_two(overrides):
    model = _compiled_path_model(overrides)
    assert model.encoder.side.recurrence.step.carries_kv
    g = torch.Generator().manual_seed(0)
    src, prev = torch.randint(4, 40, (3, 7), generator=g), torch.randint(4, 40, (3, 6), generator=g)
    src[0, :2] = 1
    assert_same_as_old(model, src, prev, _old_kv)
