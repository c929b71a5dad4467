"""What one block of a trained SUT decoder costs on R of a beam-search call's rows: the
part of a block call that halting cannot save.

When some positions of a decoder call have halted, incremental decoding runs the step's
block on the running rows alone (``recurrence.block_on_rows``). Its cost is a part per
call (the routers, one GEMM per expert of each routed projection however few its rows,
the LayerNorms, the operators' dispatch) plus a part per row. This script captures the
block's inputs at one call of fairseq's beam search (the first ``--sentences`` of the
subset, beam 5, every hypothesis ``--fixed-length`` tokens; step ``--step`` at position
``--position``), times the full block and ``block_on_rows`` on R randomly chosen rows for
each R of ``--rows`` (the medians of ``--repeats`` interleaved rounds), and fits

    cost(R) = a + b · R        (least squares over the R timed)

Printed: the medians, the fit, and ``per-call share of a full block f = a / full``. With
a share f, a step that skips a fraction s of its rows saves at most (1 - f) · s of its time;
a skipped row saves b, whatever a is.

With ``--halted S ...``, for each share S of the call's rows (chosen at random) halted,
the two ways a step can run them: the block on every row with the halted ones masked (the
routers send them to no expert: only the routed projections skip them) and
``block_on_rows`` on the running rows (what incremental decoding does from
``recurrence.COMPACT_HALTED_SHARE`` halted)::

    with S halted: block on every row (masked) X ms, on the running rows Y ms

With ``--profile``, the block on the fewest rows asked for (where the per-call part a is
most of the time) runs ten times under ``torch.profiler``; printed are the aten operators
per call, the expert products (``aten::mm`` / ``addmm``, inside the grouped GEMM or the
expert loop) with their share of the time, and the rate at which the block's expert
weights would stream from memory if those products did nothing else::

    profile of the block on R rows: N aten operators per call, T ms per call under the profiler
      expert products: P per call, U us each, X% of the time; the block's expert weights W MB, streamed at G GB/s
      by self time: aten::mm X%, ...

    python benchmarks/block_on_rows.py --path CHECKPOINT --data DATA_BIN
        [--sentences 64] [--step 3] [--position 12] [--rows 320 240 160 80 8] [--repeats 7]
        [--halted 0.1 0.2 0.3] [--profile]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_halting import load  # noqa: E402  (this folder is on sys.path)
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

from sut_fairseq.modules import recurrence  # noqa: E402
from sut_fairseq.modules.expert_linear import ExpertLinear  # noqa: E402


def capture(model, batch, generator, step_index: int, position: int):
    """The block and its inputs (query (B, 1, d), keys/values (B, H, position + 1, D), the
    running rows, the StepInputs) at step ``step_index`` of the decoder call at
    ``position``, under beam search of ``batch`` at α_thresh 0.999 (every row running)."""
    step = model.decoder.side.recurrence.step
    inner, found = step.forward, {}

    def spy(h, S, running, l, state, rule, carry, inputs, te, decide_next, threshold=None):
        if l == step_index and inputs.q_start == position and not found:
            block = step.blocks[l - 1] if len(step.blocks) > 1 else step.blocks[0]
            query = h if te is None else recurrence.add_embedding(h, te, inputs.coords)
            k, v = inputs.cache.buffer.read(l, position)
            new_k, new_v = step.source(block, h if step.kv_from_state else S, None, te, inputs, carry, running)
            found.update(block=block, query=query, k=torch.cat([k, new_k], 2),
                         v=torch.cat([v, new_v], 2), running=running.clone(), inputs=inputs)
        return inner(h, S, running, l, state, rule, carry, inputs, te, decide_next, threshold)

    step.forward = spy
    try:
        generator.generate([model], batch)
    finally:
        step.forward = inner
    if not found:
        raise SystemExit(f"block_on_rows.py: no decoder call at position {position} with step {step_index} "
                         "(ask for a position below --fixed-length and a step the decoder has)")
    return found


def masked(c, running):
    """The captured block on every row with ``running`` (B, 1) as its mask."""
    inputs = c["inputs"]
    return lambda: c["block"](c["query"], c["k"], c["v"], running,
                              self_padding_mask=inputs.self_padding_mask, q_start=inputs.q_start,
                              cross_k=inputs.cross_k, cross_v=inputs.cross_v,
                              cross_padding_mask=inputs.cross_padding_mask)


def profile_block(call, block, rows: int, calls: int = 10) -> None:
    """``call`` (the block on ``rows`` rows) ``calls`` times under the profiler: operators,
    expert products and the bandwidth they imply (``--profile``)."""
    from torch.profiler import profile
    call()
    with profile() as prof:
        for _ in range(calls):
            call()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total_us = sum(e.self_cpu_time_total for e in events) / calls
    products = [e for e in events if e.key in ("aten::mm", "aten::addmm")]
    count = sum(e.count for e in products) / calls
    product_us = sum(e.self_cpu_time_total for e in products) / calls
    weights = sum(m.weight.numel() * m.weight.element_size()
                  for m in block.modules() if isinstance(m, ExpertLinear))
    print(f"profile of the block on {rows} rows: {sum(e.count for e in events) / calls:.0f} aten operators "
          f"per call, {total_us / 1e3:.2f} ms per call under the profiler")
    print(f"  expert products: {count:.0f} per call, {product_us / max(count, 1):.1f} us each, "
          f"{100 * product_us / total_us:.0f}% of the time; the block's expert weights {weights / 2**20:.2f} MB, "
          f"streamed at {weights / max(product_us, 1e-9) / 1e3:.1f} GB/s")
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
    print("  by self time: " + ", ".join(f"{e.key} {100 * e.self_cpu_time_total / calls / total_us:.0f}%"
                                         for e in top))


def seconds_per_call(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="a trained SUT checkpoint")
    parser.add_argument("--data", required=True, help="its data-bin directory")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--sentences", type=int, default=64, help="sentences of the one batch")
    parser.add_argument("--fixed-length", type=int, default=24)
    parser.add_argument("--step", type=int, default=3, help="the decoder step timed (1-based)")
    parser.add_argument("--position", type=int, default=12, help="the decoder call timed (0-based)")
    parser.add_argument("--rows", type=int, nargs="+", default=[320, 240, 160, 80, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--halted", type=float, nargs="*", default=[], metavar="S",
                        help="shares of the rows halted, each in (0, 1): the block masked against on the running rows")
    parser.add_argument("--profile", action="store_true",
                        help="profile the block on the fewest rows asked for: operators, expert products, bandwidth")
    args = parser.parse_args()
    if not 0 <= args.position < args.fixed_length:
        parser.error(f"--position {args.position}: must be in [0, --fixed-length {args.fixed_length})")
    for share in args.halted:
        if not 0 < share < 1:
            parser.error(f"--halted {share}: a share of the rows must be in (0, 1)")
    torch.manual_seed(0)
    model, target_dictionary, (batch,) = load(args.path, args.data, args.subset, args.sentences, args.sentences)
    if model.decoder.side.chunk_size:
        raise SystemExit(f"block_on_rows.py: {args.path} decodes chunk by chunk (no per-call block on rows)")
    model.set_halting_threshold(0.999)
    generator = SequenceGenerator([model], target_dictionary, beam_size=5, min_len=args.fixed_length,
                                  max_len_a=0, max_len_b=args.fixed_length)
    with torch.no_grad():
        c = capture(model, batch, generator, args.step, args.position)
        B = c["query"].size(0)
        rows = sorted({min(R, B) for R in args.rows if R > 0})
        g = torch.Generator().manual_seed(1)
        picks = {R: torch.randperm(B, generator=g)[:R].sort().values for R in rows}
        inputs = c["inputs"]

        full = masked(c, c["running"])  # every row running

        def on_rows(R):
            return lambda: recurrence.block_on_rows(c["block"], picks[R], c["query"], c["k"], c["v"],
                                                    c["running"], inputs)

        calls = {"full": full, **{R: on_rows(R) for R in rows}}
        for share in args.halted:  # the same random rows halted both ways
            halted = min(max(round(share * B), 1), B - 1)  # some rows halted, some running
            keep = torch.randperm(B, generator=g)[halted:].sort().values
            running = torch.zeros_like(c["running"])
            running[keep] = True
            calls[("masked", share)] = masked(c, running)
            calls[("rows", share)] = (lambda keep=keep, running=running: recurrence.block_on_rows(
                c["block"], keep, c["query"], c["k"], c["v"], running, inputs))
        times = {key: [] for key in calls}
        for _ in range(args.repeats):  # interleaved: a slow phase of the machine hits all alike
            for key, call in calls.items():
                times[key].append(seconds_per_call(call, 10))
    ms = {key: 1e3 * statistics.median(t) for key, t in times.items()}
    mean_r = sum(rows) / len(rows)
    mean_t = sum(ms[R] for R in rows) / len(rows)
    slope = (sum((R - mean_r) * (ms[R] - mean_t) for R in rows)
             / max(sum((R - mean_r) ** 2 for R in rows), 1e-12))
    per_call = mean_t - slope * mean_r
    print(f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads; {args.path}; step {args.step} "
          f"of the decoder call at position {args.position}, {B} rows "
          f"({args.sentences} sentences x beam 5), {c['k'].size(2)} cached positions")
    print(f"full block {ms['full']:.2f} ms; block on R rows: "
          + ", ".join(f"R={R} {ms[R]:.2f} ms" for R in rows))
    print(f"cost(R) = {per_call:.2f} ms + {1e3 * slope:.1f} us x R; "
          f"per-call share of a full block f = {per_call / ms['full']:.2f}")
    for share in args.halted:
        print(f"with {share:g} halted: block on every row (masked) {ms[('masked', share)]:.2f} ms, "
              f"on the running rows {ms[('rows', share)]:.2f} ms")
    if args.profile:
        with torch.no_grad():
            profile_block(calls[rows[0]], c["block"], rows[0])


if __name__ == "__main__":
    main()
