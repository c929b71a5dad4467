"""Logical inference data (docs/results/logic_data.md): formulas, truth sets, relations,
the generator, deduplication and splits, the original file format, the protocols and the
CLIs."""
import math
import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from cli_helpers import run_in_process
from conftest import ScriptedRng
from sut_fairseq.data import logic_inference as li

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GENERATE = os.path.join(REPO, "data-prep", "logic", "generate.py")
PREPARE = os.path.join(REPO, "data-prep", "logic", "prepare.py")


def worlds(predicate):
    """Hand-built truth set: the mask of worlds w (variable i true iff bit i of w)
    for which predicate(a, b, c, d, e, f) holds."""
    mask = 0
    for w in range(64):
        if predicate(*((w >> i) & 1 == 1 for i in range(6))):
            mask |= 1 << w
    return mask


def rel(left, right):
    return li.formula_relation(left, right)


# --------------------------------------------------------------------------- truth sets

def test_variable_truth_sets_follow_the_bit_convention():
    assert li.truth_set("a") == worlds(lambda a, b, c, d, e, f: a)
    assert li.truth_set("f") == worlds(lambda a, b, c, d, e, f: f)
    assert li.truth_set("a") & 1 == 0            # world 0: every variable false
    assert (li.truth_set("a") >> 1) & 1 == 1     # world 1: only a true
    assert (li.truth_set("c") >> 4) & 1 == 1     # world 4: only c true
    for v in li.VARIABLES:
        assert bin(li.truth_set(v)).count("1") == 32


def test_truth_sets_of_and_or_not():
    a, b = li.truth_set("a"), li.truth_set("b")
    assert li.truth_set(("not", "a")) == worlds(lambda a, b, c, d, e, f: not a) == li.FULL_SET ^ a
    assert li.truth_set(("and", "a", "b")) == worlds(lambda a, b, c, d, e, f: a and b) == a & b
    assert li.truth_set(("or", "a", "b")) == worlds(lambda a, b, c, d, e, f: a or b) == a | b
    nested = li.parse_formula("( ( not a ) ( or ( b ( and ( not c ) ) ) ) )")
    assert li.truth_set(nested) == worlds(lambda a, b, c, d, e, f: (not a) or (b and not c))
    assert bin(li.truth_set(("and", "a", "b"))).count("1") == 16
    assert bin(li.truth_set(("or", "a", "b"))).count("1") == 48
    assert li.truth_set(("and", "a", ("not", "a"))) == 0
    assert li.truth_set(("or", "a", ("not", "a"))) == li.FULL_SET


def test_operator_count():
    assert li.operator_count("a") == 0
    assert li.operator_count(li.parse_formula("( not a )")) == 1
    assert li.operator_count(li.parse_formula("( a ( or ( not b ) ) )")) == 2
    assert li.operator_count(li.parse_formula("( not ( ( not a ) ( and ( b ( or c ) ) ) ) )")) == 4


# --------------------------------------------------------------------------- relations

# Each case checked by hand with the four tests I, JL, JR, O of
# docs/results/logic_data.md#relations.
RELATION_CASES = [
    # a∧b vs b∧a: same set (16 worlds); I yes, JL no, JR no, O yes (a false).
    ("( a ( and b ) )", "( b ( and a ) )", "="),
    # a∧b ⊂ a: I yes, JL no, JR yes (a∧¬b), O yes (¬a).
    ("( a ( and b ) )", "a", "<"),
    # a ⊃ a∧b: I yes, JL yes (a∧¬b), JR no, O yes.
    ("a", "( a ( and b ) )", ">"),
    # a vs ¬a: I no, JL yes, JR yes, O no (the union is every world).
    ("a", "( not a )", "^"),
    # a∧b vs ¬a: I no, JL yes, JR yes, O yes (a∧¬b is in neither).
    ("( a ( and b ) )", "( not a )", "|"),
    # a∨b vs ¬a: I yes (¬a∧b), JL yes (a), JR yes (¬a∧¬b), O no (the union is everything).
    ("( a ( or b ) )", "( not a )", "v"),
    # a vs b: all four tests true.
    ("a", "b", "#"),
    # De Morgan: ¬(a∨b) = ¬a∧¬b.
    ("( not ( a ( or b ) ) )", "( ( not a ) ( and ( not b ) ) )", "="),
    # a∧b vs a∨b: subset.
    ("( a ( and b ) )", "( a ( or b ) )", "<"),
    # a∧b vs ¬(a∧b) is negation; a∧b vs ¬a∧¬b is alternation.
    ("( a ( and b ) )", "( not ( a ( and b ) ) )", "^"),
    ("( a ( and b ) )", "( ( not a ) ( and ( not b ) ) )", "|"),
]


@pytest.mark.parametrize("left,right,expected", RELATION_CASES)
def test_relation_hand_checked(left, right, expected):
    assert rel(left, right) == expected


def test_relation_on_hand_built_sets():
    one, two, both = 1 << 0, 1 << 1, (1 << 0) | (1 << 1)
    everything_else = li.FULL_SET ^ both
    assert li.relation(both, both) == "="
    assert li.relation(one, both) == "<"
    assert li.relation(both, one) == ">"
    assert li.relation(both, everything_else) == "^"
    assert li.relation(one, two) == "|"
    assert li.relation(li.FULL_SET ^ one, li.FULL_SET ^ two) == "v"
    assert li.relation(both, (1 << 1) | (1 << 2)) == "#"
    # Literal reading of the table: equal tautologies fail O, so they are '#', not '='.
    assert li.relation(li.FULL_SET, li.FULL_SET) == "#"
    assert set(li.RELATIONS) == {"=", "<", ">", "^", "|", "v", "#"}


# --------------------------------------------------------------------------- formulas as text

formulas = st.recursive(
    st.sampled_from(li.VARIABLES),
    lambda children: st.one_of(st.tuples(st.just("not"), children),
                               st.tuples(st.sampled_from(li.BINARY_OPERATORS), children, children)),
    max_leaves=16)


@settings(max_examples=200, deadline=None)
@given(formulas)
def test_parse_to_string_round_trip(formula):
    text = li.to_string(formula)
    assert li.parse_formula(text) == formula
    assert li.to_string(li.parse_formula(text)) == text


def test_to_string_matches_the_original_format():
    assert li.to_string("a") == "a"
    assert li.to_string(("not", "b")) == "( not b )"
    assert li.to_string(("or", "a", ("not", "b"))) == "( a ( or ( not b ) ) )"
    assert li.to_string(("and", ("or", "a", "b"), "c")) == "( ( a ( or b ) ) ( and c ) )"
    # Parentheses need not be spaced when parsing; the output is canonical.
    assert li.to_string(li.parse_formula("(a (or (not b)))")) == "( a ( or ( not b ) ) )"


@pytest.mark.parametrize("bad", ["", "( a", "( a ( xor b ) )", "a b", "( g )", "( not )",
                                 "( a ( and b ) ) )", "( a b )", "x"])
def test_parse_errors_name_the_text(bad):
    with pytest.raises(ValueError) as err:
        li.parse_formula(bad)
    assert repr(bad) in str(err.value)


# --------------------------------------------------------------------------- generator

def test_generator_is_deterministic_for_a_seed():
    first = li.generate_buckets(3000, seed=7)
    assert first == li.generate_buckets(3000, seed=7)
    assert first != li.generate_buckets(3000, seed=8)
    assert sum(len(b) for b in first) == 3000
    assert len(first) == 13


def test_generated_pairs_are_consistent():
    buckets = li.generate_buckets(5000, seed=3)
    for k, pairs in enumerate(buckets):
        for pair in pairs:
            left, right = li.parse_formula(pair.left), li.parse_formula(pair.right)
            ls, rs = li.truth_set(left), li.truth_set(right)
            assert ls not in (0, li.FULL_SET) and rs not in (0, li.FULL_SET)  # no taut./contr.
            assert pair.relation == li.relation(ls, rs)
            assert k == min(max(li.operator_count(left), li.operator_count(right)), 12)
            assert li.to_string(left) == pair.left
            used = set(pair.left.split() + pair.right.split()) & set(li.VARIABLES)
            assert len(used) <= 4                      # 4 of the 6 variables per pair
    assert all(buckets[k] for k in range(13))          # every bucket is reached
    assert {p.relation for b in buckets for p in b} == set(li.RELATIONS)


def test_grow_formula_respects_the_budget():
    # Budget 12 -> 6 -> 3 -> 1: at most 3 binary levels, so at most 7 binary operators,
    # and at most one `not` per node (15 nodes).
    rng = random.Random(0)
    for _ in range(2000):
        f = li.grow_formula(rng, ("a", "b", "c", "d"))
        text = li.to_string(f)
        binary = text.split().count("and") + text.split().count("or")
        assert binary <= 7
        assert li.operator_count(f) <= 7 + 15
        assert "( not ( not" not in text
        assert set(text.split()) & set(li.VARIABLES) <= {"a", "b", "c", "d"}


# Bucket sizes at a reduced scale. The original sizes (ORIGINAL_SIZES) are deduplicated
# counts out of 500,000 accepted pairs. For buckets 0..4 deduplication removes a large,
# non-linear share at that scale (at 500k, bucket 2 keeps ~1/3 of its draws), so their raw
# proportions are not recoverable from the original sizes; for buckets 5..12 it removes
# < 0.3%, so p_k ~= (train_k + test_k) / 500,000 is the per-pair probability of bucket k and
# the raw count of n pairs is Binomial(n, p_k). Our count minus n/500k times the original
# count (itself one binomial draw of 500k) has variance n p (1-p) (1 + n/500k); we allow 4 standard
# deviations of that difference plus 0.5% of the expectation for the deduplication at 500k.
# (At n = 100,000 that is about ±4% for bucket 5 and ±12% for bucket 12; a wrong negation
# probability or budget shifts these proportions by far more.) Bucket 0 has exactly 36
# distinct pairs (6 x 6 variables), all drawn long before 100k pairs: 30 train / 6 test.
SIZE_CHECK_PAIRS = 100_000


def test_bucket_proportions_match_original_sizes():
    n = SIZE_CHECK_PAIRS
    buckets = li.generate_buckets(n, seed=11)
    for k in range(5, 13):
        p = sum(li.ORIGINAL_SIZES[k]) / li.ORIGINAL_PAIRS
        expected = n * p
        sd = math.sqrt(n * p * (1 - p) * (1 + n / li.ORIGINAL_PAIRS))
        tolerance = 4 * sd + 0.005 * expected
        assert abs(len(buckets[k]) - expected) <= tolerance, (k, len(buckets[k]), expected, tolerance)
    train0, test0 = li.split_buckets(buckets)[0]
    assert (len(train0), len(test0)) == li.ORIGINAL_SIZES[0] == (30, 6)


# --------------------------------------------------------------------------- dedup and split

def test_train_size_rule_reproduces_every_original_split():
    for k, (train, test) in li.ORIGINAL_SIZES.items():
        assert li.train_size(train + test) == train, k
    assert li.train_size(20) == 17 and li.train_size(0) == 0 and li.train_size(1) == 0


def test_split_buckets_dedups_keeping_first_then_85_15():
    p = [li.Pair("#", v, w) for v in "abcdef" for w in "abcdef" if v != w][:20]
    bucket = [p[0], p[1], p[0], p[2], p[1]] + p[3:20] + [p[5]]
    (train, test), (train_e, test_e) = li.split_buckets([bucket, []])
    assert train + test == p                      # first occurrences, in order
    assert len(train) == 17 and len(test) == 3    # floor(0.85 * 20) = 17
    assert (train_e, test_e) == ([], [])


# --------------------------------------------------------------------------- file format

def test_original_files_round_trip(tmp_path):
    splits = li.split_buckets(li.generate_buckets(2000, seed=2))
    li.write_original(str(tmp_path), splits)
    assert sorted(os.listdir(tmp_path)) == sorted([f"train{k}" for k in range(13)] +
                                                  [f"test{k}" for k in range(13)])
    train = li.read_buckets(str(tmp_path), "train", check_relation=True)
    test = li.read_buckets(str(tmp_path), "test", check_relation=True)
    assert [train[k] for k in range(13)] == [s[0] for s in splits]
    assert [test[k] for k in range(13)] == [s[1] for s in splits]
    line = (tmp_path / "train3").read_text().splitlines()[0]
    assert line.count("\t") == 2 and line.split("\t")[0] in li.RELATIONS


@pytest.mark.parametrize("bad_line,message", [
    ("<\ta", "expected 3 tab-separated fields"),
    ("<\ta\tb\tc", "expected 3 tab-separated fields"),
    ("?\ta\tb", "unknown relation '?'"),
    ("#\t( a ( xor b ) )\tb", "cannot parse formula '( a ( xor b ) )'"),
    ("#\ta\t( b", "cannot parse formula '( b'"),
])
def test_malformed_lines_name_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "train4"
    path.write_text("#\ta\tb\n\n" + bad_line + "\n")   # blank line 2 is skipped but counted
    with pytest.raises(li.LogicDataError) as err:
        li.read_pairs(str(path))
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)


def test_non_utf8_line_is_named(tmp_path):
    path = tmp_path / "test2"
    path.write_bytes(b"#\ta\tb\n#\ta\t\xff\n")
    with pytest.raises(li.LogicDataError, match="test2:2: not UTF-8"):
        li.read_pairs(str(path))


def test_wrong_relation_is_caught_when_checked(tmp_path):
    path = tmp_path / "test1"
    path.write_text("=\ta\t( not a )\n")
    assert li.read_pairs(str(path)) == [li.Pair("=", "a", "( not a )")]
    with pytest.raises(li.LogicDataError, match=r"test1:1: relation '=' .* give '\^'"):
        li.read_pairs(str(path), check_relation=True)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="train0"):
        li.read_buckets(str(tmp_path), "train")


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "train0"
    li.write_pairs(str(path), [li.Pair("#", "a", "b")])

    def lines():
        yield "<\ta\t( a ( or b ) )"
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        li.write_lines_atomic(str(path), lines())
    assert path.read_text() == "#\ta\tb\n"
    assert os.listdir(tmp_path) == ["train0"]     # no temporary file left behind


# --------------------------------------------------------------------------- protocols

def _pairs(texts):
    return [li.Pair(li.formula_relation(l, r), l, r) for l, r in texts]


def test_standard_protocol_holds_out_every_tenth():
    buckets = li.generate_buckets(3000, seed=4)
    splits = li.split_buckets(buckets)
    train = {k: splits[k][0] for k in range(13)}
    test = {k: splits[k][1] for k in range(13)}
    out = li.standard_protocol(train, test)
    pool = [p for k in range(7) for p in train[k]]
    assert out["valid"] == pool[9::10]
    assert out["train"] == [p for i, p in enumerate(pool) if i % 10 != 9]
    assert [out[f"test{k}"] for k in range(13)] == [test[k] for k in range(13)]
    assert set(out) == {"train", "valid"} | {f"test{k}" for k in range(13)}


def test_compositional_split_membership():
    pool = _pairs([
        ("( b ( and ( not a ) ) )", "c"),        # A, B, C
        ("c", "( ( b ( and ( not a ) ) ) ( or d ) )"),  # A (right side), B, C
        ("( b ( and ( not c ) ) )", "a"),        # B, C (not A: negated variable is c)
        ("( b ( and ( not ( a ( or c ) ) ) ) )", "a"),  # B, C (not A)
        ("( b ( or ( not a ) ) )", "c"),         # C only
        ("( ( not a ) ( and b ) )", "c"),        # none: the `not` is on the left operand
        ("( not ( a ( and b ) ) )", "c"),        # none
        ("a", "b"),                              # none
    ])
    train = {k: [] for k in range(7)}
    train[2] = pool
    expected_test = {"A": pool[:2], "B": pool[:4], "C": pool[:5]}
    for name in "ABC":
        out = li.compositional_protocol(train, name)
        assert out["test"] == expected_test[name], name
        assert out["train"] + out["valid"] == [p for p in pool if p not in expected_test[name]]
    with pytest.raises(ValueError, match="D"):
        li.compositional_protocol(train, "D")


def test_compositional_splits_on_generated_data():
    splits = li.split_buckets(li.generate_buckets(4000, seed=5))
    train = {k: splits[k][0] for k in range(7)}
    tests = {}
    for name in "ABC":
        out = li.compositional_protocol(train, name)
        patterns = li.COMPOSITIONAL_PATTERNS[name]
        rest = [p for k in range(7) for p in train[k] if not li.matches_pattern(p, patterns)]
        assert out["valid"] == rest[9::10]
        assert len(out["train"]) + len(out["valid"]) + len(out["test"]) == sum(map(len, train.values()))
        assert all(li.matches_pattern(p, patterns) for p in out["test"])
        tests[name] = set(out["test"])
    assert tests["A"] < tests["B"] < tests["C"]      # each pattern set implies the next


# --------------------------------------------------------------------------- seq2seq and CLIs

def test_seq2seq_form(tmp_path):
    pair = li.Pair("<", "( a ( and b ) )", "a")
    assert li.to_seq2seq(pair) == ("( a ( and b ) ) #SEP# a", "<")
    src, tgt = li.write_seq2seq(str(tmp_path), "valid", [pair, li.Pair("#", "a", "b")])
    assert os.path.basename(src) == "valid.src" and os.path.basename(tgt) == "valid.tgt"
    assert open(src).read() == "( a ( and b ) ) #SEP# a\na #SEP# b\n"
    assert open(tgt).read() == "<\n#\n"


def _run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def _in_process(script, *args):
    """``_run`` in the test's process (cli_helpers.run_in_process: no interpreter start-up);
    prepare.py without --binarize starts no tool."""
    return run_in_process(script, args)


def _lines(path):
    with open(path) as handle:
        return handle.read().splitlines()


def test_generate_and_prepare_clis(tmp_path):
    raw, std, comp = tmp_path / "raw", tmp_path / "std", tmp_path / "compA"
    result = _run(GENERATE, "--out", str(raw), "--pairs", "3000", "--seed", "9", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "orig train" in result.stdout and "|     12 |" in result.stdout
    assert len(os.listdir(raw)) == 26

    result = _in_process(PREPARE, "--data", str(raw), "--out", str(std), "--protocol", "standard",
                         "--check-relations")
    assert result.returncode == 0, result.stderr
    n_train_files = sum(len(_lines(raw / f"train{k}")) for k in range(7))
    train, valid = _lines(std / "train.src"), _lines(std / "valid.src")
    assert len(train) + len(valid) == n_train_files and len(valid) == n_train_files // 10
    assert len(_lines(std / "train.tgt")) == len(train)
    for k in range(13):
        src, tgt = _lines(std / f"test{k}.src"), _lines(std / f"test{k}.tgt")
        raw_lines = _lines(raw / f"test{k}")
        assert len(src) == len(tgt) == len(raw_lines)
        for s, t, r in zip(src, tgt, raw_lines):
            relation, left, right = r.split("\t")
            assert s == f"{left} #SEP# {right}" and t == relation

    result = _in_process(PREPARE, "--data", str(raw), "--out", str(comp), "--protocol", "A")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(comp)) == ["test.src", "test.tgt", "train.src", "train.tgt",
                                        "valid.src", "valid.tgt"]
    assert all("( and ( not a ) )" in s for s in _lines(comp / "test.src"))
    assert not any("( and ( not a ) )" in s for s in _lines(comp / "train.src"))

    os.remove(raw / "test12")
    result = _in_process(PREPARE, "--data", str(raw), "--out", str(tmp_path / "x"))
    assert result.returncode != 0 and "test12" in result.stderr
    (raw / "train3").write_text("=\ta\n")
    result = _in_process(PREPARE, "--data", str(raw), "--out", str(tmp_path / "y"), "--protocol", "B")
    assert result.returncode != 0 and f"{raw / 'train3'}:1:" in result.stderr


def test_classify_form(tmp_path):
    pairs = [li.Pair("<", "( a ( and b ) )", "a"), li.Pair("#", "a", "b")]
    paths = li.write_classify(str(tmp_path), "valid", pairs)
    assert list(paths) == [str(tmp_path / name) for name in ("valid.input0", "valid.input1", "valid.label")]
    assert sorted(os.listdir(tmp_path)) == ["valid.input0", "valid.input1", "valid.label"]
    assert [open(p).read() for p in paths] == ["( a ( and b ) )\na\n", "a\nb\n", "<\n#\n"]


def test_prepare_classify_binarizes_the_sentence_prediction_layout(tmp_path):
    """--format classify --binarize: input0 / input1 with one dictionary, label; the task
    sut_classification reads every pair back (formulas and relation) from each split."""
    from fairseq.data import Dictionary

    from sut_fairseq.tasks.sut_classification import SUTClassificationConfig, SUTClassificationTask

    raw, out = tmp_path / "raw", tmp_path / "cls"
    result = _run(GENERATE, "--out", str(raw), "--pairs", "1500", "--seed", "3", "--no-progress")
    assert result.returncode == 0, result.stderr
    result = _run(PREPARE, "--data", str(raw), "--out", str(out), "--format", "classify", "--binarize")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("running (into a temporary directory") == 4, result.stdout
    assert _lines(out / "train.tokens") == _lines(out / "train.input0") + _lines(out / "train.input1")
    bin_dir = out / "bin"
    assert sorted(os.listdir(bin_dir)) == ["input0", "input1", "label"]
    assert open(bin_dir / "input0" / "dict.txt").read() == open(bin_dir / "input1" / "dict.txt").read()
    task = SUTClassificationTask.setup_task(SUTClassificationConfig(data=str(bin_dir), seed=1))
    assert task.pair and task.num_classes == len(li.RELATIONS)
    labels = Dictionary.load(str(bin_dir / "label" / "dict.txt"))
    for split, text in (("valid", "valid"), ("test", "test0"), ("test7", "test7")):
        dataset = task.load_dataset(split)
        expected = list(zip(_lines(out / f"{text}.input0"), _lines(out / f"{text}.input1"),
                            _lines(out / f"{text}.label")))
        got = []
        for i in range(len(dataset)):
            item = dataset[i]  # NestedDictionaryDataset: flattened keys
            got.append((task.dictionary.string(item["net_input.src_tokens"][:-1]),
                        task.dictionary.string(item["net_input.pair_tokens"][:-1]),
                        labels[int(item["target"]) + labels.nspecial]))
        assert sorted(got) == sorted(expected) and len(got) > 0, split


# --------------------------------------------------------------------------- exact behaviour
# (each test below pins what a mutation-testing run found unchecked, docs/testing.md)

def test_variable_sets_are_built_by_the_bit_convention():
    """``_variable_set`` itself (the table ``truth_set`` reads is built at import)."""
    for i, name in enumerate(li.VARIABLES):
        assert li._variable_set(i) == worlds(lambda *values: values[i]) == li._VARIABLE_SETS[name]


def test_write_original_returns_the_paths_in_bucket_order(tmp_path):
    splits = [([li.Pair("#", "a", "b")], [li.Pair("=", "a", "a")])] * 2
    assert li.write_original(str(tmp_path), splits) == [
        str(tmp_path / name) for name in ("train0", "test0", "train1", "test1")]


def test_parse_line_defaults_and_whole_messages():
    """Without a path the message names ``<string>:0``; the quoted line keeps its leading
    spaces; only the line break is stripped before splitting (an empty last field is a
    formula error, not a field count); relations are not checked unless asked."""
    with pytest.raises(li.LogicDataError) as err:
        li.parse_line("  <\ta\n")
    assert str(err.value) == ("<string>:0: expected 3 tab-separated fields (RELATION, LEFT, RIGHT), "
                              "found 2: '  <\\ta'")
    with pytest.raises(li.LogicDataError) as err:
        li.parse_line("=\ta\t\n")
    assert str(err.value).startswith("<string>:0: cannot parse formula")
    assert li.parse_line("=\ta\t( not a )\r\n") == li.Pair("=", "a", "( not a )")
    with pytest.raises(li.LogicDataError) as err:    # a bad formula is quoted as written
        li.parse_line("=\ta\tX\n")
    assert "'X'" in str(err.value)


def _write_buckets(directory, wrong_in):
    """train0..6 and test0..12, one consistent pair each, except a wrong relation in the
    file ``wrong_in``."""
    for prefix, buckets in (("train", range(7)), ("test", range(13))):
        for k in buckets:
            pair = li.Pair("=", "a", "( not a )") if f"{prefix}{k}" == wrong_in else li.Pair("#", "a", "b")
            li.write_pairs(os.path.join(directory, f"{prefix}{k}"), [pair])


@pytest.mark.parametrize("wrong_in", ["train3", "test9"])
def test_protocols_check_relations_only_when_asked(tmp_path, wrong_in):
    _write_buckets(str(tmp_path), wrong_in)
    li.make_protocol(str(tmp_path), "standard")              # default: not checked
    li.read_buckets(str(tmp_path), wrong_in[:-1], [int(wrong_in[-1])])
    with pytest.raises(li.LogicDataError, match=f"{wrong_in}:1: relation '='"):
        li.make_protocol(str(tmp_path), "standard", check_relation=True)
    with pytest.raises(li.LogicDataError, match=f"{wrong_in}:1: relation '='"):
        li.read_buckets(str(tmp_path), wrong_in[:-1], [int(wrong_in[-1])], check_relation=True)
    with pytest.raises(ValueError) as err:
        li.make_protocol(str(tmp_path), "D")
    assert str(err.value) == f"unknown protocol 'D'; expected one of {li.PROTOCOLS}"


@pytest.mark.parametrize("bad, message", [
    ("", "expected a formula at token 1, found end of text"),
    ("( a", "expected '(' at token 3, found end of text"),
    ("( a ( xor b ) )", "expected 'and' or 'or' at token 4, found 'xor'"),
    ("( not )", "expected a variable (a, b, c, d, e, f) or '(' at token 3, found ')'"),
    ("a b", "expected end of formula at token 2, found 'b'"),
    ("( a b )", "expected '(' at token 3, found 'b'"),
    ("(", "expected a formula at token 2, found end of text"),
    ("( a (", "expected 'and' or 'or' at token 4, found end of text"),
])
def test_parse_errors_whole(bad, message):
    """Which token (1-based) was found where what was expected: checked by hand."""
    with pytest.raises(ValueError) as err:
        li.parse_formula(bad)
    assert str(err.value) == f"cannot parse formula {bad!r}: {message}"


def test_a_protocol_without_every_training_bucket_is_refused():
    train = {k: [li.Pair("#", "a", "b")] for k in range(5)}
    with pytest.raises(ValueError) as err:
        li.standard_protocol(train, {k: [] for k in range(13)})
    assert str(err.value) == "training buckets [5, 6] are missing"


def test_generate_buckets_reports_progress_in_thousands_and_the_rest():
    calls = []
    buckets = li.generate_buckets(2300, seed=4, progress=calls.append)
    assert calls == [1000, 1000, 300] and sum(map(len, buckets)) == 2300
    calls.clear()
    li.generate_buckets(2000, seed=4, progress=calls.append)
    assert calls == [1000, 1000]
    assert li.generate_buckets(0, seed=4, progress=calls.append) == [[] for _ in li.BUCKETS]
    assert calls == [1000, 1000]
    with pytest.raises(ValueError) as err:
        li.generate_buckets(-1, seed=4)
    assert str(err.value) == "n_pairs must be >= 0, got -1"


def test_grow_formula_follows_its_draws():
    """Budget 2 still allows a binary node (a leaf only below 2), whose children get
    budget 1 (leaves, though their node draws say 'and'); ``not`` wraps a node when the
    draw is below 1/3, not at 1/3 exactly."""
    choices = list(li._NODE_CHOICES)
    and_ = choices.index("and")
    leaf = choices.index(None)
    p = li.NOT_PROBABILITY
    # root: node draw 'and'; left: node draw 'and' (ignored, budget 1), variable b, not-draw
    # 0.2 (wrapped); right: node draw leaf, variable c, not-draw p (not wrapped); root's
    # not-draw 0.9
    rng = ScriptedRng([and_, and_, 1, leaf, 2], [0.2, p, 0.9])
    assert li.grow_formula(rng, ["a", "b", "c"], budget=2) == ("and", ("not", "b"), "c")
    assert rng.picks == [] and rng.numbers == []
    rng = ScriptedRng([and_, 0], [0.9])                       # budget 1: a leaf
    assert li.grow_formula(rng, ["a", "b"], budget=1) == "a"


@pytest.mark.parametrize("node", [("and", "a"), ("not", "a", "b"), ("xor", "a", "b"), ("or", "a", "b", "c")])
def test_malformed_formula_nodes_are_refused_whole(node):
    for function in (li.truth_set, li.to_string):
        with pytest.raises(ValueError) as err:
            function(node)
        assert str(err.value) == f"malformed formula node {node!r}"
    for function in (li.truth_set, li.to_string):
        with pytest.raises(ValueError) as err:
            function("g")
        assert str(err.value) == f"unknown variable 'g'; expected one of {li.VARIABLES}"


def test_too_deep_a_formula_is_refused_with_its_first_80_characters():
    text = "(" * 3000 + "a"
    with pytest.raises(ValueError) as err:
        li.parse_formula(text)
    assert str(err.value) == f"cannot parse formula {'(' * 80!r}...: nested too deeply"


def test_an_unknown_relation_lists_the_relations():
    with pytest.raises(li.LogicDataError) as err:
        li.parse_line("?\ta\tb")
    assert str(err.value) == "<string>:0: unknown relation '?'; expected one of = < > ^ | v #"


def test_progress_of_fewer_pairs_than_a_thousand():
    calls = []
    li.generate_buckets(999, seed=4, progress=calls.append)
    assert calls == [999]
