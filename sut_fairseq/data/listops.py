"""ListOps (Nangia & Bowman, 2018) as a seq2seq task, docs/listops.md.

Standard library only, like everything in ``sut_fairseq.data``.

An expression is a list ``[OP a_1 ... a_n ]`` whose arguments are digits 0-9 or lists;
``OP`` is one of ``[MAX``, ``[MIN``, ``[MED`` (the median; for an even count the mean of
the two middle values rounded down, as the original's ``int(np.median(...))``) and
``[SM`` (the sum mod 10). Its value, a digit, is the label (10 classes) and the one
target token; the source is the expression's tokens, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]``.

The trees follow the original generator's law: a node at depth d (the root has depth 1)
is a list with probability ``VALUE_P = 0.25`` when ``d < max_depth`` and a digit
otherwise; a list has ``randint(2, max_args)`` arguments and a uniform operator. Lists
therefore nest at most ``max_depth - 1`` deep. Two differences: the root is always a list
(the original draws a bare digit three times in four, and its deduplicated sets keep at
most ten of them), and a tree is abandoned as soon as it has more tokens than its split
allows (the same law conditioned on the length, found without building long trees).

:func:`sample_tokens` draws one expression, :func:`evaluate` computes its value with a
stack, :func:`iter_dataset` builds the deduplicated, mutually disjoint splits of a
:class:`Config`, and :class:`SplitStats` counts what a split holds.
"""
import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

MAX, MIN, MED, SUM_MOD = "[MAX", "[MIN", "[MED", "[SM"
OPERATORS = (MAX, MIN, MED, SUM_MOD)
CLOSE = "]"
DIGITS = tuple(str(v) for v in range(10))
#: The original generator's probability that a node above the depth limit is a list.
VALUE_P = 0.25
#: A split gives up after this many draws in a row that are too short, too long or seen.
MAX_REJECTIONS = 2_000_000


# --------------------------------------------------------------------------- the task

def median_floor(values: Sequence[int]) -> int:
    """The median; for an even count the mean of the two middle values, rounded down
    (``int(np.median(values))`` for non-negative values, as the original)."""
    ordered = sorted(values)
    half = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[half]
    return (ordered[half - 1] + ordered[half]) // 2


def apply(operator: str, values: Sequence[int]) -> int:
    """The value of ``operator`` over ``values``."""
    if operator == MAX:
        return max(values)
    if operator == MIN:
        return min(values)
    if operator == MED:
        return median_floor(values)
    if operator == SUM_MOD:
        return sum(values) % 10
    raise ValueError(f"unknown operator {operator!r}")


def evaluate(tokens: Sequence[str]) -> int:
    """The value of an expression, read left to right with a stack of open lists; a
    malformed expression raises ValueError."""
    stack: List[Tuple[str, List[int]]] = []
    result: Optional[int] = None
    for position, token in enumerate(tokens):
        if result is not None:
            raise ValueError(f"token {position} ({token!r}) follows the end of the expression")
        if token in OPERATORS:
            stack.append((token, []))
        elif token == CLOSE:
            if not stack or not stack[-1][1]:
                raise ValueError(f"token {position}: ']' closes no list with arguments")
            operator, values = stack.pop()
            value = apply(operator, values)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        elif token in DIGITS:
            if not stack:
                raise ValueError(f"token {position}: digit {token} outside a list")
            stack[-1][1].append(int(token))
        else:
            raise ValueError(f"token {position}: unknown token {token!r}")
    if result is None:
        raise ValueError("the expression is not closed")
    return result


def depth(tokens: Sequence[str]) -> int:
    """The deepest nesting of lists (``[MAX 1 2 ]`` has depth 1)."""
    current = deepest = 0
    for token in tokens:
        if token in OPERATORS:
            current += 1
            deepest = max(deepest, current)
        elif token == CLOSE:
            current -= 1
    return deepest


def max_arguments(tokens: Sequence[str]) -> int:
    """The largest number of arguments of one list."""
    counts: List[int] = []
    widest = 0
    for token in tokens:
        if token in OPERATORS:
            if counts:
                counts[-1] += 1
            counts.append(0)
        elif token == CLOSE:
            widest = max(widest, counts.pop())
        elif counts:
            counts[-1] += 1
    return widest


def sample_shape(rng: random.Random, max_args: int, max_depth: int,
                 max_length: Optional[int] = None) -> Optional[List[int]]:
    """The shape of one expression: its nodes in prefix order, the number of arguments for
    a list and 0 for a digit; None as soon as the expression has more than ``max_length``
    tokens (the rest of the tree is not drawn). A node at depth d is a list when
    ``d == 1`` (the root) or ``d < max_depth`` and ``u <= VALUE_P`` (u uniform on [0, 1));
    a list has ``2 + floor(u' (max_args - 1))`` arguments."""
    draw, span = rng.random, max_args - 1
    nodes: List[int] = []
    length = 0
    pending = [1]                      # depths of the nodes still to draw, last first
    while pending:
        node_depth = pending.pop()
        if node_depth == 1 or (node_depth < max_depth and draw() <= VALUE_P):
            arguments = 2 + int(draw() * span)
            nodes.append(arguments)
            length += 2                # the operator and the closing bracket
            pending.extend([node_depth + 1] * arguments)
        else:
            nodes.append(0)
            length += 1
        if max_length is not None and length > max_length:
            return None
    return nodes


def fill(rng: random.Random, shape: Sequence[int]) -> List[str]:
    """The tokens of a shape: a uniform operator for every list, a uniform digit for every
    leaf, and the closing brackets."""
    tokens: List[str] = []
    remaining: List[int] = []          # arguments still to come, per open list
    for arguments in shape:
        if arguments:
            tokens.append(rng.choice(OPERATORS))
            remaining.append(arguments)
            continue
        tokens.append(rng.choice(DIGITS))
        while remaining:               # a finished node completes its parents
            remaining[-1] -= 1
            if remaining[-1]:
                break
            remaining.pop()
            tokens.append(CLOSE)
    return tokens


def shape_length(shape: Sequence[int]) -> int:
    """The number of tokens of a shape's expression."""
    return sum(2 if arguments else 1 for arguments in shape)


def sample_tokens(rng: random.Random, max_args: int, max_depth: int,
                  max_length: Optional[int] = None) -> Optional[List[str]]:
    """One expression's tokens (:func:`sample_shape`, then :func:`fill`); None when it has
    more than ``max_length`` tokens."""
    shape = sample_shape(rng, max_args, max_depth, max_length)
    return None if shape is None else fill(rng, shape)


# --------------------------------------------------------------------------- configurations

@dataclass(frozen=True)
class SplitSpec:
    """One generated split: its size, the generator's argument and depth limits, and the
    length range kept (tokens, both ends included)."""
    size: int
    max_args: int = 5
    max_depth: int = 20
    min_length: int = 1
    max_length: int = 100

    def check(self, name: str) -> None:
        for key, low in (("size", 0), ("max_args", 2), ("max_depth", 2), ("min_length", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"split {name}: {key} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.max_length, int) or self.max_length < max(self.min_length, 4):
            raise ValueError(f"split {name}: max_length must be an integer >= max(min_length, 4) "
                             f"(the shortest list has 4 tokens), got {self.max_length!r}")


#: The training distribution's generator (the original's: 5 arguments, depth 20).
IID = dict(max_args=5, max_depth=20)


@dataclass(frozen=True)
class Config:
    """A data configuration: ``train``, ``valid`` and the near-IID ``test`` are one
    deduplicated sample of the ``IID`` generator dealt out in proportion to their sizes
    (train and valid keep length <= ``train_max_length``, test <= ``iid_max_length``);
    ``tests`` are the generalisation splits, each from its own generator and length range."""
    name: str
    train_size: int
    valid_size: int
    iid_test_size: int
    tests: Tuple[Tuple[str, SplitSpec], ...]
    train_max_length: int = 100
    iid_max_length: int = 1000
    seed: int = 1

    def specs(self) -> List[Tuple[str, SplitSpec]]:
        """Every split with its generator and length range, tests first."""
        iid_test = SplitSpec(self.iid_test_size, max_length=self.iid_max_length, **IID)
        train = SplitSpec(self.train_size, max_length=self.train_max_length, **IID)
        valid = SplitSpec(self.valid_size, max_length=self.train_max_length, **IID)
        return [("test-iid", iid_test), *self.tests, ("valid", valid), ("train", train)]

    def test_names(self) -> List[str]:
        return ["test-iid"] + [name for name, _ in self.tests]

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.train_size, int) or self.train_size < 1:
            raise ValueError(f"train_size must be an integer >= 1, got {self.train_size!r}")
        if not isinstance(self.iid_test_size, int) or self.iid_test_size < 1:
            raise ValueError(f"iid_test_size must be an integer >= 1, got {self.iid_test_size!r}")
        names = [name for name, _ in self.specs()]
        if len(set(names)) != len(names):
            raise ValueError(f"split names must be distinct, got {names}")
        for name, spec in self.specs():
            spec.check(name)
            if name.startswith("test") and name != "test-iid" and spec.size < 1:
                raise ValueError(f"split {name}: size must be >= 1")


def _length_split(size: int, low: int, high: int) -> SplitSpec:
    """A length-generalisation split: the training generator, lengths strictly between
    ``low`` and ``high`` (as Havrylov et al.'s generator)."""
    return SplitSpec(size, min_length=low + 1, max_length=high - 1, **IID)


def _argument_split(size: int, max_args: int) -> SplitSpec:
    """An argument-generalisation split (Ray Chowdhury & Caragea): up to ``max_args``
    arguments, generator depth 9, lengths 100 to 1000."""
    return SplitSpec(size, max_args=max_args, max_depth=9, min_length=100, max_length=1000)


def _tests(length_size: int, argument_size: int) -> Tuple[Tuple[str, SplitSpec], ...]:
    return (("test-len200-300", _length_split(length_size, 200, 300)),
            ("test-len500-600", _length_split(length_size, 500, 600)),
            ("test-len900-1000", _length_split(length_size, 900, 1000)),
            ("test-args10", _argument_split(argument_size, 10)),
            ("test-args15", _argument_split(argument_size, 15)))


CONFIGS: Dict[str, Config] = {
    # the CPU experiment
    "small": Config("small", 30_000, 1_000, 2_000, _tests(500, 500)),
    # the paper's sizes: the original's 90k training examples (length <= 100 here),
    # 1k valid, 10k near-IID test, 2k per generalisation split
    "paper": Config("paper", 90_000, 1_000, 10_000, _tests(2_000, 2_000)),
}


def make_config(name: str = "small", train_size: Optional[int] = None,
                valid_size: Optional[int] = None, iid_test_size: Optional[int] = None,
                test_size: Optional[int] = None, seed: Optional[int] = None,
                splits: Optional[Sequence[str]] = None) -> Config:
    """``CONFIGS[name]`` with the given sizes (``test_size``: every generalisation split),
    only the generalisation ``splits`` named (e.g. ``["test-args10"]``; ``[]`` for none)
    and ``seed``; validated (ValueError)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; choose one of {', '.join(CONFIGS)}")
    config = CONFIGS[name]
    tests = config.tests
    if splits is not None:
        known = [n for n, _ in tests]
        unknown = [s for s in splits if s not in known]
        if unknown:
            raise ValueError(f"unknown test split {unknown[0]!r}; choose from {', '.join(known)}")
        tests = tuple((n, s) for n, s in tests if n in splits)
    if test_size is not None:
        tests = tuple((n, replace(s, size=test_size)) for n, s in tests)
    fields = {k: v for k, v in dict(train_size=train_size, valid_size=valid_size,
                                    iid_test_size=iid_test_size, seed=seed).items() if v is not None}
    config = replace(config, tests=tests, **fields)
    config.validate()
    return config


# --------------------------------------------------------------------------- splits

class Example(NamedTuple):
    """One example: the expression's tokens and its value."""
    tokens: Tuple[str, ...]
    label: int


def to_seq2seq(example: Example) -> Tuple[str, str]:
    """``(source, target)`` text lines: the tokens space-separated, and the digit."""
    return " ".join(example.tokens), str(example.label)


def _key(tokens: Sequence[str]) -> bytes:
    return hashlib.blake2b(" ".join(tokens).encode("ascii"), digest_size=16).digest()


def split_rng(seed: int, split: str) -> random.Random:
    """The independent stream of one split (or of the IID pool, ``split="iid"``)."""
    return random.Random(f"listops/{seed}/{split}")


def _draw(rng: random.Random, spec: SplitSpec, seen: Set[bytes], what: str
          ) -> Tuple[List[str], bytes]:
    """A new (unseen) expression of ``spec``'s generator whose length lies in its range."""
    for _ in range(MAX_REJECTIONS):
        shape = sample_shape(rng, spec.max_args, spec.max_depth, spec.max_length)
        if shape is None or shape_length(shape) < spec.min_length:
            continue
        tokens = fill(rng, shape)
        key = _key(tokens)
        if key not in seen:
            return tokens, key
    raise RuntimeError(f"{MAX_REJECTIONS} draws in a row gave no new expression for {what}: "
                       "widen its length range or ask for fewer examples")


def _example(tokens: List[str], key: bytes, seen: Set[bytes],
             progress: Optional[Callable[[int], None]]) -> Example:
    seen.add(key)
    if progress is not None:
        progress(1)
    return Example(tuple(tokens), evaluate(tokens))


def iter_test(name: str, spec: SplitSpec, seed: int, seen: Set[bytes],
              progress: Optional[Callable[[int], None]] = None) -> Iterator[Example]:
    """``spec.size`` new expressions of ``spec``'s generator with a length in its range."""
    rng = split_rng(seed, name)
    for _ in range(spec.size):
        yield _example(*_draw(rng, spec, seen, name), seen, progress)


def deal_iid(config: Config, seen: Set[bytes], progress: Optional[Callable[[int], None]] = None
             ) -> Dict[str, List[Example]]:
    """The near-IID test, valid and train splits from one stream of the IID generator:
    each next example goes to a split chosen with probability proportional to what each
    still needs, and is drawn under that split's length limit. So each split is the
    generator's law conditioned on its own lengths, and short expressions, which repeat
    often and are kept once, are shared out fairly instead of going to whichever split is
    drawn first."""
    specs = {name: spec for name, spec in config.specs() if name in ("test-iid", "valid", "train")}
    needed = {name: spec.size for name, spec in specs.items()}
    out: Dict[str, List[Example]] = {name: [] for name in specs}
    rng = split_rng(config.seed, "iid")
    while any(needed.values()):
        u = rng.randrange(sum(needed.values()))
        for name in specs:
            if u < needed[name]:
                break
            u -= needed[name]
        needed[name] -= 1
        out[name].append(_example(*_draw(rng, specs[name], seen, name), seen, progress))
    return out


def iter_dataset(config: Config, progress: Optional[Callable[[int], None]] = None
                 ) -> Iterator[Tuple[str, Iterator[Example]]]:
    """Yield ``(split name, examples)``: ``test-iid``, every generalisation test, then
    ``valid`` (unless its size is 0) and ``train``; all mutually disjoint."""
    config.validate()
    seen: Set[bytes] = set()
    iid = deal_iid(config, seen, progress)
    yield "test-iid", iter(iid["test-iid"])
    for name, spec in config.tests:
        yield name, iter_test(name, spec, config.seed, seen, progress)
    if config.valid_size:
        yield "valid", iter(iid["valid"])
    yield "train", iter(iid["train"])


def generate(config: Config, progress: Optional[Callable[[int], None]] = None
             ) -> Dict[str, List[Example]]:
    """All splits in memory, in :func:`iter_dataset`'s order."""
    return {name: list(examples) for name, examples in iter_dataset(config, progress)}


def total_examples(config: Config) -> int:
    return sum(spec.size for _, spec in config.specs())


# --------------------------------------------------------------------------- statistics

@dataclass
class SplitStats:
    """Running counts of one split: size, lengths, depths, widest list, labels, and the
    generator limits the split was drawn under (checked for every example)."""
    spec: Optional[SplitSpec] = None
    n: int = 0
    length_sum: int = 0
    length_min: Optional[int] = None
    length_max: int = 0
    depth_sum: int = 0
    depth_max: int = 0
    args_max: int = 0
    labels: Counter = field(default_factory=Counter)
    operators: Counter = field(default_factory=Counter)

    def add(self, example: Example) -> None:
        tokens = example.tokens
        if evaluate(tokens) != example.label:
            raise RuntimeError(f"example {' '.join(tokens)} does not evaluate to {example.label}")
        n, d, a = len(tokens), depth(tokens), max_arguments(tokens)
        if self.spec is not None and not (self.spec.min_length <= n <= self.spec.max_length
                                          and d < self.spec.max_depth and a <= self.spec.max_args):
            raise RuntimeError(f"example of length {n}, depth {d}, {a} arguments is outside {self.spec}")
        self.n += 1
        self.length_sum += n
        self.length_min = n if self.length_min is None else min(self.length_min, n)
        self.length_max = max(self.length_max, n)
        self.depth_sum += d
        self.depth_max = max(self.depth_max, d)
        self.args_max = max(self.args_max, a)
        self.labels[example.label] += 1
        self.operators.update(t for t in tokens if t in OPERATORS)

    def summary(self) -> dict:
        """The JSON-ready statistics of the split."""
        n = max(self.n, 1)
        common = self.labels.most_common()
        return {
            "size": self.n,
            "limits": None if self.spec is None else {
                "max_args": self.spec.max_args, "generator_max_depth": self.spec.max_depth,
                "min_length": self.spec.min_length, "max_length": self.spec.max_length},
            "length": {"min": self.length_min, "mean": self.length_sum / n, "max": self.length_max},
            "depth": {"mean": self.depth_sum / n, "max": self.depth_max},
            "max_arguments": self.args_max,
            "labels": {str(v): self.labels[v] for v in range(10)},
            "majority": {"label": common[0][0] if common else None,
                         "share": common[0][1] / n if common else None},
            "operators": {op: self.operators[op] for op in OPERATORS},
        }


def stats_table(splits: Dict[str, dict]) -> str:
    """A Markdown table of :meth:`SplitStats.summary` per split (labels in % of the
    split, 0 to 9)."""
    lines = ["| split | examples | length min / mean / max | depth mean / max | max arguments "
             "| labels 0–9 (%) | majority (%) |",
             "|---|---:|---|---|---:|---|---:|"]
    for name, s in splits.items():
        length, d = s["length"], s["depth"]
        labels = " ".join(f"{100 * s['labels'][str(v)] / max(s['size'], 1):.0f}" for v in range(10))
        lines.append(f"| {name} | {s['size']:,} | {length['min']} / {length['mean']:.1f} / "
                     f"{length['max']} | {d['mean']:.2f} / {d['max']} | {s['max_arguments']} | "
                     f"{labels} | {100 * (s['majority']['share'] or 0):.1f} |")
    return "\n".join(lines)
