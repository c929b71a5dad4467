"""CFQ data (docs/cfq.md#data-preparation): source/target preprocessing, the target
simplification and its inverse, the streaming JSON parser, split handling, errors, and
prepare.py from a directory, an archive and a (file://) download -- on the fixture in
tests/fixtures/cfq."""
import io
import json
import os
import random
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cli_helpers import run_in_process
from sut_fairseq.data import cfq

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "cfq")
PREPARE = os.path.join(REPO, "data-prep", "cfq", "prepare.py")
SPOUSE = ("ns:people.person.spouse_s/ns:people.marriage.spouse|"
          "ns:fictional_universe.fictional_character.married_to/"
          "ns:fictional_universe.marriage_of_fictional_characters.spouses")
SIBLING = "ns:people.person.sibling_s/ns:people.sibling_relationship.sibling"


def fixture_records():
    with open(os.path.join(FIXTURE, "dataset.json"), encoding="utf-8") as f:
        return json.load(f)


def fixture_split(name):
    with open(os.path.join(FIXTURE, "splits", name + ".json")) as f:
        return json.load(f)


# --------------------------------------------------------------------------- source rules

@pytest.mark.parametrize("question, expected", [
    ("Did M1 's female actor edit and produce M0", "Did M1 ' s female actor edit and produce M0"),
    ("Did M2 star M3 , M4 , and M5", "Did M2 star M3 , M4 , and M5"),
    ("Was M0 a co-founder of M1?", "Was M0 a co - founder of M1 ?"),
    ("Who  directed\tM0 's sequel", "Who directed M0 ' s sequel"),
    ("What (film) did M0's \"sibling\" edit", 'What ( film ) did M0 \' s " sibling " edit'),
])
def test_question_punctuation_becomes_tokens(question, expected):
    assert cfq.preprocess_question(question) == expected


# --------------------------------------------------------------------------- target rules

def test_count_star_is_split_into_tokens():
    out = cfq.preprocess_query("SELECT count(*) WHERE {\n?x0 ns:film.editor.film M0\n}")
    assert out == "SELECT count ( * ) WHERE { ?x0 film.editor.film M0 }"


def test_ns_prefix_is_dropped_from_every_token_and_entities_become_m_underscore():
    query = ("SELECT count(*) WHERE {\n?x0 ns:film.editor.film M0 .\n"
             "?x0 ns:people.person.gender ns:m.02zsn\n}")
    assert cfq.preprocess_query(query) == (
        "SELECT count ( * ) WHERE { ?x0 film.editor.film M0 . ?x0 people.person.gender m_02zsn }")
    # the class after `a` loses its prefix too; placeholders and variables are untouched
    assert cfq.preprocess_query("SELECT DISTINCT ?x0 WHERE {\n?x0 a ns:film.film .\n"
                                "?x0 ns:film.film.directed_by M10\n}") == (
        "SELECT DISTINCT ?x0 WHERE { ?x0 a film.film . ?x0 film.film.directed_by M10 }")


def test_only_the_leading_ns_of_a_path_token_is_dropped():
    out = cfq.preprocess_query(f"SELECT count(*) WHERE {{\n?x0 {SPOUSE} M0\n}}")
    assert out.split()[8] == SPOUSE[3:]
    assert out.split()[8].startswith("people.person.spouse_s/ns:people.marriage.spouse|ns:")


def test_m_dot_rule_applies_after_the_prefix_rule_and_only_at_token_start():
    assert cfq.preprocess_query("S { ?x0 p ns:m.0f8l9c . ?x0 film.film m.05zppz }") == \
        "S { ?x0 p m_0f8l9c . ?x0 film.film m_05zppz }"
    assert cfq.preprocess_query("S { ?x0 ns:film.film M0 }") == "S { ?x0 film.film M0 }"


def test_newlines_and_escaped_newlines_become_spaces():
    assert cfq.preprocess_query("SELECT DISTINCT ?x0 WHERE {\r\n?x0 a ns:film.actor\n}") == \
        "SELECT DISTINCT ?x0 WHERE { ?x0 a film.actor }"
    assert cfq.preprocess_query("SELECT DISTINCT ?x0 WHERE {\\n?x0 a ns:film.actor\\n}") == \
        "SELECT DISTINCT ?x0 WHERE { ?x0 a film.actor }"


def test_restore_inverts_preprocessing_on_every_fixture_query():
    for record in fixture_records():
        query = record["sparqlPatternModEntities"]
        assert cfq.restore_query(cfq.preprocess_query(query)) == query


# --------------------------------------------------------------------------- simplification

REALISTIC = [
    # merged objects, FILTER, a class, a path with `/`
    ("SELECT DISTINCT ?x0 WHERE {\n?x0 a ns:people.person .\n"
     "?x0 ns:film.actor.film/ns:film.performance.film M1 .\n"
     "?x0 ns:influence.influence_node.influenced_by M3 .\n"
     "?x0 ns:influence.influence_node.influenced_by M2 .\nFILTER ( ?x0 != M1 )\n}",
     "SELECT DISTINCT ?x0 WHERE { ?x0 a people.person . "
     "?x0 film.actor.film/ns:film.performance.film M1 . "
     "?x0 influence.influence_node.influenced_by M2 , M3 . FILTER ( ?x0 != M1 ) }"),
    # count(*), an `|` path merged over three objects, an m_ entity
    ("SELECT count(*) WHERE {\n?x0 ns:film.producer.film|ns:film.production_company.films M2 .\n"
     "?x0 ns:people.person.gender ns:m.02zsn .\n"
     "?x0 ns:film.producer.film|ns:film.production_company.films M0 .\n"
     "?x0 ns:film.producer.film|ns:film.production_company.films M1\n}",
     "SELECT count ( * ) WHERE { ?x0 film.producer.film|ns:film.production_company.films M0 , M1 , M2 . "
     "?x0 people.person.gender m_02zsn }"),
    # two subjects and two filters in scrambled order: ?x0 before ?x1, filters sorted, last
    ("SELECT DISTINCT ?x0 WHERE {\nFILTER ( ?x1 != M0 ) .\n?x1 " + SIBLING + " M0 .\n"
     "?x0 " + SPOUSE + " ?x1 .\nFILTER ( ?x0 != ?x1 )\n}",
     "SELECT DISTINCT ?x0 WHERE { ?x0 " + SPOUSE[3:] + " ?x1 . ?x1 " + SIBLING[3:] + " M0 . "
     "FILTER ( ?x0 != ?x1 ) . FILTER ( ?x1 != M0 ) }"),
    # entity subjects sort after variables; numbers sort numerically (?x2 < ?x10, M2 < M10)
    ("SELECT DISTINCT ?x0 WHERE {\nM10 ns:film.film.directed_by ?x0 .\nM2 ns:film.film.directed_by ?x0 .\n"
     "?x10 ns:film.film.edited_by ?x0 .\n?x2 ns:film.film.edited_by ?x0 .\n?x0 a ns:film.director\n}",
     "SELECT DISTINCT ?x0 WHERE { ?x0 a film.director . ?x2 film.film.edited_by ?x0 . "
     "?x10 film.film.edited_by ?x0 . M2 film.film.directed_by ?x0 . M10 film.film.directed_by ?x0 }"),
]


@pytest.mark.parametrize("raw, expected", REALISTIC)
def test_simplification_of_realistic_queries(raw, expected):
    plain = cfq.preprocess_query(raw)
    simplified = cfq.simplify_query(plain)
    assert simplified == expected
    assert cfq.simplify_query(simplified) == simplified              # idempotent
    assert cfq.query_triples(cfq.expand_query(simplified)) == cfq.query_triples(plain)
    assert cfq.query_triples(simplified) == cfq.query_triples(plain)  # same meaning


def test_simplification_groups_only_equal_subject_and_predicate():
    plain = ("SELECT DISTINCT ?x0 WHERE { ?x0 film.director.film M0 . ?x0 film.editor.film M0 . "
             "?x1 film.director.film M0 . ?x0 film.director.film M1 }")
    assert cfq.simplify_query(plain) == (
        "SELECT DISTINCT ?x0 WHERE { ?x0 film.director.film M0 , M1 . ?x0 film.editor.film M0 . "
        "?x1 film.director.film M0 }")


def test_expand_is_the_inverse_up_to_order():
    simplified = "SELECT count ( * ) WHERE { M0 film.film.starring/ns:film.performance.actor M3 , M4 , M5 }"
    assert cfq.expand_query(simplified) == (
        "SELECT count ( * ) WHERE { M0 film.film.starring/ns:film.performance.actor M3 . "
        "M0 film.film.starring/ns:film.performance.actor M4 . "
        "M0 film.film.starring/ns:film.performance.actor M5 }")
    assert cfq.simplify_query(cfq.expand_query(simplified)) == simplified


def test_restore_turns_a_simplified_query_into_sparql_with_object_lists():
    simplified = "SELECT count ( * ) WHERE { ?x0 a film.actor . ?x0 people.person.gender m_02zsn , M1 }"
    assert cfq.restore_query(simplified) == (
        "SELECT count(*) WHERE {\n?x0 a ns:film.actor .\n"
        "?x0 ns:people.person.gender ns:m.02zsn , M1\n}")


@pytest.mark.parametrize("bad", [
    "SELECT DISTINCT ?x0 WHERE ?x0 a film.film",                 # no braces
    "SELECT DISTINCT ?x0 WHERE { ?x0 a film.film",               # unclosed
    "{ ?x0 a film.film }",                                       # no header
    "SELECT DISTINCT ?x0 WHERE { ?x0 a }",                       # truncated triple
    "SELECT DISTINCT ?x0 WHERE { ?x0 a film.film ?x1 p M0 }",    # missing '.'
    "SELECT DISTINCT ?x0 WHERE { FILTER ( ?x0 != M0 }",          # unbalanced FILTER
    "SELECT DISTINCT ?x0 WHERE { ?x0 p M0 , }",                  # dangling comma
    "SELECT DISTINCT ?x0 WHERE { { ?x0 p M0 } }",                # nested group
])
def test_unparsable_queries_raise(bad):
    with pytest.raises(cfq.QueryFormatError):
        cfq.simplify_query(bad)


# Property: queries that differ only in the order of their triples and filters (or in
# repeated triples) have one simplified form, which keeps their meaning.
TERMS = st.sampled_from(["?x0", "?x1", "?x2", "?x10", "M0", "M1", "M2", "M12", "m_02zsn",
                         "m_05zppz"])
PREDICATES = st.sampled_from([
    "a", "film.director.film", "film.editor.film", "people.person.gender",
    "film.producer.film|ns:film.production_company.films",
    "film.actor.film/ns:film.performance.film", SPOUSE[3:]])
TRIPLES = st.lists(st.tuples(TERMS, PREDICATES, TERMS), min_size=1, max_size=9)
FILTERS = st.lists(st.tuples(TERMS, TERMS).map(lambda ab: ("FILTER", "(", ab[0], "!=", ab[1], ")")),
                   max_size=3)
HEADERS = st.sampled_from(["SELECT DISTINCT ?x0 WHERE", "SELECT count ( * ) WHERE"])


def render(header, triples, filters, trailing_dot=False):
    statements = [" ".join(t) for t in triples] + [" ".join(f) for f in filters]
    return f"{header} {{ {' . '.join(statements)}{' .' if trailing_dot else ''} }}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=HEADERS, triples=TRIPLES, filters=FILTERS, seed=st.integers(0, 2 ** 32 - 1),
       repeat=st.booleans(), trailing_dot=st.booleans())
def test_simplification_is_canonical_under_triple_order(header, triples, filters, seed, repeat,
                                                        trailing_dot):
    original = render(header, triples, filters)
    rng = random.Random(seed)
    statements = list(triples) + (triples[:2] if repeat else [])
    rng.shuffle(statements)
    shuffled_filters = list(filters)
    rng.shuffle(shuffled_filters)
    # filters may also sit between triples
    mixed = [" ".join(t) for t in statements]
    for f in shuffled_filters:
        mixed.insert(rng.randint(0, len(mixed)), " ".join(f))
    permuted = f"{header} {{ {' . '.join(mixed)}{' .' if trailing_dot else ''} }}"

    simplified = cfq.simplify_query(original)
    assert cfq.simplify_query(permuted) == simplified
    assert cfq.simplify_query(simplified) == simplified
    assert cfq.query_triples(simplified) == (frozenset(triples), frozenset(filters))
    assert cfq.query_triples(cfq.expand_query(simplified)) == (frozenset(triples), frozenset(filters))
    # each (subject, predicate) appears once in the simplified form
    groups = [s.split()[:2] for s in simplified.split("{", 1)[1].rstrip("}").split(" . ")
              if not s.strip().startswith("FILTER")]
    assert len(groups) == len({tuple(g) for g in groups}) == len({t[:2] for t in triples})


@settings(max_examples=100, deadline=None)
@given(triples=TRIPLES, seed=st.integers(0, 2 ** 32 - 1))
def test_simplification_of_raw_cfq_layout_is_order_invariant(triples, seed):
    def raw(ts):  # the CFQ file layout: one statement a line, ns: prefixes
        lines = [f"{s} {p if p == 'a' else 'ns:' + p} {o}" for s, p, o in ts]
        lines = [l.replace("m_", "ns:m.") for l in lines]
        return "SELECT DISTINCT ?x0 WHERE {\n" + " .\n".join(lines) + "\n}"

    shuffled = list(triples)
    random.Random(seed).shuffle(shuffled)
    one = cfq.simplify_query(cfq.preprocess_query(raw(triples)))
    two = cfq.simplify_query(cfq.preprocess_query(raw(shuffled)))
    assert one == two


# --------------------------------------------------------------------------- streaming parser

TRICKY = ('[{"questionPatternModEntities": "Did M0 say \\"]\\" or \\"}\\"", '
          '"sparqlPatternModEntities": "SELECT count(*) WHERE {\\n?x0 ns:film.film M0\\n}", '
          '"ruleIds": ["[", "]", "\\\\", "{\\"a\\": [1, 2]}"], "n": -12.5e3, "u": "\\u00e9\\ud83c\\udfac"},'
          '  12345678 , "Amélie 🎬 [x]" ,true,null , [[], {}, [{"k": "v,]"}]],'
          '{"questionPatternModEntities": "q", "sparqlPatternModEntities": "s"}\n]\n')


def parse(text, chunk, binary=True):
    handle = io.BytesIO(text.encode("utf-8")) if binary else io.StringIO(text)
    return list(cfq.iter_json_array(handle, "t.json", chunk_chars=chunk))


@pytest.mark.parametrize("binary", [True, False])
def test_streaming_parser_across_every_chunk_boundary(binary):
    expected = list(enumerate(json.loads(TRICKY)))
    for chunk in list(range(1, 40)) + [64, 1000]:
        assert parse(TRICKY, chunk, binary) == expected, chunk


def test_streaming_parser_reports_bytes_read_and_handles_empty_array():
    seen = []
    handle = io.BytesIO(TRICKY.encode("utf-8"))
    list(cfq.iter_json_array(handle, "t.json", chunk_chars=7, on_read=seen.append))
    assert sum(seen) == len(TRICKY.encode("utf-8"))
    assert parse(" [ ] ", 1) == [] and parse("[]", 3) == []
    assert parse("\ufeff[1]", 1) == [(0, 1)]  # a UTF-8 byte-order mark is skipped


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from(list('ab"\\[]{},: \n\té🎬')), max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(alphabet=st.sampled_from(list('k"]}\\')), max_size=4), children, max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(JSON_VALUES, max_size=6), chunk=st.integers(1, 50),
       indent=st.sampled_from([None, 1, 2]), ascii_only=st.booleans())
def test_streaming_parser_matches_json_loads(values, chunk, indent, ascii_only):
    text = json.dumps(values, indent=indent, ensure_ascii=ascii_only)
    assert [v for _, v in parse(text, chunk)] == json.loads(text)


@pytest.mark.parametrize("text, message", [
    ("", "expected a JSON array ('[') at character 0, found an empty file"),
    ('{"a": 1}', "expected a JSON array"),
    ('[{"a": 1}, {"b": 2},]', "malformed JSON in record 2"),
    ('[{"a": 1} {"b": 2}]', "expected ',' or ']' after record 0"),
    ('[{"a": 1}, {"b": "unterminated}]', "malformed JSON in record 1"),
    ('[{"a": 1}, {"b": 2}, {"c": ', "malformed JSON in record 2"),
    ('[{"a": 1}, {"b": 2}', "expected ',' or ']' after record 1"),
    ('[{"a": 1}, ', "unexpected end of file in record 1"),
    ('[{"a": 1}] x', "unexpected data after the closing ']'"),
    ('[{"a": 1}, {"b": tru}]', "malformed JSON in record 1"),
])
def test_malformed_json_errors_name_file_and_record(text, message):
    for chunk in (1, 5, 1000):
        with pytest.raises(cfq.CfqDataError) as err:
            parse(text, chunk)
        assert str(err.value).startswith("t.json: ") and message in str(err.value), str(err.value)


def test_invalid_utf8_is_reported():
    with pytest.raises(cfq.CfqDataError, match="t.json: not valid UTF-8"):
        list(cfq.iter_json_array(io.BytesIO(b'["\xff\xfe"]'), "t.json"))


# --------------------------------------------------------------------------- records and splits

def write_dataset(directory, records, splits):
    os.makedirs(os.path.join(directory, "splits"), exist_ok=True)
    with open(os.path.join(directory, "dataset.json"), "w") as f:
        json.dump(records, f)
    for name, split in splits.items():
        with open(os.path.join(directory, "splits", name + ".json"), "w") as f:
            json.dump(split, f)


GOOD = {"questionPatternModEntities": "Who directed M0",
        "sparqlPatternModEntities": "SELECT DISTINCT ?x0 WHERE {\n?x0 ns:film.director.film M0\n}"}
SPLIT = {"trainIdxs": [0, 2], "devIdxs": [1], "testIdxs": [2]}


@pytest.mark.parametrize("bad_record, message", [
    ({"questionPatternModEntities": "q"}, "record 1 has no field 'sparqlPatternModEntities'"),
    ({"sparqlPatternModEntities": "s", "question": "q"}, "record 1 has no field 'questionPatternModEntities'"),
    ({"questionPatternModEntities": 3, "sparqlPatternModEntities": "s"},
     "record 1: field 'questionPatternModEntities' is not a string"),
    (["not", "an", "object"], "record 1 is a list, not a JSON object"),
])
def test_record_errors_name_file_and_index(tmp_path, bad_record, message):
    write_dataset(str(tmp_path / "cfq"), [GOOD, bad_record, GOOD], {"s": SPLIT})
    with pytest.raises(cfq.CfqDataError) as err:
        cfq.prepare(str(tmp_path / "out"), ["s"], cfq_dir=str(tmp_path / "cfq"), progress=False)
    assert str(tmp_path / "cfq" / "dataset.json") in str(err.value) and message in str(err.value)


def test_split_index_out_of_range_names_split_file_and_index(tmp_path):
    write_dataset(str(tmp_path), [GOOD, GOOD, GOOD],
                  {"s": {"trainIdxs": [0, 1], "devIdxs": [2], "testIdxs": [1, 3]}})
    with pytest.raises(cfq.CfqDataError) as err:
        cfq.prepare(str(tmp_path / "out"), ["s"], cfq_dir=str(tmp_path), progress=False)
    text = str(err.value)
    assert str(tmp_path / "splits" / "s.json") in text
    assert "testIdxs[1] = 3 is out of range" in text and "has 3 records" in text
    assert not os.path.exists(tmp_path / "out" / "s" / "train.src")  # nothing half-written


@pytest.mark.parametrize("split, message", [
    ({"trainIdxs": [0], "devIdxs": [1]}, "no 'testIdxs' list"),
    ({"trainIdxs": [0], "devIdxs": [1], "testIdxs": [-1]}, "testIdxs[0] = -1 is not a record index"),
    ({"trainIdxs": [0, "1"], "devIdxs": [1], "testIdxs": [2]}, "trainIdxs[1] = '1' is not a record index"),
    ({"trainIdxs": 0, "devIdxs": [1], "testIdxs": [2]}, "'trainIdxs' is not a list"),
    ([0, 1, 2], "a split file must hold a JSON object"),
])
def test_malformed_split_files(tmp_path, split, message):
    write_dataset(str(tmp_path), [GOOD, GOOD, GOOD], {"s": split})
    with pytest.raises(cfq.CfqDataError) as err:
        cfq.prepare(str(tmp_path / "out"), ["s"], cfq_dir=str(tmp_path), progress=False)
    assert str(tmp_path / "splits" / "s.json") in str(err.value) and message in str(err.value)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(cfq.CfqDataError, match="dataset.json: file not found"):
        cfq.prepare(str(tmp_path / "out"), ["mcd1"], cfq_dir=str(tmp_path), progress=False)
    write_dataset(str(tmp_path), [GOOD], {"mcd1": SPLIT})
    with pytest.raises(cfq.CfqDataError, match=r"mcd9\.json: split file not found \(available: mcd1\)"):
        cfq.prepare(str(tmp_path / "out"), ["mcd9"], cfq_dir=str(tmp_path), progress=False)
    with open(tmp_path / "splits" / "bad.json", "w") as f:
        f.write('{"trainIdxs": [0,')
    with pytest.raises(cfq.CfqDataError, match=r"bad\.json: malformed JSON at line 1"):
        cfq.prepare(str(tmp_path / "out"), ["bad"], cfq_dir=str(tmp_path), progress=False)
    with pytest.raises(cfq.CfqDataError, match="archive not found"):
        cfq.prepare(str(tmp_path / "out"), ["mcd1"], archive=str(tmp_path / "none.tar.gz"))


def test_a_query_that_cannot_be_simplified_names_the_record(tmp_path):
    bad = dict(GOOD, sparqlPatternModEntities="SELECT DISTINCT ?x0 WHERE {\n?x0 ns:film.film\n}")
    write_dataset(str(tmp_path), [GOOD, GOOD, bad], {"s": SPLIT})
    with pytest.raises(cfq.CfqDataError, match=r"dataset.json: record 2: cannot simplify"):
        cfq.prepare(str(tmp_path / "out"), ["s"], cfq_dir=str(tmp_path), progress=False)
    summary = cfq.prepare(str(tmp_path / "out"), ["s"], cfq_dir=str(tmp_path),
                          target_form="plain", progress=False)
    assert summary == {"s": {"train": 2, "valid": 1, "test": 1}}


# --------------------------------------------------------------------------- the fixture

def test_fixture_is_in_the_cfq_schema_and_covers_every_rule():
    records = fixture_records()
    assert len(records) > 100
    queries = [r["sparqlPatternModEntities"] for r in records]
    joined = "\n".join(queries)
    for feature in ("count(*)", "FILTER ( ", "ns:m.", "|ns:", "/ns:", "SELECT DISTINCT ?x0", " a ns:"):
        assert feature in joined, feature
    assert any("'s" in r["questionPatternModEntities"] for r in records)
    assert any("," in r["questionPatternModEntities"] for r in records)
    simplified = [cfq.simplify_query(cfq.preprocess_query(q)) for q in queries]
    assert sum(" , " in s for s in simplified) >= 10  # merged objects occur
    for name in ("mcd1", "random_split"):
        split = fixture_split(name)
        assert set(split) >= {"trainIdxs", "devIdxs", "testIdxs"}
        assert all(0 <= i < len(records) for k in split for i in split[k])


def expected_files(records, split, target_form="simplified"):
    files = {}
    for subset, key in cfq.SPLIT_KEYS:
        rows = [records[i] for i in split[key]]
        plain = [cfq.preprocess_query(r["sparqlPatternModEntities"]) for r in rows]
        files[subset + ".src"] = [cfq.preprocess_question(r["questionPatternModEntities"]) for r in rows]
        files[subset + ".sparql"] = plain
        files[subset + ".tgt"] = [cfq.simplify_query(p) for p in plain] if target_form == "simplified" else plain
    return files


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def make_archive(path, members_first=("splits",)):
    """A cfq1.1.tar.gz look-alike (top folder cfq/) of the fixture."""
    with tarfile.open(path, "w:gz") as tar:
        order = ["splits", "dataset.json"] if members_first == ("splits",) else ["dataset.json", "splits"]
        for name in order:
            tar.add(os.path.join(FIXTURE, name), arcname="cfq/" + name)
    return path


def test_prepare_from_directory_writes_every_split_in_index_order(tmp_path):
    out = str(tmp_path / "out")
    summary = cfq.prepare(out, ["mcd1", "random_split"], cfq_dir=FIXTURE, progress=False,
                          chunk_chars=97)
    records = fixture_records()
    for name in ("mcd1", "random_split"):
        split = fixture_split(name)
        assert summary[name] == {"train": len(split["trainIdxs"]), "valid": len(split["devIdxs"]),
                                 "test": len(split["testIdxs"])}
        for filename, lines in expected_files(records, split).items():
            assert read_lines(os.path.join(out, name, filename)) == lines, (name, filename)
        info = json.load(open(os.path.join(out, name, "prep.json")))
        assert info["counts"] == summary[name] and info["dataset_records"] == len(records)
    leftovers = [f for _, _, fs in os.walk(out) for f in fs if f.endswith(".tmp")]
    assert leftovers == []


@pytest.mark.parametrize("order", ["splits-first", "dataset-first"])
def test_prepare_from_archive_equals_directory(tmp_path, order):
    archive = make_archive(str(tmp_path / "cfq1.1.tar.gz"),
                           ("splits",) if order == "splits-first" else ("dataset",))
    cfq.prepare(str(tmp_path / "a"), ["mcd1", "random_split"], archive=archive, progress=False)
    cfq.prepare(str(tmp_path / "d"), ["mcd1", "random_split"], cfq_dir=FIXTURE, progress=False)
    for name in ("mcd1", "random_split"):
        for subset in ("train", "valid", "test"):
            for ext in ("src", "tgt", "sparql"):
                f = f"{subset}.{ext}"
                assert read_lines(tmp_path / "a" / name / f) == read_lines(tmp_path / "d" / name / f)
    with pytest.raises(cfq.CfqDataError, match=r"no splits/mcd7.json \(available: mcd1, random_split\)"):
        cfq.prepare(str(tmp_path / "x"), ["mcd7"], archive=archive, progress=False)


def test_download_accepts_a_url_and_fails_clearly_offline(tmp_path):
    archive = make_archive(str(tmp_path / "src.tar.gz"))
    dest = str(tmp_path / "cache" / cfq.ARCHIVE_NAME)
    assert cfq.download("file://" + archive, dest, progress=False) == dest
    assert open(dest, "rb").read() == open(archive, "rb").read()
    assert not os.path.exists(dest + ".part")
    with pytest.raises(cfq.CfqDataError, match="could not download .*--archive.*--cfq-dir"):
        cfq.download("file://" + str(tmp_path / "missing.tar.gz"), str(tmp_path / "d2" / "x.tar.gz"),
                     progress=False)
    assert not os.path.exists(tmp_path / "d2" / "x.tar.gz")


# --------------------------------------------------------------------------- the CLI

def run_prepare(*args):
    """prepare.py without --binarize (no tool started) in the test's process
    (cli_helpers.run_in_process); test_cfq_pipeline.py runs it as a real process."""
    return run_in_process(PREPARE, args)


def test_cli_prepares_from_a_url(tmp_path):
    archive = make_archive(str(tmp_path / "cfq1.1.tar.gz"))
    proc = run_prepare("--out", str(tmp_path / "out"), "--url", "file://" + archive,
                       "--split", "mcd1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "mcd1: 89 train / 6 valid / 6 test" in proc.stdout
    assert os.path.exists(tmp_path / "out" / "download" / cfq.ARCHIVE_NAME)
    assert len(read_lines(tmp_path / "out" / "mcd1" / "test.tgt")) == 6


def test_cli_errors_exit_1_with_the_file_named(tmp_path):
    write_dataset(str(tmp_path), [GOOD, {"questionPatternModEntities": "q"}], {"s": SPLIT})
    proc = run_prepare("--cfq-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--split", "s",
                       "--no-progress")
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "dataset.json: record 1 has no field" in proc.stderr
    proc = run_prepare("--out", str(tmp_path / "o"), "--url", "file:///nonexistent/cfq1.1.tar.gz",
                       "--no-progress")
    assert proc.returncode == 1 and "--archive" in proc.stderr
