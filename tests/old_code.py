"""Exactness of #48's changes against the code they replace: one forward and backward of
a model with the new code and with the old (patched back in), outputs and every
parameter's gradient compared in fp32."""
from typing import Callable, Dict, Tuple

import torch


def forward_backward(model, src, prev, seed: int = 0) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """A training-mode forward of ``model`` (no dropout) and the backward of
    L = Σ logits · R + Σ_sides L_ACT, R fixed random; returns (logits, {name: grad})."""
    model.train()
    model.zero_grad(set_to_none=True)
    logits, extra = model(src, torch.full((src.size(0),), src.size(1)), prev)
    R = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    loss = (logits * R).sum()
    for key in ("halting_encoder", "halting_decoder"):
        if extra.get(key) is not None:
            loss = loss + extra[key].act_loss()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def assert_same_as_old(model, src, prev, patch_old: Callable[[], object], atol: float = 1e-4) -> None:
    """The model's logits and gradients with the new code == with ``patch_old()`` applied
    (a context manager restoring the old code), within ``atol``; the same parameters
    receive gradients."""
    new_out, new_grads = forward_backward(model, src, prev)
    with patch_old():
        old_out, old_grads = forward_backward(model, src, prev)
    torch.testing.assert_close(new_out, old_out, atol=atol, rtol=0)
    assert new_grads.keys() == old_grads.keys()
    for name in old_grads:
        torch.testing.assert_close(new_grads[name], old_grads[name], atol=atol, rtol=0, msg=name)
