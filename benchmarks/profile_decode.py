"""Where beam search's time goes: one batch of ``generate_throughput.py``'s synthetic test
set decoded by each model under ``torch.profiler`` (after one untimed and one timed
decoding of the same batch), the self time of every operator and profiled
range (the Python between operators lands in the ranges: ``other``) sorted into
``profile_step.py``'s groups (matmul, gather/scatter, copies and fills, other).

Printed per model: the unprofiled seconds, the decoder calls (one per generated position of
the batch), ms per decoder call, **aten operator calls per decoder call** (the profiler's
count: every aten operator, also those a composite operator calls inside C++), **operators
called from Python per decoder call** (the aten operators whose caller is not another aten
operator: those the Python layers issue, also inside a custom op's Python implementation,
each paying the interpreter and the dispatcher), the groups' shares and the top operators with their calls per decoder call.

    python benchmarks/profile_decode.py [--preset wmt|multi30k] [--sentences 16]
        [--beam 5] [--top 12] [--arch ...]
"""
import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_throughput as gt  # noqa: E402
from profile_step import group_of  # noqa: E402

from fairseq.sequence_generator import SequenceGenerator  # noqa: E402


def called_from_python(events) -> int:
    """How many of the profiler's aten ``events`` were not called by another aten operator."""
    return sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def profile(arch: str, d, sample, args) -> None:
    model = gt.build(arch, len(d))
    generator = SequenceGenerator([model], d, beam_size=args.beam, max_len_a=args.max_len_a,
                                  max_len_b=args.max_len_b)
    cpu = torch.device("cpu")
    gt.decode(generator, model, sample, cpu)  # untimed: allocator, caches
    seconds, _, calls = gt.decode(generator, model, sample, cpu)
    with torch.profiler.profile() as prof:
        gt.decode(generator, model, sample, cpu)
    from_python = called_from_python(prof.events())
    events = list(prof.key_averages())  # aten operators, custom ops, the generator's own ranges
    total = sum(e.self_cpu_time_total for e in events)
    aten_calls = sum(e.count for e in events if e.key.startswith("aten::"))
    groups = collections.Counter()
    for e in events:
        groups[group_of(e.key)] += e.self_cpu_time_total
    rows = sample["nsentences"] * args.beam
    print(f"== {arch}: {seconds:.2f} s unprofiled, {calls} decoder calls of {rows} rows, "
          f"{1e3 * seconds / calls:.1f} ms/decoder call, {aten_calls / calls:.0f} aten calls/decoder call, "
          f"{from_python / calls:.0f} from Python")
    print("   " + ", ".join(f"{g} {100 * t / total:.1f}%" for g, t in groups.most_common()))
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"   {e.key:48s} {100 * e.self_cpu_time_total / total:5.1f}%  {e.count / calls:8.1f} calls/decoder call")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(gt.PRESETS), default="wmt")
    parser.add_argument("--arch", nargs="+", default=None,
                        help="models (default: the preset's SUT and transformer)")
    parser.add_argument("--sentences", type=int, default=16, help="sentences of the one batch")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--max-len-a", type=float, default=1.2)
    parser.add_argument("--max-len-b", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    preset = gt.PRESETS[args.preset]
    d, batches = gt.make_batches(args.sentences, preset["vocab"], 0, batch_size=args.sentences,
                                 mu=preset["mu"], sigma=preset["sigma"])
    sample = batches[0]
    print(f"--preset {args.preset}, torch {torch.__version__}, cpu, {torch.get_num_threads()} threads; "
          f"one batch of {sample['nsentences']} x {sample['net_input']['src_tokens'].size(1)} source tokens, "
          f"beam {args.beam}", flush=True)
    for arch in args.arch or preset["archs"][:2]:
        profile(arch, d, sample, args)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
