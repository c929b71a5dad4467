"""C-PVR data (docs/cpvr.md): the task on the paper's App. G examples, the exact
conditional sampler (hop counts, uniformity, agreement with rejection sampling), the
splits, the shortcut baselines and data-prep/cpvr/generate.py."""
import itertools
import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from fractions import Fraction

import pytest

from cli_helpers import run_in_process
from sut_fairseq.data import cpvr

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GENERATE = os.path.join(REPO, "data-prep", "cpvr", "generate.py")

# Table 4 of the paper (App. G): sequence, label, number of hops (L = 16, values <= 100).
APP_G = """\
65 29 36 16 23 69 99 75 2 72 61 12 13 74 10 54 | 65 | 1
94 40 22 79 56 50 2 68 81 88 77 43 6 81 20 75 | 81 | 2
39 70 96 62 23 42 41 21 45 81 54 44 43 66 44 79 | 43 | 4
20 90 20 24 63 62 19 27 5 63 28 31 90 54 29 59 | 29 | 6
38 31 12 33 76 39 40 48 56 42 73 80 49 26 20 44 | 44 | 5
49 87 35 7 36 64 74 3 3 79 76 59 57 27 77 25 | 49 | 1
21 72 25 67 24 2 80 20 63 53 87 22 66 24 32 74 | 20 | 3
19 25 20 25 80 36 24 65 26 20 62 27 100 98 28 35 | 20 | 5
3 25 7 72 65 75 9 8 12 72 86 8 31 46 50 61 | 8 | 5
82 87 26 18 60 99 92 52 86 64 34 96 45 13 20 88 | 88 | 5"""


# --------------------------------------------------------------------------- chi-square

def chi2_sf(x, df):
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma
    Q(df/2, x/2) (series below a+1, Lentz continued fraction above)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def goodness_of_fit(counts, probabilities):
    """p-value of observed ``counts`` (dict) against ``probabilities`` (dict, sums to 1)."""
    n = sum(counts.values())
    assert set(counts) <= set(probabilities), set(counts) - set(probabilities)
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probabilities.items())
    return chi2_sf(stat, len(probabilities) - 1)


def two_sample(first, second, min_cell=10):
    """p-value of the chi-square test that two Counters of equal total come from one
    distribution (cells with fewer than ``min_cell`` joint counts pooled)."""
    n1, n2 = sum(first.values()), sum(second.values())
    cells, pooled = [], [0, 0]
    for key in set(first) | set(second):
        pair = (first.get(key, 0), second.get(key, 0))
        if sum(pair) < min_cell:
            pooled = [pooled[0] + pair[0], pooled[1] + pair[1]]
        else:
            cells.append(pair)
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, size in ((x, n1), (y, n2)):
            expected = total * size / (n1 + n2)
            stat += (observed - expected) ** 2 / expected
    return chi2_sf(stat, len(cells) - 1)


def test_chi2_sf_matches_closed_forms():
    for x in (0.1, 1.0, 3.0, 10.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    # df = 4: Q(2, x/2) = exp(-x/2) (1 + x/2)
    for x in (0.5, 2.0, 9.0, 30.0):
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-10)


# --------------------------------------------------------------------------- the task

@pytest.mark.parametrize("line", APP_G.splitlines())
def test_app_g_examples(line):
    text, label, hops = (part.strip() for part in line.split("|"))
    sequence = [int(v) for v in text.split()]
    assert len(sequence) == 16 and max(sequence) <= 100
    assert cpvr.retrieve(sequence) == (int(label), int(hops))
    positions = cpvr.chain(sequence)
    assert len(positions) == int(hops) and positions == sorted(set(positions))
    assert sequence[positions[-1]] == int(label)


def test_retrieval_follows_listing_1():
    # pointer(0) = (3-1) mod 4 = 2 > 0, pointer(2) = (8-1) mod 4 = 3 > 2, pointer(3) = 1 <= 3
    assert cpvr.retrieve([3, 1, 8, 2]) == (2, 3)
    assert cpvr.chain([3, 1, 8, 2]) == [0, 2, 3]
    assert cpvr.retrieve([5, 2, 3, 4]) == (5, 1)           # (5-1) mod 4 = 0: stays
    assert cpvr.retrieve([2, 3, 4, 4]) == (4, 4)           # 0 -> 1 -> 2 -> 3, a[3] -> 3
    assert cpvr.follow([2, 3, 4, 4], max_hops=2) == (1, 2)


def test_counts_sum_to_every_sequence():
    """Brute force over [1, K]^L: the hop-count histogram equals N_{n-1}(0) K^(L-n)."""
    for L, K in ((4, 4), (5, 7), (3, 10)):
        sampler = cpvr.HopSampler(L, K)
        histogram = Counter(cpvr.retrieve(s)[1]
                            for s in itertools.product(range(1, K + 1), repeat=L))
        assert histogram == {n: sampler.count_sequences(n) for n in range(1, L + 1)
                             if sampler.count_sequences(n)}
        assert sum(sampler.probability(n) for n in range(1, L + 1)) == 1


def test_hop_probabilities():
    sampler = cpvr.HopSampler(100, 1000)
    assert sampler.probability(1) == Fraction(1, 100)
    assert float(sampler.probability(9)) == pytest.approx(1.5389e-5, rel=1e-4)
    small = cpvr.HopSampler(16, 100)
    assert small.probability(1) == Fraction(7, 100)         # a[0] in {1, 17, ..., 97}
    assert "| 9 | 1.327e-06 | 1.539e-05 |" in cpvr.probability_table([(16, 100), (100, 1000)], range(1, 10))


@pytest.mark.parametrize("length,max_value,message", [
    (1, 5, "L must be >= 2"), (8, 5, "K must be >= L = 8"), (4.0, 8, "integer")])
def test_bad_sizes_are_named(length, max_value, message):
    with pytest.raises(ValueError, match=message):
        cpvr.HopSampler(length, max_value)


@pytest.mark.parametrize("hops", [0, 17, -1])
def test_infeasible_hops_are_named(hops):
    with pytest.raises(ValueError, match=f"hops = {hops} is infeasible for L = 16"):
        cpvr.HopSampler(16, 100).sample(hops, random.Random(0))


# --------------------------------------------------------------------------- the sampler

@pytest.mark.parametrize("length,max_value", [(16, 100), (16, 16), (7, 30), (5, 5),
                                              (100, 1000), (100, 100)])
def test_sampled_hop_count_is_exact(length, max_value):
    sampler, rng = cpvr.HopSampler(length, max_value), random.Random(length * 1000 + max_value)
    hops_list = sorted(set(range(1, min(length, 9) + 1)) | {length})
    for n in hops_list:
        for _ in range(40 if length >= 100 else 300):
            sequence = sampler.sample(n, rng)
            assert len(sequence) == length and all(1 <= v <= max_value for v in sequence)
            assert cpvr.retrieve(sequence)[1] == n


@pytest.mark.parametrize("max_value,sizes,per_sequence", [
    (4, {1: 64, 2: 144, 3: 44, 4: 4}, 200),
    (6, {1: 432, 2: 684, 3: 168, 4: 12}, 60),     # K not a multiple of L: c(j) = 2, 2, 1, 1
])
def test_sampler_is_uniform_on_each_hop_class(max_value, sizes, per_sequence):
    """L = 4: all K^4 sequences grouped by hop count; the sampler must hit every
    sequence of a group equally often (chi-square against uniform)."""
    L, K = 4, max_value
    groups = {}
    for sequence in itertools.product(range(1, K + 1), repeat=L):
        groups.setdefault(cpvr.retrieve(sequence)[1], []).append(sequence)
    assert {n: len(g) for n, g in groups.items()} == sizes
    sampler = cpvr.HopSampler(L, K)
    for n, members in groups.items():
        rng = random.Random(100 * K + n)
        counts = Counter(tuple(sampler.sample(n, rng)) for _ in range(per_sequence * len(members)))
        assert set(counts) == set(members)                  # every sequence is reached
        p_value = goodness_of_fit(counts, {s: 1 / len(members) for s in members})
        assert p_value > 1e-3, (n, p_value)


def exact_chain_law(L, K, hops=3):
    """P((p_1, p_2, label) | hops = 3) by enumerating the three visited cells' values."""
    law = Counter()
    for a0, a1, a2 in itertools.product(range(1, K + 1), repeat=3):
        p1 = (a0 - 1) % L
        if p1 == 0:
            continue
        # a1 sits at p1, a2 at p2: a forward jump from p1, then a stop
        p2 = (a1 - 1) % L
        if p2 > p1 and (a2 - 1) % L <= p2:
            law[(p1, p2, a2)] += 1
    total = sum(law.values())
    return {key: count / total for key, count in law.items()}, Fraction(total, K ** 3)


def test_sampler_matches_exact_law_and_rejection_sampling():
    """L = 8, K = 13: c(j) = 2 for j < 5 and 1 above, so a sampler that drops the c(j)
    weighting of the next position or of the stop (exact when every c(j) is equal, as at
    K = 16) fails the chi-square tests."""
    L, K, n, draws = 8, 13, 3, 40_000
    sampler = cpvr.HopSampler(L, K)
    assert sampler.counts == [2, 2, 2, 2, 2, 1, 1, 1]
    exact, probability = exact_chain_law(L, K)
    assert sampler.probability(n) == probability
    rng = random.Random(7)
    sampled = [sampler.sample(n, rng) for _ in range(draws)]
    rejected, rng = [], random.Random(8)
    while len(rejected) < draws:
        sequence = [rng.randrange(1, K + 1) for _ in range(L)]
        if cpvr.retrieve(sequence)[1] == n:
            rejected.append(sequence)

    def chain_key(s):
        positions = cpvr.chain(s)
        return positions[1], positions[2], s[positions[2]]

    assert goodness_of_fit(Counter(map(chain_key, sampled)), exact) > 1e-3
    assert goodness_of_fit(Counter(map(chain_key, rejected)), exact) > 1e-3
    for name, feature in (("visited positions", lambda s: tuple(cpvr.chain(s))),
                          ("label", lambda s: cpvr.retrieve(s)[0]),
                          ("a[0]", lambda s: s[0]), ("a[L-1]", lambda s: s[-1]),
                          ("a[3]", lambda s: s[3])):
        p_value = two_sample(Counter(map(feature, sampled)), Counter(map(feature, rejected)))
        assert p_value > 1e-3, (name, p_value)


# --------------------------------------------------------------------------- configurations

def tiny_config(**overrides):
    fields = dict(length=6, max_value=20, train_per_hop=150, valid_per_hop=20,
                  test_per_hop=40, test_hops=range(1, 7), seed=3)
    fields.update(overrides)
    return cpvr.make_config("small", **fields)


def test_configurations():
    small = cpvr.make_config("small")
    assert (small.length, small.max_value, small.train_hops, small.test_hops) == (16, 100, (1, 2, 3, 4), tuple(range(1, 10)))
    assert (small.train_per_hop, small.test_per_hop, small.valid_per_hop) == (25_000, 2_000, 1_000)
    paper = cpvr.make_config("from-scratch")
    assert (paper.length, paper.max_value, paper.train_per_hop, paper.test_per_hop) == (100, 1000, 450_000, 50_000)
    assert cpvr.make_config("small", "plain").max_value == 16
    assert cpvr.make_config("from-scratch", "plain", length=30).max_value == 30
    assert cpvr.parse_hops("1-4") == (1, 2, 3, 4) and cpvr.parse_hops("2,5-6,2") == (2, 5, 6)


@pytest.mark.parametrize("overrides,message", [
    (dict(variant="plain", max_value=100), "plain variant needs K = L = 16"),
    (dict(max_value=16), "modulus variant needs K > L = 16"),
    (dict(test_hops=(1, 17)), "hops = 17 is infeasible for L = 16"),
    (dict(train_per_hop=0), "train_per_hop must be an integer >= 1"),
    (dict(variant="odd"), "variant must be one of modulus, plain"),
    (dict(length=4, max_value=5, train_hops=(4,), test_hops=(4,), train_per_hop=5,
          valid_per_hop=0, test_per_hop=1), "6 distinct sequences with hops = 4 requested, but only 5 exist"),
])
def test_bad_configurations_are_named(overrides, message):
    name = overrides.pop("name", "small")
    with pytest.raises(ValueError, match=message):
        cpvr.make_config(name, **overrides)


def test_bad_hop_list_is_named():
    with pytest.raises(ValueError, match="bad hop list '4-1'"):
        cpvr.parse_hops("4-1")


def test_splits_sizes_disjointness_and_determinism():
    config = tiny_config()
    data = cpvr.generate(config)
    assert list(data) == [f"test{n}" for n in range(1, 7)] + ["valid", "train"]
    for n in range(1, 7):
        assert len(data[f"test{n}"]) == 40 and {e.hops for e in data[f"test{n}"]} == {n}
    for split, per_hop in (("train", 150), ("valid", 20)):
        assert Counter(e.hops for e in data[split]) == {1: per_hop, 2: per_hop, 3: per_hop, 4: per_hop}
    keys = [e.sequence for examples in data.values() for e in examples]
    assert len(keys) == len(set(keys)) == cpvr.total_examples(config)   # deduplicated, disjoint
    for e in data["train"]:
        assert cpvr.retrieve(e.sequence) == (e.label, e.hops)
    assert cpvr.generate(config) == data                                  # reproducible
    other = cpvr.generate(tiny_config(train_per_hop=60, seed=3))
    assert all(other[f"test{n}"] == data[f"test{n}"] for n in range(1, 7))  # tests fixed by seed
    assert cpvr.generate(tiny_config(seed=4))["test3"] != data["test3"]


def test_dedupe_reaches_every_sequence_of_a_small_class():
    # L = K = 4 has exactly 4 sequences with 4 hops; 2 train + 1 valid + 1 test use them all.
    config = cpvr.make_config("small", "plain", length=4, train_hops=(4,), test_hops=(4,),
                              train_per_hop=2, valid_per_hop=1, test_per_hop=1)
    data = cpvr.generate(config)
    sequences = [e.sequence for examples in data.values() for e in examples]
    assert sorted(sequences) == [(2, 3, 4, 1), (2, 3, 4, 2), (2, 3, 4, 3), (2, 3, 4, 4)]


# --------------------------------------------------------------------------- baselines

def test_baselines_on_hand_made_sets():
    example = lambda *s: cpvr.Example(tuple(s), *cpvr.retrieve(s))
    train = [example(1, 5, 9, 2, 3, 4), example(7, 2, 3, 4, 5, 6), example(2, 1, 1, 1, 1, 1)]
    assert [e.label for e in train] == [1, 7, 1]            # majority 1
    test = {
        1: [example(1, 2, 3, 4, 5, 6), example(7, 8, 9, 10, 11, 12)],              # labels 1, 7
        2: [example(3, 1, 2, 4, 5, 6), example(2, 7, 1, 1, 1, 1)],                 # labels 2, 7
        5: [example(2, 3, 4, 5, 1, 6), example(2, 3, 4, 5, 7, 6), example(2, 3, 4, 5, 2, 6)],
    }
    assert [e.hops for es in test.values() for e in es] == [1, 1, 2, 2, 5, 5, 5]
    assert [e.label for e in test[5]] == [1, 7, 2]
    stats = {n: cpvr.evaluate(es) for n, es in test.items()}
    result = cpvr.baselines(stats, Counter(e.label for e in train))
    assert result["majority_label"] == 1
    rows = result["hops"]
    assert rows["1"] == {"size": 2, "copy_first": 1.0, "majority": 0.5, "first_or_last": 1.0, "capped_4": 1.0}
    # hop 2: first-or-last answers a[5] = 6 and 1 for labels 2 and 7
    assert rows["2"] == {"size": 2, "copy_first": 0.0, "majority": 0.0, "first_or_last": 0.0, "capped_4": 1.0}
    # hop 5: the capped solver stops at position 3 and answers a[3] = 5; copy answers 2;
    # first-or-last answers a[5] = 6 (the chain ends at position 4)
    assert rows["5"] == {"size": 3, "copy_first": pytest.approx(1 / 3), "majority": pytest.approx(1 / 3),
                         "first_or_last": 0.0, "capped_4": 0.0}
    assert cpvr.capped_solver([2, 3, 4, 5, 1, 6]) == 5
    # a chain that ends at the last cell: 0 -> 1 -> 2 (a[2] = 3 points back to 2), L = 3
    assert cpvr.retrieve((2, 3, 3)) == (3, 3) and cpvr.first_or_last((2, 3, 3)) == 3
    assert cpvr.first_or_last((4, 2, 5)) == 4  # a[0] = 4 points to 0 (L = 3): one hop
    table = cpvr.baseline_table(result)
    assert "| 5 | 3 | 33.33 | 33.33 | 0.00 | 0.00 |" in table and "majority label (1)" in table
    assert cpvr.majority_label(Counter({4: 2, 3: 2, 9: 1})) == 3   # ties: the smallest


# --------------------------------------------------------------------------- generate.py

def _run(*args):
    """generate.py as a command (its own process: the entry point and the package import)."""
    return subprocess.run([sys.executable, GENERATE, *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def _main(*args):
    """generate.py's ``main`` in this process (the command's code without the few seconds
    of a fresh interpreter importing torch and fairseq; cli_helpers.run_in_process): its
    exit status, stdout and stderr."""
    return run_in_process(GENERATE, args)


def _lines(path):
    with open(path) as handle:
        return handle.read().splitlines()


TINY = ("--length", 6, "--max-value", 20, "--train-per-hop", 120, "--valid-per-hop", 15,
        "--test-per-hop", 25, "--test-hops", "1-6", "--no-progress")


def test_generate_cli_writes_refuses_and_overwrites(tmp_path):
    out = tmp_path / "cpvr"
    result = _main("--out", out, *TINY)  # test_generate_cli_binarize runs the real command
    assert result.returncode == 0, result.stderr
    tests = [f"test{n}" for n in range(1, 7)]
    expected = sorted([f"{s}.{e}" for s in ["train", "valid"] + tests for e in ("src", "tgt")]
                      + ["stats.json", "baselines.json"])
    assert sorted(os.listdir(out)) == expected
    seen = set()
    expected_hops = {"train": {1: 120, 2: 120, 3: 120, 4: 120}, "valid": {1: 15, 2: 15, 3: 15, 4: 15},
                     **{t: {int(t[4:]): 25} for t in tests}}
    for split, size in [("train", 480), ("valid", 60)] + [(t, 25) for t in tests]:
        sources, targets = _lines(out / f"{split}.src"), _lines(out / f"{split}.tgt")
        assert len(sources) == len(targets) == size
        hops_seen = Counter()
        for source, target in zip(sources, targets):
            sequence = [int(v) for v in source.split(" ")]
            label, hops = cpvr.retrieve(sequence)
            assert len(sequence) == 6 and str(label) == target
            hops_seen[hops] += 1
            seen.add(source)
        assert hops_seen == expected_hops[split], split   # the train hops 1-4, 120 / 15 each
    assert len(seen) == 480 + 60 + 6 * 25                    # all distinct across files
    stats = json.loads((out / "stats.json").read_text())
    assert stats["splits"]["train"]["hops_checked"] == {"1": 120, "2": 120, "3": 120, "4": 120}
    assert stats["config"]["length"] == 6 and stats["splits"]["test6"]["size"] == 25
    baselines = json.loads((out / "baselines.json").read_text())
    assert baselines["hops"]["1"]["copy_first"] == 1.0 and baselines["hops"]["4"]["capped_4"] == 1.0
    assert "| hops | test size | copy a[0] |" in result.stdout and "| 6 | 25 |" in result.stdout

    before = (out / "train.src").read_text()
    refused = _main("--out", out, *TINY, "--seed", 5)
    assert refused.returncode == 2 and "is not empty" in refused.stderr
    assert (out / "train.src").read_text() == before
    (out / "stale.txt").write_text("old")
    replaced = _main("--out", out, *TINY, "--seed", 5, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert not (out / "stale.txt").exists() and (out / "train.src").read_text() != before
    assert sorted(os.listdir(tmp_path)) == ["cpvr"]          # no temporary sibling left

    bad = _main("--out", tmp_path / "bad", "--test-hops", "1-17")
    assert bad.returncode == 2 and "hops = 17 is infeasible for L = 16" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_generate_cli_binarize(tmp_path):
    out = tmp_path / "bin-run"
    result = _run("--out", out, *TINY, "--binarize")
    assert result.returncode == 0, result.stderr
    assert "fairseq-preprocess --source-lang src --target-lang tgt --joined-dictionary" in result.stdout
    assert "hop 1 -> test, hop 2 -> test1" in result.stdout
    assert (out / "bin" / "dict.src.txt").exists() and (out / "bin" / "dict.tgt.txt").exists()
    for split in ["train", "valid", "test"] + [f"test{k}" for k in range(1, 6)]:
        assert (out / "bin" / f"{split}.src-tgt.src.bin").exists(), split
    stats = json.loads((out / "stats.json").read_text())
    assert stats["binarized_test_splits"]["6"] == "test5"
    assert sorted(os.listdir(tmp_path)) == ["bin-run"]


# --------------------------------------------------------------------------- exact behaviour
# (each test below pins what a mutation-testing run found unchecked, docs/testing.md)

def test_probability_table_whole():
    """P(hops = 1) for L = 4, K = 5 is 2/5 (a[0] in {1, 5} points to cell 0); hops beyond
    L print 0."""
    assert cpvr.probability_table([(4, 5), (3, 3)], [1, 4]) == "\n".join([
        "| hops | L=4, K=5 | L=3, K=3 |", "|---:|---:|---:|",
        f"| 1 | {float(cpvr.HopSampler(4, 5).probability(1)):.4g} | {float(cpvr.HopSampler(3, 3).probability(1)):.4g} |",
        f"| 4 | {float(cpvr.HopSampler(4, 5).probability(4)):.4g} | 0 |"])
    assert cpvr.HopSampler(4, 5).probability(1) == cpvr.Fraction(2, 5)


def test_requests_and_the_sequences_they_need():
    """A hop count in the training set needs train + valid sequences, in the test set
    test ones, in both the sum; a test-only hop count with too few sequences is refused."""
    config = cpvr.make_config("small", length=6, max_value=20, train_hops=(1, 2), test_hops=(2, 5),
                              train_per_hop=7, valid_per_hop=3, test_per_hop=4)
    assert [config.requested(n) for n in (1, 2, 5, 6)] == [10, 14, 4, 0]
    with pytest.raises(ValueError) as err:          # L = 4, K = 5: 5 sequences with 4 hops
        cpvr.make_config("small", length=4, max_value=5, train_hops=(1,), test_hops=(4,),
                         train_per_hop=1, valid_per_hop=0, test_per_hop=6)
    assert str(err.value) == "6 distinct sequences with hops = 4 requested, but only 5 exist for L = 4, K = 5"
    for empty in ("train_hops", "test_hops"):
        with pytest.raises(ValueError) as err:
            cpvr.make_config("small", **{empty: ()}).validate()
        assert str(err.value) == f"{empty} is empty"


def test_configuration_defaults_names_and_test_split_names():
    assert cpvr.make_config() == cpvr.CONFIGS["small"]
    with pytest.raises(ValueError) as err:
        cpvr.make_config("huge")
    assert str(err.value) == "unknown configuration 'huge'; choose one of small, from-scratch"
    assert cpvr.binarized_test_splits([3, 5, 7]) == {3: "test", 5: "test1", 7: "test2"}


def test_the_data_of_a_fixed_seed_is_pinned_and_progress_counts_it():
    """The exact data of a small configuration, seed 1 (each (split, hop count) from its
    own stream ``cpvr/1/<split>/<hops>``): a change to the generator that changes the data
    has to change this digest on purpose. Progress is called once per example."""
    import hashlib

    config = cpvr.make_config("small", length=6, max_value=20, train_per_hop=12, valid_per_hop=3,
                              test_per_hop=4, test_hops=(1, 2, 3, 5))
    calls = []
    data = cpvr.generate(config, progress=calls.append)
    assert calls == [1] * cpvr.total_examples(config) == [1] * sum(map(len, data.values()))
    text = "\n".join(f"{name}\t{e.sequence}\t{e.label}\t{e.hops}" for name, v in data.items() for e in v)
    assert data["train"][0] == cpvr.Example((19, 5, 20, 8, 2, 16), 19, 1)
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "2ca35cb9cb30c5401eca6cf5137ba7fe444cc926531c6ef03065b251099e572a")


def test_a_sampler_that_misses_its_hop_count_is_caught():
    class Wrong(cpvr.HopSampler):
        def sample(self, hops, rng):
            return [1, 2, 3, 4, 5, 6]           # a[0] = 1 points to cell 0: one hop
    with pytest.raises(RuntimeError) as err:
        list(cpvr.iter_split(Wrong(6, 20), "test", (3,), 1, 1, set()))
    label, hops = cpvr.retrieve([1, 2, 3, 4, 5, 6])
    assert str(err.value) == f"sampled a sequence with {hops} hops instead of 3: [1, 2, 3, 4, 5, 6]"


def test_split_statistics_by_hand():
    example = lambda *s: cpvr.Example(tuple(s), *cpvr.retrieve(s))   # noqa: E731
    # a[0] = 1 mod 4 points to cell 0 itself (pointer (a[0] - 1) mod L): one hop, label a[0]
    examples = [example(v, 1, 1, 1) for v in (5, 5, 13, 9, 17, 21, 25, 29)]
    assert [(e.label, e.hops) for e in examples] == [(v, 1) for v in (5, 5, 13, 9, 17, 21, 25, 29)]
    stats = cpvr.evaluate(examples)
    s = stats.summary()
    assert s["size"] == 8 and s["hops_checked"] == {"1": 8}
    assert s["labels"] == {"distinct": 7, "most_common": [[5, 2], [13, 1], [9, 1], [17, 1], [21, 1]],
                           "least_common": [29, 1], "majority_share": 2 / 8}
    assert cpvr.SplitStats().summary() == {"size": 0, "hops_checked": {}, "labels": {
        "distinct": 0, "most_common": [], "least_common": None, "majority_share": None}}
    bad = cpvr.Example((5, 1, 1, 1), 9, 1)
    with pytest.raises(RuntimeError) as err:
        stats.add(bad)
    assert str(err.value) == f"example {bad} has label 5 and 1 hops"
    with pytest.raises(ValueError) as err:
        cpvr.majority_label(Counter())
    assert str(err.value) == "no labels: the training set is empty"


def test_baseline_table_whole():
    result = {"majority_label": 3, "capped_hops": 4, "hops": {
        "2": {"size": 1500, "copy_first": 0.5, "majority": 0.125, "first_or_last": 0.25, "capped_4": 1.0}}}
    assert cpvr.baseline_table(result) == "\n".join([
        "| hops | test size | copy a[0] | majority label (3) | a[0] if one hop, else a[L-1] "
        "| solver capped at 4 hops |", "|---:|---:|---:|---:|---:|---:|",
        "| 2 | 1,500 | 50.00 | 12.50 | 25.00 | 100.00 |"])


def test_size_and_hop_checks_whole():
    cpvr.check_sizes(2, 2)                                      # the smallest task
    for args, message in [(("3", 5), "length L must be an integer, got '3'"),
                          ((3, 2.0), "max value K must be an integer, got 2.0"),
                          ((True, 5), "length L must be an integer, got True")]:
        with pytest.raises(ValueError) as err:
            cpvr.check_sizes(*args)
        assert str(err.value) == message
    for hops in (True, 2.0):
        with pytest.raises(ValueError) as err:
            cpvr.check_hops(hops, 5)
        assert str(err.value) == f"hops must be an integer, got {hops!r}"
    config = cpvr.make_config("small", train_hops=(3, 1, 3), test_hops=[5, 2, 5])
    assert (config.train_hops, config.test_hops) == ((1, 3), (2, 5))    # sorted, distinct
