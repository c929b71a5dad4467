"""#48 item 4 in the compiled step, against the code each change replaces: outputs and
every parameter's gradient within 1e-4 in fp32 (the compiled path's modules, uncompiled)."""
import contextlib

import pytest
import torch

from conftest import make_model, randomise_halting
from old_code import assert_same_as_old
from sut_fairseq.modules.compiled_step import RecurrenceStep, build_compiled
from sut_fairseq.ops.masked_linear_op import masked_linear


def _compiled_path_model(overrides):
    """A model whose sides run ``RecurrenceStep`` under ``run_compiled``, uncompiled."""
    model = make_model(encoder_layers=4, decoder_layers=4, halting_threshold=0.8, **overrides)
    randomise_halting(model, seed=5)
    for side, name in ((model.encoder, "encoder"), (model.decoder, "decoder")):
        side.compiled_step = build_compiled(side.block, side.halting, side.step_embedding, name)
        side.compiled_step.compiled = side.compiled_step.step
    return model


def _old_changed_kv(self, S, changed, k_rows, v_rows):
    """Before #48: the key and value projections as two masked linear maps."""
    x = self.block.self_attn_norm(S) if self.block.normalize_before else S
    attn, keep = self.block.self_attn, changed.unsqueeze(-1)
    k = torch.where(keep, masked_linear(x, attn.k_proj, changed), k_rows)
    v = torch.where(keep, masked_linear(x, attn.v_proj, changed), v_rows)
    return k, v


@contextlib.contextmanager
def _old_kv():
    new = RecurrenceStep.changed_kv
    RecurrenceStep.changed_kv = _old_changed_kv
    try:
        yield
    finally:
        RecurrenceStep.changed_kv = new


@pytest.mark.parametrize("overrides", [{}, dict(encoder_normalize_before=True, decoder_normalize_before=True)],
                         ids=["post-ln", "pre-ln"])
def test_keys_and_values_as_one_product_equal_two(overrides):
    model = _compiled_path_model(overrides)
    assert model.encoder.compiled_step.step.carries_kv
    g = torch.Generator().manual_seed(0)
    src, prev = torch.randint(4, 40, (3, 7), generator=g), torch.randint(4, 40, (3, 6), generator=g)
    src[0, :2] = 1
    assert_same_as_old(model, src, prev, _old_kv)
