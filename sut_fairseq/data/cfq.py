"""CFQ (Keysers et al. 2019) for the SUT paper's Table 4 (docs/cfq.md#data-preparation).

Standard library only (tqdm is used for progress bars when it is installed), so data
preparation needs neither torch nor fairseq; ``data-prep/cfq/prepare.py`` is the CLI.

Inputs
    ``dataset.json``: one JSON array (about 4 GB) of records; each record holds at least
    ``questionPatternModEntities`` (the source) and ``sparqlPatternModEntities`` (the
    target). It is read with :func:`iter_json_array`, a streaming parser over
    ``json.JSONDecoder.raw_decode`` on buffered chunks: memory stays at one chunk plus
    one record. ``splits/NAME.json`` (``mcd1``, ``mcd2``, ``mcd3``, ``random_split``,
    ...): an object with the lists ``trainIdxs``, ``devIdxs``, ``testIdxs`` of 0-based
    record indices. Both are read from an extracted directory or straight out of
    ``cfq1.1.tar.gz`` (:func:`prepare`).

Source preprocessing (:func:`preprocess_question`)
    every punctuation character (``string.punctuation``) becomes its own token:
    ``Did M1 's female actor edit M0`` -> ``Did M1 ' s female actor edit M0``.

Target preprocessing (:func:`preprocess_query`), in this order
    ``count(*)`` -> ``count ( * )``; newlines (and the two characters ``\\n``) -> spaces;
    per whitespace token: a leading ``ns:`` is dropped, then a leading ``m.`` becomes
    ``m_`` (``ns:m.02zsn`` -> ``m_02zsn``). The rule is per token, as in the reference
    preprocessing: the second component of a path keeps its prefix
    (``ns:film.actor.film/ns:film.performance.film`` -> ``film.actor.film/ns:film.performance.film``).
    :func:`restore_query` inverts it for queries laid out as CFQ lays them out.

Target simplification (:func:`simplify_query`; Furrer et al. 2020, Zheng & Lapata 2021)
    the triples of the WHERE block are grouped by (subject, predicate) and each group's
    objects merged into one comma-separated object list -- SPARQL's own object-list
    syntax, so the simplified query is still a valid query with the same meaning::

        SELECT DISTINCT ?x0 WHERE { ?x0 a people.person . ?x0 influence.influence_node.influenced_by M2 . ?x0 influence.influence_node.influenced_by M1 . FILTER ( ?x0 != M1 ) }
        SELECT DISTINCT ?x0 WHERE { ?x0 a people.person . ?x0 influence.influence_node.influenced_by M1 , M2 . FILTER ( ?x0 != M1 ) }

    Groups are sorted by subject then predicate, objects within a group and FILTER
    clauses after all groups are sorted too, with one total order on tokens (variables
    ``?xN`` by N, then placeholders ``MN`` by N, then everything else by string; the
    predicate ``a`` first), so queries that differ only in the order of their triples or
    filters (or in repeated triples) get one string. :func:`expand_query` is the inverse
    up to that order: one triple per statement.
"""
import codecs
import io
import json
import os
import re
import string
import tarfile
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Callable, Dict, IO, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from .atomic import write_lines_atomic

#: Public location of the dataset (Keysers et al. 2019), about 255 MiB.
CFQ_URL = "https://storage.googleapis.com/cfq_dataset/cfq1.1.tar.gz"
ARCHIVE_NAME = "cfq1.1.tar.gz"
DATASET_NAME = "dataset.json"
SOURCE_FIELD = "questionPatternModEntities"
TARGET_FIELD = "sparqlPatternModEntities"
#: (our subset name, key in the split file)
SPLIT_KEYS = (("train", "trainIdxs"), ("valid", "devIdxs"), ("test", "testIdxs"))
#: Split files of cfq1.1 (``splits/NAME.json``); any other name found there works too.
KNOWN_SPLITS = ("mcd1", "mcd2", "mcd3", "random_split", "question_pattern_split",
                "question_complexity_split", "query_pattern_split", "query_complexity_split")
TARGET_FORMS = ("simplified", "plain")
DEFAULT_CHUNK_CHARS = 1 << 20
_PUNCTUATION = frozenset(string.punctuation)


class CfqDataError(ValueError):
    """A missing or malformed input file, record or split; the message names the file
    (and the record index where there is one)."""


class QueryFormatError(ValueError):
    """A target query that the simplification cannot parse."""


# ---------------------------------------------------------------------------------------
# Progress bars (optional tqdm)
# ---------------------------------------------------------------------------------------

class _NoBar:
    def __init__(self, *args, **kwargs):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress_bar(enabled: bool, **kwargs):
    """A tqdm bar (``kwargs`` as tqdm's) when ``enabled`` and tqdm is installed, else a
    no-op object with the same ``update``/``close`` interface."""
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency of fairseq
            return _NoBar()
        return tqdm(**kwargs)
    return _NoBar()


# ---------------------------------------------------------------------------------------
# Source and target preprocessing
# ---------------------------------------------------------------------------------------

def preprocess_question(text: str) -> str:
    """Every punctuation character becomes a separate token; whitespace is normalised."""
    return " ".join("".join(f" {c} " if c in _PUNCTUATION else c for c in text).split())


def preprocess_query(sparql: str) -> str:
    """The target rules of docs/cfq.md#target-preprocessing: ``count(*)`` ->
    ``count ( * )``, newlines -> spaces, the leading ``ns:`` of every token dropped, a
    leading ``m.`` -> ``m_``."""
    text = sparql.replace("\\n", " ").replace("count(*)", "count ( * )")
    tokens = []
    for token in text.split():
        if token.startswith("ns:"):
            token = token[3:]
        if token.startswith("m."):
            token = "m_" + token[2:]
        tokens.append(token)
    return " ".join(tokens)


# ---------------------------------------------------------------------------------------
# Query structure: parse, simplify, expand, restore
# ---------------------------------------------------------------------------------------

Triple = Tuple[str, str, str]
_RESERVED = frozenset({".", ",", "{", "}", "(", ")", "FILTER"})
_VARIABLE = re.compile(r"\?x(\d+)$")
_PLACEHOLDER = re.compile(r"M(\d+)$")


class Query(NamedTuple):
    """A parsed (preprocessed) CFQ query: the tokens before ``{``, the triples of the
    WHERE block in their order, and the FILTER clauses (token tuples) in theirs."""
    header: Tuple[str, ...]
    triples: Tuple[Triple, ...]
    filters: Tuple[Tuple[str, ...], ...]


def parse_query(text: str) -> Query:
    """Parse a preprocessed query (plain or simplified form). A statement is either
    ``SUBJECT PREDICATE OBJECT [, OBJECT ...]`` or ``FILTER ( ... )``; statements are
    separated by ``.`` (optional after a FILTER and before ``}``)."""
    tokens = text.split()
    if "{" not in tokens or not tokens or tokens[-1] != "}":
        raise QueryFormatError(f"not a query of the form 'HEADER {{ ... }}': {text!r}")
    open_at = tokens.index("{")
    header, body = tuple(tokens[:open_at]), tokens[open_at + 1:-1]
    if not header:
        raise QueryFormatError(f"no SELECT header before '{{': {text!r}")
    if "{" in body or "}" in body:
        raise QueryFormatError(f"nested group patterns are not supported: {text!r}")
    triples: List[Triple] = []
    filters: List[Tuple[str, ...]] = []
    i, n = 0, len(body)

    def fail(message):
        raise QueryFormatError(f"{message} at body token {i} of {text!r}")

    def term(k):
        if k >= n or body[k] in _RESERVED:
            raise QueryFormatError(f"expected a term at body token {k} of {text!r}")
        return body[k]

    while i < n:
        if body[i] == "FILTER":
            if i + 1 >= n or body[i + 1] != "(":
                fail("expected '(' after FILTER")
            depth, j = 0, i + 1
            while j < n:
                depth += {"(": 1, ")": -1}.get(body[j], 0)
                if depth == 0:
                    break
                j += 1
            if j >= n:
                fail("unbalanced parentheses in FILTER")
            filters.append(tuple(body[i:j + 1]))
            i = j + 1
            if i < n and body[i] == ".":
                i += 1
            continue
        subject, predicate = term(i), term(i + 1)
        objects = [term(i + 2)]
        i += 3
        while i < n and body[i] == ",":
            objects.append(term(i + 1))
            i += 2
        triples.extend((subject, predicate, o) for o in objects)
        if i < n:
            if body[i] == ".":
                i += 1
            elif body[i] != "FILTER":
                fail(f"expected '.' after a triple, got {body[i]!r}")
    return Query(header, tuple(triples), tuple(filters))


def token_key(token: str):
    """The total order on tokens used by the canonical form."""
    m = _VARIABLE.match(token)
    if m:
        return (0, int(m.group(1)), token)
    m = _PLACEHOLDER.match(token)
    if m:
        return (1, int(m.group(1)), token)
    return (2, 0, token)


def predicate_key(predicate: str):
    return (0, "") if predicate == "a" else (1, predicate)


def _grouped(query: Query) -> List[Tuple[str, str, List[str]]]:
    groups: Dict[Tuple[str, str], set] = defaultdict(set)
    for s, p, o in query.triples:
        groups[(s, p)].add(o)
    ordered = sorted(groups, key=lambda sp: (token_key(sp[0]), predicate_key(sp[1])))
    return [(s, p, sorted(groups[(s, p)], key=token_key)) for s, p in ordered]


def _sorted_filters(query: Query) -> List[Tuple[str, ...]]:
    return sorted(set(query.filters), key=lambda f: [token_key(t) for t in f])


def _format(header: Sequence[str], statements: Sequence[str]) -> str:
    body = " . ".join(statements)
    return " ".join(header) + (" { " + body + " }" if body else " { }")


def simplify_query(text: str) -> str:
    """The canonical simplified form of a preprocessed query (see the module docstring)."""
    query = parse_query(text)
    statements = [f"{s} {p} {' , '.join(objects)}" for s, p, objects in _grouped(query)]
    statements += [" ".join(f) for f in _sorted_filters(query)]
    return _format(query.header, statements)


def expand_query(text: str) -> str:
    """Inverse of :func:`simplify_query` up to statement order: one ``S P O`` triple per
    statement (canonical order), then the FILTER clauses."""
    query = parse_query(text)
    statements = [f"{s} {p} {o}" for s, p, objects in _grouped(query) for o in objects]
    statements += [" ".join(f) for f in _sorted_filters(query)]
    return _format(query.header, statements)


def query_triples(text: str) -> Tuple[frozenset, frozenset]:
    """(set of triples, set of FILTER clauses): what the simplification preserves."""
    query = parse_query(text)
    return frozenset(query.triples), frozenset(query.filters)


def restore_query(text: str) -> str:
    """Inverse of :func:`preprocess_query` for the CFQ layout: ``count ( * )`` ->
    ``count(*)``; ``ns:`` back on every predicate (except ``a``) and on the class after
    ``a``; ``m_`` entities -> ``ns:m.``; ``{`` ends the first line, each statement is a
    line, statements end in `` .`` except the last, ``}`` is the last line. Statement
    order and object lists are kept as they are (so it also turns a simplified query
    into runnable SPARQL)."""
    parse_query(text)  # validates the structure
    tokens = text.split()
    open_at = tokens.index("{")
    header = " ".join(tokens[:open_at]).replace("count ( * )", "count(*)")
    statements: List[List[str]] = []
    for token in tokens[open_at + 1:-1]:
        if token == ".":
            statements.append([])
            continue
        if token == "FILTER" or not statements:
            statements.append([])
        statements[-1].append(token)

    def entity(token):
        return "ns:m." + token[2:] if token.startswith("m_") else token

    lines = []
    for statement in filter(None, statements):
        if statement[0] == "FILTER":
            lines.append(" ".join(entity(t) for t in statement))
            continue
        subject, predicate, objects = statement[0], statement[1], statement[2:]
        if predicate == "a":
            objects = [o if o == "," or o.startswith(("m_", "?")) or _PLACEHOLDER.match(o)
                       else "ns:" + o for o in objects]
        else:
            predicate = "ns:" + predicate
        lines.append(" ".join([entity(subject), predicate] + [entity(o) for o in objects]))
    return header + " {\n" + " .\n".join(lines) + ("\n" if lines else "") + "}"


# ---------------------------------------------------------------------------------------
# Streaming JSON array parser
# ---------------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER_TAIL = re.compile(r"[0-9.eE+-]*")


def iter_json_array(handle: IO, name: str = "<stream>", chunk_chars: int = DEFAULT_CHUNK_CHARS,
                    on_read: Optional[Callable[[int], None]] = None) -> Iterator[Tuple[int, object]]:
    """Yield ``(index, value)`` for every element of the JSON array in ``handle`` (text or
    binary, UTF-8) while reading it in chunks of about ``chunk_chars``: memory holds one
    chunk plus the element being decoded. ``on_read(n)`` is called with the size of every
    chunk read (bytes for a binary handle) for progress bars. Raises
    :class:`CfqDataError` naming ``name``, the element index and the character offset for
    anything that is not one well-formed JSON array."""
    decoder = json.JSONDecoder()
    binary = not isinstance(handle, io.TextIOBase)
    utf8 = codecs.getincrementaldecoder("utf-8-sig")() if binary else None
    state = {"buf": "", "pos": 0, "offset": 0, "eof": False}

    def fill(size: int) -> bool:
        """Append up to ``size`` more characters; False at the end of the input."""
        while not state["eof"]:
            raw = handle.read(size)
            if on_read is not None and raw:
                on_read(len(raw))
            if binary:
                try:
                    chunk = utf8.decode(raw, final=not raw)
                except UnicodeDecodeError as err:
                    raise CfqDataError(f"{name}: not valid UTF-8 near character "
                                       f"{state['offset'] + len(state['buf'])}: {err}") from None
            else:
                chunk = raw
            if not raw:
                state["eof"] = True
            if chunk:
                if state["pos"]:
                    state["offset"] += state["pos"]
                    state["buf"] = state["buf"][state["pos"]:]
                    state["pos"] = 0
                state["buf"] += chunk
                return True
        return False

    def skip_whitespace() -> Optional[str]:
        """Advance past whitespace; the next character, or None at the end of input."""
        while True:
            state["pos"] = _WHITESPACE.match(state["buf"], state["pos"]).end()
            if state["pos"] < len(state["buf"]):
                return state["buf"][state["pos"]]
            if not fill(chunk_chars):
                return None

    def where() -> str:
        return f"character {state['offset'] + state['pos']}"

    first = skip_whitespace()
    if first != "[":
        found = "an empty file" if first is None else repr(first)
        raise CfqDataError(f"{name}: expected a JSON array ('[') at {where()}, found {found}")
    state["pos"] += 1
    index = 0
    while True:
        char = skip_whitespace()
        if char is None:
            raise CfqDataError(f"{name}: unexpected end of file in record {index} "
                               f"(the array is not closed with ']')")
        if char == "]" and index == 0:
            state["pos"] += 1
            break
        size = chunk_chars
        while True:
            try:
                value, end = decoder.raw_decode(state["buf"], state["pos"])
            except json.JSONDecodeError as err:
                # Maybe the record only continues in the next chunk: read more and retry
                # (doubling the read so that a huge record costs linear time).
                if fill(size):
                    size *= 2
                    continue
                raise CfqDataError(f"{name}: malformed JSON in record {index} at character "
                                   f"{state['offset'] + err.pos}: {err.msg}") from None
            # A number may continue in the next chunk ("1" + "2", "0" + ".5"): retry until
            # something that cannot continue it follows, or the input ends.
            if _NUMBER_TAIL.fullmatch(state["buf"], end) and fill(size):
                continue
            break
        state["pos"] = end
        yield index, value
        index += 1
        char = skip_whitespace()
        if char == ",":
            state["pos"] += 1
            continue
        if char == "]":
            state["pos"] += 1
            break
        found = "the end of the file" if char is None else repr(char)
        raise CfqDataError(f"{name}: expected ',' or ']' after record {index - 1} at "
                           f"{where()}, found {found}")
    trailing = skip_whitespace()
    if trailing is not None:
        raise CfqDataError(f"{name}: unexpected data after the closing ']' at {where()}")


# ---------------------------------------------------------------------------------------
# Records and splits
# ---------------------------------------------------------------------------------------

def record_fields(record: object, index: int, name: str) -> Tuple[str, str]:
    """(question, query) of one record, or :class:`CfqDataError` naming file and index."""
    if not isinstance(record, dict):
        raise CfqDataError(f"{name}: record {index} is a {type(record).__name__}, "
                           f"not a JSON object")
    values = []
    for field in (SOURCE_FIELD, TARGET_FIELD):
        if field not in record:
            raise CfqDataError(f"{name}: record {index} has no field {field!r}")
        if not isinstance(record[field], str):
            raise CfqDataError(f"{name}: record {index}: field {field!r} is not a string")
        values.append(record[field])
    return values[0], values[1]


def read_records(handle: IO, name: str, wanted: Optional[set] = None,
                 chunk_chars: int = DEFAULT_CHUNK_CHARS,
                 on_read: Optional[Callable[[int], None]] = None) -> Tuple[Dict[int, Tuple[str, str]], int]:
    """Stream the dataset: ``({index: (question, query)}, number of records)``, keeping
    only the indices in ``wanted`` (all when None). Every record is checked."""
    kept: Dict[int, Tuple[str, str]] = {}
    count = 0
    for index, record in iter_json_array(handle, name, chunk_chars, on_read):
        pair = record_fields(record, index, name)
        if wanted is None or index in wanted:
            kept[index] = pair
        count = index + 1
    return kept, count


def parse_split(data: object, name: str) -> Dict[str, List[int]]:
    """``{"train": [...], "valid": [...], "test": [...]}`` from a decoded split file."""
    if not isinstance(data, dict):
        raise CfqDataError(f"{name}: a split file must hold a JSON object with "
                           f"{', '.join(k for _, k in SPLIT_KEYS)}")
    split = {}
    for subset, key in SPLIT_KEYS:
        if key not in data:
            raise CfqDataError(f"{name}: no {key!r} list")
        indices = data[key]
        if not isinstance(indices, list):
            raise CfqDataError(f"{name}: {key!r} is not a list")
        for k, idx in enumerate(indices):
            if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
                raise CfqDataError(f"{name}: {key}[{k}] = {idx!r} is not a record index "
                                   f"(a non-negative integer)")
        split[subset] = indices
    return split


def load_split_file(path: str) -> Dict[str, List[int]]:
    if not os.path.isfile(path):
        raise CfqDataError(f"{path}: split file not found")
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as err:
            raise CfqDataError(f"{path}: malformed JSON at line {err.lineno} column "
                               f"{err.colno}: {err.msg}") from None
    return parse_split(data, path)


def check_split_range(split: Dict[str, List[int]], n_records: int, split_name: str,
                      dataset_name: str) -> None:
    """Every index must name a record of the dataset."""
    for subset, key in SPLIT_KEYS:
        for k, idx in enumerate(split[subset]):
            if idx >= n_records:
                raise CfqDataError(
                    f"{split_name}: {key}[{k}] = {idx} is out of range: {dataset_name} has "
                    f"{n_records} records (indices 0..{n_records - 1})")


def split_label(split: str) -> str:
    """The output directory name of a split given as a name or a path."""
    base = os.path.basename(split)
    return base[:-5] if base.endswith(".json") else base


# ---------------------------------------------------------------------------------------
# Sources: an extracted directory or the archive
# ---------------------------------------------------------------------------------------

def find_dataset_dir(path: str) -> str:
    """The directory holding ``dataset.json``: ``path`` itself or ``path/cfq``."""
    for candidate in (path, os.path.join(path, "cfq")):
        if os.path.isfile(os.path.join(candidate, DATASET_NAME)):
            return candidate
    raise CfqDataError(f"{os.path.join(path, DATASET_NAME)}: file not found (expected the "
                       f"extracted CFQ directory with {DATASET_NAME} and splits/)")


def _split_path(dataset_dir: str, split: str) -> str:
    if split.endswith(".json") or os.sep in split:
        return split
    path = os.path.join(dataset_dir, "splits", split + ".json")
    if not os.path.isfile(path):
        have = sorted(f[:-5] for f in os.listdir(os.path.join(dataset_dir, "splits"))
                      if f.endswith(".json")) if os.path.isdir(os.path.join(dataset_dir, "splits")) else []
        raise CfqDataError(f"{path}: split file not found"
                           + (f" (available: {', '.join(have)})" if have else ""))
    return path


def _read_from_directory(path, splits, progress, chunk_chars):
    dataset_dir = find_dataset_dir(path)
    loaded = {}
    for split in splits:
        path = _split_path(dataset_dir, split)
        loaded[split] = (path, load_split_file(path))
    wanted = {i for _, split in loaded.values() for idxs in split.values() for i in idxs}
    dataset = os.path.join(dataset_dir, DATASET_NAME)
    with open(dataset, "rb") as handle, progress_bar(
            progress, total=os.path.getsize(dataset), unit="B", unit_scale=True,
            desc=f"reading {DATASET_NAME}") as bar:
        records, n = read_records(handle, dataset, wanted, chunk_chars, bar.update)
    return dataset, records, n, loaded


def _read_from_archive(path, splits, progress, chunk_chars):
    """One pass over the .tar.gz (stream mode, nothing extracted): split files are read
    when met; dataset.json is streamed, keeping only the needed records if every
    requested split was met before it, else all of them (two strings per record)."""
    loaded, records, n, dataset = {}, None, None, None
    by_name = {}
    for s in splits:
        if s.endswith(".json") or os.sep in s:
            loaded[s] = (s, load_split_file(s))
        else:
            by_name[s] = s
    try:
        archive = tarfile.open(path, "r|*")
    except (OSError, tarfile.TarError) as err:
        raise CfqDataError(f"{path}: cannot open as a tar archive: {err}") from None
    available = []
    with archive:
        try:
            for member in archive:
                if not member.isfile():
                    continue
                parts = member.name.split("/")
                if len(parts) >= 2 and parts[-2] == "splits" and parts[-1].endswith(".json"):
                    available.append(parts[-1][:-5])
                    if parts[-1][:-5] in by_name:
                        label = f"{path}:{member.name}"
                        raw = archive.extractfile(member).read().decode("utf-8")
                        try:
                            data = json.loads(raw)
                        except json.JSONDecodeError as err:
                            raise CfqDataError(f"{label}: malformed JSON at line {err.lineno} "
                                               f"column {err.colno}: {err.msg}") from None
                        loaded[parts[-1][:-5]] = (label, parse_split(data, label))
                elif parts[-1] == DATASET_NAME and records is None:
                    dataset = f"{path}:{member.name}"
                    wanted = None
                    if all(s in loaded for s in splits):
                        wanted = {i for _, sp in loaded.values() for idxs in sp.values() for i in idxs}
                    with progress_bar(progress, total=member.size, unit="B", unit_scale=True,
                                      desc=f"reading {DATASET_NAME}") as bar:
                        records, n = read_records(archive.extractfile(member), dataset, wanted,
                                                  chunk_chars, bar.update)
        except (tarfile.TarError, EOFError, OSError) as err:
            raise CfqDataError(f"{path}: corrupt or truncated archive: {err}") from None
    if records is None:
        raise CfqDataError(f"{path}: the archive holds no {DATASET_NAME}")
    for s in splits:
        if s not in loaded:
            raise CfqDataError(f"{path}: the archive holds no splits/{s}.json"
                               + (f" (available: {', '.join(sorted(available))})" if available else ""))
    return dataset, records, n, loaded


def download(url: str, dest: str, progress: bool = True) -> str:
    """Download ``url`` to ``dest`` (atomically, via ``dest + '.part'``) unless ``dest``
    exists; SystemExit with what to do instead when offline."""
    if os.path.exists(dest):
        return dest
    os.makedirs(os.path.dirname(os.path.abspath(dest)) or ".", exist_ok=True)
    part = dest + ".part"
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with progress_bar(progress, total=total, unit="B", unit_scale=True,
                              desc=f"downloading {os.path.basename(dest)}") as bar:
                while True:
                    block = response.read(1 << 20)
                    if not block:
                        break
                    out.write(block)
                    bar.update(len(block))
        os.replace(part, dest)
    except (urllib.error.URLError, OSError) as err:
        if os.path.exists(part):
            os.unlink(part)
        raise CfqDataError(
            f"could not download {url}: {err}. Offline? Download {ARCHIVE_NAME} elsewhere and "
            f"pass it with --archive, or pass the extracted directory with --cfq-dir") from None
    return dest


# ---------------------------------------------------------------------------------------
# Preparation
# ---------------------------------------------------------------------------------------

def process_record(index: int, question: str, query: str, name: str, target_form: str) -> Tuple[str, str, str]:
    """(source, target, plain target) of one record; errors name file and record."""
    source, plain = preprocess_question(question), preprocess_query(query)
    if not source or not plain:
        raise CfqDataError(f"{name}: record {index} has an empty "
                           f"{SOURCE_FIELD if not source else TARGET_FIELD}")
    target = plain
    if target_form == "simplified":
        try:
            target = simplify_query(plain)
        except QueryFormatError as err:
            raise CfqDataError(f"{name}: record {index}: cannot simplify the query: {err}") from None
    return source, target, plain


def prepare(out_dir: str, splits: Sequence[str], cfq_dir: Optional[str] = None,
            archive: Optional[str] = None, target_form: str = "simplified",
            progress: bool = True, chunk_chars: int = DEFAULT_CHUNK_CHARS,
            label_dirs: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, int]]:
    """Write ``OUT/LABEL/{train,valid,test}.{src,tgt,sparql}`` for every split (one pass
    over the dataset for all of them) and ``OUT/LABEL/prep.json``; return
    ``{label: {subset: count}}``. ``.tgt`` holds the training targets (``target_form``),
    ``.sparql`` the preprocessed plain query. Exactly one of ``cfq_dir`` / ``archive``.
    ``label_dirs`` ({label: directory}) sends a split's files elsewhere than
    ``OUT/LABEL`` (``data-prep/cfq/prepare.py`` passes temporary directories that it
    renames to ``OUT/LABEL`` once they are complete). Every file is written atomically;
    nothing is written before the whole dataset has been read and checked."""
    if (cfq_dir is None) == (archive is None):
        raise ValueError("give exactly one of cfq_dir and archive")
    if target_form not in TARGET_FORMS:
        raise ValueError(f"target_form must be one of {TARGET_FORMS}")
    if not splits:
        raise ValueError("no split requested")
    labels = [split_label(s) for s in splits]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two requested splits share an output name: {labels}")
    if archive is not None:
        if not os.path.isfile(archive):
            raise CfqDataError(f"{archive}: archive not found")
        dataset, records, n, loaded = _read_from_archive(archive, splits, progress, chunk_chars)
    else:
        dataset, records, n, loaded = _read_from_directory(cfq_dir, splits, progress, chunk_chars)
    for s in splits:
        check_split_range(loaded[s][1], n, loaded[s][0], dataset)

    processed: Dict[int, Tuple[str, str, str]] = {}
    needed = sorted({i for _, sp in loaded.values() for idxs in sp.values() for i in idxs})
    bar = progress_bar(progress, total=len(needed), unit="rec", desc="preprocessing")
    for i in needed:
        processed[i] = process_record(i, records[i][0], records[i][1], dataset, target_form)
        bar.update()
    bar.close()

    summary = {}
    for s, label in zip(splits, labels):
        split_file, split = loaded[s]
        directory = (label_dirs or {}).get(label) or os.path.join(out_dir, label)
        counts = {}
        for subset, _ in SPLIT_KEYS:
            rows = [processed[i] for i in split[subset]]
            prefix = os.path.join(directory, subset)
            write_lines_atomic(prefix + ".src", (r[0] for r in rows))
            write_lines_atomic(prefix + ".tgt", (r[1] for r in rows))
            write_lines_atomic(prefix + ".sparql", (r[2] for r in rows))
            counts[subset] = len(rows)
        info = {"split": label, "split_file": split_file, "dataset": dataset,
                "dataset_records": n, "target_form": target_form, "counts": counts}
        write_lines_atomic(os.path.join(directory, "prep.json"), [json.dumps(info, indent=2)])
        summary[label] = counts
    return summary
