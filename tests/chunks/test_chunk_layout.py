"""The chunk layout of chunk-wise recurrence (``ChunkLayout``, ``local_positions``;
docs/chunked.md): real token i of a row (its rank among the row's real tokens) goes to
chunk ⌊i/g⌋, slot i mod g; N = max(1, ⌈longest/g⌉) chunks of width w = max(1, min(g,
longest)). Everything is compared with a per-row Python loop over the real tokens; the
masks cover g = 1, rows shorter than g (one chunk), rows of at most one real token
(width 1), all-padding rows and an empty batch."""
import math

import pytest
import torch
from fairseq.modules import PositionalEmbedding

from sut_fairseq.modules.chunked_recurrence import ChunkLayout, local_positions


def mask(*rows):
    """(B, T) bool from strings of '1' (real) and '.' (padding)."""
    return torch.tensor([[c == "1" for c in row] for row in rows], dtype=torch.bool).view(len(rows), -1)


def reference_layout(real, g):
    """N, w and {(b, t): (chunk, slot)} for the real tokens, by a loop over each row."""
    B, T = real.shape
    rows = [[t for t in range(T) if real[b, t]] for b in range(B)]
    longest = max((len(r) for r in rows), default=0)
    N = max(1, math.ceil(longest / g))
    w = max(1, min(g, longest))
    where = {(b, t): (i // g, i % g) for b, toks in enumerate(rows) for i, t in enumerate(toks)}
    return N, w, where


# (mask, g, N, w) with N and w worked out by hand
CASES = {
    "g=1": (mask("..111", "1.1.1", "11..."), 1, 3, 1),
    "g=3, two and three chunks": (mask("11111111", "..111111", "1.1.1..."), 3, 3, 3),
    "g=4, left and right padding": (mask("..111111", "11111...", "......11"), 4, 2, 4),
    "rows shorter than g: one chunk": (mask("..11", "111.", "1..."), 4, 1, 3),
    "at most one real token a row: width 1": (mask("...1", "1...", "...."), 3, 1, 1),
    "one real token, g=1": (mask("..1.",), 1, 1, 1),
    "all padding": (mask("....", "...."), 3, 1, 1),
    "empty batch": (torch.zeros(0, 5, dtype=torch.bool), 3, 1, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_equals_a_loop_over_each_rows_real_tokens(case):
    """num_chunks, width (hand-worked and from the loop), slot (B, T) (0 on padding) and
    chunk_real (B, N, w) against the loop's (chunk, slot) of every real token."""
    real, g, N, w = CASES[case]
    ref_N, ref_w, where = reference_layout(real, g)
    assert (ref_N, ref_w) == (N, w)
    layout = ChunkLayout(real, g)
    assert (layout.num_chunks, layout.width) == (N, w)
    B, T = real.shape
    slot = torch.zeros(B, T, dtype=torch.long)
    chunk_real = torch.zeros(B, N, w, dtype=torch.bool)
    for (b, t), (c, s) in where.items():
        slot[b, t] = s
        chunk_real[b, c, s] = True
    assert torch.equal(layout.slot, slot)
    assert layout.chunk_real.shape == (B, N, w) and torch.equal(layout.chunk_real, chunk_real)
    assert torch.equal(layout.real, real)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rest", [(), (2,), (2, 3)], ids=["(B,T)", "(B,T,2)", "(B,T,2,3)"])
def test_gather_and_scatter_equal_a_loop_over_the_tokens(case, rest):
    """gather: x (B, T, *rest) -> (B, N, w, *rest), x's token at its (chunk, slot), zero on
    empty slots; scatter: y (B, N, w, *rest) -> (B, T, *rest), each real token's slot of y,
    padding tokens ``fill``; scatter after gather gives x back on the real tokens."""
    real, g, N, w = CASES[case]
    _, _, where = reference_layout(real, g)
    B, T = real.shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, *rest, generator=gen) + 10.0  # no entry is 0
    y = torch.randn(B, N, w, *rest, generator=gen) + 10.0
    fill = torch.randn(B, T, *rest, generator=gen) - 10.0
    layout = ChunkLayout(real, g)

    gathered = torch.zeros(B, N, w, *rest)
    scattered = fill.clone()
    for (b, t), (c, s) in where.items():
        gathered[b, c, s] = x[b, t]
        scattered[b, t] = y[b, c, s]
    assert torch.equal(layout.gather(x), gathered)
    assert torch.equal(layout.scatter(y, fill), scattered)
    back = layout.scatter(layout.gather(x), fill)
    assert torch.equal(back, torch.where(real.view(B, T, *[1] * len(rest)), x, fill))


@pytest.mark.parametrize("size", [0, -2])
def test_a_chunk_size_below_one_is_refused_with_its_value(size):
    with pytest.raises(ValueError, match=rf"^chunk size must be >= 1; got {size}$"):
        ChunkLayout(mask("111"), size)


# ---- local_positions --------------------------------------------------------------------

PAD = 1


@pytest.mark.parametrize("learned", [False, True], ids=["sinusoidal", "learned"])
@pytest.mark.parametrize("g", [1, 3, 4])
def test_local_positions_are_the_positions_of_each_chunk_alone(learned, g):
    """local_positions (B, T, d) of the slots: each real token gets what fairseq's position
    module gives it in a sequence made of its chunk's tokens alone (positions restart in
    every chunk); padding gets 0."""
    torch.manual_seed(0)
    d = 8
    embed_positions = PositionalEmbedding(64, d, padding_idx=PAD, learned=learned)
    real = mask("..11111111", "11111.....", "1.1.1.1.1.")
    B, T = real.shape
    _, _, where = reference_layout(real, g)
    slot = torch.zeros(B, T, dtype=torch.long)
    for (b, t), (_, s) in where.items():
        slot[b, t] = s
    got = local_positions(embed_positions, slot, real, g)

    expected = torch.zeros(B, T, d)
    for b in range(B):
        chunks = {}
        for t in range(T):
            if real[b, t]:
                chunks.setdefault(where[b, t][0], []).append(t)
        for toks in chunks.values():
            alone = torch.full((1, len(toks)), PAD + 5)  # the chunk's tokens, no padding
            expected[b, toks] = embed_positions(alone)[0]
    assert got.shape == (B, T, d) and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class DeviceChecked:
    """fairseq's position module behind a device check: like a CUDA kernel, it refuses
    tokens on another device than its table's (the meta device lets a CPU test see a tensor
    made on the default device instead of the slots' device)."""

    def __init__(self, module, device):
        self.module, self.device = module.to(device), torch.device(device)
        self.padding_idx = module.padding_idx

    def __call__(self, tokens):
        assert tokens.device == self.device, f"tokens on {tokens.device}, the table on {self.device}"
        return self.module(tokens)


def test_local_positions_are_made_on_the_slots_device():
    """The positions' placeholder tokens are made on the slots' device (meta here; CUDA in
    a GPU run), and the result lands there."""
    embed_positions = DeviceChecked(PositionalEmbedding(64, 8, padding_idx=PAD, learned=False), "meta")
    real = mask("..111", "11111").to("meta")
    slot = torch.zeros(2, 5, dtype=torch.long, device="meta")
    out = local_positions(embed_positions, slot, real, 3)
    assert out.device.type == "meta" and out.shape == (2, 5, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_local_positions_on_cuda_equal_the_cpu_ones():
    embed_positions = PositionalEmbedding(64, 8, padding_idx=PAD, learned=False)
    real = mask("..11111", "1111111")
    layout = ChunkLayout(real, 3)
    cpu = local_positions(embed_positions, layout.slot, real, 3)
    gpu = local_positions(embed_positions.cuda(), layout.slot.cuda(), real.cuda(), 3)
    assert gpu.is_cuda
    torch.testing.assert_close(gpu.cpu(), cpu)
