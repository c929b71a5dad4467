"""``chunked_recurrence`` itself (docs/chunked.md), on a toy block and a toy memory, against
a loop over each row's chunks in float64: its defaults (every chunk reads the memory the
previous chunk wrote, no step cap, no final memory), ``write_last``, ``memory_reset``,
``cap_steps`` (encoder and causal), no memory, and the refusal of ``memory_reset`` in
training mode with its whole message."""
import math

import pytest
import torch

from sut_fairseq.modules.chunked_recurrence import ChunkLayout, chunked_recurrence
from sut_fairseq.modules.halting import NoHalting
from toy_recurrence import run_toy

D, K, L, G = 4, 2, 4, 3
# rows of 8, 5, 1 and 4 real tokens (left, right and inner padding): N = 3 chunks of 3;
# chunks of 1, 2 and 3 tokens, so that a step cap min(L, n_c + 1) would show
REAL = torch.tensor([[c == "1" for c in row] for row in
                     ("..11111111", "11111.....", ".....1....", "1.1.1.1...")], dtype=torch.bool)


def weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(D, D, generator=gen, dtype=torch.float64) / D ** 0.5
    h0 = torch.randn(*REAL.shape, D, generator=gen, dtype=torch.float64)
    M0 = torch.randn(REAL.size(0), K, D, generator=gen, dtype=torch.float64)
    return W, h0, M0


class ToyMemory:
    """A stand-in for ``ChunkMemory``: M^0 is fixed (B, K, D); a write adds
    tanh(Σ the chunk's real rows) to every slot (an empty chunk writes nothing)."""

    def __init__(self, M0, training=False):
        self.M0, self.training = M0, training

    def begin(self, like):
        return self.M0

    def update(self, M, S, real):
        return M + torch.tanh((S * real.unsqueeze(-1)).sum(1, keepdim=True))


def toy_factory(W):
    """(C_0, real_c (B, w), M (B, K, D) or None, rule) -> the recurrence over the chunk with
    a toy block: every position reads the mean of its chunk's real rows of S and the mean of
    the memory's slots."""
    def run_chunk(x, real_c, M, rule):
        def step(h, S, running, l):
            r = real_c.unsqueeze(-1).to(S.dtype)
            ctx = (S * r).sum(1, keepdim=True) / r.sum(1, keepdim=True).clamp_min(1)
            mem = 0 if M is None else M.mean(1, keepdim=True)
            return torch.tanh(h @ W + 0.1 * l + ctx + mem)
        return run_toy(step, x, real_c, rule, L)
    return run_chunk


def reference(W, h0, M0, memory=True, write_last=False, reset=False, cap=None):
    """A loop over each row's chunks (its real tokens in order, g at a time; a row shorter
    than the longest has empty chunks at the end) and, within a chunk, over the steps.
    cap: None, "encoder" (min(L, n_c + 1) steps) or "causal" (min(L, j + 2) for the j-th
    token of the chunk). Returns S (B, T, D) (padding: h0), steps (B, T), the memories
    read [(B, K, D)] * N and the final memory."""
    B, T = REAL.shape
    rows = [[t for t in range(T) if REAL[b, t]] for b in range(B)]
    N = max(1, math.ceil(max(len(r) for r in rows) / G))
    S, steps = h0.clone(), torch.zeros(B, T, dtype=torch.long)
    read = [torch.zeros_like(M0) for _ in range(N)]
    final = torch.zeros_like(M0)
    for b, toks in enumerate(rows):
        M = M0[b]
        for c in range(N):
            idx = toks[c * G:(c + 1) * G]
            if reset:
                M = M0[b]
            read[c][b] = M
            n = len(idx)
            caps = [L] * n if cap is None else (
                [min(L, n + 1)] * n if cap == "encoder" else [min(L, j + 2) for j in range(n)])
            h = h0[b, idx]
            for l in range(1, L + 1):
                if n == 0:
                    break
                ctx = h.mean(0)
                new = torch.tanh(h @ W + 0.1 * l + ctx + (M.mean(0) if memory else 0))
                run = torch.tensor([l <= cap_j for cap_j in caps]).unsqueeze(-1)
                h = torch.where(run, new, h)
            S[b, idx] = h
            steps[b, idx] = torch.tensor(caps, dtype=torch.long)
            if c < N - 1 or write_last:
                M = M + torch.tanh(h.sum(0))
        final[b] = M
    return S, steps, read, final


def run(W, h0, M0, memory=True, training=False, **options):
    mem = ToyMemory(M0, training) if memory else None
    return chunked_recurrence(toy_factory(W), h0, ChunkLayout(REAL, G), NoHalting(), L, mem, **options)


def check(got, ref, memory=True, final=False):
    S, result = got
    ref_S, ref_steps, ref_read, ref_final = ref
    torch.testing.assert_close(S, ref_S, rtol=1e-12, atol=1e-12)
    assert torch.equal(result.steps, ref_steps)
    if memory:
        assert len(result.memories) == len(ref_read) == 3
        for M, ref_M in zip(result.memories, ref_read):
            torch.testing.assert_close(M, ref_M, rtol=1e-12, atol=1e-12)
    else:
        assert result.memories == []
    if final:
        torch.testing.assert_close(result.final_memory, ref_final, rtol=1e-12, atol=1e-12)
    else:
        assert result.final_memory is None


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_defaults_read_the_previous_chunks_write_run_every_step_and_keep_no_final_memory(training):
    """chunked_recurrence(step, h0, layout, rule, L, memory) with nothing else: chunk c reads
    M^c (the writes of chunks 0..c-1), every real position runs all L steps, M^N is not
    kept (final_memory None); in training mode as well (no reset: nothing refused)."""
    W, h0, M0 = weights()
    check(run(W, h0, M0, training=training), reference(W, h0, M0))


def test_write_last_keeps_the_final_memory():
    W, h0, M0 = weights(1)
    check(run(W, h0, M0, write_last=True), reference(W, h0, M0, write_last=True), final=True)


@pytest.mark.parametrize("write_last", [False, True])
def test_without_memory_the_chunks_are_independent_and_there_is_no_final_memory(write_last):
    W, h0, M0 = weights(2)
    check(run(W, h0, M0, memory=False, write_last=write_last), reference(W, h0, M0, memory=False),
          memory=False)


def test_memory_reset_makes_every_chunk_read_the_initial_memory():
    W, h0, M0 = weights(3)
    check(run(W, h0, M0, memory_reset=True, write_last=True),
          reference(W, h0, M0, reset=True, write_last=True), final=True)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "causal"])
def test_cap_steps_runs_each_position_at_most_the_cap(causal):
    """cap_steps: min(L, n_c + 1) steps (encoder) or min(L, j + 2) for the chunk's j-th
    token (causal), here with a rule that would run all L."""
    W, h0, M0 = weights(4)
    check(run(W, h0, M0, cap_steps=True, causal=causal),
          reference(W, h0, M0, cap="causal" if causal else "encoder"))


def test_memory_reset_in_training_mode_is_refused_with_the_whole_message():
    """The message names the option, why, and the exact override to evaluate with (a
    Python literal: ``True``)."""
    W, h0, M0 = weights()
    with pytest.raises(ValueError) as error:
        run(W, h0, M0, training=True, memory_reset=True)
    assert str(error.value) == (
        "--tlb-memory-reset is a test-time control and the model is in training mode "
        "(fairseq-train): train without it and set it for evaluation with "
        "--model-overrides \"{'tlb_memory_reset': True}\"")
