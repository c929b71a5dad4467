"""Is the chunked encoder linear in the sequence length?

Times the encoder forward of a dense UT and of a TLB with the same block (d = 64, E = k = 1,
4 heads of 16, FFN 256, 2 steps, no halting, no relative positions, pre-LN) on one random
sequence (batch 1) per length, the median of --repeats runs after two warm-ups, on
--threads threads (1 by default). The TLB cuts the sequence into chunks of --chunk real
tokens with --slots memory slots and U = 1 write block (docs/chunked.md). Prints the time
per token for each length, then for each model
``per-token(LONGEST)/per-token(SHORTEST)``: about 1 for a linear encoder (goal for the TLB:
<= 1.5), growing with the length for the UT, whose self-attention is quadratic.

    python benchmarks/chunked_scaling.py [--lengths 256 512 1024 2048 4096]
        [--repeats 5] [--threads 1] [--chunk 64] [--slots 10]
"""
import argparse
import logging
import statistics
import time

import torch

logging.disable(logging.WARNING)

from sut_fairseq.models.standalone import build_model  # noqa: E402

BLOCK = dict(encoder_embed_dim=64, att_experts=1, att_topk=1, att_heads=4, att_head_dim=16,
             ffd_experts=1, ffd_topk=1, ffd_hidden_dim=256, encoder_layers=2, decoder_layers=1,
             encoder_halting="none", decoder_halting="none", rel_pos="none",
             encoder_normalize_before=True, dropout=0.0)


def build(longest: int, **chunks):
    torch.manual_seed(0)
    model = build_model("sut_transformer", dict_size=1000, share_all_embeddings=True,
                        max_source_positions=longest, max_target_positions=longest,
                        **BLOCK, **chunks)
    return model.eval()


def time_encoder(model, src: torch.Tensor, repeats: int) -> float:
    """Median seconds of one encoder forward (after two warm-up runs)."""
    times = []
    with torch.no_grad():
        for _ in range(2):
            model.encoder(src)
        for _ in range(repeats):
            start = time.perf_counter()
            model.encoder(src)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=64, help="TLB chunk size g")
    parser.add_argument("--slots", type=int, default=10, help="TLB memory slots k")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    longest = max(args.lengths)
    models = {"UT": build(longest),
              "TLB": build(longest, encoder_chunk_size=args.chunk, encoder_memory_slots=args.slots,
                           tlb_encoder_out="both")}
    print(f"encoder forward, batch 1, d 64, 2 steps, {torch.get_num_threads()} thread(s); "
          f"TLB: g {args.chunk}, k {args.slots}, U 1; median of {args.repeats}")
    print(f"{'length':>7} " + " ".join(f"{name + ' ms':>10} {name + ' us/token':>13}" for name in models))
    per_token = {name: {} for name in models}
    g = torch.Generator().manual_seed(0)
    for n in sorted(args.lengths):
        src = torch.randint(4, 1000, (1, n), generator=g)
        row = f"{n:>7} "
        for name, model in models.items():
            t = time_encoder(model, src, args.repeats)
            per_token[name][n] = t / n
            row += f"{1e3 * t:>10.1f} {1e6 * t / n:>13.1f} "
        print(row.rstrip(), flush=True)
    short, long_ = min(args.lengths), longest
    for name in models:
        ratio = per_token[name][long_] / per_token[name][short]
        goal = " (goal <= 1.5)" if name == "TLB" else ""
        print(f"{name} per-token({long_})/per-token({short}): {ratio:.2f}{goal}")


if __name__ == "__main__":
    main()
