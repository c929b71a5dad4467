"""Recorded outputs and gradients of the recurrence as it was before it became one step
(``fixtures/one_step_reference.pt``, written by the code of commit 4d2ca68, whose eager
step was ``side_step.SideStep`` and compiled step ``compiled_step.RecurrenceStep``), so
that ``recurrence/test_one_step.py`` checks the one step against the two it replaced:
outputs, halting decisions and every parameter's gradient, eager and compiled.

Gradients are stored as 4 fixed random projections per parameter (a changed gradient
changes them; the whole tensors would make the file megabytes).

Regenerate only for a deliberate numerical change (the reason in its commit):
``python tests/one_step_reference.py --write`` (one thread; ``SUT_COMPILE_BACKEND=aot_eager``
is set for the compiled variants).
"""
import os
import sys

import torch

from conftest import make_model, randomise_halting

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "one_step_reference.pt")
HYPER = dict(encoder_embed_dim=32, decoder_embed_dim=32, att_heads=2, att_head_dim=8,
             ffd_hidden_dim=48, encoder_layers=3, decoder_layers=3, hyper_modules=4,
             hyper_embed_dim=6, hyper_key_dim=12)
#: name -> (preset, options); every variant also runs incremental decoding
VARIANTS = {
    "sut_tiny": ("sut_tiny", dict(encoder_layers=4, decoder_layers=4)),
    "logic": ("sut_logic", dict(encoder_layers=6, decoder_layers=3)),
    "gut-state": ("sut_tiny", dict(encoder_halting="global-mean", decoder_halting="global-mean",
                                   halting_transition=True, gated_ffn=True, encoder_halting_kv="state",
                                   encoder_layers=4, decoder_layers=4)),
    "act-steps": ("sut_tiny", dict(encoder_halting="act", decoder_halting="act",
                                   encoder_step_embedding="timestep", decoder_step_embedding="coordinate",
                                   decoder_normalize_before=True, encoder_layers=4, decoder_layers=4)),
    "chunked": ("sut_tiny", dict(encoder_chunk_size=3, encoder_memory_slots=2, decoder_chunk_size=2,
                                 decoder_memory_slots=2, encoder_layers=3, decoder_layers=3)),
    "hyper": ("hyper_ut_cpvr", dict(HYPER, hyper_components="qkv,out,ffn")),
    "exits": ("sut_tiny", dict(decoder_halting="entropy", exit_entropy=3.0, decoder_layers=4)),
}
#: the variants ``--compile-step`` covers (compiled with aot_eager: the traced graph, no codegen)
COMPILED = ("sut_tiny", "logic", "gut-state", "act-steps")
PROJECTIONS = 4


def inputs(vocab=40):
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, vocab, (3, 9), generator=g)
    src[0, :3] = 1  # left padding
    prev = torch.randint(4, vocab, (3, 7), generator=g)
    prev[:, 0] = 2
    prev[2, 5:] = 1  # right padding
    return src, src.ne(1).sum(1), prev


def project(name: str, grad: torch.Tensor) -> torch.Tensor:
    """PROJECTIONS fixed random projections of ``grad`` (float64), seeded by the name."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(PROJECTIONS, grad.numel(), generator=g, dtype=torch.float64) @ grad.double().reshape(-1)


def outputs(name: str, compiled: bool = False) -> dict:
    """The tensors recorded for a variant (one thread): eval-mode encoder output, logits,
    executed steps and incremental logits; a training-mode loss's logits and its
    gradients' projections."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _outputs(name, compiled)
    finally:
        torch.set_num_threads(threads)


def _model(name, compiled):
    if compiled:  # a new model's step: without a reset, dynamo counts it as a recompilation
        torch._dynamo.reset()
    arch, options = VARIANTS[name]
    model = make_model(arch, seed=0, halting_threshold=0.6, compile_step=compiled, **options)
    randomise_halting(model, seed=4)
    return model


def _outputs(name, compiled):
    out = {}
    model = _model(name, compiled)
    src, lengths, prev = inputs()
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        logits, extra = model.decoder(prev, enc)
        out["encoder_out"] = enc["encoder_out"][0].clone()
        out["encoder_steps"] = enc["halting"][0].steps.clone()
        out["logits"] = logits.clone()
        out["decoder_steps"] = extra["halting_decoder"].steps.clone()
        if not compiled:
            state, inc = {}, []
            for t in range(prev.size(1)):
                inc.append(model.decoder(prev[:, : t + 1], enc, incremental_state=state)[0])
            out["incremental_logits"] = torch.cat(inc, 1)
    model.train()
    logits, extra = model(src, lengths, prev)
    loss = (logits.float().logsumexp(-1).sum() + extra["halting_decoder"].act_loss()
            + extra["halting_encoder"].act_loss())
    loss.backward()
    out["train_logits"] = logits.detach().clone()
    legacy = legacy_names(model)  # named as when the fixture was recorded
    for pname, p in model.named_parameters():
        if p.grad is not None:
            pname = legacy.get(pname, pname)
            out[f"grad/{pname}"] = project(pname, p.grad)
    return out


def legacy_names(model) -> dict:
    """Today's parameter names -> those of the code that recorded the fixture: the sides
    were not modules (``encoder.block`` for ``encoder.side.block``) and the expert layers
    held their weights themselves (MoE-FFD ``w1 b1 w2 b2``, MoMHA ``q_weight q_bias
    o_weight o_bias``): the inverse of what the loader does to old checkpoints."""
    from sut_fairseq.modules.moe_ffd import MoEFeedForward
    from sut_fairseq.modules.momha import MixtureOfMultiHeadAttention

    renames = {MoEFeedForward: {"up.weight": "w1", "up.bias": "b1", "down.weight": "w2", "down.bias": "b2"},
               MixtureOfMultiHeadAttention: {"q_proj.weight": "q_weight", "q_proj.bias": "q_bias",
                                             "o_proj.weight": "o_weight", "o_proj.bias": "o_bias"}}
    out = {}
    for path, module in model.named_modules():
        for new, old in renames.get(type(module), {}).items():
            out[f"{path}.{new}"] = f"{path}.{old}"
    names = [n for n, _ in model.named_parameters()]
    return {n: out.get(n, n).replace(".side.", ".", 1) for n in names}


def key(name: str, compiled: bool) -> str:
    return f"{name}/{'compiled' if compiled else 'eager'}"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    os.environ["SUT_COMPILE_BACKEND"] = "aot_eager"
    record = {}
    for variant in VARIANTS:
        for compiled in ((False, True) if variant in COMPILED else (False,)):
            print("recording", key(variant, compiled), flush=True)
            record[key(variant, compiled)] = outputs(variant, compiled)
    torch.save(record, FIXTURE)
    print(f"wrote {FIXTURE}")
