"""ListOps data (docs/listops.md): labels against an independent recursive evaluator, the
median rule, the generator's limits and law, the splits (sizes, disjointness,
determinism, length limits), the statistics, the refusals, and
data-prep/listops/generate.py."""
import json
import math
import os
import random
import statistics
from collections import Counter

import pytest

from cli_helpers import check_refusals, read_lines, run_binarized, run_in_process
from conftest import ScriptedRng
from sut_fairseq.data import listops

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GENERATE = os.path.join(REPO, "data-prep", "listops", "generate.py")


# --------------------------------------------------------------------------- an independent evaluator

def parse(tokens, i=0):
    """Recursive descent: ``(tree, next index)``, a tree being an int or ``(op, [children])``."""
    token = tokens[i]
    if token.isdigit():
        return int(token), i + 1
    assert token.startswith("["), token
    children, i = [], i + 1
    while tokens[i] != "]":
        child, i = parse(tokens, i)
        children.append(child)
    return (token[1:], children), i + 1


def value(tree):
    """The value of a parsed tree, the original's way (``int(np.median(...))`` is
    ``int(statistics.median(...))`` for these integers)."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    values = [value(c) for c in children]
    return {"MAX": max, "MIN": min, "SM": lambda v: sum(v) % 10,
            "MED": lambda v: int(statistics.median(v))}[op](values)


def shape(tree, depth=1):
    """``(depth of the deepest list, widest list, smallest list)`` of a parsed tree."""
    if isinstance(tree, int):
        return 0, 0, math.inf
    child_shapes = [shape(c, depth + 1) for c in tree[1]]
    return (max([depth] + [s[0] for s in child_shapes]),
            max([len(tree[1])] + [s[1] for s in child_shapes]),
            min([len(tree[1])] + [s[2] for s in child_shapes]))


def independent_value(tokens):
    tree, end = parse(list(tokens))
    assert end == len(tokens), "trailing tokens"
    return value(tree)


# --------------------------------------------------------------------------- the task

@pytest.mark.parametrize("text,label", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[MED 1 2 ]", 1),                      # even count: (1 + 2) / 2 = 1.5, rounded down
    ("[MED 3 8 1 6 ]", 4),                  # 1 3 6 8: (3 + 6) / 2 = 4.5 -> 4
    ("[MED 7 0 2 ]", 2),
    ("[SM 9 9 9 ]", 7),
    ("[MIN [MAX 1 [SM 5 6 ] ] [MED 9 9 0 0 ] 8 ]", 1),
])
def test_hand_examples(text, label):
    assert listops.evaluate(text.split()) == label == independent_value(text.split())


@pytest.mark.parametrize("max_args,max_depth,max_length", [(5, 20, 300), (10, 9, 1000), (15, 9, 1000), (2, 4, None)])
def test_labels_equal_an_independent_recursive_evaluator(max_args, max_depth, max_length):
    rng = random.Random(f"labels/{max_args}/{max_depth}")
    checked = 0
    while checked < 400:
        tokens = listops.sample_tokens(rng, max_args, max_depth, max_length)
        if tokens is None:
            continue
        checked += 1
        assert listops.evaluate(tokens) == independent_value(tokens)
        deepest, widest, narrowest = shape(parse(tokens)[0])
        assert listops.depth(tokens) == deepest < max_depth      # lists nest at most max_depth - 1
        assert listops.max_arguments(tokens) == widest <= max_args and narrowest >= 2
        assert max_length is None or len(tokens) <= max_length
        assert tokens[0] in listops.OPERATORS                    # the root is always a list


def test_median_matches_numpy_style_median():
    rng = random.Random(5)
    for _ in range(2000):
        values = [rng.randrange(10) for _ in range(rng.randint(1, 8))]
        assert listops.median_floor(values) == int(statistics.median(values))


def test_generator_law_on_small_trees():
    # max_depth 3: the root's children are lists with probability VALUE_P, grandchildren digits
    rng = random.Random(11)
    arguments, operators, child_lists, children = Counter(), Counter(), 0, 0
    for _ in range(4000):
        tree, _ = parse(listops.sample_tokens(rng, 4, 3))
        arguments[len(tree[1])] += 1
        operators[tree[0]] += 1
        for child in tree[1]:
            children += 1
            if not isinstance(child, int):
                child_lists += 1
                assert all(isinstance(g, int) for g in child[1])   # depth 3 is always a digit
    for count in (2, 3, 4):                     # randint(2, max_args): uniform
        assert abs(arguments[count] / 4000 - 1 / 3) < 5 * math.sqrt(2 / 9 / 4000)
    assert set(arguments) == {2, 3, 4}
    for op in ("MAX", "MIN", "MED", "SM"):
        assert abs(operators[op] / 4000 - 0.25) < 5 * math.sqrt(0.1875 / 4000)
    p = listops.VALUE_P
    assert abs(child_lists / children - p) < 5 * math.sqrt(p * (1 - p) / children)


def test_malformed_expressions_are_refused():
    for text, message in [("[MAX 1 2", "not closed"), ("[MAX ]", "closes no list"),
                          ("1", "outside a list"), ("[MAX 1 2 ] 3", "follows the end"),
                          ("[FOO 1 2 ]", "unknown token")]:
        with pytest.raises(ValueError, match=message):
            listops.evaluate(text.split())


def test_early_abandon_keeps_the_conditional_law():
    # drawing with max_length = 12 gives the same expressions as drawing freely and
    # discarding the longer ones, draw for draw, as long as the streams agree
    rng_a, rng_b = random.Random(2), random.Random(2)
    kept = 0
    for _ in range(300):
        short = listops.sample_shape(rng_a, 5, 20, 12)
        full = listops.sample_shape(rng_b, 5, 20)
        if short is None:
            assert listops.shape_length(full) > 12
            break                             # the streams part here (the rest was not drawn)
        assert short == full and listops.shape_length(short) <= 12
        listops.fill(rng_a, short), listops.fill(rng_b, full)
        kept += 1
    assert kept > 0


# --------------------------------------------------------------------------- splits

def small(**overrides):
    kwargs = dict(train_size=300, valid_size=20, iid_test_size=60, test_size=6)
    kwargs.update(overrides)
    return listops.make_config("small", **kwargs)


def test_splits_sizes_limits_disjointness_and_determinism():
    config = small(splits=["test-len200-300", "test-args10", "test-args15"])
    data = listops.generate(config)
    assert list(data) == ["test-iid", "test-len200-300", "test-args10", "test-args15", "valid", "train"]
    assert [len(v) for v in data.values()] == [60, 6, 6, 6, 20, 300]
    specs = dict(config.specs())
    for name, examples in data.items():
        spec = specs[name]
        for e in examples:
            n = len(e.tokens)
            assert spec.min_length <= n <= spec.max_length, (name, n)
            assert listops.depth(e.tokens) < spec.max_depth and listops.max_arguments(e.tokens) <= spec.max_args
            assert e.label == independent_value(e.tokens)
    assert all(200 < len(e.tokens) < 300 for e in data["test-len200-300"])
    assert all(len(e.tokens) <= 100 for e in data["train"] + data["valid"])
    assert max(listops.max_arguments(e.tokens) for e in data["test-args15"]) > 5
    keys = [e.tokens for v in data.values() for e in v]
    assert len(keys) == len(set(keys)) == listops.total_examples(config)
    assert listops.generate(small(splits=["test-len200-300", "test-args10", "test-args15"])) == data
    other = listops.generate(small(seed=3, splits=["test-len200-300", "test-args10", "test-args15"]))
    assert other["train"] != data["train"] and other["test-args10"] != data["test-args10"]


def test_iid_splits_share_one_stream_under_their_own_length_limits():
    data = listops.generate(small(train_size=400, iid_test_size=400, splits=[]))
    assert list(data) == ["test-iid", "valid", "train"]
    lengths = {name: [len(e.tokens) for e in v] for name, v in data.items()}
    assert max(lengths["train"]) <= 100 and max(lengths["valid"]) <= 100
    assert max(lengths["test-iid"]) > 100              # about 8% of the generator's are longer
    # short expressions repeat and are kept once; both splits hold them in proportion
    short = lambda v: sum(n <= 5 for n in v) / len(v)  # noqa: E731
    assert abs(short(lengths["train"]) - short(lengths["test-iid"])) < 0.1


@pytest.mark.parametrize("kwargs,message", [
    (dict(train_size=0), "train_size must be an integer >= 1"),
    (dict(iid_test_size=0), "iid_test_size must be an integer >= 1"),
    (dict(test_size=0), "split test-len200-300: size must be >= 1"),
    (dict(valid_size=-1), "split valid: size must be an integer >= 0"),
    (dict(splits=["test-len2"]), "unknown test split 'test-len2'"),
])
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        small(**kwargs)
    with pytest.raises(ValueError, match="unknown configuration 'huge'"):
        listops.make_config("huge")
    with pytest.raises(ValueError, match="max_length must be an integer >= max"):
        listops.SplitSpec(5, min_length=50, max_length=40).check("x")


def test_split_statistics():
    stats = listops.SplitStats(listops.SplitSpec(10, max_args=3, max_depth=3, max_length=20))
    stats.add(listops.Example(tuple("[MAX 2 9 [MIN 4 7 ] ]".split()), 9))
    stats.add(listops.Example(tuple("[SM 1 2 ]".split()), 3))
    s = stats.summary()
    assert s["size"] == 2 and s["length"] == {"min": 4, "mean": 6.0, "max": 8}
    assert s["depth"] == {"mean": 1.5, "max": 2} and s["max_arguments"] == 3
    assert s["labels"]["9"] == s["labels"]["3"] == 1 and s["majority"]["share"] == 0.5
    assert s["operators"] == {"[MAX": 1, "[MIN": 1, "[MED": 0, "[SM": 1}
    with pytest.raises(RuntimeError, match="does not evaluate to 4"):
        stats.add(listops.Example(tuple("[SM 1 2 ]".split()), 4))
    with pytest.raises(RuntimeError, match="outside"):          # depth 3 >= generator depth 3
        stats.add(listops.Example(tuple("[SM 1 [MAX 1 [MIN 2 3 ] ] ]".split()), 3))
    assert "| s | 2 | 4 / 6.0 / 8 | 1.50 / 2 | 3 |" in listops.stats_table({"s": s})


# --------------------------------------------------------------------------- generate.py

TINY = ("--train-size", 150, "--valid-size", 10, "--iid-test-size", 20, "--test-size", 4,
        "--splits", "test-len200-300", "test-args10", "--no-progress")


def test_generate_cli_writes_refuses_and_overwrites(tmp_path):
    out = tmp_path / "lo"
    # generation and its refusals in the test's process (run_in_process: no interpreter
    # start-up); test_generate_cli_binarize runs the script as a real process
    result = run_in_process(GENERATE, ["--out", out, *TINY])
    assert result.returncode == 0, result.stderr
    splits = {"train": 150, "valid": 10, "test-iid": 20, "test-len200-300": 4, "test-args10": 4}
    assert sorted(os.listdir(out)) == sorted([f"{s}.{e}" for s in splits for e in ("src", "tgt")]
                                             + ["stats.json"])
    seen = set()
    for split, size in splits.items():
        sources, targets = read_lines(out / f"{split}.src"), read_lines(out / f"{split}.tgt")
        assert len(sources) == len(targets) == size
        for source, target in zip(sources, targets):
            assert str(independent_value(source.split(" "))) == target
            seen.add(source)
    assert len(seen) == sum(splits.values())
    stats = json.loads((out / "stats.json").read_text())
    assert stats["splits"]["test-args10"]["limits"] == {"max_args": 10, "generator_max_depth": 9,
                                                        "min_length": 100, "max_length": 1000}
    assert sum(stats["splits"]["train"]["labels"].values()) == 150
    assert "| test-len200-300 | 4 |" in result.stdout and "labels 0–9 (%)" in result.stdout

    before = (out / "train.src").read_text()
    refused = run_in_process(GENERATE, ["--out", out, *TINY, "--seed", 4])
    assert refused.returncode == 2 and "is not empty" in refused.stderr
    assert (out / "train.src").read_text() == before
    replaced = run_in_process(GENERATE, ["--out", out, *TINY, "--seed", 4, "--overwrite"])
    assert replaced.returncode == 0, replaced.stderr
    assert (out / "train.src").read_text() != before
    assert sorted(os.listdir(tmp_path)) == ["lo"]

    check_refusals(GENERATE, tmp_path / "bad", [
        (("--splits", "test-len2"), "unknown test split 'test-len2'"),
        (("--train-size", 0), "train_size must be an integer >= 1"),
        (("--valid-size", 0, "--binarize"), "--binarize needs a validation set"),
    ])


def test_generate_cli_binarize(tmp_path):
    out = tmp_path / "bin-run"
    result = run_binarized(GENERATE, out, *TINY)
    assert "test-iid -> test, test-len200-300 -> test1, test-args10 -> test2" in result.stdout
    for split in ["train", "valid", "test", "test1", "test2"]:
        assert (out / "bin" / f"{split}.src-tgt.src.bin").exists(), split
    stats = json.loads((out / "stats.json").read_text())
    assert stats["binarized_test_splits"] == {"test-iid": "test", "test-len200-300": "test1",
                                              "test-args10": "test2"}


def test_the_configurations_pin_the_protocol():
    """Every split of both configurations, as the protocol states it: near-IID test,
    valid and train from the training generator (5 arguments, depth 20; train/valid
    <= 100 tokens, test <= 1000), lengths strictly between 200-300, 500-600 and 900-1000
    for the length splits, and 10 or 15 arguments at depth 9 over 100-1000 tokens."""
    S = listops.SplitSpec

    def protocol(length_size, argument_size, iid, valid, train):
        return [("test-iid", S(iid, 5, 20, 1, 1000)),
                ("test-len200-300", S(length_size, 5, 20, 201, 299)),
                ("test-len500-600", S(length_size, 5, 20, 501, 599)),
                ("test-len900-1000", S(length_size, 5, 20, 901, 999)),
                ("test-args10", S(argument_size, 10, 9, 100, 1000)),
                ("test-args15", S(argument_size, 15, 9, 100, 1000)),
                ("valid", S(valid, 5, 20, 1, 100)), ("train", S(train, 5, 20, 1, 100))]

    assert listops.CONFIGS["small"].specs() == protocol(500, 500, 2_000, 1_000, 30_000)
    assert listops.CONFIGS["paper"].specs() == protocol(2_000, 2_000, 10_000, 1_000, 90_000)
    assert listops.CONFIGS["small"].test_names() == [
        "test-iid", "test-len200-300", "test-len500-600", "test-len900-1000", "test-args10", "test-args15"]


@pytest.mark.parametrize("spec,message", [
    (dict(size=-1), "split x: size must be an integer >= 0, got -1"),
    (dict(size=True), "split x: size must be an integer >= 0, got True"),
    (dict(size=3, max_args=1), "split x: max_args must be an integer >= 2, got 1"),
    (dict(size=3, max_depth=1), "split x: max_depth must be an integer >= 2, got 1"),
    (dict(size=3, min_length=0), "split x: min_length must be an integer >= 1, got 0"),
    (dict(size=3, max_length=3), "split x: max_length must be an integer >= max(min_length, 4) "
                                 "(the shortest list has 4 tokens), got 3"),
    (dict(size=3, max_length=4.0), "split x: max_length must be an integer >= max(min_length, 4) "
                                   "(the shortest list has 4 tokens), got 4.0"),
])
def test_split_spec_refusals_whole(spec, message):
    with pytest.raises(ValueError) as err:
        listops.SplitSpec(**spec).check("x")
    assert str(err.value) == message
    listops.SplitSpec(0, 2, 2, 1, 4).check("x")  # the smallest allowed values


def test_config_refusals_whole():
    import dataclasses

    base = listops.CONFIGS["small"]
    for field, value, message in [
            ("train_size", 0, "train_size must be an integer >= 1, got 0"),
            ("train_size", 2.5, "train_size must be an integer >= 1, got 2.5"),
            ("iid_test_size", 0, "iid_test_size must be an integer >= 1, got 0"),
            ("iid_test_size", "9", "iid_test_size must be an integer >= 1, got '9'")]:
        with pytest.raises(ValueError) as err:
            dataclasses.replace(base, **{field: value}).validate()
        assert str(err.value) == message
    twice = dataclasses.replace(base, tests=base.tests + base.tests[:1])
    with pytest.raises(ValueError) as err:
        twice.validate()
    assert str(err.value) == f"split names must be distinct, got {[n for n, _ in twice.specs()]}"
    empty = dataclasses.replace(base, tests=(("test-len200-300", listops.SplitSpec(0)),))
    with pytest.raises(ValueError) as err:
        empty.validate()
    assert str(err.value) == "split test-len200-300: size must be >= 1"
    dataclasses.replace(base, train_size=1, iid_test_size=1).validate()


# --------------------------------------------------------------------------- exact behaviour
# (each test below pins what a mutation-testing run found unchecked, docs/testing.md)


def test_sample_shape_follows_its_draws_exactly():
    """max_args 3, max_depth 3: the root is a list of 2 + floor(0.99 * 2) = 3 arguments;
    its first child draws u = VALUE_P exactly (a list: u <= VALUE_P) of 2 + floor(0 * 2) = 2
    digits (depth 3 = max_depth: no draw); the other two draw 0.9 and 0.5 (digits). Prefix
    order [3, 2, 0, 0, 0, 0]: 2 + 2 + 4 = 8 tokens, 5 draws."""
    draws = (0.99, listops.VALUE_P, 0.0, 0.9, 0.5)
    rng = ScriptedRng(numbers=draws)
    assert listops.sample_shape(rng, 3, 3) == [3, 2, 0, 0, 0, 0] and rng.numbers == []
    assert listops.shape_length([3, 2, 0, 0, 0, 0]) == 8
    assert listops.sample_shape(ScriptedRng(numbers=draws), 3, 3, max_length=8) == [3, 2, 0, 0, 0, 0]
    assert listops.sample_shape(ScriptedRng(numbers=draws), 3, 3, max_length=7) is None
    # abandoned at the first node that takes the length past 5 (the first child's second
    # digit, 6 tokens): the last two draws are not made
    rng = ScriptedRng(numbers=draws)
    assert listops.sample_shape(rng, 3, 3, max_length=5) is None and rng.numbers == [0.9, 0.5]


def test_a_split_keeps_both_ends_of_its_length_range():
    """Flat lists of 3 or 4 arguments (5 or 6 tokens): min_length 5 and max_length 6 are
    both kept, in the split's own stream ``listops/<seed>/<name>``."""
    spec = listops.SplitSpec(40, max_args=4, max_depth=2, min_length=5, max_length=6)
    examples = list(listops.iter_test("test-x", spec, 1, set()))
    assert Counter(len(e.tokens) for e in examples).keys() == {5, 6}
    again = list(listops.iter_test("test-x", spec, 1, set()))
    other = list(listops.iter_test("test-y", spec, 1, set()))
    assert again == examples and other != examples


def test_exhausted_splits_name_themselves(monkeypatch):
    """Four-token lists are 4 x 100 expressions: asking for more stops after MAX_REJECTIONS
    draws in a row, naming the split, for a generalisation test and for an IID split."""
    monkeypatch.setattr(listops, "MAX_REJECTIONS", 500)
    spec = listops.SplitSpec(401, max_args=2, max_depth=2, min_length=4, max_length=4)
    with pytest.raises(RuntimeError) as err:
        list(listops.iter_test("test-four", spec, 1, set()))
    assert str(err.value) == ("500 draws in a row gave no new expression for test-four: "
                              "widen its length range or ask for fewer examples")
    import dataclasses

    config = dataclasses.replace(listops.make_config("small", splits=[]), train_size=401,
                                 valid_size=0, iid_test_size=1, train_max_length=4)
    with pytest.raises(RuntimeError, match="^500 draws in a row gave no new expression for train: "):
        listops.generate(config)


def test_progress_counts_every_example_once():
    config = small(train_size=30, valid_size=4, iid_test_size=5, test_size=2,
                   splits=["test-len200-300", "test-args10"])
    calls = []
    data = listops.generate(config, progress=calls.append)
    assert calls == [1] * listops.total_examples(config) == [1] * sum(len(v) for v in data.values())


def test_the_data_of_a_fixed_seed_is_pinned():
    """The exact data of a small configuration, seed 1 (each split from its own stream
    ``listops/1/<split>``, the IID ones from ``listops/1/iid``): a change to the generator
    that changes the data has to change this digest on purpose."""
    import hashlib

    config = small(train_size=40, valid_size=6, iid_test_size=8, test_size=2,
                   splits=["test-len200-300", "test-args10"])
    data = listops.generate(config)
    text = "\n".join(f"{name}\t{' '.join(e.tokens)}\t{e.label}" for name, v in data.items() for e in v)
    assert data["train"][0] == listops.Example(tuple("[MAX [MED 1 1 1 4 ] 1 9 7 ]".split()), 9)
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "09e75d986b6aff27d115136086ed23c8cd0dab4177f65215611cf36396edfcd2")


def test_the_split_builders_give_the_protocol():
    """The generalisation splits as the configurations build them (``CONFIGS`` is built at
    import, so the builders are called here too)."""
    S = listops.SplitSpec
    assert listops._tests(7, 9) == (
        ("test-len200-300", S(7, 5, 20, 201, 299)), ("test-len500-600", S(7, 5, 20, 501, 599)),
        ("test-len900-1000", S(7, 5, 20, 901, 999)), ("test-args10", S(9, 10, 9, 100, 1000)),
        ("test-args15", S(9, 15, 9, 100, 1000)))
    assert listops.CONFIGS["small"].tests == listops._tests(500, 500)
    assert listops.CONFIGS["paper"].tests == listops._tests(2_000, 2_000)


def test_configuration_defaults_and_lengths():
    import dataclasses

    assert listops.make_config() == listops.CONFIGS["small"]
    config = dataclasses.replace(listops.CONFIGS["small"], train_max_length=50, iid_max_length=70)
    specs = dict(config.specs())
    assert (specs["train"].max_length, specs["valid"].max_length, specs["test-iid"].max_length) == (50, 50, 70)
    one = listops.make_config("small", test_size=1)      # a generalisation split of one example
    assert all(spec.size == 1 for _, spec in one.tests)


def test_unknown_names_and_operators_whole_messages():
    with pytest.raises(ValueError) as err:
        listops.make_config("huge")
    assert str(err.value) == "unknown configuration 'huge'; choose one of small, paper"
    with pytest.raises(ValueError) as err:
        listops.make_config("small", splits=["test-args10", "len"])
    assert str(err.value) == ("unknown test split 'len'; choose from test-len200-300, test-len500-600, "
                              "test-len900-1000, test-args10, test-args15")
    with pytest.raises(ValueError) as err:
        listops.apply("[FOO", [1, 2])
    assert str(err.value) == "unknown operator '[FOO'"
    with pytest.raises(ValueError) as err:
        listops.evaluate("[MAX 1 2".split())
    assert str(err.value) == "the expression is not closed"
    assert listops.max_arguments(["7"]) == listops.depth(["7"]) == 0   # a bare digit: no list


def test_split_statistics_by_hand():
    """Three examples added shortest first (4, 4 and 8 tokens: the minimum is not the last
    one's), labels 3, 9, 9; an empty split; a split of one; the table of the three."""
    stats = listops.SplitStats(listops.SplitSpec(10, max_args=3, max_depth=3, min_length=4, max_length=20))
    for text, label in [("[SM 1 2 ]", 3), ("[MAX 9 9 ]", 9), ("[MAX 2 9 [MIN 4 7 ] ]", 9)]:
        stats.add(listops.Example(tuple(text.split()), label))
    s = stats.summary()
    assert s["length"] == {"min": 4, "mean": 16 / 3, "max": 8} and s["depth"] == {"mean": 4 / 3, "max": 2}
    assert s["labels"] == {"0": 0, "1": 0, "2": 0, "3": 1, "4": 0, "5": 0, "6": 0, "7": 0, "8": 0, "9": 2}
    assert s["majority"] == {"label": 9, "share": 2 / 3}
    assert s["limits"] == {"max_args": 3, "generator_max_depth": 3, "min_length": 4, "max_length": 20}
    empty = listops.SplitStats().summary()
    assert empty["limits"] is None and empty["majority"] == {"label": None, "share": None}
    assert empty["length"] == {"min": None, "mean": 0.0, "max": 0}
    single = listops.SplitStats()
    single.add(listops.Example(tuple("[MIN 4 7 ]".split()), 4))
    assert single.summary()["length"]["mean"] == 4.0 and single.summary()["majority"]["share"] == 1.0
    with pytest.raises(RuntimeError) as err:
        stats.add(listops.Example(tuple("[SM 1 2 ]".split()), 4))
    assert str(err.value) == "example [SM 1 2 ] does not evaluate to 4"
    assert listops.stats_table({"a": s, "one": single.summary(), "empty": empty}) == "\n".join([
        "| split | examples | length min / mean / max | depth mean / max | max arguments "
        "| labels 0–9 (%) | majority (%) |",
        "|---|---:|---|---|---:|---|---:|",
        "| a | 3 | 4 / 5.3 / 8 | 1.33 / 2 | 3 | 0 0 0 33 0 0 0 0 0 67 | 66.7 |",
        "| one | 1 | 4 / 4.0 / 4 | 1.00 / 1 | 2 | 0 0 0 0 100 0 0 0 0 0 | 100.0 |",
        "| empty | 0 | None / 0.0 / 0 | 0.00 / 0 | 0 | 0 0 0 0 0 0 0 0 0 0 | 0.0 |"])
