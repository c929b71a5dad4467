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
