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
    model = build_case(name)
    d = model.decoder.dictionary
    return beam_search(model, d, *sources(d.pad(), d.eos()), BEAM, MAX_LEN_B)


def beam_search(model, dictionary, src, lengths, beam: int, max_len_b: int) -> list:
    """fairseq's ``SequenceGenerator`` on the sources ``src`` (B, S) (max_len_a 0): per
    sentence, per hypothesis, the tokens, the score and the positional scores."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], dictionary, beam_size=beam, max_len_a=0, max_len_b=max_len_b)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}, "id": torch.arange(src.size(0))}
    with torch.no_grad():
        hypos = generator.generate([model], sample)
    return [[{"tokens": h["tokens"].tolist(), "score": float(h["score"]),
              "positional_scores": h["positional_scores"].tolist()} for h in sentence]
            for sentence in hypos]


def assert_same_hypotheses(got: list, want: list) -> None:
    """The same hypotheses (tokens exactly) with the same scores (to 1e-5), sentence by
    sentence, as ``beam_search`` returns them."""
    import pytest

    assert len(got) == len(want)
    for sentence, (g, w) in enumerate(zip(got, want)):
        assert [h["tokens"] for h in g] == [h["tokens"] for h in w], f"sentence {sentence}"
        for h, r in zip(g, w):
            assert h["score"] == pytest.approx(r["score"], abs=1e-5)
            assert h["positional_scores"] == pytest.approx(r["positional_scores"], abs=1e-5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"record {GOLDEN}")
    args = parser.parse_args()
    record = {"beam": BEAM, "max_len_b": MAX_LEN_B, "cases": {name: decode_case(name) for name in CASES}}
    for name, sentences in record["cases"].items():
        print(name, [len(s[0]["tokens"]) for s in sentences])
    if args.write:
        write_record(GOLDEN, record)


def write_record(path: str, record: dict) -> None:
    """``record`` with the commit it was made at, as JSON at ``path`` (atomically)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"commit": commit, **record}, f, indent=0)
    os.replace(path + ".tmp", path)
    print("wrote", path)


if __name__ == "__main__":
    main()
