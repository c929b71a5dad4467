"""The incremental-decoding cache of the chunked decoder (``modules/chunk_cache.py``), unit
by unit: ``start``'s entries (which, their shapes, dtypes and device), ``empty_prefix``'s
steps 1..L, ``key_padding`` by hand, ``advance`` over a sequence of tokens with padding
against a per-row loop over the real tokens (buffers, counters, the memory written at each
completed chunk, the prefix sums reset there) and ``reorder``."""
import torch
import pytest

from sut_fairseq.modules import chunk_cache
from sut_fairseq.modules.memory import ChunkMemory

B, L, H, D, d, G = 3, 2, 2, 3, 4, 3  # batch, steps, heads, head dim, model dim, chunk size


class NoMemory:
    """A stand-in memory whose use shows: ``start`` must not need anything but ``begin``."""

    def begin(self, h):
        return torch.full((h.size(0), 2, h.size(2)), 7.0, dtype=h.dtype, device=h.device)


def _h(dtype=torch.float32, device="cpu", batch=B):
    return torch.randn(batch, 1, d, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)


# ---- start ---------------------------------------------------------------------------------

def test_start_without_memory_or_prefix_holds_zero_counters_and_zero_buffers_only():
    """Defaults: no memory and ``prefix=False`` give exactly count, chunk_max (long zeros,
    (B,)) and self_k/self_v (zeros of (L, B, H, g-1, D) in h's dtype); no "prefix" key
    (the default is False), no "rows"/"memory"."""
    h = _h(torch.float64)
    cache = chunk_cache.start(h, L, H, D, G)
    assert set(cache) == {"count", "chunk_max", "self_k", "self_v"}
    for name in ("count", "chunk_max"):
        assert cache[name].dtype == torch.long, name
        assert cache[name].shape == (B,)
        assert not cache[name].any()
    for name in ("self_k", "self_v"):
        assert cache[name].shape == (L, B, H, G - 1, D)
        assert cache[name].dtype == torch.float64
        assert not cache[name].any()


def test_start_with_memory_and_prefix_adds_rows_the_initial_memory_and_zero_prefix_sums():
    """With a memory: rows (B, g-1, d) zeros and memory = ``memory.begin(h)``; with
    ``prefix=True``: the zero prefix sums of steps 1..L."""
    h = _h()
    cache = chunk_cache.start(h, L, H, D, G, memory=NoMemory(), prefix=True)
    assert set(cache) == {"count", "chunk_max", "self_k", "self_v", "rows", "memory", "prefix"}
    assert cache["rows"].shape == (B, G - 1, d) and not cache["rows"].any()
    assert torch.equal(cache["memory"], torch.full((B, 2, d), 7.0))
    assert sorted(cache["prefix"]) == list(range(1, L + 1))
    cache = chunk_cache.start(h, L, H, D, G, memory=NoMemory(), prefix=False)
    assert "prefix" not in cache


def test_start_puts_every_entry_on_the_device_of_h():
    """The counters are made with ``torch.zeros`` (not from h): they must still be on h's
    device (here the meta device, which CPU-only runs also have), or the decoder mixes
    devices on a GPU."""
    h = _h().to("meta")
    cache = chunk_cache.start(h, L, H, D, G, prefix=True)
    for name in ("count", "chunk_max", "self_k", "self_v"):
        assert cache[name].device == h.device, name
    assert cache["count"].dtype == cache["chunk_max"].dtype == torch.long


# ---- empty_prefix --------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [1, 2, 3])
def test_empty_prefix_has_zero_sums_and_counts_for_exactly_steps_1_to_L(steps):
    """Keys exactly 1..L (not 0, not L+1, none missing); each a zero sum (B, d) and a zero
    count (B,) in h's dtype."""
    h = _h(torch.float64)
    prefix = chunk_cache.empty_prefix(h, steps)
    assert sorted(prefix) == list(range(1, steps + 1))
    for s, c in prefix.values():
        assert s.shape == (B, d) and c.shape == (B,)
        assert s.dtype == c.dtype == torch.float64
        assert not s.any() and not c.any()


# ---- key_padding ---------------------------------------------------------------------------

def test_key_padding_by_hand():
    """g = 4, keys [3 cached slots; the new token]: count 0 masks the 3 cached slots,
    count 1 the first 2, count 2 the first, count 3 none; the new token never."""
    cache = {"count": torch.tensor([0, 1, 2, 3])}
    expected = torch.tensor([[1, 1, 1, 0],
                             [1, 1, 0, 0],
                             [1, 0, 0, 0],
                             [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(chunk_cache.key_padding(cache, 4), expected)


def test_key_padding_is_on_the_device_of_the_counters():
    """The positions are made with ``torch.arange``: on the counters' device (meta here),
    or comparing them with the counters fails on a GPU."""
    cache = {"count": torch.tensor([0, 2]).to("meta")}
    mask = chunk_cache.key_padding(cache, 3)
    assert mask.device.type == "meta" and mask.shape == (2, 3) and mask.dtype == torch.bool


# ---- advance: against a per-row loop over the real tokens ----------------------------------

def _memory(seed=3):
    torch.manual_seed(seed)
    memory = ChunkMemory(d, 2, 1, H, D).double()
    with torch.no_grad():
        memory.initial.copy_(torch.randn(memory.initial.shape))
    return memory.eval()


class Reference:
    """One row, token by token: every real token's keys/values/S_L and steps in order; the
    current chunk's tokens; the memory written with each completed chunk's g rows."""

    def __init__(self, M0):
        self.keys, self.values, self.states = [], [], []
        self.chunk_steps = []  # steps of the current chunk's tokens (kept after it completes)
        self.count = 0
        self.M = M0

    def add(self, k, v, s, steps, memory):
        opened = self.count == 0
        if opened:
            self.chunk_steps = []
        before = max(self.chunk_steps, default=0)
        self.chunk_steps.append(steps)
        self.keys.append(k)
        self.values.append(v)
        self.states.append(s)
        self.count += 1
        done = self.count == G
        if done:
            rows = torch.stack(self.states[-G:])[None]
            with torch.no_grad():
                self.M = memory.update(self.M[None], rows, torch.ones(1, G, dtype=torch.bool))[0]
            self.count = 0
        return opened, max(self.chunk_steps) - before, done

    def last(self, items, like):
        """The last g-1 of the real tokens' items, zeros before the first (right-aligned)."""
        padded = [torch.zeros_like(like)] * (G - 1) + items
        return torch.stack(padded[len(padded) - (G - 1):])


def test_advance_over_tokens_with_padding_equals_a_loop_over_each_rows_real_tokens():
    """Three rows, 9 positions, padding at different places (left, inside, right), steps
    1..L at random: after every position the buffers hold each row's last g-1 real tokens'
    keys/values/S_L right-aligned; count is the slot in the chunk (0 after a completed
    chunk); ``opened`` marks a real token at slot 0; ``raised`` the rise of the chunk's most
    steps (0 for padding) and chunk_max that maximum (long); the memory is written exactly
    when a row completes a chunk, from its g real rows (a row not done keeps it); the prefix
    sums handed in are kept, or zeroed on the rows that completed a chunk."""
    g = torch.Generator().manual_seed(11)
    memory = _memory()
    real_all = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1],
                             [1, 1, 0, 1, 1, 0, 1, 1, 1],
                             [1, 1, 1, 1, 0, 0, 1, 0, 0]], dtype=torch.bool)
    h = torch.zeros(B, 1, d, dtype=torch.float64)
    cache = chunk_cache.start(h, L, H, D, G, memory=memory, prefix=True)
    refs = [Reference(cache["memory"][b].clone()) for b in range(B)]
    any_done = any_kept = False
    for t in range(real_all.size(1)):
        real = real_all[:, t]
        new_k = [torch.randn(B, H, 1, D, generator=g, dtype=torch.float64) for _ in range(L)]
        new_v = [torch.randn(B, H, 1, D, generator=g, dtype=torch.float64) for _ in range(L)]
        S = torch.randn(B, 1, d, generator=g, dtype=torch.float64)
        steps = torch.randint(1, L + 1, (B,), generator=g)
        prefix = {l: (torch.randn(B, d, generator=g, dtype=torch.float64),
                      torch.rand(B, generator=g, dtype=torch.float64) + 1) for l in range(1, L + 1)}
        # key_padding before the token: the cached slots that are not this chunk's tokens
        mask = chunk_cache.key_padding(cache, G)
        for b in range(B):
            c = refs[b].count
            assert mask[b].tolist() == [i < G - 1 - c for i in range(G)], (t, b)
        out, opened, raised = chunk_cache.advance(cache, new_k, new_v, S, real, steps, G,
                                                  memory, prefix)
        assert opened.dtype == torch.bool and raised.dtype == torch.long
        assert out["chunk_max"].dtype == out["count"].dtype == torch.long
        done = []
        for b in range(B):
            ref = refs[b]
            if real[b]:
                o, r, dn = ref.add(torch.stack([k[b, :, 0] for k in new_k]),
                                   torch.stack([v[b, :, 0] for v in new_v]),
                                   S[b, 0], int(steps[b]), memory)
            else:
                o, r, dn = False, 0, False
            done.append(dn)
            assert bool(opened[b]) == o, (t, b)
            assert int(raised[b]) == r, (t, b)
            assert int(out["count"][b]) == ref.count, (t, b)
            assert int(out["chunk_max"][b]) == max(ref.chunk_steps, default=0), (t, b)
            like_kv = torch.zeros(L, H, D, dtype=torch.float64)
            # (L, H, g-1, D): the last g-1 real tokens, the newest at g-2
            for name, items in (("self_k", ref.keys), ("self_v", ref.values)):
                expected = ref.last(items, like_kv).permute(1, 2, 0, 3)
                assert torch.equal(out[name][:, b], expected), (t, b, name)
            assert torch.equal(out["rows"][b], ref.last(ref.states, S[b, 0])), (t, b)
            torch.testing.assert_close(out["memory"][b], ref.M, atol=1e-12, rtol=1e-12)
            for l in range(1, L + 1):
                s, c = out["prefix"][l]
                keep = 0.0 if dn else 1.0
                assert torch.equal(s[b], prefix[l][0][b] * keep), (t, b, l)
                assert torch.equal(c[b], prefix[l][1][b] * keep), (t, b, l)
        any_done |= any(done)
        any_kept |= any(done) and not all(done)
        cache = out
    assert any_done and any_kept, "the test needs a step where some rows complete a chunk, not all"
    # the per-row counters differ (so a mix-up between rows shows)
    assert len(set(cache["count"].tolist())) > 1


def test_advance_without_memory_or_prefix_adds_neither():
    """No memory: no rows or memory in the new cache; no prefix handed in: none made."""
    h = _h()
    cache = chunk_cache.start(h, L, H, D, G)
    new = [torch.ones(B, H, 1, D) for _ in range(L)]
    out, opened, raised = chunk_cache.advance(cache, new, new, h, torch.ones(B, dtype=torch.bool),
                                              torch.full((B,), 2), G)
    assert set(out) == {"count", "chunk_max", "self_k", "self_v"}
    assert opened.all() and raised.tolist() == [2] * B and out["count"].tolist() == [1] * B


def test_a_padding_token_leaves_the_cache_as_it_was():
    """A padding token (real False) changes no entry and counts nothing, wherever the row
    is in its chunk (the other rows advance)."""
    g = torch.Generator().manual_seed(2)
    memory = _memory()
    h = torch.zeros(B, 1, d, dtype=torch.float64)
    cache = chunk_cache.start(h, L, H, D, G, memory=memory)
    for t in range(4):  # rows at different slots: row 0 gets every token, row 2 none
        real = torch.tensor([True, t % 2 == 0, False])
        new = [torch.randn(B, H, 1, D, generator=g, dtype=torch.float64) for _ in range(L)]
        S = torch.randn(B, 1, d, generator=g, dtype=torch.float64)
        steps = torch.randint(1, L + 1, (B,), generator=g)
        out, opened, raised = chunk_cache.advance(cache, new, new, S, real, steps, G, memory)
        for name in ("count", "chunk_max", "rows", "memory"):
            assert torch.equal(out[name][2], cache[name][2]), (t, name)
        for name in ("self_k", "self_v"):
            assert torch.equal(out[name][:, 2], cache[name][:, 2]), (t, name)
        assert not opened[2] and raised[2] == 0
        cache = out
    assert cache["count"].tolist() == [1, 2, 0]


# ---- reorder -------------------------------------------------------------------------------

def test_reorder_selects_every_entry_along_its_batch_dimension():
    """self_k/self_v along dim 1, the prefix sums and counts and every other entry along
    dim 0; rows may repeat (beam search)."""
    g = torch.Generator().manual_seed(5)
    cache = {"count": torch.tensor([0, 1, 2]), "chunk_max": torch.tensor([3, 4, 5]),
             "self_k": torch.randn(L, B, H, G - 1, D, generator=g),
             "self_v": torch.randn(L, B, H, G - 1, D, generator=g),
             "rows": torch.randn(B, G - 1, d, generator=g),
             "memory": torch.randn(B, 2, d, generator=g),
             "prefix": {l: (torch.randn(B, d, generator=g), torch.randn(B, generator=g))
                        for l in range(1, L + 1)}}
    order = torch.tensor([2, 0, 0])
    out = chunk_cache.reorder(cache, order)
    assert set(out) == set(cache)
    for name in ("count", "chunk_max", "rows", "memory"):
        assert torch.equal(out[name], cache[name][order]), name
    for name in ("self_k", "self_v"):
        assert torch.equal(out[name], cache[name][:, order]), name
    assert sorted(out["prefix"]) == list(range(1, L + 1))
    for l, (s, c) in out["prefix"].items():
        assert torch.equal(s, cache["prefix"][l][0][order])
        assert torch.equal(c, cache["prefix"][l][1][order])
