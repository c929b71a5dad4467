"""Incremental decoding's state for the (unchunked) SUT decoder. Beam search calls the
decoder once per generated position t and reorders its state between calls
(``reorder_incremental_state``: row b of the next call continues row ``order[b]``); rather
than growing the caches by concatenation and reordering them by copying:

* ``KeyValueBuffer``: keys and values of all L steps in one time-major buffer
  (T_cap, 2, L, B, H, D); step l of position t writes its row (B, H, D) in place and
  attends over a view of positions 0..t; a reorder is one ``index_select`` of the
  filled prefix into a second buffer of the same shape, and the two swap.
* ``CrossKV``: under beam search the encoder output's keys and values are projected from
  one copy per sentence (B / beam rows), the beams' queries attend to them as one group
  (``MixtureOfMultiHeadAttention``), and a reorder within the sentences moves nothing.
* ``DecoderState``: everything the decoder keeps between its calls, with one ``reorder``.
* ``reorder_encoder_rows``: the encoder output's rows after a reorder, which under beam
  search moves nothing once every sentence's rows are copies of one row.
"""
from typing import Dict, Optional, Tuple

import torch

from . import chunk_cache
from .chunk_cache import Prefix, reorder_prefix

#: positions added to the buffer at a time (a copy of the filled part each time)
CAPACITY_STEP = 32


class KeyValueBuffer:
    """Keys and values (B, H, D) per step l = 1..L and position t, time-major
    (T_cap, 2, L, B, H, D); ``length``: positions written."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.buf: Optional[torch.Tensor] = None
        self.spare: Optional[torch.Tensor] = None  # the reorder's target, same shape
        self.length = 0

    def write(self, step: int, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Step l's keys and values k, v (B, H, 1, D) of position t."""
        if k.size(2) != 1:
            raise ValueError(f"the buffer takes one position per call; got {k.size(2)}")
        if self.buf is None or t >= self.buf.size(0):
            self._reserve(t + 1, k)
        self.buf[t, 0, step - 1] = k[:, :, 0]
        self.buf[t, 1, step - 1] = v[:, :, 0]
        self.length = max(self.length, t + 1)

    def read(self, step: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Step l's keys and values of positions 0..n-1: views (B, H, n, D) of the buffer."""
        kv = self.buf[:n, :, step - 1]  # (n, 2, B, H, D)
        return kv[:, 0].permute(1, 2, 0, 3), kv[:, 1].permute(1, 2, 0, 3)

    def reorder(self, order: torch.Tensor) -> None:
        """Row b continues row ``order[b]`` (B',): one gather of the written positions."""
        if self.buf is None:
            return
        shape = (self.buf.size(0), 2, self.num_steps, order.numel()) + tuple(self.buf.shape[4:])
        out = self.spare if self.spare is not None and self.spare.shape == shape else self.buf.new_empty(shape)
        torch.index_select(self.buf[: self.length], 3, order, out=out[: self.length])
        self.spare = self.buf if tuple(self.buf.shape) == shape else None
        self.buf = out

    def _reserve(self, n: int, like: torch.Tensor) -> None:
        B, H, _, D = like.shape
        capacity = -(-n // CAPACITY_STEP) * CAPACITY_STEP
        grown = like.new_empty(capacity, 2, self.num_steps, B, H, D)
        if self.buf is not None:
            grown[: self.length] = self.buf[: self.length]
        self.buf, self.spare = grown, None


class BufferedKeyCache:
    """``chunk_cache.StepKeyCache``'s interface on ``KeyValueBuffer`` for one incremental
    call at position t: ``extend`` writes step l's new keys/values and returns those of
    positions 0..t (B, H, t + 1, D); ``record`` only writes (the steps a halted position
    skips)."""

    def __init__(self, buffer: KeyValueBuffer, t: int, prefix_in=None):
        if buffer.length != t:
            raise ValueError(f"the cache holds {buffer.length} positions; the decoder was "
                             f"called at position {t} (one call per position, in order)")
        self.buffer, self.t, self.num_steps = buffer, t, buffer.num_steps
        self.prefix_in, self.frozen_prefix = prefix_in, {}

    def record(self, step: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.buffer.write(step, self.t, k, v)

    def extend(self, step: int, k: torch.Tensor, v: torch.Tensor):
        self.record(step, k, v)
        return self.buffer.read(step, self.t + 1)


class CrossKV:
    """Cross-attention keys and values (B_kv, H, S, D) and the source padding (B_kv, S)
    of incremental decoding, B_kv = B / ``beams``: one row per sentence under beam
    search, else one per decoder row."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, padding: Optional[torch.Tensor],
                 beams: int):
        self.k, self.v, self.padding, self.beams = k, v, padding, beams

    @classmethod
    def project(cls, block, enc: torch.Tensor, padding: Optional[torch.Tensor],
                beam_size: int) -> "CrossKV":
        """From the encoder output ``enc`` (B, S, d_enc) as the generator passes it: when
        its rows come in groups of ``beam_size`` equal copies (one group per sentence,
        what ``reorder_encoder_out`` gives beam search), one row per group is projected;
        otherwise every row."""
        beams = 1
        if beam_size > 1 and enc.size(0) % beam_size == 0:  # compared once, at the first call
            groups = enc.view(-1, beam_size, *enc.shape[1:])
            beams = beam_size if bool((groups == groups[:, :1]).all()) else 1
        if beams > 1:
            enc = enc[::beams]
            padding = None if padding is None else padding[::beams]
        k, v = block.cross_kv(enc)
        return cls(k, v, padding, beams)

    def reorder(self, order: torch.Tensor) -> None:
        """Row b of the next call continues row ``order[b]`` (B',). With beams, a reorder
        within the sentences (order[b] // beams == b // beams) moves nothing; when
        sentences left the batch, row group i takes the sentence order[i * beams] // beams."""
        if self.beams > 1 and order.numel() == self.k.size(0) * self.beams:
            return
        rows = order.view(-1, self.beams)[:, 0] // self.beams if self.beams > 1 else order
        self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)
        if self.padding is not None:
            self.padding = self.padding.index_select(0, rows)


def first_beam_copies(order: torch.Tensor, rows: int) -> int:
    """G when ``order`` (B',) repeats each of ``rows`` rows G >= 2 times in place
    (``arange(rows).repeat_interleave(G)``: beam search's first reorder of the encoder
    output, one group of G copies per sentence), else 0."""
    G = order.numel() // rows if rows else 0
    if G < 2 or G * rows != order.numel():
        return 0
    return G if torch.equal(order, torch.arange(rows, device=order.device).repeat_interleave(G)) else 0


def within_groups(order: torch.Tensor, G: int) -> bool:
    """Whether output row b reads a row of its own group of G (order[b] // G == b // G)."""
    return torch.equal(order // G, torch.arange(order.numel(), device=order.device) // G)


def whole_groups(order: torch.Tensor, G: int) -> bool:
    """Whether every group of G output rows reads rows of one input group."""
    if order.numel() % G:
        return False
    groups = order.view(-1, G) // G
    return bool((groups == groups[:, :1]).all())


def reorder_encoder_rows(encoder_out: Dict, order: torch.Tensor) -> Dict:
    """fairseq's encoder-out dict with row b taken from row ``order[b]`` (B',): ``encoder_out``
    (S, B, d), ``encoder_padding_mask`` (B, S), ``src_lengths`` (B,); ``halting`` kept.

    Beam search reorders the encoder output before every decoder call. Its first reorder
    makes G copies of each sentence's row (``first_beam_copies``), recorded in the dict as
    ``beam_copies`` [G]; later reorders keep each beam within its sentence, so while the
    batch keeps its size every row is asked for a copy of itself and the dict is returned
    as it is (the copy of the (S, B, d) output would be a few percent of decoding). A
    reorder that drops finished sentences copies, and keeps the record while each group of
    G rows still reads one sentence."""
    pad = encoder_out["encoder_padding_mask"][0]
    G = encoder_out.get("beam_copies", [0])[0]
    if G and order.numel() == pad.size(0) and within_groups(order, G):
        return encoder_out
    out = {"encoder_out": [encoder_out["encoder_out"][0].index_select(1, order)],
           "encoder_padding_mask": [pad.index_select(0, order)],
           "src_lengths": [x.index_select(0, order) for x in encoder_out["src_lengths"]],
           "halting": encoder_out["halting"]}
    G = first_beam_copies(order, pad.size(0)) or (G if G and whole_groups(order, G) else 0)
    if G:
        out["beam_copies"] = [G]
    return out


class DecoderState:
    """The incremental state of one decoder over a batch of B rows (hypotheses):
    ``cross`` (``CrossKV``, set at the first call); ``kv`` (``KeyValueBuffer``); ``prefix``:
    global-mean halting's causal prefix sums per step l, else None; ``hyper_prefix``:
    Hyper-UT's (Σ h_{l-1}, count) per step l over the real prefix, else None; ``chunk``: the
    chunked decoder's cache (``chunk_cache.py``; then ``kv`` and the prefixes are unused)."""

    def __init__(self, num_steps: int):
        self.cross: Optional[CrossKV] = None
        self.kv = KeyValueBuffer(num_steps)
        self.prefix: Optional[Prefix] = None
        self.hyper_prefix: Optional[Prefix] = None
        self.chunk: Optional[Dict] = None

    def reorder(self, order: torch.Tensor) -> None:
        """Row b of the next call continues row ``order[b]`` (B',) — every part at once."""
        if self.cross is not None:
            self.cross.reorder(order)
        self.kv.reorder(order)
        self.prefix = reorder_prefix(self.prefix, order)
        self.hyper_prefix = reorder_prefix(self.hyper_prefix, order)
        if self.chunk is not None:
            self.chunk = chunk_cache.reorder(self.chunk, order)
