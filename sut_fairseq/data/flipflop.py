"""The flip-flop language of Liu et al. (2023) as a seq2seq task, docs/flipflop.md.

Standard library only, like everything in ``sut_fairseq.data``.

A string is a sequence of instruction/bit pairs ``w b`` (write b), ``r b`` (read: b is
the last written bit) and ``i b`` (ignore: b is random). The first instruction is a write,
the last one a read; every instruction in between is ``w`` or ``r`` with probability
``(1 - p_i) / 2`` each and ``i`` with probability ``p_i``; written and ignored bits are
fair coins. The *length* of a string is its number of tokens (instructions and bits), as
in the generator of the recurrent-transformers paper's code, so a string of length n holds
n / 2 pairs. As seq2seq, the source is the string up to and including its final ``r``
(n - 1 tokens) and the target is the bit that read returns.

:func:`sample` draws one string, :func:`solve` re-reads a source, :func:`iter_dataset`
builds the deduplicated, mutually disjoint splits of a :class:`Config`, and
:class:`SplitStats` counts what a split holds (instruction frequencies, label balance,
where the last write lies, two shortcut baselines).
"""
import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

WRITE, READ, IGNORE = "w", "r", "i"
INSTRUCTIONS = (WRITE, READ, IGNORE)
BITS = ("0", "1")
#: Chunk sizes for which the statistics count the examples whose last write lies in an
#: earlier chunk than the final read (the recipe's CPU models use g = 8, the paper 10).
STAT_CHUNK_SIZES = (8, 10)
#: A split gives up after this many consecutive duplicates (a set nearly exhausted).
MAX_REJECTIONS = 100_000


# --------------------------------------------------------------------------- the task

def check_length(length: int) -> None:
    """Raise ValueError unless ``length`` is an even integer >= 4 (a write pair and the
    final read pair)."""
    if not isinstance(length, int) or isinstance(length, bool):
        raise ValueError(f"length must be an integer, got {length!r}")
    if length < 4 or length % 2:
        raise ValueError(f"length must be an even number of tokens >= 4 (instruction/bit "
                         f"pairs, the first a write, the last a read), got {length}")


def check_p_ignore(p_ignore: float) -> None:
    """Raise ValueError unless ``0 <= p_ignore <= 1``."""
    if isinstance(p_ignore, bool) or not isinstance(p_ignore, (int, float)) \
            or not 0.0 <= p_ignore <= 1.0:
        raise ValueError(f"p_i (the probability of an ignore instruction) must lie in "
                         f"[0, 1], got {p_ignore!r}")


def sample(length: int, p_ignore: float, rng: random.Random) -> List[str]:
    """One string of ``length`` tokens: ``w b``, then ``length / 2 - 2`` random pairs, then
    ``r b``. A random instruction is ``w`` if ``u < (1 - p_i) / 2``, ``r`` if
    ``u < 1 - p_i``, else ``i`` (u uniform on [0, 1)); read bits copy the memory."""
    p_write = (1.0 - p_ignore) / 2.0
    memory = rng.choice(BITS)
    tokens = [WRITE, memory]
    for _ in range(length // 2 - 2):
        u = rng.random()
        if u < p_write:
            memory = rng.choice(BITS)
            tokens += [WRITE, memory]
        elif u < 2.0 * p_write:
            tokens += [READ, memory]
        else:
            tokens += [IGNORE, rng.choice(BITS)]
    tokens += [READ, memory]
    return tokens


def solve(source: Sequence[str]) -> str:
    """The bit the final ``r`` of ``source`` returns: the bit after its last ``w``."""
    for k in range(len(source) - 2, -1, -1):
        if source[k] == WRITE and k % 2 == 0:
            return source[k + 1]
    raise ValueError("the source holds no write instruction")


def last_write(source: Sequence[str]) -> int:
    """The token index of the last ``w`` instruction in ``source`` (instructions stand at
    even indices)."""
    return max(k for k in range(0, len(source), 2) if source[k] == WRITE)


def last_carrier(source: Sequence[str]) -> int:
    """The token index of the last instruction before the final read that tells its bit:
    the last ``w``, or a later ``r`` (every read after the last write returns the written
    bit, and earlier reads stay in the source with their bits)."""
    final_read = len(source) - 1
    return max(k for k in range(0, final_read, 2) if source[k] in (WRITE, READ))


def bit_before_read_chunk(instruction: int, read: int, chunk_size: int) -> bool:
    """Whether the bit of the instruction at token ``instruction`` (token
    ``instruction + 1``) lies in an earlier chunk than the final read at token ``read``,
    with chunks of ``chunk_size`` tokens counted from the first source token (chunk of
    token t: ``t // chunk_size``). For the last carrier (:func:`last_carrier`) this says
    whether the answer is nowhere in the read's own chunk, so that it must pass through a
    chunk-wise model's memory."""
    return (instruction + 1) // chunk_size < read // chunk_size


def possible_strings(length: int, p_ignore: float) -> int:
    """How many distinct strings of ``length`` tokens have a positive probability: two
    first bits times, per middle pair, 2 written + 1 read + 2 ignored variants (those whose
    instruction can occur)."""
    p_write = (1.0 - p_ignore) / 2.0
    variants = (3 if p_write > 0 else 0) + (2 if p_ignore > 0 else 0)
    return 2 * variants ** (length // 2 - 2)


class Example(NamedTuple):
    """One example: the source tokens (ending in the final ``r``), the target bit, the
    index of the last write instruction, and the setting it was drawn from."""
    source: Tuple[str, ...]
    target: str
    write: int
    length: int
    p_ignore: float

    @property
    def read(self) -> int:
        """The token index of the final read (the last source token)."""
        return len(self.source) - 1


def to_seq2seq(example: Example) -> Tuple[str, str]:
    """``(source, target)`` text lines: the tokens space-separated, and the bit."""
    return " ".join(example.source), example.target


def to_meta(example: Example) -> dict:
    """The side-file record of a test example (JSON-ready): the token indices of the last
    write instruction, of the last carrier of the answer (:func:`last_carrier`) and of the
    final read, the source length and the target."""
    return {"write": example.write, "carrier": last_carrier(example.source), "read": example.read,
            "source_length": len(example.source), "target": example.target}


# --------------------------------------------------------------------------- configurations

Setting = Tuple[int, float]   # (length, p_i)


def setting_name(length: int, p_ignore: float) -> str:
    """The split name of a test setting, e.g. ``test64-p0.8``."""
    return f"test{length}-p{p_ignore:g}"


@dataclass(frozen=True)
class Config:
    """A data configuration: the training setting and size, the test settings (every test
    length with every p_i) and size, the validation size per validation setting, which
    settings the validation split mixes, and the seed."""
    name: str
    train_length: int
    train_p_ignore: float
    train_size: int
    test_lengths: Tuple[int, ...]
    test_p_ignore: Tuple[float, ...]
    test_size: int
    valid_size: int
    valid_mix: str = "mixed"
    seed: int = 1

    def test_settings(self) -> List[Setting]:
        return [(n, p) for n in self.test_lengths for p in self.test_p_ignore]

    def valid_settings(self) -> List[Setting]:
        """``mixed``: the training setting and every test setting (the paper's validation
        set, each setting once); ``train``: the training setting only."""
        settings = [(self.train_length, self.train_p_ignore)]
        if self.valid_mix == "mixed":
            settings += [s for s in self.test_settings() if s not in settings]
        return settings

    def validate(self) -> None:
        """Raise ValueError naming the first bad field, or a request for more distinct
        strings of one length than exist."""
        check_length(self.train_length)
        check_p_ignore(self.train_p_ignore)
        for name in ("test_lengths", "test_p_ignore"):
            if not getattr(self, name):
                raise ValueError(f"{name} is empty")
        for n in self.test_lengths:
            check_length(n)
        for p in self.test_p_ignore:
            check_p_ignore(p)
        for name, low in (("train_size", 1), ("test_size", 1), ("valid_size", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.valid_mix not in VALID_MIXES:
            raise ValueError(f"valid_mix must be one of {', '.join(VALID_MIXES)}, got {self.valid_mix!r}")
        wanted: Counter = Counter()
        for setting, count in self.requests():
            wanted[setting] += count
        for (n, p), count in wanted.items():
            available = possible_strings(n, p)
            if count > available:
                raise ValueError(f"{count} distinct strings of length {n} with p_i = {p:g} "
                                 f"requested, but only {available} exist")

    def requests(self) -> List[Tuple[Setting, int]]:
        """``((length, p_i), count)`` of every draw the splits make."""
        out = [(s, self.test_size) for s in self.test_settings()]
        out += [(s, self.valid_size) for s in self.valid_settings()] if self.valid_size else []
        return out + [((self.train_length, self.train_p_ignore), self.train_size)]


VALID_MIXES = ("mixed", "train")

CONFIGS: Dict[str, Config] = {
    # the CPU experiment: train at length 64, test at 64 and 128
    "small": Config("small", 64, 0.8, 20_000, (64, 128), (0.1, 0.8, 0.98), 2_000, 250),
    # the paper's: train at length 512 (160,000), test at 512 and 1024 (10,000 each)
    "paper": Config("paper", 512, 0.8, 160_000, (512, 1024), (0.1, 0.8, 0.98), 10_000, 1_000),
}


def make_config(name: str = "small", **overrides) -> Config:
    """``CONFIGS[name]`` with ``overrides`` (``None`` values ignored), validated
    (ValueError)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; choose one of {', '.join(CONFIGS)}")
    fields = {k: v for k, v in overrides.items() if v is not None}
    for key in ("test_lengths", "test_p_ignore"):
        if key in fields:
            fields[key] = tuple(sorted(set(fields[key])))
    config = replace(CONFIGS[name], **fields)
    config.validate()
    return config


# --------------------------------------------------------------------------- splits

def _key(tokens: Sequence[str]) -> bytes:
    return hashlib.blake2b("".join(tokens).encode("ascii"), digest_size=16).digest()


def split_rng(seed: int, split: str, setting: Setting) -> random.Random:
    """The independent stream of one (split, setting): a test set does not depend on the
    sizes of the other splits."""
    return random.Random(f"flipflop/{seed}/{split}/{setting[0]}/{setting[1]!r}")


def iter_split(split: str, settings: Sequence[Setting], per_setting: int, seed: int,
               seen: Set[bytes], progress: Optional[Callable[[int], None]] = None
               ) -> Iterator[Example]:
    """Yield ``per_setting`` examples of every setting, interleaved round-robin, none of
    them in ``seen`` (which this adds them to). Every target is re-read with
    :func:`solve`; a disagreement raises RuntimeError."""
    rngs = {s: split_rng(seed, split, s) for s in settings}
    for _ in range(per_setting):
        for length, p_ignore in settings:
            for _attempt in range(MAX_REJECTIONS):
                tokens = sample(length, p_ignore, rngs[(length, p_ignore)])
                key = _key(tokens)
                if key not in seen:
                    break
            else:
                raise RuntimeError(f"{MAX_REJECTIONS} duplicates in a row for length {length}, "
                                   f"p_i = {p_ignore:g}: ask for fewer examples")
            seen.add(key)
            source, target = tuple(tokens[:-1]), tokens[-1]
            if solve(source) != target:
                raise RuntimeError(f"the final read of {' '.join(tokens)} is not the last write")
            if progress is not None:
                progress(1)
            yield Example(source, target, last_write(source), length, p_ignore)


def iter_dataset(config: Config, progress: Optional[Callable[[int], None]] = None
                 ) -> Iterator[Tuple[str, Iterator[Example]]]:
    """Yield ``(split name, examples)``: every test setting (:func:`setting_name`), then
    ``valid`` (unless its size is 0), then ``train``; all mutually disjoint. Consume each
    iterator before the next."""
    config.validate()
    seen: Set[bytes] = set()
    for setting in config.test_settings():
        yield setting_name(*setting), iter_split("test", [setting], config.test_size,
                                                 config.seed, seen, progress)
    if config.valid_size:
        yield "valid", iter_split("valid", config.valid_settings(), config.valid_size,
                                  config.seed, seen, progress)
    yield "train", iter_split("train", [(config.train_length, config.train_p_ignore)],
                              config.train_size, config.seed, seen, progress)


def generate(config: Config, progress: Optional[Callable[[int], None]] = None
             ) -> Dict[str, List[Example]]:
    """All splits in memory, in :func:`iter_dataset`'s order."""
    return {name: list(examples) for name, examples in iter_dataset(config, progress)}


def total_examples(config: Config) -> int:
    """The number of examples :func:`iter_dataset` yields."""
    return sum(count for _, count in config.requests())


# --------------------------------------------------------------------------- statistics

def previous_bit(source: Sequence[str]) -> str:
    """Shortcut: the bit just before the final ``r`` (right whenever the previous
    instruction is a write or a read; a coin flip after an ignore)."""
    return source[-2]


@dataclass
class SplitStats:
    """Running counts of one split: sizes and lengths, the random instructions (the first
    write and the final read excluded), target bits, the distance from the last written
    bit to the final read, the examples whose answer lies only in chunks before the read's
    (:func:`bit_before_read_chunk` of the last carrier) per chunk size, and the examples two shortcuts get right."""
    n: int = 0
    lengths: Counter = field(default_factory=Counter)
    instructions: Counter = field(default_factory=Counter)
    targets: Counter = field(default_factory=Counter)
    distance_sum: int = 0
    distance_min: Optional[int] = None
    distance_max: int = 0
    first_write_only: int = 0
    before_read_chunk: Counter = field(default_factory=Counter)
    previous_bit: int = 0

    def add(self, example: Example) -> None:
        source = example.source
        if solve(source) != example.target or last_write(source) != example.write:
            raise RuntimeError(f"example {example} does not re-read to its target")
        self.n += 1
        self.lengths[len(source) + 1] += 1
        self.instructions.update(source[k] for k in range(2, len(source) - 1, 2))
        self.targets[example.target] += 1
        distance = example.read - (example.write + 1)
        self.distance_sum += distance
        self.distance_min = distance if self.distance_min is None else min(self.distance_min, distance)
        self.distance_max = max(self.distance_max, distance)
        self.first_write_only += example.write == 0
        for g in STAT_CHUNK_SIZES:
            self.before_read_chunk[g] += bit_before_read_chunk(last_carrier(source), example.read, g)
        self.previous_bit += previous_bit(source) == example.target

    def summary(self) -> dict:
        """The JSON-ready statistics of the split."""
        drawn = sum(self.instructions.values())
        share = lambda c, total: c / total if total else None  # noqa: E731
        return {
            "size": self.n,
            "lengths": {str(n): c for n, c in sorted(self.lengths.items())},
            "random_instructions": drawn,
            "instruction_share": {i: share(self.instructions[i], drawn) for i in INSTRUCTIONS},
            "target_share_1": share(self.targets["1"], self.n),
            "write_to_read_distance": {"mean": share(self.distance_sum, self.n),
                                       "min": self.distance_min, "max": self.distance_max},
            "first_write_only": share(self.first_write_only, self.n),
            "answer_before_read_chunk": {str(g): share(self.before_read_chunk[g], self.n)
                                         for g in STAT_CHUNK_SIZES},
            "baselines": {"previous_bit": share(self.previous_bit, self.n),
                          "majority": share(max(self.targets.values(), default=0), self.n)},
        }


def stats_table(splits: Dict[str, dict]) -> str:
    """A Markdown table of :meth:`SplitStats.summary` per split."""
    g1, g2 = STAT_CHUNK_SIZES
    lines = ["| split | examples | length | w / r / i (%) | target 1 (%) | write→read distance "
             f"mean (max) | last write is the first (%) | answer only before the read's chunk, g={g1} / g={g2} (%) "
             "| previous-bit baseline (%) |",
             "|---|---:|---|---|---:|---|---:|---|---:|"]
    pct = lambda v: "–" if v is None else f"{100 * v:.1f}"  # noqa: E731
    for name, s in splits.items():
        lengths = "/".join(s["lengths"])
        mix = " / ".join(pct(s["instruction_share"][i]) for i in INSTRUCTIONS)
        d = s["write_to_read_distance"]
        chunks = " / ".join(pct(s["answer_before_read_chunk"][str(g)]) for g in STAT_CHUNK_SIZES)
        lines.append(f"| {name} | {s['size']:,} | {lengths} | {mix} | {pct(s['target_share_1'])} | "
                     f"{d['mean']:.1f} ({d['max']}) | {pct(s['first_write_only'])} | {chunks} | "
                     f"{pct(s['baselines']['previous_bit'])} |")
    return "\n".join(lines)
