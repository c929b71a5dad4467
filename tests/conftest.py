"""Shared fixtures: small models built exactly as ``fairseq-train --arch ...`` would."""
import logging

import pytest
import torch

logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.ERROR)


def make_model(arch="sut_tiny", dict_size=40, seed=0, **overrides):
    """An eval-mode model with no dropout (deterministic), over a joined dictionary."""
    from sut_fairseq.models.standalone import build_model

    torch.manual_seed(seed)
    overrides.setdefault("dropout", 0.0)
    model = build_model(arch, dict_size=dict_size, share_all_embeddings=True, **overrides)
    return model.eval()


def randomise_halting(model, std=2.0, seed=1):
    """Give the halting units a non-zero last layer so positions halt at different steps."""
    g = torch.Generator().manual_seed(seed)
    for side in (model.encoder, model.decoder):
        unit = getattr(side.halting, "unit", None)
        if unit is not None:
            with torch.no_grad():
                unit.fc2.weight.copy_(torch.randn(unit.fc2.weight.shape, generator=g) * std / unit.fc2.weight.size(1) ** 0.5)
                unit.fc2.bias.fill_(-0.5)


@pytest.fixture
def tiny_model():
    return make_model


def run_incremental(model, enc, prev, reorder=None):
    """Decode ``prev`` (B, T) one position at a time through fairseq's incremental API;
    with ``reorder`` (B,) the cache, the encoder output and the prefix are reordered before
    every step after the first, as beam search does. Returns the logits (B, T, V), the
    decoder's executed steps (B, T) and the final (reordered) prefix."""
    state, outs, steps = {}, [], []
    for t in range(prev.size(1)):
        if reorder is not None and t > 0:
            model.decoder.reorder_incremental_state_scripting(state, reorder)
            enc = model.encoder.reorder_encoder_out(enc, reorder)
            prev = prev.index_select(0, reorder)
            outs = [o.index_select(0, reorder) for o in outs]
            steps = [s.index_select(0, reorder) for s in steps]
        out, extra = model.decoder(prev[:, : t + 1], enc, incremental_state=state)
        outs.append(out)
        steps.append(extra["halting_decoder"].steps)
    return torch.cat(outs, 1), torch.cat(steps, 1), prev


def pytest_runtest_logreport(report):
    """With SUT_TEST_FAILURES_AT_ONCE=1, print each failure's traceback as soon as the test
    fails, not in the summary at the end: a run killed at a time limit (the GPU node's
    10-minute commands) still shows why the tests before the kill failed."""
    import os

    if report.failed and os.environ.get("SUT_TEST_FAILURES_AT_ONCE") == "1":
        lines = report.longreprtext.splitlines()
        print(f"\nFAILED {report.nodeid} ({report.when}):\n" + "\n".join(lines[-40:]), flush=True)
