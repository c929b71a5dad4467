"""Flip-flop data (docs/flipflop.md): the strings against an independent re-reading, the
instruction frequencies, lengths, the splits (sizes, disjointness, determinism), the
last-write subset, the refusals, and data-prep/flipflop/generate.py."""
import itertools
import json
import math
import os
import random
from collections import Counter

import pytest

from cli_helpers import check_refusals, read_lines, run_binarized, run_in_process
from sut_fairseq.data import flipflop

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GENERATE = os.path.join(REPO, "data-prep", "flipflop", "generate.py")


def reread(tokens):
    """An independent reading of a whole string: walk it as (instruction, bit) pairs,
    keep the memory, and return the bits every ``r`` must show (one per read, in order)
    with the bits it shows; raise AssertionError on a malformed string."""
    assert len(tokens) % 2 == 0
    pairs = list(zip(tokens[0::2], tokens[1::2]))
    assert pairs[0][0] == "w", "the first instruction must be a write"
    memory, expected, shown = None, [], []
    for instruction, bit in pairs:
        assert instruction in ("w", "r", "i") and bit in ("0", "1"), (instruction, bit)
        if instruction == "w":
            memory = bit
        elif instruction == "r":
            expected.append(memory)
            shown.append(bit)
    return expected, shown


SETTINGS = [(4, 0.5), (16, 0.0), (64, 0.1), (64, 0.8), (64, 0.98), (128, 1.0), (130, 0.8)]


@pytest.mark.parametrize("length,p_ignore", SETTINGS)
def test_every_read_shows_the_last_written_bit(length, p_ignore):
    rng = random.Random(f"reread/{length}/{p_ignore}")
    for _ in range(300):
        tokens = flipflop.sample(length, p_ignore, rng)
        expected, shown = reread(tokens)
        assert shown == expected                       # every read, the final one included
        assert tokens[-2] == "r" and len(tokens) == length
        source, target = tokens[:-1], tokens[-1]
        assert flipflop.solve(source) == target == expected[-1]
        write = flipflop.last_write(source)
        assert source[write] == "w" and "w" not in source[write + 2::2]


def test_lengths_first_write_and_final_read_of_generated_splits():
    config = flipflop.make_config("small", train_size=50, test_size=20, valid_size=5,
                                  test_lengths=(16, 34), test_p_ignore=(0.1, 0.9), train_length=24)
    for name, examples in flipflop.generate(config).items():
        for e in examples:
            assert e.source[0] == "w" and e.source[-1] == "r"
            assert len(e.source) == e.length - 1 and e.read == e.length - 2
            assert e.length in ((24,) if name == "train" else (16, 24, 34))
            assert all(t in ("w", "r", "i") for t in e.source[0::2])
            assert all(t in ("0", "1") for t in e.source[1::2])
            assert reread(list(e.source) + [e.target])[0][-1] == e.target


@pytest.mark.parametrize("p_ignore", [0.1, 0.8, 0.98])
def test_instruction_frequencies_follow_p_ignore(p_ignore):
    rng = random.Random(f"freq/{p_ignore}")
    counts, bits = Counter(), Counter()
    for _ in range(1500):
        tokens = flipflop.sample(64, p_ignore, rng)
        middle = tokens[2:-2]                          # the random pairs only
        counts.update(middle[0::2])
        bits.update(b for i, b in zip(middle[0::2], middle[1::2]) if i != "r")
        bits[tokens[1]] += 1
    n = sum(counts.values())
    assert n == 1500 * 30
    expected = {"w": (1 - p_ignore) / 2, "r": (1 - p_ignore) / 2, "i": p_ignore}
    for instruction, p in expected.items():
        se = math.sqrt(p * (1 - p) / n)
        assert abs(counts[instruction] / n - p) < 5 * se + 1e-12, (instruction, counts)
    total = sum(bits.values())
    assert abs(bits["1"] / total - 0.5) < 5 * math.sqrt(0.25 / total)


def test_possible_strings_matches_enumeration():
    # all strings of 8 tokens the grammar allows: w b, two random pairs, r b, reads consistent
    strings = set()
    for first in "01":
        for middle in itertools.product(["w0", "w1", "r", "i0", "i1"], repeat=2):
            memory, tokens = first, ["w", first]
            for pair in middle:
                if pair[0] == "w":
                    memory = pair[1]
                    tokens += ["w", memory]
                elif pair == "r":
                    tokens += ["r", memory]
                else:
                    tokens += ["i", pair[1]]
            strings.add(tuple(tokens + ["r", memory]))
    assert len(strings) == flipflop.possible_strings(8, 0.5) == 50
    assert flipflop.possible_strings(8, 1.0) == 2 * 2 ** 2 and flipflop.possible_strings(8, 0.0) == 2 * 3 ** 2
    rng, seen = random.Random(3), set()
    for _ in range(3000):
        seen.add(tuple(flipflop.sample(8, 0.5, rng)))
    assert seen == strings                             # the sampler reaches every one of them


def test_splits_sizes_disjointness_and_determinism():
    kwargs = dict(train_size=200, test_size=30, valid_size=10, test_lengths=(64, 128),
                  test_p_ignore=(0.1, 0.8, 0.98))
    config = flipflop.make_config("small", **kwargs)
    data = flipflop.generate(config)
    names = [flipflop.setting_name(n, p) for n in (64, 128) for p in (0.1, 0.8, 0.98)]
    assert list(data) == names + ["valid", "train"]
    assert [len(data[n]) for n in names] == [30] * 6
    assert len(data["valid"]) == 10 * 6 and len(data["train"]) == 200   # mixed: 6 settings
    assert {(e.length, e.p_ignore) for e in data["valid"]} == {(n, p) for n in (64, 128) for p in (0.1, 0.8, 0.98)}
    for name in names:
        length, p = int(name[4:].split("-")[0]), float(name.split("-p")[1])
        assert {(e.length, e.p_ignore) for e in data[name]} == {(length, p)}
    keys = [e.source for examples in data.values() for e in examples]
    assert len(keys) == len(set(keys)) == flipflop.total_examples(config)
    again = flipflop.generate(flipflop.make_config("small", **kwargs))
    assert again == data
    other = flipflop.generate(flipflop.make_config("small", seed=2, **kwargs))
    assert other["train"] != data["train"] and other[names[0]] != data[names[0]]
    bigger = flipflop.generate(flipflop.make_config("small", **dict(kwargs, train_size=300)))
    assert all(bigger[n] == data[n] for n in names)     # tests do not depend on the train size
    only_train = flipflop.make_config("small", valid_mix="train", **kwargs)
    assert only_train.valid_settings() == [(64, 0.8)]


def test_dedupe_uses_every_string_of_a_small_set():
    config = flipflop.make_config("small", train_length=6, train_p_ignore=0.5, train_size=10,
                                  test_lengths=(4,), test_p_ignore=(0.5,), test_size=2, valid_size=0)
    data = flipflop.generate(config)
    assert len({e.source for e in data["train"]}) == 10   # 2 * 5 strings of 6 tokens: all of them
    assert {e.source for e in data["test4-p0.5"]} == {("w", "0", "r"), ("w", "1", "r")}


def test_last_carrier_subset_on_hand_made_strings():
    #          0    1    2    3    4    5    6    7    8    9   10
    source = ("w", "1", "i", "0", "w", "0", "i", "1", "i", "1", "r")
    assert flipflop.last_write(source) == 4 and flipflop.solve(source) == "0"
    assert flipflop.last_carrier(source) == 4                    # no read after the last write
    e = flipflop.Example(source, "0", 4, 12, 0.5)
    assert e.read == 10 and flipflop.to_meta(e) == {"write": 4, "carrier": 4, "read": 10,
                                                     "source_length": 11, "target": "0"}
    # the written bit at 5, the read at 10: chunk 5 // g against chunk 10 // g
    assert flipflop.bit_before_read_chunk(4, 10, 4)          # chunks 1 < 2
    assert flipflop.bit_before_read_chunk(4, 10, 8)          # 0 < 1
    assert not flipflop.bit_before_read_chunk(4, 10, 11)     # one chunk
    assert not flipflop.bit_before_read_chunk(8, 10, 4)      # bit 9 and read 10 share chunk 2
    assert not flipflop.bit_before_read_chunk(4, 8, 5)       # w in chunk 0, its bit in the read's
    # a read after the last write repeats its bit: it, not the write, is the last carrier
    #          0    1    2    3    4    5    6    7    8    9   10   11   12
    source = ("w", "1", "i", "0", "w", "0", "i", "1", "r", "0", "i", "1", "r")
    assert flipflop.last_write(source) == 4 and flipflop.last_carrier(source) == 8
    assert flipflop.bit_before_read_chunk(4, 12, 8)          # the write's bit is in chunk 0 ...
    assert not flipflop.bit_before_read_chunk(8, 12, 8)      # ... but the read's at 9 is in the read's chunk 1
    # an ignore never carries the answer, whatever its bit
    assert flipflop.last_carrier(("w", "1", "i", "1", "i", "0", "r")) == 0


def test_last_carrier_agrees_with_a_scan_from_the_read():
    """On sampled strings: the last carrier is the last w/r before the final read, found by
    scanning backwards from the read in steps of one token, and its bit is the answer."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        tokens = flipflop.sample(24, 0.6, rng)
        source, target = tuple(tokens[:-1]), tokens[-1]
        k = len(source) - 2
        while not (k % 2 == 0 and source[k] in ("w", "r")):
            k -= 1
        assert flipflop.last_carrier(source) == k and source[k + 1] == target


def test_split_statistics_and_baselines():
    stats = flipflop.SplitStats()
    stats.add(flipflop.Example(("w", "1", "i", "0", "r"), "1", 0, 6, 0.5))   # previous bit 0: wrong
    stats.add(flipflop.Example(("w", "0", "r", "0", "r"), "0", 0, 6, 0.5))   # previous bit 0: right
    s = stats.summary()
    assert s["size"] == 2 and s["lengths"] == {"6": 2} and s["random_instructions"] == 2
    assert s["instruction_share"] == {"w": 0.0, "r": 0.5, "i": 0.5}
    assert s["baselines"] == {"previous_bit": 0.5, "majority": 0.5}
    assert s["write_to_read_distance"] == {"mean": 3.0, "min": 3, "max": 3}
    assert s["first_write_only"] == 1.0
    with pytest.raises(RuntimeError, match="does not re-read"):
        stats.add(flipflop.Example(("w", "1", "r"), "0", 0, 4, 0.5))
    assert "| x | 2 | 6 |" in flipflop.stats_table({"x": s})


@pytest.mark.parametrize("overrides,message", [
    (dict(train_length=63), "even number of tokens >= 4"),
    (dict(train_length=2), "even number of tokens >= 4"),
    (dict(test_lengths=(64, 65)), "got 65"),
    (dict(train_p_ignore=1.5), r"must lie in \[0, 1\], got 1.5"),
    (dict(test_p_ignore=(-0.1,)), "got -0.1"),
    (dict(train_size=0), "train_size must be an integer >= 1"),
    (dict(valid_mix="other"), "valid_mix must be one of mixed, train"),
    (dict(train_length=4, train_size=5, test_lengths=(8,), test_size=1, valid_size=0),
     "5 distinct strings of length 4 with p_i = 0.8 requested, but only 2 exist"),
])
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        flipflop.make_config("small", **overrides)
    with pytest.raises(ValueError, match="unknown configuration 'big'"):
        flipflop.make_config("big")


# --------------------------------------------------------------------------- generate.py

TINY = ("--train-length", 16, "--train-size", 80, "--valid-size", 3, "--test-size", 12,
        "--test-lengths", "16,32", "--test-p-ignore", "0.5,0.9", "--no-progress")


def test_generate_cli_writes_refuses_and_overwrites(tmp_path):
    out = tmp_path / "ff"
    # generation and its refusals in the test's process (run_in_process: no interpreter
    # start-up); test_generate_cli_binarize runs the script as a real process
    result = run_in_process(GENERATE, ["--out", out, *TINY])
    assert result.returncode == 0, result.stderr
    tests = ["test16-p0.5", "test16-p0.9", "test32-p0.5", "test32-p0.9"]
    expected = sorted([f"{s}.{e}" for s in ["train", "valid"] + tests for e in ("src", "tgt")]
                      + [f"{t}.meta.jsonl" for t in tests] + ["stats.json"])
    assert sorted(os.listdir(out)) == expected
    seen = set()
    for split, size in [("train", 80), ("valid", 3 * 5)] + [(t, 12) for t in tests]:
        sources, targets = read_lines(out / f"{split}.src"), read_lines(out / f"{split}.tgt")
        assert len(sources) == len(targets) == size
        meta = [json.loads(l) for l in read_lines(out / f"{split}.meta.jsonl")] if split in tests else None
        for k, (source, target) in enumerate(zip(sources, targets)):
            tokens = source.split(" ")
            expected_bits, shown = reread(tokens + [target])
            assert shown == expected_bits
            if meta is not None:
                assert meta[k]["read"] == len(tokens) - 1 and tokens[meta[k]["write"]] == "w"
                assert tokens[meta[k]["carrier"]] in ("w", "r") and meta[k]["carrier"] >= meta[k]["write"]
                assert meta[k]["target"] == target and meta[k]["source_length"] == len(tokens)
                assert len(tokens) + 1 == int(split[4:].split("-")[0])
            seen.add(source)
    assert len(seen) == 80 + 15 + 4 * 12                       # all distinct across files
    stats = json.loads((out / "stats.json").read_text())
    assert stats["config"]["train_length"] == 16 and stats["splits"]["test32-p0.9"]["size"] == 12
    assert stats["settings"]["test32-p0.9"] == {"length": 32, "p_ignore": 0.9}
    assert set(stats["splits"]["train"]["answer_before_read_chunk"]) == {"8", "10"}
    assert "| test32-p0.9 | 12 | 32 |" in result.stdout and "previous-bit baseline" in result.stdout

    before = (out / "train.src").read_text()
    refused = run_in_process(GENERATE, ["--out", out, *TINY, "--seed", 5])
    assert refused.returncode == 2 and "is not empty" in refused.stderr and "--overwrite" in refused.stderr
    assert (out / "train.src").read_text() == before
    (out / "stale.txt").write_text("old")
    replaced = run_in_process(GENERATE, ["--out", out, *TINY, "--seed", 5, "--overwrite"])
    assert replaced.returncode == 0, replaced.stderr
    assert not (out / "stale.txt").exists() and (out / "train.src").read_text() != before
    assert sorted(os.listdir(tmp_path)) == ["ff"]                # no temporary sibling left

    check_refusals(GENERATE, tmp_path / "bad", [
        (("--train-length", 15), "got 15"),
        (("--test-p-ignore", "0.5,2"), "got 2.0"),
        (("--test-lengths", "16,x"), "expected comma-separated numbers"),
        (("--valid-size", 0, "--binarize"), "--binarize needs a validation set"),
    ])


def test_generate_cli_binarize(tmp_path):
    out = tmp_path / "bin-run"
    result = run_binarized(GENERATE, out, *TINY)
    assert "fairseq-preprocess --source-lang src --target-lang tgt --joined-dictionary" in result.stdout
    assert "test16-p0.5 -> test, test16-p0.9 -> test1" in result.stdout
    for split in ["train", "valid", "test", "test1", "test2", "test3"]:
        assert (out / "bin" / f"{split}.src-tgt.src.bin").exists(), split
    stats = json.loads((out / "stats.json").read_text())
    assert stats["binarized_test_splits"] == {"test16-p0.5": "test", "test16-p0.9": "test1",
                                              "test32-p0.5": "test2", "test32-p0.9": "test3"}
    dictionary = {line.split()[0] for line in read_lines(out / "bin" / "dict.src.txt")}
    assert {"w", "r", "i", "0", "1"} <= dictionary


# --------------------------------------------------------------------------- worked by hand

def test_check_length_and_p_ignore_whole_messages():
    for bad in (8.0, "8", True):
        with pytest.raises(ValueError) as err:
            flipflop.check_length(bad)
        assert str(err.value) == f"length must be an integer, got {bad!r}"
    with pytest.raises(ValueError) as err:
        flipflop.check_length(6 + 1)
    assert str(err.value) == ("length must be an even number of tokens >= 4 (instruction/bit "
                              "pairs, the first a write, the last a read), got 7")
    flipflop.check_p_ignore(0.0)
    flipflop.check_p_ignore(1.0)
    for bad in (True, "0.5", 1.01, -0.01):
        with pytest.raises(ValueError) as err:
            flipflop.check_p_ignore(bad)
        assert str(err.value) == ("p_i (the probability of an ignore instruction) must lie in "
                                  f"[0, 1], got {bad!r}")


def test_solve_reads_the_last_write_and_refuses_a_source_without_one():
    assert flipflop.solve(("w", "0", "w", "1")) == "1"  # the write just before the end
    assert flipflop.solve(("w", "0", "i", "1", "r")) == "0"
    with pytest.raises(ValueError) as err:
        flipflop.solve(("i", "0", "r"))
    assert str(err.value) == "the source holds no write instruction"


def test_bit_before_read_chunk_by_hand():
    """The bit of the instruction at token 2 is token 3: chunk 0 of size 4; a read at
    token 5 is in chunk 1, a read at token 3 in chunk 0."""
    assert flipflop.bit_before_read_chunk(2, 5, 4) is True
    assert flipflop.bit_before_read_chunk(2, 3, 4) is False
    assert flipflop.bit_before_read_chunk(3, 5, 4) is False  # its bit, token 4, is in chunk 1


def test_make_config_defaults_sorts_and_names_the_choices():
    assert flipflop.make_config() == flipflop.make_config("small")
    config = flipflop.make_config(test_lengths=(32, 16, 16), test_p_ignore=(0.9, 0.5, 0.9))
    assert config.test_lengths == (16, 32) and config.test_p_ignore == (0.5, 0.9)
    with pytest.raises(ValueError) as err:
        flipflop.make_config("big")
    assert str(err.value) == f"unknown configuration 'big'; choose one of {', '.join(flipflop.CONFIGS)}"
    with pytest.raises(ValueError) as err:
        flipflop.make_config(test_lengths=())
    assert str(err.value) == "test_lengths is empty"
    with pytest.raises(ValueError) as err:
        flipflop.make_config(train_size=True)
    assert str(err.value) == "train_size must be an integer >= 1, got True"
    # one setting asked for by two splits: the counts add up (2 + 1 > the 2 strings)
    with pytest.raises(ValueError) as err:
        flipflop.make_config(train_length=4, train_p_ignore=0.8, train_size=2, test_lengths=(4,),
                             test_p_ignore=(0.8,), test_size=1, valid_size=0)
    assert str(err.value) == "3 distinct strings of length 4 with p_i = 0.8 requested, but only 2 exist"


def test_each_split_draws_from_its_own_stream_and_reports_progress():
    """The first example of every split is the first string of its own (seed, split,
    setting) stream (no duplicate can occur that early at these lengths); progress is
    called once per example with 1; settings that differ in length only get different
    streams."""
    config = flipflop.make_config(train_length=64, train_size=3, test_lengths=(64, 128),
                                  test_p_ignore=(0.5,), test_size=2, valid_size=2, seed=7)
    calls = []
    splits = flipflop.generate(config, progress=calls.append)
    assert calls == [1] * sum(len(v) for v in splits.values())
    streams = {"64-0.5": ("test", (64, 0.5)), "128-0.5": ("test", (128, 0.5)),
               "train": ("train", (64, config.train_p_ignore))}
    for name, (split, setting) in streams.items():
        first = flipflop.sample(*setting, flipflop.split_rng(7, split, setting))
        assert splits[flipflop.setting_name(*setting) if split == "test" else name][0].source == tuple(first[:-1])
    valid_setting = config.valid_settings()[0]
    first = flipflop.sample(*valid_setting, flipflop.split_rng(7, "valid", valid_setting))
    assert splits["valid"][0].source == tuple(first[:-1])
    a, b = flipflop.split_rng(1, "test", (8, 0.5)), flipflop.split_rng(1, "test", (16, 0.5))
    assert a.random() != b.random()


def test_iter_split_refusals_name_the_setting(monkeypatch):
    with pytest.raises(RuntimeError) as err:
        list(flipflop.iter_split("train", [(4, 0.8)], 3, 1, set()))
    assert str(err.value) == (f"{flipflop.MAX_REJECTIONS} duplicates in a row for length 4, "
                              "p_i = 0.8: ask for fewer examples")
    monkeypatch.setattr(flipflop, "solve", lambda source: "x")
    with pytest.raises(RuntimeError) as err:
        next(flipflop.iter_split("train", [(4, 0.0)], 1, 1, set()))
    assert str(err.value).startswith("the final read of w ") and str(err.value).endswith(
        " is not the last write")
    assert len(str(err.value).split(" of ")[1].split(" is ")[0].split(" ")) == 4


def test_statistics_and_table_worked_by_hand():
    stats = flipflop.SplitStats()
    for source, target, write in [(("w", "1", "r"), "1", 0),  # the shortest distance first
                                  (("w", "1", "i", "0", "r"), "1", 0),
                                  (("w", "0", "r", "0", "r"), "0", 0),
                                  (("w", "0", "i", "1", "w", "1", "r", "1", "i", "0", "r"), "1", 4)]:
        stats.add(flipflop.Example(source, target, write, len(source) + 1, 0.5))
    s = stats.summary()
    assert s == {
        "size": 4, "lengths": {"4": 1, "6": 2, "12": 1}, "random_instructions": 6,
        "instruction_share": {"w": 1 / 6, "r": 2 / 6, "i": 3 / 6}, "target_share_1": 0.75,
        "write_to_read_distance": {"mean": 3.0, "min": 1, "max": 5}, "first_write_only": 0.75,
        "answer_before_read_chunk": {"8": 0.25, "10": 0.25},
        "baselines": {"previous_bit": 0.5, "majority": 0.75}}
    short = flipflop.SplitStats()
    short.add(flipflop.Example(("w", "1", "r"), "1", 0, 4, 0.5))
    assert flipflop.stats_table({"s": s, "short": short.summary()}).splitlines() == [
        "| split | examples | length | w / r / i (%) | target 1 (%) | write→read distance mean (max) "
        "| last write is the first (%) | answer only before the read's chunk, g=8 / g=10 (%) "
        "| previous-bit baseline (%) |",
        "|---|---:|---|---|---:|---|---:|---|---:|",
        "| s | 4 | 4/6/12 | 16.7 / 33.3 / 50.0 | 75.0 | 3.0 (5) | 75.0 | 25.0 / 25.0 | 50.0 |",
        "| short | 1 | 4 | – / – / – | 100.0 | 1.0 (1) | 100.0 | 0.0 / 0.0 | 100.0 |"]
    empty = flipflop.SplitStats().summary()
    assert empty["target_share_1"] is None and empty["baselines"] == {"previous_bit": None, "majority": None}


def test_the_answer_before_the_reads_chunk_is_counted_over_examples():
    """An example whose answer lies only before the read's chunk, then one whose does
    not: the count is 1 of 2 for both chunk sizes (it accumulates, the last example does
    not overwrite it)."""
    stats = flipflop.SplitStats()
    long = ("w", "0", "i", "1", "w", "1", "r", "1", "i", "0", "r")
    stats.add(flipflop.Example(long, "1", 4, len(long) + 1, 0.5))
    stats.add(flipflop.Example(("w", "1", "r"), "1", 0, 4, 0.5))
    assert stats.summary()["answer_before_read_chunk"] == {"8": 0.5, "10": 0.5}
