"""Does halting save decoding time? Beam search with a trained SUT/UT checkpoint at several
α_thresh, through fairseq's ``SequenceGenerator`` as fairseq-generate runs it (beam 5,
``max_len_a`` 0, ``max_len_b`` 200, fairseq-generate's defaults), over the first
``--sentences`` sentences of a binarised subset.

A lower threshold changes the hypotheses, and so their lengths and the number of decoder
calls; the time is therefore compared per decoder position (one row of one decoder call:
a beam's token), beside the decoder steps executed per position (the plugin's step
accounting). Printed per threshold::

    alpha_thresh A: S sentences/s, P decoder positions, U us/position, decoder steps executed X%, encoder Y%

and, for each threshold against the first (the highest, where nothing halts):
``time saved per position / decoder steps skipped: R`` (1.0: time falls in proportion to
the decoder steps skipped; the encoder runs once per sentence and is inside the time).
The thresholds take turns batch by batch (a slow phase of a shared machine hits all
alike), after one untimed batch each.

What halting can save is the time inside the decoder's recurrence steps (the shared block
and the halting unit, ``RecurrenceStep``); beam search, the embedding, the output layer
and its softmax cost the same at every threshold. Each threshold's line therefore also
gives that time (``decoder steps S s, X% of the time``, and the output layer's share), and
each comparison its own ratio
in the steps alone: if the steps' time fell exactly with the steps skipped, the whole
decoding's ratio would be their share of the time (X% at the reference threshold).

A third line per threshold says where the whole decoding's time goes: the decoder steps,
the output layer, the decoder call's other work (embedding, halting read-out, caches), the
encoder, the reorders of the decoder's state and of the encoder output between calls,
fairseq's log-softmax of the logits, and the rest, fairseq's beam search itself::

      where the time goes: decoder steps X%, output layer Y%, the decoder's other work Z%, encoder E%, reorders R%, log-softmax S%, beam search G%

and, where some rows halted, where those rows fall: in steps whose block ran on the
running rows alone, or in steps with too few rows halted for that, where the block runs on
every row and a halted row saves only its routed projections::

      halted rows in the decoder's steps: N, X% in steps on the running rows alone, Y% in steps with fewer than 25% of the rows halted (block on every row)

A lower threshold can also change how long the hypotheses are, and a batch whose last
sentences run long decodes them with few rows per call, which costs more per position
whatever the halting. ``--fixed-length L`` removes that: every hypothesis is exactly L
tokens (fairseq's ``min_len`` = ``max_len`` = L, end-of-sentence forced at L), so every
threshold makes the same decoder calls on the same rows, and the time compares directly
with the steps executed (the halting is the trained model's, on real sources; past a
sentence's natural end the tokens are the model's continuation).

    python benchmarks/decode_halting.py --path CHECKPOINT --data DATA_BIN
        [--subset test] [--sentences 500] [--thresholds 0.999 0.5] [--beam 5] [--batch-size 64]
        [--fixed-length L] [--rounds N] [--plot PNG]

``--plot PNG`` draws the trade-off: per threshold, the time per decoder position against the
decoder steps executed, both relative to the first threshold, beside two lines: time in
proportion to the steps (y = x), and the most halting can save if the decoder steps' time
fell exactly with them while everything else stayed (y = 1 - s (1 - x), s the steps' share
of the time at the first threshold).

The figures printed are pooled over ``--rounds`` passes over the sentences; with more than
one, each comparison also prints each pass's ratio and their median::

      each of the N rounds, time saved per position / decoder steps skipped: r1, r2, ...; median M
      each of the N rounds, in the decoder steps alone: s1, s2, ...; median M
"""
import argparse
import logging
import os
import statistics
import sys
import time

import torch

logging.disable(logging.WARNING)

from fairseq.sequence_generator import SequenceGenerator  # noqa: E402

from sut_fairseq.analysis.sweep import load_checkpoint  # noqa: E402
from sut_fairseq.modules import recurrence  # noqa: E402


def load(path: str, data: str, subset: str, sentences: int, batch_size: int):
    """The model (eval), its target dictionary and the batches of the first ``sentences``
    sentences of ``subset`` (by id), in fairseq-generate's order (sorted by length)."""
    model, task, _ = load_checkpoint(data, path, subset)
    model.eval()
    if not hasattr(model, "set_halting_threshold"):
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: {path} is not a SUT/UT checkpoint (no halting threshold)")
    dataset = task.dataset(subset)
    order = [i for i in dataset.ordered_indices() if i < sentences]  # ids 0..sentences-1
    batches = [dataset.collater([dataset[i] for i in order[s:s + batch_size]])
               for s in range(0, len(order), batch_size)]
    return model, task.target_dictionary, batches


class Clocks:
    """Seconds spent inside parts of the decoding, by name: modules (forward pre- and
    post-hooks, ``module``) and bound methods (``method``: the method replaced on its
    object by a timed wrapper, for those fairseq calls directly rather than through
    ``__call__``). A part called inside another is counted in both."""

    def __init__(self):
        self.seconds = {}
        self._start = {}

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def module(self, name: str, module: torch.nn.Module) -> None:
        self.seconds[name] = 0.0
        module.register_forward_pre_hook(lambda m, args: self._start.__setitem__(name, time.perf_counter()))
        module.register_forward_hook(lambda m, args, out: self._add(name, self._start[name]))

    def method(self, name: str, owner, attribute: str) -> None:
        self.seconds[name] = 0.0
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._add(name, start)

        setattr(owner, attribute, timed)

    def _add(self, name: str, start: float) -> None:
        self.seconds[name] += time.perf_counter() - start


def clocks_for(model) -> Clocks:
    """The parts of a decoding: the decoder's recurrence steps (its block and halting unit)
    and output layer, the decoder call around them (embedding, halting read-out, the
    caches), the encoder, the reorders of the decoder's state and of the encoder output
    between calls, and fairseq's log-softmax of the logits; the rest of the time is
    fairseq's beam search (top-k, scores, finished hypotheses)."""
    clocks = Clocks()
    clocks.module("steps", model.decoder.side.recurrence.step)
    clocks.module("output", model.decoder.output_projection)
    clocks.method("decoder", model.decoder, "forward")
    clocks.method("encoder", model.encoder, "forward")
    clocks.method("reorder_state", model.decoder, "reorder_incremental_state")
    clocks.method("reorder_encoder", model.encoder, "reorder_encoder_out")
    clocks.method("log_softmax", model, "get_normalized_probs")
    return clocks


class HaltedRows:
    """Where the decoder's halted rows fall: for every incremental decoder step with some
    rows halted and some running, its halted rows, counted under ``compacted`` when the
    block ran on the running rows alone (at least ``recurrence.COMPACT_HALTED_SHARE`` of
    the call's rows halted) and under ``masked`` otherwise (the block on every row, the
    halted ones only dropped from the routed projections). A compacted step's count comes
    from the rows ``recurrence.running_rows`` returns; a masked step's from one host read
    of its ``running`` mask."""

    def __init__(self):
        self.compacted = self.masked = 0
        inner = recurrence.running_rows

        def counted(running, query, inputs, z, memory_kv):
            rows = inner(running, query, inputs, z, memory_kv)
            if rows is not None:  # compacted: the running rows are already on the host
                self.compacted += running.size(0) - rows.numel()
            elif inputs.cache is not recurrence.NO_CACHE and query.size(1) == 1:
                halted = running.size(0) - int(running[:, 0].sum())
                if 0 < halted < running.size(0):
                    self.masked += halted
            return rows

        recurrence.running_rows = counted

    def reset(self) -> None:
        self.compacted = self.masked = 0


def shares(parts: dict, seconds: float) -> str:
    """``parts`` (Clocks.seconds summed over batches) as percentages of ``seconds``."""
    rest = {"decoder steps": parts["steps"], "output layer": parts["output"],
            "the decoder's other work": parts["decoder"] - parts["steps"] - parts["output"],
            "encoder": parts["encoder"], "reorders": parts["reorder_state"] + parts["reorder_encoder"],
            "log-softmax": parts["log_softmax"]}
    rest["beam search"] = seconds - sum(rest.values())
    return ", ".join(f"{name} {100 * t / seconds:.1f}%" for name, t in rest.items())


def decode_all(generator, model, batches, seconds):
    """Decode every batch; add its seconds to ``seconds``."""
    for sample in batches:
        start = time.perf_counter()
        generator.generate([model], sample)
        seconds.append(time.perf_counter() - start)


def one_round(generator, model, batches, thresholds, clocks: Clocks, halted: HaltedRows, label: str) -> dict:
    """One pass over ``batches``, the thresholds taking turns batch by batch. Returns per
    threshold: seconds per batch, decoder and encoder steps executed and their maxima,
    decoder positions, the Clocks' parts and the halted rows' counts."""
    meter = model.step_meter
    figures = {t: {"seconds": [], "executed": {"enc": 0, "dec": 0}, "maximum": {"enc": 0, "dec": 0},
                   "positions": 0, "parts": dict.fromkeys(clocks.seconds, 0.0),
                   "halted": {"compacted": 0, "masked": 0}}
               for t in thresholds}
    for i, sample in enumerate(batches, 1):
        for threshold in thresholds:
            model.set_halting_threshold(threshold)
            meter.reset()
            clocks.reset()
            halted.reset()
            f = figures[threshold]
            decode_all(generator, model, [sample], f["seconds"])
            f["halted"]["compacted"] += halted.compacted
            f["halted"]["masked"] += halted.masked
            for part, seconds in clocks.seconds.items():
                f["parts"][part] += seconds
            for side in ("enc", "dec"):
                f["executed"][side] += meter.executed[side]
                f["maximum"][side] += meter.maximum[side]
            f["positions"] += meter.positions["dec"]
        print(f"[{label}batch {i}/{len(batches)}] " + ", ".join(
            f"{t}: {sum(figures[t]['seconds']):.1f} s" for t in thresholds), file=sys.stderr, flush=True)
    return figures


def pooled(rounds: list) -> dict:
    """The rounds' figures (``one_round``'s) added up, per threshold."""
    out = {}
    for t in rounds[0]:
        fs = [r[t] for r in rounds]
        out[t] = {"seconds": [x for f in fs for x in f["seconds"]],
                  "positions": sum(f["positions"] for f in fs),
                  **{key: {k: sum(f[key][k] for f in fs) for k in fs[0][key]}
                     for key in ("executed", "maximum", "parts", "halted")}}
    return out


def summary(f: dict) -> dict:
    """Seconds per decoder position (all, and in the decoder's steps), the steps' share of
    the time, and the decoder's and encoder's steps executed (fractions)."""
    seconds = sum(f["seconds"])
    return {"seconds": seconds, "per_position": seconds / f["positions"],
            "steps_per_position": f["parts"]["steps"] / f["positions"],
            "share": f["parts"]["steps"] / seconds,
            "dec": f["executed"]["dec"] / f["maximum"]["dec"],
            "enc": f["executed"]["enc"] / f["maximum"]["enc"]}


def comparison(base: dict, r: dict) -> dict:
    """One threshold's ``summary`` against the reference's: time per position saved,
    decoder steps skipped, and the ratios (None where no decoder step was skipped)."""
    saved = 1 - r["per_position"] / base["per_position"]
    skipped = 1 - r["dec"] / base["dec"]
    in_steps = 1 - r["steps_per_position"] / base["steps_per_position"]
    return {"saved": saved, "skipped": skipped, "in_steps": in_steps,
            "ratio": saved / skipped if skipped > 0 else None,
            "in_steps_ratio": in_steps / skipped if skipped > 0 else None}


def plot(rows: dict, thresholds, path: str, title: str) -> None:
    """The ``--plot`` figure: relative time per position against relative decoder steps
    executed, one labelled point per threshold, and the two reference lines."""
    from sut_fairseq.analysis.plots import _pyplot, savefig_atomic

    base = rows[thresholds[0]]
    xs = [rows[t]["dec"] / base["dec"] for t in thresholds]
    ys = [rows[t]["per_position"] / base["per_position"] for t in thresholds]
    low = min(xs + [0.5])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5.0), layout="constrained")
    line = [low, 1.0]
    ax.plot(line, line, "--", color="gray", label="time in proportion to the decoder steps")
    ax.plot(line, [1 - base["share"] * (1 - x) for x in line], ":", color="tab:red",
            label=f"decoder steps' time only ({100 * base['share']:.0f}% of it at {thresholds[0]:g})")
    ax.plot(xs, ys, "o", color="tab:blue", label=r"measured, one point per $\alpha_{thresh}$")
    for x, y, t in zip(xs, ys, thresholds):
        ax.annotate(f"{t:g}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel(f"decoder steps executed (relative to alpha_thresh {thresholds[0]:g})")
    ax.set_ylabel("time per decoder position (relative)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=9)
    savefig_atomic(fig, path)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description="Does halting save decoding time? Beam search "
                                     "with a trained SUT/UT checkpoint at several alpha_thresh.")
    parser.add_argument("--path", required=True, help="a trained SUT/UT checkpoint")
    parser.add_argument("--data", required=True, help="its data-bin directory")
    parser.add_argument("--subset", default="test", help="binarised subset (default: test)")
    parser.add_argument("--sentences", type=int, default=500,
                        help="decode the subset's first N sentences (default 500)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.999, 0.5],
                        help="alpha_thresh values, the first the reference (default 0.999 0.5)")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    parser.add_argument("--fixed-length", type=int, metavar="L",
                        help="every hypothesis exactly L tokens: the same decoder calls and rows "
                             "at every threshold (default: fairseq-generate's own lengths)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over the sentences; with more than one, each pass's ratios "
                             "and their median are printed too (default 1)")
    parser.add_argument("--plot", metavar="PNG",
                        help="write the trade-off (time per position against decoder steps executed) as a PNG")
    args = parser.parse_args()
    if args.fixed_length is not None and args.fixed_length < 1:
        parser.error(f"--fixed-length {args.fixed_length}: needs at least one token (L >= 1)")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: needs at least one pass (N >= 1)")
    if len(set(args.thresholds)) != len(args.thresholds):
        parser.error(f"--thresholds {' '.join(map(str, args.thresholds))}: each threshold once")
    if args.plot is not None and not args.plot.endswith(".png"):
        parser.error(f"--plot {args.plot}: the figure is a PNG file (a name ending in .png)")
    if args.plot is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        parser.error(f"--plot {args.plot}: no directory {os.path.dirname(os.path.abspath(args.plot))}")
    torch.manual_seed(0)
    model, tgt_dict, batches = load(args.path, args.data, args.subset, args.sentences, args.batch_size)
    lengths = {} if args.fixed_length is None else dict(
        min_len=args.fixed_length, max_len_a=0, max_len_b=args.fixed_length)
    generator = SequenceGenerator([model], tgt_dict, beam_size=args.beam, **lengths)
    clocks = clocks_for(model)
    halted = HaltedRows()
    n = sum(b["nsentences"] for b in batches)
    length = "" if args.fixed_length is None else f", every hypothesis {args.fixed_length} tokens"
    print(f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads; {args.path}; "
          f"{n} sentences of {args.subset} in {len(batches)} batches, beam {args.beam}{length}", flush=True)
    with torch.no_grad():
        for threshold in args.thresholds:  # untimed: allocator, caches
            model.set_halting_threshold(threshold)
            decode_all(generator, model, batches[:1], [])
        rounds = [one_round(generator, model, batches, args.thresholds, clocks, halted,
                            f"round {k}/{args.rounds}, " if args.rounds > 1 else "")
                  for k in range(1, args.rounds + 1)]
    figures = pooled(rounds)
    rows = {t: summary(f) for t, f in figures.items()}
    for threshold in args.thresholds:
        f, row = figures[threshold], rows[threshold]
        seconds = row["seconds"]
        print(f"alpha_thresh {threshold}: {n * args.rounds / seconds:.2f} sentences/s, {f['positions']} decoder "
              f"positions, {1e6 * row['per_position']:.0f} us/position, decoder steps "
              f"executed {100 * row['dec']:.1f}%, encoder {100 * row['enc']:.1f}%; "
              f"decoder steps {f['parts']['steps']:.1f} s, {100 * row['share']:.1f}% of the time, "
              f"output layer {100 * f['parts']['output'] / seconds:.1f}%")
        print(f"  where the time goes: {shares(f['parts'], seconds)}")
        rows_halted = f["halted"]["compacted"] + f["halted"]["masked"]
        if rows_halted:
            print(f"  halted rows in the decoder's steps: {rows_halted}, "
                  f"{100 * f['halted']['compacted'] / rows_halted:.1f}% in steps on the running rows "
                  f"alone, {100 * f['halted']['masked'] / rows_halted:.1f}% in steps with fewer than "
                  f"{recurrence.COMPACT_HALTED_SHARE:.0%} of the rows halted (block on every row)")
    reference = args.thresholds[0]
    for threshold in args.thresholds[1:]:
        c = comparison(rows[reference], rows[threshold])
        ratio = "n/a (no decoder step skipped)" if c["ratio"] is None else f"{c['ratio']:.2f}"
        print(f"alpha_thresh {threshold} against {reference}: time per position saved "
              f"{100 * c['saved']:.1f}%, decoder steps skipped {100 * c['skipped']:.1f}%; time saved per "
              f"position / decoder steps skipped: {ratio}")
        ratio = "n/a" if c["in_steps_ratio"] is None else f"{c['in_steps_ratio']:.2f}"
        print(f"  in the decoder steps alone: time saved {100 * c['in_steps']:.1f}%, time saved / steps "
              f"skipped: {ratio} (the whole decoding's ratio is at most about the steps' share of "
              f"the time, {rows[reference]['share']:.2f})")
        if args.rounds > 1 and c["ratio"] is not None:
            each = [comparison(summary(r[reference]), summary(r[threshold])) for r in rounds]
            for key, what in (("ratio", "time saved per position / decoder steps skipped"),
                              ("in_steps_ratio", "in the decoder steps alone")):
                values = [e[key] for e in each if e[key] is not None]
                print(f"  each of the {args.rounds} rounds, {what}: "
                      + ", ".join(f"{v:.2f}" for v in values)
                      + f"; median {statistics.median(values):.2f}")
    if args.plot is not None:
        plot(rows, args.thresholds, args.plot,
             f"{os.path.basename(args.path)}: {n} sentences of {args.subset}, beam {args.beam}{length}")
        print(f"trade-off figure: {args.plot}")


if __name__ == "__main__":
    main()
