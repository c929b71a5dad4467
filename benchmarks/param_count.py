"""Parameter count of every preset, as in the paper's Table 1 (docs/model.md#presets).

One line per architecture, ``ARCH PARAMS``, for a 32,768-entry joined dictionary with all
embeddings shared (``--share-all-embeddings``), followed by the paper's figure where it
has one. fairseq's ``transformer_wmt_en_de`` is the vanilla baseline.

    python benchmarks/param_count.py
"""
import argparse
import logging

logging.disable(logging.WARNING)

from sut_fairseq.models.standalone import build_model  # noqa: E402

PRESETS = ["sut_base", "sut_big", "ut_base", "ut_big", "ut_cfq", "sut_logic", "sut_tiny",
           "ut_cpvr", "hyper_ut_cpvr", "tlb_logic", "gutlb_logic", "tlb_flipflop", "gutlb_flipflop",
           "transformer_wmt_en_de", "sut_multi30k", "ut_multi30k", "transformer_multi30k"]
PAPER = {"sut_base": 66e6, "sut_big": 110e6, "ut_base": 64e6, "ut_big": 105e6,
         "transformer_wmt_en_de": 65e6}


def count(arch: str, dict_size: int) -> int:
    model = build_model(arch, dict_size=dict_size, share_all_embeddings=True)
    return sum(p.numel() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dict-size", type=int, default=32768)
    parser.add_argument("--arch", nargs="*", default=PRESETS)
    args = parser.parse_args()
    for arch in args.arch:
        n = count(arch, args.dict_size)
        note = ""
        if arch in PAPER:
            note = f"  # paper {PAPER[arch] / 1e6:.0f}M, ours {n / 1e6:.1f}M ({100 * (n / PAPER[arch] - 1):+.1f}%)"
        print(f"{arch} {n}{note}")


if __name__ == "__main__":
    main()
