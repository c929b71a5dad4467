"""Logical inference data of Bowman et al. (2015), as used by the SUT paper
(docs/results/logic_data.md).

Everything here is standard library only.

Formulas
    A formula is a variable name (``"a"`` .. ``"f"``), ``("not", X)``, ``("and", L, R)``
    or ``("or", L, R)``. In the original files formulas are fully parenthesised with
    space-separated tokens: a variable is written bare (``a``), a negation as
    ``( not X )`` and a binary node as ``( L ( OP R ) )``; e.g. ``( a ( or ( not b ) ) )``
    is ``a OR (NOT b)``. :func:`to_string` writes that form, :func:`parse_formula`
    reads it back.

Truth sets
    Six variables give 64 worlds; world ``w`` makes variable ``i`` (``a`` = 0 .. ``f`` = 5)
    true iff bit ``i`` of ``w`` is set. A truth set is a 64-bit integer whose bit ``w`` is
    set iff the formula holds in world ``w``.

Files
    ``train0`` .. ``train12`` and ``test0`` .. ``test12``: one pair per line,
    ``RELATION<TAB>LEFT<TAB>RIGHT``; the number is the bucket, the operator count
    (``and``, ``or``, ``not``) of the larger side, capped at 12.

Protocols (see :func:`standard_protocol`, :func:`compositional_protocol`) and the seq2seq
form (``LEFT #SEP# RIGHT`` -> relation token, :func:`write_seq2seq`) follow
docs/results/logic_data.md#protocols; the classification form (left, right and relation in
three line-aligned files, :func:`write_classify`) is the Siamese classifier's.
"""
import os
import random
import re
from typing import Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

from .atomic import write_lines_atomic

VARIABLES = ("a", "b", "c", "d", "e", "f")
BINARY_OPERATORS = ("and", "or")
OPERATORS = ("and", "or", "not")
#: The seven relations, in the order of Bowman et al.: equivalence, forward entailment,
#: backward entailment, negation, alternation, cover, independence.
RELATIONS = ("=", "<", ">", "^", "|", "v", "#")
N_WORLDS = 2 ** len(VARIABLES)
FULL_SET = (1 << N_WORLDS) - 1
MAX_BUCKET = 12
BUCKETS = tuple(range(MAX_BUCKET + 1))
#: Generator settings (docs/results/logic_data.md#the-generator).
SIZE_BUDGET = 12
VARIABLES_PER_PAIR = 4
NOT_PROBABILITY = 1.0 / 3.0
#: Node choices: "and", "or" twice each and five leaves (None).
_NODE_CHOICES = ("and", "or", "and", "or", None, None, None, None, None)
#: Train share of each deduplicated bucket: the first floor(n * 85 / 100) pairs.
TRAIN_PERCENT = 85
#: Sizes (train, test) of the original files per bucket (docs/results/logic_data.md#original-files).
ORIGINAL_SIZES = {
    0: (30, 6), 1: (2319, 410), 2: (12451, 2198), 3: (23252, 4104), 4: (30373, 5361),
    5: (34152, 6027), 6: (32952, 5816), 7: (26671, 4707), 8: (18962, 3347),
    9: (12634, 2230), 10: (8181, 1444), 11: (4894, 864), 12: (4831, 853),
}
#: Number of accepted pairs the original sizes correspond to.
ORIGINAL_PAIRS = 500_000
#: Source-side separator token of the seq2seq form.
SEPARATOR = "#SEP#"
#: Buckets trained on in both protocols.
TRAIN_BUCKETS = tuple(range(7))
#: Substrings that send a pair to the test split of a compositional protocol.
COMPOSITIONAL_PATTERNS = {
    "A": ("( and ( not a ) )",),
    "B": ("( and ( not ",),
    "C": ("( and ( not ", "( or ( not "),
}
PROTOCOLS = ("standard",) + tuple(COMPOSITIONAL_PATTERNS)

Formula = Union[str, tuple]


class Pair(NamedTuple):
    """One example: the relation and the two formulas in their string form."""
    relation: str
    left: str
    right: str


class LogicDataError(ValueError):
    """A malformed line in an original-format file; the message names file and line."""


# ---------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------

def _variable_set(index: int) -> int:
    mask = 0
    for world in range(N_WORLDS):
        if (world >> index) & 1:
            mask |= 1 << world
    return mask


_VARIABLE_SETS = {name: _variable_set(i) for i, name in enumerate(VARIABLES)}


def truth_set(formula: Formula) -> int:
    """The 64-bit mask of worlds in which ``formula`` holds."""
    if isinstance(formula, str):
        try:
            return _VARIABLE_SETS[formula]
        except KeyError:
            raise ValueError(f"unknown variable {formula!r}; expected one of {VARIABLES}") from None
    op = formula[0]
    if op == "not" and len(formula) == 2:
        return FULL_SET & ~truth_set(formula[1])
    if op == "and" and len(formula) == 3:
        return truth_set(formula[1]) & truth_set(formula[2])
    if op == "or" and len(formula) == 3:
        return truth_set(formula[1]) | truth_set(formula[2])
    raise ValueError(f"malformed formula node {formula!r}")


def operator_count(formula: Formula) -> int:
    """Number of ``and``, ``or`` and ``not`` operators in ``formula``."""
    if isinstance(formula, str):
        return 0
    return 1 + sum(operator_count(child) for child in formula[1:])


def to_string(formula: Formula) -> str:
    """The original fully parenthesised form: ``a``, ``( not X )``, ``( L ( OP R ) )``."""
    if isinstance(formula, str):
        if formula not in _VARIABLE_SETS:
            raise ValueError(f"unknown variable {formula!r}; expected one of {VARIABLES}")
        return formula
    if formula[0] == "not" and len(formula) == 2:
        return f"( not {to_string(formula[1])} )"
    if formula[0] in BINARY_OPERATORS and len(formula) == 3:
        return f"( {to_string(formula[1])} ( {formula[0]} {to_string(formula[2])} ) )"
    raise ValueError(f"malformed formula node {formula!r}")


_TOKEN = re.compile(r"[()]|[^\s()]+")


def parse_formula(text: str) -> Formula:
    """Parse the original format (see :func:`to_string`) into the tuple form.

    Tokens may be separated by any whitespace; parentheses need not be spaced.
    Raises ValueError naming the text and the offending token.
    """
    tokens = _TOKEN.findall(text)
    pos = 0

    def fail(expected: str):
        found = repr(tokens[pos]) if pos < len(tokens) else "end of text"
        raise ValueError(f"cannot parse formula {text!r}: expected {expected} at token "
                         f"{pos + 1}, found {found}")

    def expect(token: str) -> None:
        nonlocal pos
        if pos >= len(tokens) or tokens[pos] != token:
            fail(repr(token))
        pos += 1

    def formula() -> Formula:
        nonlocal pos
        if pos >= len(tokens):
            fail("a formula")
        token = tokens[pos]
        if token in _VARIABLE_SETS:
            pos += 1
            return token
        if token != "(":
            fail(f"a variable ({', '.join(VARIABLES)}) or '('")
        pos += 1
        if pos < len(tokens) and tokens[pos] == "not":
            pos += 1
            operand = formula()
            expect(")")
            return ("not", operand)
        left = formula()
        expect("(")
        if pos >= len(tokens) or tokens[pos] not in BINARY_OPERATORS:
            fail("'and' or 'or'")
        op = tokens[pos]
        pos += 1
        right = formula()
        expect(")")
        expect(")")
        return (op, left, right)

    try:
        result = formula()
    except RecursionError:
        raise ValueError(f"cannot parse formula {text[:80]!r}...: nested too deeply") from None
    if pos != len(tokens):
        fail("end of formula")
    return result


def relation(left_set: int, right_set: int) -> str:
    """The relation between two truth sets (docs/results/logic_data.md#relations).

    I: L∩R ≠ ∅, JL: L\\R ≠ ∅, JR: R\\L ≠ ∅, O: complement of L∪R ≠ ∅.
    ``=`` I,¬JL,¬JR,O; ``<`` I,¬JL,JR,O; ``>`` I,JL,¬JR,O; ``^`` ¬I,JL,JR,¬O;
    ``|`` ¬I,JL,JR,O; ``v`` I,JL,JR,¬O; ``#`` otherwise.
    """
    i = (left_set & right_set) != 0
    jl = (left_set & ~right_set & FULL_SET) != 0
    jr = (right_set & ~left_set & FULL_SET) != 0
    o = (FULL_SET & ~(left_set | right_set)) != 0
    if i and not jl and not jr and o:
        return "="
    if i and not jl and jr and o:
        return "<"
    if i and jl and not jr and o:
        return ">"
    if not i and jl and jr and not o:
        return "^"
    if not i and jl and jr and o:
        return "|"
    if i and jl and jr and not o:
        return "v"
    return "#"


def formula_relation(left: Formula, right: Formula) -> str:
    """The relation between two formulas (tuple form, or strings in the original format)."""
    if isinstance(left, str):
        left = parse_formula(left)
    if isinstance(right, str):
        right = parse_formula(right)
    return relation(truth_set(left), truth_set(right))


# ---------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------

def grow_formula(rng: random.Random, variables: Sequence[str], budget: int = SIZE_BUDGET) -> Formula:
    """Grow one random formula (docs/results/logic_data.md#the-generator).

    Draw from ``[and, or, and, or, leaf x5]``; a leaf, or any node when ``budget < 2``,
    is a variable drawn from ``variables``; a binary node builds both children with
    ``budget // 2``. Every node is then wrapped in ``not`` with probability 1/3.
    The node draw is made even when ``budget < 2`` (it is then ignored).
    """
    choice = rng.choice(_NODE_CHOICES)
    if choice is None or budget < 2:
        node: Formula = rng.choice(variables)
    else:
        left = grow_formula(rng, variables, budget // 2)
        right = grow_formula(rng, variables, budget // 2)
        node = (choice, left, right)
    if rng.random() < NOT_PROBABILITY:
        node = ("not", node)
    return node


def bucket_of(left: Formula, right: Formula) -> int:
    """min(max operator count of the two sides, 12)."""
    return min(max(operator_count(left), operator_count(right)), MAX_BUCKET)


def generate_pair(rng: random.Random) -> Tuple[int, Pair]:
    """Draw pairs until one is accepted; return ``(bucket, pair)``.

    Per attempt: pick 4 of the 6 variables, grow the left then the right formula from
    them, reject the attempt when either side is a tautology (all 64 worlds) or a
    contradiction (no world).
    """
    while True:
        variables = rng.sample(VARIABLES, VARIABLES_PER_PAIR)
        left = grow_formula(rng, variables)
        right = grow_formula(rng, variables)
        left_set, right_set = truth_set(left), truth_set(right)
        if left_set in (0, FULL_SET) or right_set in (0, FULL_SET):
            continue
        return bucket_of(left, right), Pair(relation(left_set, right_set),
                                            to_string(left), to_string(right))


def iter_pairs(seed: int) -> Iterator[Tuple[int, Pair]]:
    """Endless stream of accepted ``(bucket, pair)`` from ``random.Random(seed)``."""
    rng = random.Random(seed)
    while True:
        yield generate_pair(rng)


def generate_buckets(n_pairs: int, seed: int,
                     progress: Optional[Callable[[int], None]] = None) -> List[List[Pair]]:
    """Generate ``n_pairs`` accepted pairs; return one list per bucket 0..12 in
    generation order (duplicates kept). ``progress(k)`` is called with the number of
    pairs generated since the previous call (every 1000 pairs and at the end)."""
    if n_pairs < 0:
        raise ValueError(f"n_pairs must be >= 0, got {n_pairs}")
    buckets: List[List[Pair]] = [[] for _ in BUCKETS]
    stream = iter_pairs(seed)
    for k in range(n_pairs):
        bucket, pair = next(stream)
        buckets[bucket].append(pair)
        if progress is not None and (k + 1) % 1000 == 0:
            progress(1000)
    if progress is not None and n_pairs % 1000:
        progress(n_pairs % 1000)
    return buckets


def deduplicate(pairs: Iterable[Pair]) -> List[Pair]:
    """Drop repeated pairs (same relation, left and right), keeping the first occurrence."""
    seen = set()
    unique = []
    for pair in pairs:
        if pair not in seen:
            seen.add(pair)
            unique.append(pair)
    return unique


def train_size(n: int) -> int:
    """Train share of a deduplicated bucket of ``n`` pairs: floor(0.85 * n), computed
    exactly in integers as ``n * 85 // 100`` (this reproduces all 13 original splits,
    e.g. 36 -> 30/6 and 2,729 -> 2,319/410)."""
    return n * TRAIN_PERCENT // 100


def split_buckets(buckets: Sequence[Sequence[Pair]]) -> List[Tuple[List[Pair], List[Pair]]]:
    """Per bucket: deduplicate keeping the first occurrence, then the first
    ``train_size(n)`` pairs go to train and the rest to test. Returns ``[(train, test)]``."""
    splits = []
    for pairs in buckets:
        unique = deduplicate(pairs)
        cut = train_size(len(unique))
        splits.append((unique[:cut], unique[cut:]))
    return splits


# ---------------------------------------------------------------------------------------
# Original file format
# ---------------------------------------------------------------------------------------

def format_pair(pair: Pair) -> str:
    """``RELATION<TAB>LEFT<TAB>RIGHT`` (no newline)."""
    return f"{pair.relation}\t{pair.left}\t{pair.right}"


def write_pairs(path: str, pairs: Iterable[Pair]) -> None:
    """Write pairs in the original format, atomically."""
    write_lines_atomic(path, (format_pair(p) for p in pairs))


def write_original(directory: str, splits: Sequence[Tuple[Sequence[Pair], Sequence[Pair]]]) -> List[str]:
    """Write ``train{k}`` and ``test{k}`` for every bucket of ``splits`` (as returned by
    :func:`split_buckets`) into ``directory``; return the paths written."""
    paths = []
    for k, (train, test) in enumerate(splits):
        for name, pairs in ((f"train{k}", train), (f"test{k}", test)):
            path = os.path.join(directory, name)
            write_pairs(path, pairs)
            paths.append(path)
    return paths


def parse_line(line: str, path: str = "<string>", lineno: int = 0,
               check_relation: bool = False) -> Pair:
    """Parse one ``RELATION<TAB>LEFT<TAB>RIGHT`` line; formulas are re-written in the
    canonical :func:`to_string` form. Raises :class:`LogicDataError` naming
    ``path:lineno``. With ``check_relation`` the relation must match the one computed
    from the truth sets."""
    where = f"{path}:{lineno}"
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != 3:
        raise LogicDataError(f"{where}: expected 3 tab-separated fields "
                             f"(RELATION, LEFT, RIGHT), found {len(fields)}: {line.rstrip()!r}")
    rel, left_text, right_text = (field.strip() for field in fields)
    if rel not in RELATIONS:
        raise LogicDataError(f"{where}: unknown relation {rel!r}; expected one of "
                             f"{' '.join(RELATIONS)}")
    try:
        left = parse_formula(left_text)
        right = parse_formula(right_text)
    except ValueError as err:
        raise LogicDataError(f"{where}: {err}") from None
    if check_relation:
        actual = relation(truth_set(left), truth_set(right))
        if actual != rel:
            raise LogicDataError(f"{where}: relation {rel!r} does not match the truth sets "
                                 f"of the formulas, which give {actual!r}")
    return Pair(rel, to_string(left), to_string(right))


def read_pairs(path: str, check_relation: bool = False) -> List[Pair]:
    """Read an original-format file. Blank lines are skipped; a malformed line raises
    :class:`LogicDataError` naming the file and the 1-based line number."""
    pairs = []
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise LogicDataError(f"{path}:{lineno}: not UTF-8 text ({err.reason})") from None
            if not line.strip():
                continue
            pairs.append(parse_line(line, path, lineno, check_relation))
    return pairs


def read_buckets(directory: str, prefix: str, buckets: Iterable[int] = BUCKETS,
                 check_relation: bool = False) -> Dict[int, List[Pair]]:
    """Read ``{prefix}{k}`` for each bucket ``k`` from ``directory``; a missing file
    raises FileNotFoundError naming it."""
    result = {}
    for k in buckets:
        path = os.path.join(directory, f"{prefix}{k}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"missing logic data file {path} (expected train0..train12 "
                                    f"and test0..test12 in {directory})")
        result[k] = read_pairs(path, check_relation)
    return result


# ---------------------------------------------------------------------------------------
# Protocols
# ---------------------------------------------------------------------------------------

def is_valid_index(index: int) -> bool:
    """Every 10th pair is held out for validation: 0-based ``index % 10 == 9``."""
    return index % 10 == 9


def _train_valid(pairs: Iterable[Pair]) -> Tuple[List[Pair], List[Pair]]:
    train, valid = [], []
    for index, pair in enumerate(pairs):
        (valid if is_valid_index(index) else train).append(pair)
    return train, valid


def _concat(train_buckets: Dict[int, Sequence[Pair]]) -> List[Pair]:
    missing = [k for k in TRAIN_BUCKETS if k not in train_buckets]
    if missing:
        raise ValueError(f"training buckets {missing} are missing")
    return [pair for k in TRAIN_BUCKETS for pair in train_buckets[k]]


def standard_protocol(train_buckets: Dict[int, Sequence[Pair]],
                      test_buckets: Dict[int, Sequence[Pair]]) -> Dict[str, List[Pair]]:
    """Standard protocol: ``train0`` .. ``train6`` concatenated in bucket then line order;
    the pair at 0-based position ``i`` goes to ``valid`` when ``i % 10 == 9``, else to
    ``train``. Each test bucket ``k`` stays separate as ``test{k}``."""
    train, valid = _train_valid(_concat(train_buckets))
    splits = {"train": train, "valid": valid}
    for k in sorted(test_buckets):
        splits[f"test{k}"] = list(test_buckets[k])
    return splits


def matches_pattern(pair: Pair, patterns: Sequence[str]) -> bool:
    """Whether either side's string contains one of ``patterns``."""
    return any(p in pair.left or p in pair.right for p in patterns)


def compositional_protocol(train_buckets: Dict[int, Sequence[Pair]], name: str) -> Dict[str, List[Pair]]:
    """Compositional split ``name`` (A, B or C) from ``train0`` .. ``train6`` only: a pair
    goes to ``test`` when either side contains a pattern of
    :data:`COMPOSITIONAL_PATTERNS`; of the remaining pairs (in bucket then line order)
    the one at 0-based position ``i`` goes to ``valid`` when ``i % 10 == 9``."""
    if name not in COMPOSITIONAL_PATTERNS:
        raise ValueError(f"unknown compositional split {name!r}; expected one of "
                         f"{sorted(COMPOSITIONAL_PATTERNS)}")
    patterns = COMPOSITIONAL_PATTERNS[name]
    rest, test = [], []
    for pair in _concat(train_buckets):
        (test if matches_pattern(pair, patterns) else rest).append(pair)
    train, valid = _train_valid(rest)
    return {"train": train, "valid": valid, "test": test}


def make_protocol(directory: str, protocol: str, check_relation: bool = False) -> Dict[str, List[Pair]]:
    """Read the original files in ``directory`` and apply ``protocol`` ("standard", "A",
    "B" or "C"). The standard protocol needs train0..6 and test0..12, the compositional
    ones only train0..6."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    train = read_buckets(directory, "train", TRAIN_BUCKETS, check_relation)
    if protocol == "standard":
        return standard_protocol(train, read_buckets(directory, "test", BUCKETS, check_relation))
    return compositional_protocol(train, protocol)


# ---------------------------------------------------------------------------------------
# Seq2seq form
# ---------------------------------------------------------------------------------------

def to_seq2seq(pair: Pair) -> Tuple[str, str]:
    """``(source, target)``: ``"LEFT #SEP# RIGHT"`` and the relation token."""
    return f"{pair.left} {SEPARATOR} {pair.right}", pair.relation


def write_seq2seq(directory: str, split: str, pairs: Sequence[Pair]) -> Tuple[str, str]:
    """Write ``{split}.src`` (one source per line) and ``{split}.tgt`` (the relation
    token) into ``directory``, atomically, line-aligned. These are the names
    ``fairseq-preprocess --source-lang src --target-lang tgt --trainpref DIR/train``
    expects. Returns the two paths."""
    src_path = os.path.join(directory, f"{split}.src")
    tgt_path = os.path.join(directory, f"{split}.tgt")
    lines = [to_seq2seq(p) for p in pairs]
    write_lines_atomic(src_path, (s for s, _ in lines))
    write_lines_atomic(tgt_path, (t for _, t in lines))
    return src_path, tgt_path


#: the files of the classification form, one line per pair: the left formula, the right
#: formula, the relation (fairseq's sentence-prediction layout: input0, input1, label)
CLASSIFY_FIELDS = ("input0", "input1", "label")


def write_classify(directory: str, split: str, pairs: Sequence[Pair]) -> Tuple[str, str, str]:
    """Write ``{split}.input0`` (left formulas), ``{split}.input1`` (right formulas) and
    ``{split}.label`` (relations) into ``directory``, atomically, line-aligned: the
    classification form, each formula encoded alone by a Siamese classifier
    (``--task sut_classification``, docs/classification.md). Returns the three paths."""
    columns = {"input0": [p.left for p in pairs], "input1": [p.right for p in pairs],
               "label": [p.relation for p in pairs]}
    paths = []
    for field in CLASSIFY_FIELDS:
        paths.append(os.path.join(directory, f"{split}.{field}"))
        write_lines_atomic(paths[-1], columns[field])
    return tuple(paths)
