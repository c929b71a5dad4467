"""C-PVR (compositional / conditional pointer-value retrieval), docs/cpvr.md.

Standard library only, like everything in ``sut_fairseq.data``.

A sequence ``a[0..L-1]`` holds integers in ``[1, K]``; cell ``i`` points to
``pointer(i) = (a[i] - 1) mod L``. Starting at ``p = 0`` with ``hops = 1``, the retrieval
jumps ``p <- pointer(p)`` (``hops += 1``) while the pointer moves forward
(``pointer(p) > p``); the label is ``a[p]`` where it stops (the paper's App. G,
Listings 1-2). Variants: ``plain`` (``K = L``) and ``modulus`` (``K > L``).

:class:`HopSampler` draws sequences exactly from the i.i.d.-uniform law conditioned on
the number of hops, with integer (exact) weights; :func:`iter_split` / :func:`generate`
build deduplicated, mutually disjoint train / valid / test sets; :func:`baseline_table`
scores the shortcut baselines.
"""
import hashlib
from array import array
from collections import Counter
from dataclasses import dataclass, field, replace
from fractions import Fraction
import random
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

VARIANTS = ("modulus", "plain")
#: The capped solver follows at most ``CAP_HOPS - 1`` jumps (it solves hops <= 4 exactly).
CAP_HOPS = 4


# --------------------------------------------------------------------------- the task

def check_sizes(length: int, max_value: int) -> None:
    """Raise ValueError unless ``length = L >= 2`` and ``max_value = K >= L`` (integers)."""
    for name, value in (("length L", length), ("max value K", max_value)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if length < 2:
        raise ValueError(f"length L must be >= 2, got L = {length}")
    if max_value < length:
        raise ValueError(f"max value K must be >= L = {length} (every position must be "
                         f"reachable), got K = {max_value}")


def check_hops(hops: int, length: int) -> None:
    """Raise ValueError unless ``1 <= hops <= L`` (a chain visits distinct increasing
    positions, so at most L of them)."""
    if not isinstance(hops, int) or isinstance(hops, bool):
        raise ValueError(f"hops must be an integer, got {hops!r}")
    if not 1 <= hops <= length:
        raise ValueError(f"hops = {hops} is infeasible for L = {length}: allowed 1 <= hops <= {length}")


def pointer(sequence: Sequence[int], i: int) -> int:
    """The position cell ``i`` points to: ``(a[i] - 1) mod L``."""
    return (sequence[i] - 1) % len(sequence)


def follow(sequence: Sequence[int], max_hops: Optional[int] = None) -> Tuple[int, int]:
    """Run the retrieval of Listing 1; return ``(p, hops)``: the stop position and the
    number of visited cells. With ``max_hops`` it stops after at most that many cells
    (``max_hops - 1`` jumps) even when the pointer still moves forward."""
    p, hops = 0, 1
    nxt = pointer(sequence, p)
    while nxt > p and (max_hops is None or hops < max_hops):   # condition_fn: p < next
        p = nxt
        nxt = pointer(sequence, p)
        hops += 1
    return p, hops


def retrieve(sequence: Sequence[int]) -> Tuple[int, int]:
    """``(label, hops)`` of a sequence: ``label = a[p]`` at the stop position ``p``."""
    p, hops = follow(sequence)
    return sequence[p], hops


def chain(sequence: Sequence[int]) -> List[int]:
    """The visited positions ``0 = p_0 < p_1 < ... < p_{hops-1}``."""
    positions = [0]
    while pointer(sequence, positions[-1]) > positions[-1]:
        positions.append(pointer(sequence, positions[-1]))
    return positions


# --------------------------------------------------------------------------- exact sampler

def pointer_counts(length: int, max_value: int) -> List[int]:
    """``c(j) = |{v in [1, K] : (v - 1) mod L = j}| = K // L + [j < K mod L]`` for
    ``j = 0..L-1`` (``q(j) = c(j) / K``)."""
    check_sizes(length, max_value)
    return [max_value // length + (1 if j < max_value % length else 0) for j in range(length)]


class HopSampler:
    """Exact sampler of ``a ~ Uniform([1, K]^L)`` conditioned on ``hops(a) = n``.

    Integer tables ``N_r(m) = K^(r+1) * W_r(m)``:

    * ``N_0(m) = sum_{j <= m} c(j)``                   (``W_0(m) = sum_{j<=m} q(j)``: stop at m)
    * ``N_r(m) = sum_{j > m} c(j) * N_{r-1}(j)``       (``W_r(m) = sum_{j>m} q(j) W_{r-1}(j)``:
      exactly r more forward jumps from m, then a stop)

    so ``P(hops = n) = W_{n-1}(0) = N_{n-1}(0) / K^n``.
    """

    def __init__(self, length: int, max_value: int):
        self.length, self.max_value = length, max_value
        self.counts = pointer_counts(length, max_value)
        n0, total = [], 0
        for c in self.counts:                       # N_0(m) = sum_{j <= m} c(j)
            total += c
            n0.append(total)
        self.tables: List[List[int]] = [n0]

    def table(self, r: int) -> List[int]:
        """The list ``N_r(0..L-1)`` (computed on demand, cached)."""
        while len(self.tables) <= r:
            prev, suffix = self.tables[-1], 0
            row = [0] * self.length
            for m in range(self.length - 1, -1, -1):    # N_r(m) = sum_{j>m} c(j) N_{r-1}(j)
                row[m] = suffix
                suffix += self.counts[m] * prev[m]
            self.tables.append(row)
        return self.tables[r]

    def chain_count(self, hops: int) -> int:
        """``N_{n-1}(0)``: the number of value assignments of the visited cells that give
        ``hops = n`` (``K^n * P(hops = n)``)."""
        check_hops(hops, self.length)
        return self.table(hops - 1)[0]

    def count_sequences(self, hops: int) -> int:
        """The number of sequences in ``[1, K]^L`` with ``hops = n``:
        ``N_{n-1}(0) * K^(L - n)`` (the unvisited cells are free)."""
        return self.chain_count(hops) * self.max_value ** (self.length - hops)

    def probability(self, hops: int) -> Fraction:
        """``P(hops = n) = W_{n-1}(0)`` under i.i.d. uniform cells, exactly."""
        return Fraction(self.chain_count(hops), self.max_value ** hops)

    def _value_to(self, j: int, rng: random.Random) -> int:
        """A uniform value among the ``c(j)`` values ``v = j + 1 + L t`` pointing to j."""
        return j + 1 + self.length * rng.randrange(self.counts[j])

    def sample(self, hops: int, rng: random.Random) -> List[int]:
        """One sequence with exactly ``hops`` hops, drawn from the conditional law.

        ``P(p_i = j | p_{i-1}) = c(j) N_{n-1-i}(j) / N_{n-i}(p_{i-1})`` for ``j > p_{i-1}``
        (the normaliser is ``N_{n-i}(p_{i-1})`` by the recursion); ``a[p_{i-1}]`` points to
        ``p_i``; ``a[p_{n-1}]`` is uniform over the ``N_0(p_{n-1})`` values pointing to a
        position ``<= p_{n-1}``; every other cell is uniform over ``[1, K]``."""
        check_hops(hops, self.length)
        self.table(hops - 1)
        L, K, c = self.length, self.max_value, self.counts
        seq = [rng.randrange(1, K + 1) for _ in range(L)]
        p = 0
        for i in range(1, hops):
            weights = self.tables[hops - 1 - i]
            u = rng.randrange(self.tables[hops - i][p])       # exact: integer weights
            j = p + 1
            while u >= c[j] * weights[j]:
                u -= c[j] * weights[j]
                j += 1
            seq[p] = self._value_to(j, rng)
            p = j
        u = rng.randrange(self.tables[0][p])                  # stop: point to j <= p
        j = 0
        while u >= c[j]:
            u -= c[j]
            j += 1
        seq[p] = self._value_to(j, rng)
        return seq


def probability_table(sizes: Sequence[Tuple[int, int]], hops: Sequence[int]) -> str:
    """A Markdown table of ``P(hops = n)`` (i.i.d. uniform cells) for each ``(L, K)``."""
    samplers = [HopSampler(L, K) for L, K in sizes]
    lines = ["| hops | " + " | ".join(f"L={L}, K={K}" for L, K in sizes) + " |",
             "|---:|" + "---:|" * len(sizes)]
    for n in hops:
        cells = [f"{float(s.probability(n)):.4g}" if n <= s.length else "0" for s in samplers]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- configurations

@dataclass(frozen=True)
class Config:
    """A data configuration: sizes, hop sets, split sizes per hop and the seed."""
    name: str
    variant: str
    length: int
    max_value: int
    train_hops: Tuple[int, ...]
    train_per_hop: int
    test_hops: Tuple[int, ...]
    test_per_hop: int
    valid_per_hop: int
    seed: int = 1

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (sizes, variant, hops, counts,
        and requests larger than the number of distinct sequences of a hop count)."""
        check_sizes(self.length, self.max_value)
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if self.variant == "plain" and self.max_value != self.length:
            raise ValueError(f"the plain variant needs K = L = {self.length}, got K = {self.max_value}")
        if self.variant == "modulus" and self.max_value <= self.length:
            raise ValueError(f"the modulus variant needs K > L = {self.length}, got K = {self.max_value}")
        for name in ("train_hops", "test_hops"):
            hops = getattr(self, name)
            if not hops:
                raise ValueError(f"{name} is empty")
            for n in hops:
                check_hops(n, self.length)
        for name, low in (("train_per_hop", 1), ("test_per_hop", 1), ("valid_per_hop", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        sampler = HopSampler(self.length, self.max_value)
        for n in sorted(set(self.train_hops) | set(self.test_hops)):
            wanted = self.requested(n)
            available = sampler.count_sequences(n)
            if wanted > available:
                raise ValueError(f"{wanted} distinct sequences with hops = {n} requested, but "
                                 f"only {available} exist for L = {self.length}, K = {self.max_value}")

    def requested(self, hops: int) -> int:
        """How many distinct sequences with ``hops`` the three splits need together."""
        train = self.train_per_hop + self.valid_per_hop if hops in self.train_hops else 0
        return train + (self.test_per_hop if hops in self.test_hops else 0)


CONFIGS: Dict[str, Config] = {
    # the CPU experiment
    "small": Config("small", "modulus", 16, 100, (1, 2, 3, 4), 25_000,
                    tuple(range(1, 10)), 2_000, 1_000),
    # the paper's from-scratch setting (§4.1): ~450k per train hop, 50k per test hop
    "from-scratch": Config("from-scratch", "modulus", 100, 1000, (1, 2, 3, 4), 450_000,
                           tuple(range(1, 10)), 50_000, 5_000),
}


def make_config(name: str = "small", variant: str = "modulus", **overrides) -> Config:
    """``CONFIGS[name]`` with ``overrides`` (``None`` values ignored); the plain variant
    sets ``K = L`` unless ``max_value`` is given. Validated (ValueError)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; choose one of {', '.join(CONFIGS)}")
    fields = {k: v for k, v in overrides.items() if v is not None}
    for key in ("train_hops", "test_hops"):
        if key in fields:
            fields[key] = tuple(sorted(set(fields[key])))
    config = replace(CONFIGS[name], variant=variant, **fields)
    if variant == "plain" and "max_value" not in fields:
        config = replace(config, max_value=config.length)
    config.validate()
    return config


def parse_hops(text: str) -> Tuple[int, ...]:
    """``"1-4"`` / ``"1,3,5-9"`` -> sorted distinct hop counts; ValueError naming the text."""
    hops: Set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            low_n, high_n = int(low), int(high) if high else int(low)
            if high_n < low_n:
                raise ValueError
            hops.update(range(low_n, high_n + 1))
    except ValueError:
        raise ValueError(f"bad hop list {text!r}: expected e.g. '1-4' or '1,3,5-9'") from None
    return tuple(sorted(hops))


# --------------------------------------------------------------------------- splits

class Example(NamedTuple):
    """One example: the sequence, its label and its hop count."""
    sequence: Tuple[int, ...]
    label: int
    hops: int


def binarized_test_splits(test_hops: Sequence[int]) -> Dict[int, str]:
    """``{hop: fairseq split name}`` of ``fairseq-preprocess --testpref test{n1},test{n2},...``:
    the first test prefix becomes ``test``, the k-th (k >= 1) ``test{k}``."""
    return {n: ("test" if k == 0 else f"test{k}") for k, n in enumerate(test_hops)}


def to_seq2seq(example: Example) -> Tuple[str, str]:
    """``(source, target)``: the L numbers space-separated, and the label."""
    return " ".join(map(str, example.sequence)), str(example.label)


def _key(sequence: Sequence[int]) -> bytes:
    """A 16-byte digest identifying a sequence (dedupe; a collision, ~1e-26 at paper
    scale, could only reject a fresh sequence, never admit a duplicate)."""
    return hashlib.blake2b(array("I", sequence).tobytes(), digest_size=16).digest()


def split_rng(seed: int, split: str, hops: int) -> random.Random:
    """The independent stream of one (split, hop count): test sets do not depend on the
    train / valid sizes."""
    return random.Random(f"cpvr/{seed}/{split}/{hops}")


def iter_split(sampler: HopSampler, split: str, hops: Sequence[int], per_hop: int,
               seed: int, seen: Set[bytes], progress: Optional[Callable[[int], None]] = None
               ) -> Iterator[Example]:
    """Yield ``per_hop`` examples of every hop count in ``hops``, interleaved
    round-robin (hop order within each round), none of them in ``seen`` (which this
    adds them to). Each example's hop count is recomputed; a mismatch raises
    RuntimeError."""
    rngs = {n: split_rng(seed, split, n) for n in hops}
    for _ in range(per_hop):
        for n in hops:
            while True:
                seq = sampler.sample(n, rngs[n])
                key = _key(seq)
                if key not in seen:
                    break
            seen.add(key)
            label, got = retrieve(seq)
            if got != n:
                raise RuntimeError(f"sampled a sequence with {got} hops instead of {n}: {seq}")
            if progress is not None:
                progress(1)
            yield Example(tuple(seq), label, n)


def iter_dataset(config: Config, progress: Optional[Callable[[int], None]] = None
                 ) -> Iterator[Tuple[str, Iterator[Example]]]:
    """Yield ``(split name, examples)`` in the order test{n} (n in test_hops), valid,
    train; all mutually disjoint. Consume each iterator before the next."""
    config.validate()
    sampler, seen = HopSampler(config.length, config.max_value), set()
    for n in config.test_hops:
        yield f"test{n}", iter_split(sampler, "test", (n,), config.test_per_hop,
                                     config.seed, seen, progress)
    if config.valid_per_hop:
        yield "valid", iter_split(sampler, "valid", config.train_hops, config.valid_per_hop,
                                  config.seed, seen, progress)
    yield "train", iter_split(sampler, "train", config.train_hops, config.train_per_hop,
                              config.seed, seen, progress)


def generate(config: Config, progress: Optional[Callable[[int], None]] = None
             ) -> Dict[str, List[Example]]:
    """All splits in memory: ``{"test1": [...], ..., "valid": [...], "train": [...]}``."""
    return {name: list(examples) for name, examples in iter_dataset(config, progress)}


def total_examples(config: Config) -> int:
    """The number of examples :func:`iter_dataset` yields."""
    return (len(config.test_hops) * config.test_per_hop
            + len(config.train_hops) * (config.train_per_hop + config.valid_per_hop))


# --------------------------------------------------------------------------- statistics

def copy_first(sequence: Sequence[int]) -> int:
    """Shortcut (a): answer ``a[0]``."""
    return sequence[0]


def first_or_last(sequence: Sequence[int]) -> int:
    """Shortcut (d): ``a[0]`` when it points to position 0 (a one-hop chain), else
    ``a[L-1]``: the last cell never points forward, so every chain that reaches it ends
    there, and long chains usually do. It needs no pointer following beyond cell 0."""
    return sequence[0] if pointer(sequence, 0) == 0 else sequence[-1]


def capped_solver(sequence: Sequence[int], max_hops: int = CAP_HOPS) -> int:
    """Shortcut (c): follow at most ``max_hops - 1`` jumps and answer ``a[p]`` there."""
    return sequence[follow(sequence, max_hops)[0]]


@dataclass
class SplitStats:
    """Running counts of one split: size, labels, (re)checked hop counts and the number
    of examples the copy-a[0], first-or-last and capped solvers get right."""
    n: int = 0
    labels: Counter = field(default_factory=Counter)
    hops: Counter = field(default_factory=Counter)
    copy_first: int = 0
    first_or_last: int = 0
    capped: int = 0

    def add(self, example: Example) -> None:
        label, hops = retrieve(example.sequence)
        if (label, hops) != (example.label, example.hops):
            raise RuntimeError(f"example {example} has label {label} and {hops} hops")
        self.n += 1
        self.labels[label] += 1
        self.hops[hops] += 1
        self.copy_first += copy_first(example.sequence) == label
        self.first_or_last += first_or_last(example.sequence) == label
        self.capped += capped_solver(example.sequence) == label

    def summary(self) -> dict:
        """``{"size", "hops_checked", "labels": {distinct, most_common, least_common,
        majority_share}}`` (JSON-ready)."""
        common = self.labels.most_common()
        return {"size": self.n,
                "hops_checked": {str(h): c for h, c in sorted(self.hops.items())},
                "labels": {"distinct": len(common),
                           "most_common": [[l, c] for l, c in common[:5]],
                           "least_common": list(common[-1]) if common else None,
                           "majority_share": common[0][1] / self.n if self.n else None}}


def majority_label(labels: Counter) -> int:
    """Shortcut (b)'s answer: the most frequent label (the smallest among ties)."""
    if not labels:
        raise ValueError("no labels: the training set is empty")
    top = max(labels.values())
    return min(l for l, c in labels.items() if c == top)


def baselines(test: Dict[int, SplitStats], train_labels: Counter) -> dict:
    """Exact per-hop accuracies of the three shortcuts on the test sets:
    ``{"majority_label": m, "hops": {n: {"size", "copy_first", "majority", "first_or_last",
    "capped_4"}}}``."""
    majority = majority_label(train_labels)
    rows = {}
    for n, stats in sorted(test.items()):
        rows[str(n)] = {"size": stats.n,
                        "copy_first": stats.copy_first / stats.n,
                        "majority": stats.labels[majority] / stats.n,
                        "first_or_last": stats.first_or_last / stats.n,
                        f"capped_{CAP_HOPS}": stats.capped / stats.n}
    return {"majority_label": majority, "capped_hops": CAP_HOPS, "hops": rows}


def evaluate(examples: Sequence[Example]) -> SplitStats:
    """The :class:`SplitStats` of a list of examples."""
    stats = SplitStats()
    for example in examples:
        stats.add(example)
    return stats


def baseline_table(result: dict) -> str:
    """The Markdown table of :func:`baselines` (accuracies in %)."""
    m, cap = result["majority_label"], result["capped_hops"]
    lines = [f"| hops | test size | copy a[0] | majority label ({m}) | a[0] if one hop, else a[L-1] "
             f"| solver capped at {cap} hops |",
             "|---:|---:|---:|---:|---:|---:|"]
    for n, row in result["hops"].items():
        lines.append(f"| {n} | {row['size']:,} | {100 * row['copy_first']:.2f} | "
                     f"{100 * row['majority']:.2f} | {100 * row['first_or_last']:.2f} | "
                     f"{100 * row[f'capped_{cap}']:.2f} |")
    return "\n".join(lines)
