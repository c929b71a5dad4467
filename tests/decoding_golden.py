"""Beam search through fairseq's ``SequenceGenerator`` on small seeded models, one per
decoder code path, and the recorded results it must keep giving
(``tests/data/decoding_golden.json``, written by this module at the commit named in it).

The incremental decoder's caches, reordering and cross-attention were rewritten for speed
(docs/performance.md#decoding-beam-search); ``test_decoding_golden.py`` checks that fairseq-generate's
hypotheses and scores did not move. Every case decodes the same four sources (different
lengths, so left padding) with beam 5; the end-of-sentence row of the output projection is
scaled up so that hypotheses end at different steps and finished sentences leave the
batch (the generator's reordering that drops rows).

    python tests/decoding_golden.py --write     # record (only at a commit that changes decoding on purpose)
"""
import argparse
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "data", "decoding_golden.json")
if HERE not in sys.path:  # run as a script: the tests' helpers
    sys.path.insert(0, HERE)
from conftest import make_model, randomise_halting  # noqa: E402

#: name -> (arch, overrides): every decoder path of incremental decoding
CASES = {
    "stick-breaking": ("sut_tiny", dict(halting_threshold=0.6, decoder_layers=4)),
    "global-mean": ("sut_tiny", dict(halting_threshold=0.6, decoder_layers=4,
                                     decoder_halting="global-mean")),
    "act": ("sut_tiny", dict(halting_threshold=0.9, decoder_layers=4, decoder_halting="act")),
    "none": ("sut_tiny", dict(decoder_layers=3, decoder_halting="none")),
    "exits": ("sut_tiny", dict(decoder_layers=4, decoder_halting="pabee", exit_patience=1)),
    "chunked": ("sut_tiny", dict(halting_threshold=0.6, decoder_chunk_size=3,
                                 decoder_memory_slots=2, encoder_normalize_before=True,
                                 decoder_normalize_before=True)),
    "hyper": ("hyper_ut_cpvr", dict(decoder_layers=3, encoder_layers=2)),
}
BEAM, MAX_LEN_B = 5, 9


def sources(pad: int, eos: int):
    """Four sources (B, 8), left-padded as fairseq-generate collates them, and their lengths."""
    g = torch.Generator().manual_seed(7)
    lengths = [8, 6, 5, 3]
    src = torch.full((4, 8), pad, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, 8 - n:-1] = torch.randint(4, 40, (n - 1,), generator=g)
        src[i, -1] = eos
    return src, torch.tensor(lengths)


def build_case(name: str):
    arch, overrides = CASES[name]
    model = make_model(arch, **overrides)
    randomise_halting(model, seed=3)
    eos = model.decoder.dictionary.eos()
    with torch.no_grad():  # make </s> likely enough that beams finish at different steps
        model.decoder.output_projection.weight[eos] *= 4.0
    return model


def decode_case(name: str) -> list:
    """Per sentence, per hypothesis: tokens, the score and the positional scores."""
    from fairseq.sequence_generator import SequenceGenerator

    model = build_case(name)
    d = model.decoder.dictionary
    src, lengths = sources(d.pad(), d.eos())
    generator = SequenceGenerator([model], d, beam_size=BEAM, max_len_a=0, max_len_b=MAX_LEN_B)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}, "id": torch.arange(4)}
    hypos = generator.generate([model], sample)
    return [[{"tokens": h["tokens"].tolist(), "score": float(h["score"]),
              "positional_scores": h["positional_scores"].tolist()} for h in sentence]
            for sentence in hypos]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"record {GOLDEN}")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    record = {"commit": commit, "beam": BEAM, "max_len_b": MAX_LEN_B,
              "cases": {name: decode_case(name) for name in CASES}}
    for name, sentences in record["cases"].items():
        print(name, [len(s[0]["tokens"]) for s in sentences])
    if args.write:
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        tmp = GOLDEN + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=0)
        os.replace(tmp, GOLDEN)
        print("wrote", GOLDEN)


if __name__ == "__main__":
    main()
