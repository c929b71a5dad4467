"""The halting result of a chunked recurrence (``ChunkedHaltingResult``; docs/chunked.md):
``act_loss`` (L_ACT per chunk: the mean over real chunks of the chunk's expected depth)
on hand-worked examples, and ``combine`` (per-chunk results (B, w) -> the token layout
(B, T) and the per-chunk fields (B, N)) against a loop over the real tokens."""
import pytest
import torch

from sut_fairseq.modules.chunked_recurrence import ChunkedHaltingResult, ChunkLayout
from sut_fairseq.modules.halting import HaltingResult


def per_chunk(chunk_real, chunk_depth):
    """A result with only the per-chunk fields act_loss reads."""
    return ChunkedHaltingResult(weights=None, expected_depth=None, steps=None, real=None,
                                max_steps=4, chunk_real=torch.tensor(chunk_real),
                                chunk_depth=torch.tensor(chunk_depth, requires_grad=True))


# (chunk_real (B, N), chunk_depth (B, N), L_ACT by hand); the depths of empty chunks are
# garbage that must not count
ACT_CASES = {
    "one real chunk": ([[True, False, False], [False, False, False]],
                       [[2.5, 9.0, 9.0], [7.0, 7.0, 7.0]], 2.5),
    "three real chunks": ([[True, True, False], [True, False, False]],
                          [[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]], 7.0 / 3.0),
    "every chunk real": ([[True, True], [True, True]], [[1.0, 2.0], [3.0, 4.5]], 10.5 / 4),
    "no real chunk": ([[False, False]], [[3.0, 5.0]], 0.0),
}


@pytest.mark.parametrize("case", list(ACT_CASES))
def test_act_loss_is_the_mean_depth_of_the_real_chunks(case):
    """L_ACT (a scalar) and its gradient, 1/n on each of the n real chunks' depths, 0 on the
    others (0 everywhere and a loss of 0, not NaN, without a real chunk)."""
    chunk_real, chunk_depth, expected = ACT_CASES[case]
    result = per_chunk(chunk_real, chunk_depth)
    loss = result.act_loss()
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    real = torch.tensor(chunk_real)
    n = int(real.sum())
    grad = torch.where(real, torch.tensor(1.0 / max(n, 1)), torch.tensor(0.0))
    torch.testing.assert_close(result.chunk_depth.grad, grad)
    assert result.act_units() == n


def test_combine_equals_a_loop_over_the_real_tokens():
    """combine over a layout of g = 3 (rows of 7, 5 and 2 real tokens, left and inner
    padding: N = 3, w = 3) with per-chunk results whose padded slots hold garbage:
    weights (B, T, L), expected_depth and steps (B, T) are each real token's entries of its
    chunk's result (0 on padding); chunk_real (B, N) whether the chunk holds a token;
    chunk_depth the mean expected depth of its real tokens; chunk_steps their most steps
    (0 for an empty chunk); memories and final_memory passed through."""
    real = torch.tensor([[c == "1" for c in row] for row in
                         ("1111111", "..11111", "1...1..")], dtype=torch.bool)
    g, L = 3, 4
    B, T = real.shape
    layout = ChunkLayout(real, g)
    N, w = layout.num_chunks, layout.width
    assert (N, w) == (3, 3)
    gen = torch.Generator().manual_seed(0)
    results = []
    for _ in range(N):
        weights = torch.rand(B, w, L, generator=gen) + 0.1
        results.append(HaltingResult(
            weights=weights / weights.sum(-1, keepdim=True),
            expected_depth=torch.rand(B, w, generator=gen) * 3 + 1,
            steps=torch.randint(1, L + 1, (B, w), generator=gen),
            real=torch.ones(B, w, dtype=torch.bool), max_steps=L))
    memories = [torch.randn(B, 2, 5, generator=gen) for _ in range(N)]
    final = torch.randn(B, 2, 5, generator=gen)

    out = ChunkedHaltingResult.combine(results, layout, memories, final)

    weights = torch.zeros(B, T, L)
    depth = torch.zeros(B, T)
    steps = torch.zeros(B, T, dtype=torch.long)
    members = {}  # (b, c) -> the chunk's slots
    for b in range(B):
        rank = 0
        for t in range(T):
            if not real[b, t]:
                continue
            c, s = rank // g, rank % g
            rank += 1
            weights[b, t] = results[c].weights[b, s]
            depth[b, t] = results[c].expected_depth[b, s]
            steps[b, t] = results[c].steps[b, s]
            members.setdefault((b, c), []).append(s)
    chunk_real = torch.zeros(B, N, dtype=torch.bool)
    chunk_depth = torch.zeros(B, N)
    chunk_steps = torch.zeros(B, N, dtype=torch.long)
    for (b, c), slots in members.items():
        chunk_real[b, c] = True
        chunk_depth[b, c] = sum(results[c].expected_depth[b, s].item() for s in slots) / len(slots)
        chunk_steps[b, c] = max(results[c].steps[b, s].item() for s in slots)

    assert out.weights.dtype == torch.float32 and torch.equal(out.weights, weights)
    assert out.expected_depth is not None and torch.equal(out.expected_depth, depth)
    assert out.steps.dtype == torch.long and torch.equal(out.steps, steps)
    assert torch.equal(out.real, real) and out.max_steps == L
    assert torch.equal(out.chunk_real, chunk_real)
    assert out.chunk_depth.dtype == torch.float32
    torch.testing.assert_close(out.chunk_depth, chunk_depth, rtol=1e-6, atol=0)
    assert torch.equal(out.chunk_steps, chunk_steps)
    assert out.memories is memories and out.final_memory is final
    # the token-level L_ACT and the per-chunk one read the same numbers
    torch.testing.assert_close(out.act_loss(), chunk_depth[chunk_real].mean())
