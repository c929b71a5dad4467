"""The recorded outputs of ``sut_tiny`` with every later option off
(``fixtures/sut_tiny_options_off.pt``; what the file holds and why: the docstring of
``recurrence/test_options_off.py``): how they are computed and compared. Used by the
options-off tests and by the chunked model's (chunks off = the model before chunks).

Regenerate the file (a deliberate numerical change to the shared layers, the reason in its
commit): ``python tests/options_off_reference.py --write``.
"""
import functools
import os
import sys

import torch

from conftest import make_model, randomise_halting

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "sut_tiny_options_off.pt")
#: as the fixture names them (before the sides were modules: ``current_name`` gives today's)
GRAD_PARAMS = ("encoder.embed_tokens.weight", "encoder.block.self_attn.k_proj.weight",
               "decoder.block.cross_attn.q_weight", "decoder.block.ffd.w1",
               "decoder.halting.unit.fc1.weight", "decoder.block.self_attn_norm.weight")
NOT_TENSORS = ("param_names", "state_shapes", "environment")


def _inputs():
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, 40, (3, 7), generator=g)
    src[0, :2] = 1  # left padding
    prev = torch.randint(4, 40, (3, 6), generator=g)
    prev[:, 0] = 2
    prev[2, 4:] = 1  # right padding
    return src, torch.tensor([5, 7, 7]), prev


def environment():
    return f"torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}"


def reference_outputs(**options):
    """The tensors the fixture holds, for ``sut_tiny`` built with ``options`` (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _outputs(options)
    finally:
        torch.set_num_threads(threads)


def _outputs(options):
    out = {}
    model = make_model(halting_threshold=0.6, seed=0, **options)
    out["param_names"] = [n for n, _ in model.named_parameters()]
    out["state_shapes"] = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    randomise_halting(model, seed=4)
    src, lengths, prev = _inputs()
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        logits, extra = model.decoder(prev, enc)
        out["encoder_out"] = enc["encoder_out"][0].clone()
        out["encoder_steps"] = enc["halting"][0].steps.clone()
        out["decoder_logits"] = logits.clone()
        out["decoder_steps"] = extra["halting_decoder"].steps.clone()
        state, inc = {}, []
        for t in range(prev.size(1)):
            step_logits, _ = model.decoder(prev[:, : t + 1], enc, incremental_state=state)
            inc.append(step_logits)
        out["incremental_logits"] = torch.cat(inc, 1)
    train_model = make_model(halting_threshold=0.6, seed=0, dropout=0.1, **options)
    randomise_halting(train_model, seed=4)
    train_model.train()
    torch.manual_seed(11)
    logits, extra = train_model(src, lengths, prev)
    loss = logits.float().logsumexp(-1).sum() + extra["halting_decoder"].act_loss() \
        + extra["halting_encoder"].act_loss()
    loss.backward()
    out["train_logits"] = logits.detach().clone()
    params = dict(train_model.named_parameters())
    for name in GRAD_PARAMS:
        out[f"grad/{name}"] = params[current_name(name)].grad.clone()
    return out


def current_name(name: str) -> str:
    """A parameter's name in a checkpoint written before the sides were modules and the
    expert layers ``ExpertLinear``s (``encoder.block.ffd.w1``) -> its name now
    (``encoder.side.block.ffd.up.weight``): what fairseq's loader does to old checkpoints
    (the model's ``upgrade_state_dict``)."""
    state = {name: None}
    _upgrading_model().upgrade_state_dict(state)
    return next(iter(state))


@functools.lru_cache(maxsize=None)
def _upgrading_model():
    return make_model()


def compare(got, expected, keys):
    for key in keys:
        if got[key].dtype == torch.long:
            assert torch.equal(got[key], expected[key]), key
        else:
            torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-5, msg=key)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    torch.save({**reference_outputs(), "environment": environment()}, FIXTURE)
    print(f"wrote {FIXTURE}")
