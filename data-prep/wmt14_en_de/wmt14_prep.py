"""WMT'14 English-German preparation (docs/wmt14.md#data-preparation), in Python: the library behind
``prepare.py``.

The recipe is the one the SUT paper used (Liu et al. 2020, "Transformer-Clinic", itself
fairseq's ``prepare-wmt14en2de.sh`` with newstest2013 as validation set):

* train: Europarl v7 + CommonCrawl + News Commentary v12 (4.5M pairs);
  valid: newstest2013; test: newstest2014 *full* (3,003 sentences, SGML).
* every set: Moses ``normalize-punctuation`` (``sacremoses.MosesPunctNormalizer``),
  ``remove-non-printing-char`` (every Unicode "Other" character becomes a space) and the
  Moses tokenizer with aggressive hyphen splitting (``-a``: ``rich-text`` ->
  ``rich @-@ text``) and the default XML escaping (``&quot;`` ...).
* train only: Moses ``clean-corpus-n`` semantics: drop a pair if a side has fewer than 1 or
  more than 80 tokens, or one side is more than 9 times longer than the other (the
  script's default ``-ratio 9``, which the recipe used by not passing ``-ratio``), or a
  token is longer than 1000 characters.
* joint BPE (subword-nmt) learnt on the cleaned train.en + train.de, applied to all sets.
* ``fairseq-preprocess --joined-dictionary`` (run by ``prepare.py``).

The second subword model (``prepare.py --subword spm``) keeps the same pairs (the length
filter decides on the Moses-tokenised text) but feeds their untokenised text, with
non-printing characters removed and whitespace collapsed (:func:`spm_text`), to one joint
SentencePiece model (:func:`learn_spm`), applied with the sentencepiece library
(:class:`SPMEncoder`); its fairseq dictionary lists exactly the model's pieces, in id order.

Lines are split on ``\\n`` only (never ``str.splitlines``: CommonCrawl has stray ``\\r``
and other separators inside lines that would break the sentence alignment).

Parallel work (normalisation + tokenisation, word counts for BPE, BPE application) runs
over chunks of lines in a ``multiprocessing`` pool; output order equals input order.
"""
import collections
import dataclasses
import gzip
import hashlib
import json
import multiprocessing
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import regex

from sut_fairseq.data import output_dir  # the staging of directory outputs (data-bin/)
from sut_fairseq.data.atomic import write_lines_atomic

SRC, TGT = "en", "de"
LANGS = (SRC, TGT)


class PrepError(Exception):
    """A user-facing error: missing input, offline, misaligned corpus, failed tool."""


# --------------------------------------------------------------------------- atomic writes

class AtomicFiles:
    """Write several text files together: each goes to a temporary file in its directory
    and all are renamed into place only when the ``with`` block succeeds."""

    def __init__(self, *paths: str):
        self.paths = paths
        self.handles, self.tmps = [], []

    def __enter__(self):
        for path in self.paths:
            directory = os.path.dirname(os.path.abspath(path))
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                                       suffix=".tmp")
            os.chmod(tmp, 0o666 & ~output_dir.umask())  # not mkstemp's 0600
            self.tmps.append(tmp)
            self.handles.append(os.fdopen(fd, "w", encoding="utf-8", newline="\n"))
        return self.handles

    def __exit__(self, exc_type, exc, tb):
        for handle in self.handles:
            handle.close()
        if exc_type is None:
            for tmp, path in zip(self.tmps, self.paths):
                os.replace(tmp, path)
        else:
            for tmp in self.tmps:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return False


def _temp_beside(path: str) -> str:
    """A new empty temporary file in the directory of ``path`` (same file system)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~output_dir.umask())  # not mkstemp's 0600
    os.close(fd)
    return tmp


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def copy_atomic(src: str, dest: str) -> None:
    """Copy ``src`` to ``dest`` through a temporary file beside ``dest`` (deleted on failure)."""
    tmp = _temp_beside(dest)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    except BaseException:
        _unlink_quietly(tmp)
        raise


# --------------------------------------------------------------------------- line helpers

def open_text(path: str):
    """Read UTF-8 text, splitting lines on ``\\n`` only; undecodable bytes survive as lone
    surrogates, which the non-printing-character removal turns into spaces."""
    return open(path, encoding="utf-8", errors="surrogateescape", newline="\n")


def read_lines(path: str) -> Iterator[str]:
    with open_text(path) as handle:
        for line in handle:
            yield line[:-1] if line.endswith("\n") else line


def count_lines(path: str) -> int:
    """Number of lines (``wc -l``, plus one for a last line without a newline); a ``.gz``
    file's decompressed lines."""
    n, last = 0, b"\n"
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as handle:
        while True:
            block = handle.read(1 << 20)
            if not block:
                break
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def require_file(path: str, what: str) -> str:
    if not os.path.isfile(path):
        raise PrepError(f"missing file: {path} ({what})")
    return path


def check_parallel(path_src: str, path_tgt: str) -> int:
    """Both sides of a parallel corpus exist and have the same number of lines; returns it."""
    require_file(path_src, "source side of a parallel corpus")
    require_file(path_tgt, "target side of a parallel corpus")
    n_src, n_tgt = count_lines(path_src), count_lines(path_tgt)
    if n_src != n_tgt:
        raise PrepError(f"the two sides of a parallel corpus have different line counts: "
                        f"{path_src} has {n_src} lines, {path_tgt} has {n_tgt}")
    return n_src


def chunks(lines: Iterable[str], size: int) -> Iterator[List[str]]:
    chunk = []
    for line in lines:
        chunk.append(line)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def progress(total: Optional[int], desc: str, unit: str = "lines"):
    """A tqdm bar on stderr (silent when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=None,
                dynamic_ncols=True, leave=False)


# --------------------------------------------------------------------------- SGML

_SEG = re.compile(r"<seg[^>]*>(.*)</seg>")


def extract_sgml(path: str) -> List[str]:
    """The segments of a WMT SGML file, in file order, as SacreBLEU reads them: the text
    between ``<seg ...>`` and ``</seg>``, stripped, inner whitespace runs collapsed to one
    space (no entity decoding: the WMT'14 files hold raw text)."""
    require_file(path, "WMT SGML test set")
    segments = []
    for line in read_lines(path):
        if "<seg" not in line:
            continue
        match = _SEG.search(line)
        if match is None:
            raise PrepError(f"{path}: malformed <seg> line: {line[:120]!r}")
        segments.append(re.sub(r"\s+", " ", match.group(1).strip()))
    if not segments:
        raise PrepError(f"{path}: no <seg> elements found (is it a WMT SGML file?)")
    return segments


# --------------------------------------------------------------------------- normalise + tokenise

_NON_PRINTING = regex.compile(r"\p{C}")


def remove_non_printing(text: str) -> str:
    """Moses ``remove-non-printing-char.perl``: every character of Unicode category C
    (control, format, surrogate, private use, unassigned) becomes a space."""
    return _NON_PRINTING.sub(" ", text)


class Tokeniser:
    """normalize-punctuation -> remove-non-printing-char -> tokenizer -a, one language.
    The output has single ASCII spaces between tokens and no other whitespace, so that
    subword-nmt (splits on ' ') and fairseq (splits on any whitespace) agree."""

    def __init__(self, lang: str):
        from sacremoses import MosesPunctNormalizer, MosesTokenizer

        self.lang = lang
        self.normaliser = MosesPunctNormalizer(lang=lang)
        self.tokeniser = MosesTokenizer(lang=lang)

    def __call__(self, line: str) -> str:
        text = remove_non_printing(self.normaliser.normalize(line))
        text = self.tokeniser.tokenize(text, aggressive_dash_splits=True, return_str=True,
                                       escape=True)
        return " ".join(text.split())


class BPEApplier:
    def __init__(self, codes_path: str):
        from subword_nmt.apply_bpe import BPE

        with open(codes_path, encoding="utf-8") as codes:
            self.bpe = BPE(codes, merges=-1, separator="@@")

    def __call__(self, line: str) -> str:
        return self.bpe.process_line(line).strip()


def spm_text(line: str) -> str:
    """The text the SentencePiece path works on: every Unicode category-C character
    becomes a space (as ``remove-non-printing-char``), then whitespace runs of any kind
    (tabs, no-break spaces, line separators) become one ASCII space, stripped at both
    ends. No tokenisation and no punctuation normalisation."""
    return " ".join(remove_non_printing(line).split())


class TextNormaliser:
    """:func:`spm_text` as a processor of :func:`map_lines` (its argument is unused)."""

    def __init__(self, _unused: str = ""):
        pass

    def __call__(self, line: str) -> str:
        return spm_text(line)


class SPMEncoder:
    """Apply a SentencePiece model: a line becomes its pieces joined by single spaces
    (pieces never hold whitespace: a word boundary is the piece prefix ``▁``)."""

    def __init__(self, model_path: str):
        import sentencepiece

        require_file(model_path, "SentencePiece model")
        self.processor = sentencepiece.SentencePieceProcessor()
        try:
            self.processor.Load(model_path)
        except (OSError, RuntimeError) as err:
            raise PrepError(f"cannot load SentencePiece model {model_path}: {err}") from err

    def __call__(self, line: str) -> str:
        return " ".join(self.processor.encode(line, out_type=str))

    def batch(self, lines: List[str]) -> List[str]:
        """Every line of a chunk in one call, on this process's thread only (the
        parallelism is the worker processes')."""
        return [" ".join(pieces) for pieces in self.processor.encode(lines, out_type=str, num_threads=1)]


# Worker-process state: one processor built per worker by the pool initializer.
_PROCESSOR: Optional[Callable[[str], str]] = None
PROCESSORS = {"tokenise": Tokeniser, "bpe": BPEApplier, "text": TextNormaliser, "spm": SPMEncoder}


def _init_worker(kind: str, arg: str) -> None:
    global _PROCESSOR
    _PROCESSOR = PROCESSORS[kind](arg)


def _process_chunk(lines: List[str]) -> List[str]:
    batch = getattr(_PROCESSOR, "batch", None)
    if batch is not None:
        return batch(lines)
    return [_PROCESSOR(line) for line in lines]


def _count_chunk(lines: List[str]) -> Tuple[collections.Counter, int]:
    counts = collections.Counter()
    for line in lines:
        counts.update(line.split())
    return counts, len(lines)


def parallel_map(func, items: Iterable, workers: int, initializer=None, initargs=()) -> Iterator:
    """``map(func, items)`` in input order over ``workers`` processes (in this process when
    ``workers <= 1``). At most ``4 * workers`` items are in flight, so a 4.5M-line file is
    never read into memory as a whole; on an error the workers are terminated."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(func, items)
        return
    pool = multiprocessing.get_context().Pool(workers, initializer=initializer, initargs=initargs)
    try:
        pending = collections.deque()
        for item in items:
            pending.append(pool.apply_async(func, (item,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def map_lines(kind: str, arg: str, in_path: str, out_path: str, workers: int = 1,
              chunk_lines: int = 10000, desc: str = "") -> int:
    """Apply processor ``kind`` (``tokenise``: arg = language; ``bpe``: arg = codes file;
    ``text``: :func:`spm_text`, arg unused; ``spm``: arg = SentencePiece model) to
    every line of ``in_path`` into ``out_path`` (written atomically, same order, same number
    of lines), over ``workers`` processes; returns the number of lines."""
    require_file(in_path, f"input of {kind}")
    PROCESSORS[kind](arg)  # fail here, not in a pool initializer (the pool would respawn it forever)
    total = count_lines(in_path)
    n = 0
    with AtomicFiles(out_path) as (out,), progress(total, desc or os.path.basename(out_path)) as bar:
        batches = chunks(read_lines(in_path), chunk_lines)
        for processed in parallel_map(_process_chunk, batches, workers, _init_worker, (kind, arg)):
            for line in processed:
                out.write(line)
                out.write("\n")
            n += len(processed)
            bar.update(len(processed))
    if n != total:
        raise PrepError(f"{kind} of {in_path}: wrote {n} lines for {total} input lines")
    return n


def tokenise_file(lang: str, in_path: str, out_path: str, workers: int = 1,
                  chunk_lines: int = 10000) -> int:
    return map_lines("tokenise", lang, in_path, out_path, workers, chunk_lines,
                     desc=f"tokenise {os.path.basename(in_path)}")


def apply_bpe_file(codes: str, in_path: str, out_path: str, workers: int = 1,
                   chunk_lines: int = 10000) -> int:
    return map_lines("bpe", codes, in_path, out_path, workers, chunk_lines,
                     desc=f"apply BPE {os.path.basename(in_path)}")


def normalise_text_file(in_path: str, out_path: str, workers: int = 1,
                        chunk_lines: int = 10000) -> int:
    """:func:`spm_text` of every line of ``in_path`` into ``out_path`` (atomically)."""
    return map_lines("text", "", in_path, out_path, workers, chunk_lines,
                     desc=f"normalise {os.path.basename(in_path)}")


def apply_spm_file(model: str, in_path: str, out_path: str, workers: int = 1,
                   chunk_lines: int = 10000) -> int:
    """Encode every line of ``in_path`` with SentencePiece model ``model`` into
    ``out_path`` (atomically; chunks of ``chunk_lines`` lines over ``workers`` processes)."""
    return map_lines("spm", model, in_path, out_path, workers, chunk_lines,
                     desc=f"apply SentencePiece {os.path.basename(in_path)}")


# --------------------------------------------------------------------------- length filter

@dataclasses.dataclass
class CleanStats:
    read: int = 0
    kept: int = 0
    empty: int = 0
    too_long: int = 0
    ratio: int = 0
    long_word: int = 0

    def as_dict(self):
        return dataclasses.asdict(self)


def pair_verdict(src: str, tgt: str, min_len: int = 1, max_len: int = 80,
                 max_ratio: float = 9.0, max_word_length: int = 1000) -> Optional[str]:
    """Why ``clean-corpus-n.perl`` would drop this tokenised pair (None: keep it).
    Reasons: ``empty`` (fewer than ``min_len`` tokens), ``too_long`` (more than
    ``max_len``), ``ratio`` (one side more than ``max_ratio`` times the other),
    ``long_word`` (a token longer than ``max_word_length`` characters)."""
    s, t = src.split(), tgt.split()
    if len(s) < min_len or len(t) < min_len or not s or not t:
        return "empty"
    if len(s) > max_len or len(t) > max_len:
        return "too_long"
    if max_ratio and (len(s) / len(t) > max_ratio or len(t) / len(s) > max_ratio):
        return "ratio"
    if any(len(w) > max_word_length for w in s + t):
        return "long_word"
    return None


def clean_corpus(pairs_in: Sequence[Tuple[str, str]], out_src: str, out_tgt: str,
                 min_len: int = 1, max_len: int = 80, max_ratio: float = 9.0,
                 max_word_length: int = 1000) -> CleanStats:
    """Concatenate the tokenised parallel files ``pairs_in`` [(src, tgt), ...] in order,
    keeping the pairs :func:`pair_verdict` accepts; both outputs written atomically."""
    stats = CleanStats()
    total = sum(check_parallel(s, t) for s, t in pairs_in)
    with AtomicFiles(out_src, out_tgt) as (fs, ft), progress(total, "length filter") as bar:
        for path_s, path_t in pairs_in:
            for src, tgt in zip(read_lines(path_s), read_lines(path_t)):
                stats.read += 1
                verdict = pair_verdict(src, tgt, min_len, max_len, max_ratio, max_word_length)
                if verdict is None:
                    stats.kept += 1
                    fs.write(" ".join(src.split()) + "\n")
                    ft.write(" ".join(tgt.split()) + "\n")
                else:
                    setattr(stats, verdict, getattr(stats, verdict) + 1)
                bar.update(1)
    return stats


def select_text_pairs(tok_pairs: Sequence[Tuple[str, str]], raw_pairs: Sequence[Tuple[str, str]],
                      out_src: str, out_tgt: str, min_len: int = 1, max_len: int = 80,
                      max_ratio: float = 9.0, max_word_length: int = 1000) -> CleanStats:
    """The training text of the SentencePiece path: the pairs :func:`clean_corpus` keeps
    (decided on the tokenised ``tok_pairs``, so both subword paths train on the same
    pairs), written as :func:`spm_text` of their untokenised lines in ``raw_pairs``
    (aligned line by line with ``tok_pairs``); both outputs written atomically."""
    stats = CleanStats()
    for (ts, tt), (rs, rt) in zip(tok_pairs, raw_pairs):
        n_tok, n_raw = check_parallel(ts, tt), check_parallel(rs, rt)
        if n_tok != n_raw:
            raise PrepError(f"{ts} has {n_tok} lines but the text it was tokenised from, "
                            f"{rs}, has {n_raw}")
    total = sum(check_parallel(s, t) for s, t in tok_pairs)
    with AtomicFiles(out_src, out_tgt) as (fs, ft), progress(total, "select text pairs") as bar:
        for (ts, tt), (rs, rt) in zip(tok_pairs, raw_pairs):
            for src, tgt, raw_src, raw_tgt in zip(read_lines(ts), read_lines(tt),
                                                  read_lines(rs), read_lines(rt)):
                stats.read += 1
                verdict = pair_verdict(src, tgt, min_len, max_len, max_ratio, max_word_length)
                if verdict is None:
                    stats.kept += 1
                    fs.write(spm_text(raw_src) + "\n")
                    ft.write(spm_text(raw_tgt) + "\n")
                else:
                    setattr(stats, verdict, getattr(stats, verdict) + 1)
                bar.update(1)
    return stats


# --------------------------------------------------------------------------- SentencePiece

#: SentencePiece ids of the special symbols, chosen equal to fairseq's dictionary
#: (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3), so a piece's SentencePiece id is its
#: index in the fairseq dictionary built by :func:`spm_dictionary_lines`.
SPM_SPECIAL_IDS = {"bos_id": 0, "pad_id": 1, "eos_id": 2, "unk_id": 3}
SPM_TYPES = ("unigram", "bpe")


def spm_dictionary_lines(vocab_path: str) -> List[str]:
    """The fairseq dictionary of a SentencePiece model from its ``.vocab`` file (``piece
    TAB score`` per line, in id order): every piece but the four special symbols, which
    fairseq's Dictionary adds itself, as ``piece 1``."""
    require_file(vocab_path, "SentencePiece vocabulary")
    specials = ("<s>", "<pad>", "</s>", "<unk>")
    out, seen = [], []
    for number, line in enumerate(read_lines(vocab_path), 1):
        piece = line.split("\t", 1)[0]
        if not piece or any(c.isspace() for c in piece):
            raise PrepError(f"{vocab_path} line {number}: piece {piece!r} is empty or holds whitespace")
        if number <= len(specials):
            seen.append(piece)
            continue
        out.append(f"{piece} 1")
    if tuple(seen) != specials:
        raise PrepError(f"{vocab_path}: the first pieces are {seen}, expected {list(specials)} "
                        "(a model trained with other special ids than prepare.py's)")
    return out


def learn_spm(train_paths: Sequence[str], model_path: str, vocab_path: str, dict_path: str,
              vocab_size: int, model_type: str = "unigram", input_sentences: int = 2000000,
              character_coverage: float = 0.9999, seed: int = 1, threads: int = 1,
              hard_vocab_limit: bool = True) -> dict:
    """Train one joint SentencePiece model on the lines of all ``train_paths`` (at most
    ``input_sentences`` of them, sampled with SentencePiece's reservoir sampling after
    a seeded shuffle), and write ``model_path``, ``vocab_path`` and the fairseq dictionary
    ``dict_path`` (:func:`spm_dictionary_lines`). The three files are trained into a
    temporary directory beside ``model_path`` and renamed into place when all exist.
    Returns notes for the summary (pieces, the fairseq dictionary size)."""
    import sentencepiece

    if model_type not in SPM_TYPES:
        raise PrepError(f"SentencePiece model type {model_type!r}: choose from {', '.join(SPM_TYPES)}")
    if vocab_size <= len(SPM_SPECIAL_IDS):
        raise PrepError(f"SentencePiece vocabulary size {vocab_size} must exceed the "
                        f"{len(SPM_SPECIAL_IDS)} special symbols")
    if input_sentences < 1:
        raise PrepError(f"--spm-input-sentences {input_sentences} must be positive")
    for path in train_paths:
        if count_lines(require_file(path, "SentencePiece training text")) == 0:
            raise PrepError(f"SentencePiece training text {path} is empty")
    directory = os.path.dirname(os.path.abspath(model_path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".learn-spm.") as tmp:
        prefix = os.path.join(tmp, "spm")
        sentencepiece.set_random_generator_seed(seed)
        try:
            sentencepiece.SentencePieceTrainer.train(
                input=list(train_paths), model_prefix=prefix, vocab_size=vocab_size,
                model_type=model_type, character_coverage=character_coverage,
                input_sentence_size=input_sentences, shuffle_input_sentence=True,
                num_threads=max(1, threads), hard_vocab_limit=hard_vocab_limit,
                minloglevel=1, **SPM_SPECIAL_IDS)
        except RuntimeError as err:
            raise PrepError(f"SentencePiece training on {list(train_paths)} failed: {err}") from err
        entries = spm_dictionary_lines(prefix + ".vocab")
        write_lines_atomic(os.path.join(tmp, "dict.txt"), entries)
        for src, dest in ((prefix + ".model", model_path), (prefix + ".vocab", vocab_path),
                          (os.path.join(tmp, "dict.txt"), dict_path)):
            os.chmod(src, 0o666 & ~output_dir.umask())
            os.replace(src, dest)
    return {"pieces": len(entries) + len(SPM_SPECIAL_IDS),
            "dictionary_entries": len(entries) + len(SPM_SPECIAL_IDS)}


# --------------------------------------------------------------------------- binarize

def binarize_command(executable: str, prefix_dir: str, dest: str, workers: int, srcdict: str = None,
                     src: str = SRC, tgt: str = TGT, tests: Sequence[str] = ("test",)):
    """The fairseq-preprocess command over ``prefix_dir/{train,valid,TEST...}.{src,tgt}``
    with one joined dictionary; ``srcdict``: a fixed one (the SentencePiece path's
    dict.txt) instead of one counted from the training data. ``tests``: the test files'
    names, binarized as fairseq's subsets ``test``, ``test1``, ``test2``, ... in order."""
    command = [executable, "--source-lang", src, "--target-lang", tgt,
               "--trainpref", os.path.join(prefix_dir, "train"),
               "--validpref", os.path.join(prefix_dir, "valid"),
               "--testpref", ",".join(os.path.join(prefix_dir, name) for name in tests),
               "--destdir", dest, "--joined-dictionary", "--workers", str(workers)]
    if srcdict is not None:
        command += ["--srcdict", srcdict]
    return command


def run_binarize(command, dest: str, extra_files: dict = None, lang: str = SRC) -> dict:
    """Run ``fairseq-preprocess`` into a temporary sibling of ``dest`` that replaces
    ``dest`` only when it succeeds (a failure or an interruption leaves ``dest`` as it
    was; the step's marker is gone already, so it is not trusted). ``extra_files``
    ``{name: path}`` are copied into it beside the binarized data."""
    print("+ " + " ".join(shlex.quote(c) for c in command), flush=True)
    shutil.rmtree(dest + ".tmp", ignore_errors=True)  # the staging name of older versions
    output_dir.remove_stale(dest)
    with output_dir.StagedDir(dest, overwrite=True) as stage:
        tmp = stage.path
        command = list(command)
        command[command.index("--destdir") + 1] = tmp
        log = os.path.join(tmp, "preprocess.stdout")
        with open(log, "w") as handle:
            proc = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            sys.stdout.write(open(log).read()[-3000:])
            raise PrepError(f"fairseq-preprocess failed (exit {proc.returncode}; the end of "
                            f"its output is printed above)")
        for name, path in (extra_files or {}).items():
            shutil.copyfile(require_file(path, f"file for {dest}"), os.path.join(tmp, name))
    dict_path = os.path.join(dest, f"dict.{lang}.txt")
    return {"dictionary_entries": count_lines(dict_path) + 4}  # + <s> <pad> </s> <unk>


# --------------------------------------------------------------------------- BPE

def word_counts(paths: Sequence[str], workers: int = 1, chunk_lines: int = 10000) -> collections.Counter:
    """Token frequencies over all ``paths`` (counted in parallel chunks)."""
    counts = collections.Counter()
    total = sum(count_lines(require_file(p, "BPE training text")) for p in paths)
    with progress(total, "count words") as bar:
        for path in paths:
            batches = chunks(read_lines(path), chunk_lines)
            for partial, n in parallel_map(_count_chunk, batches, workers):
                counts.update(partial)
                bar.update(n)
    return counts


def learn_joint_bpe(train_paths: Sequence[str], codes_path: str, merges: int,
                    vocab_path: Optional[str] = None, min_frequency: int = 2,
                    workers: int = 1, chunk_lines: int = 10000) -> int:
    """Learn ``merges`` BPE merge operations (subword-nmt ``learn_bpe``) on the joint word
    counts of ``train_paths`` (the recipe's ``cat train.en train.de | learn_bpe.py -s N``);
    writes ``codes_path`` atomically and returns the number of merges learnt (fewer than
    asked when no pair occurs ``min_frequency`` times any more)."""
    from subword_nmt.learn_bpe import learn_bpe

    counts = word_counts(train_paths, workers, chunk_lines)
    if not counts:
        raise PrepError(f"no words to learn BPE from in {list(train_paths)}")
    vocab_lines = [f"{w} {c}" for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    vocab_path = vocab_path or codes_path + ".vocab"
    write_lines_atomic(vocab_path, vocab_lines)
    with AtomicFiles(codes_path) as (out,), open(vocab_path, encoding="utf-8") as vocab:
        learn_bpe(vocab, out, merges, min_frequency=min_frequency, is_dict=True)
    return sum(1 for line in read_lines(codes_path) if line and not line.startswith("#version"))


# --------------------------------------------------------------------------- corpora

@dataclasses.dataclass(frozen=True)
class Corpus:
    """One parallel corpus: ``members`` maps a language to its file inside ``archive``
    (downloaded from ``url``); ``sgml``: the members are WMT SGML files."""
    name: str
    archive: str
    url: str
    members: Dict[str, str]
    sgml: bool = False


CORPORA = {
    "europarl-v7": Corpus(
        "europarl-v7", "training-parallel-europarl-v7.tgz",
        "https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
        {l: f"training/europarl-v7.de-en.{l}" for l in LANGS}),
    "commoncrawl": Corpus(
        "commoncrawl", "training-parallel-commoncrawl.tgz",
        "https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
        {l: f"commoncrawl.de-en.{l}" for l in LANGS}),
    "news-commentary-v12": Corpus(
        "news-commentary-v12", "training-parallel-nc-v12.tgz",
        "https://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz",
        {l: f"training/news-commentary-v12.de-en.{l}" for l in LANGS}),
    "newstest2013": Corpus(
        "newstest2013", "dev.tgz", "https://data.statmt.org/wmt17/translation-task/dev.tgz",
        {l: f"dev/newstest2013.{l}" for l in LANGS}),
    "newstest2014": Corpus(
        "newstest2014", "test-full.tgz", "https://www.statmt.org/wmt14/test-full.tgz",
        {"en": "test-full/newstest2014-deen-src.en.sgm",
         "de": "test-full/newstest2014-deen-ref.de.sgm"}, sgml=True),
}
TRAIN_CORPORA = ("europarl-v7", "commoncrawl", "news-commentary-v12")
VALID_CORPUS, TEST_CORPUS = "newstest2013", "newstest2014"


def locate(corpus: Corpus, lang: str, local_dirs: Sequence[str], orig_dir: str):
    """Where the ``lang`` side of ``corpus`` comes from: ``("file", path)`` for an extracted
    file in a local directory (its base name, or its path inside the archive), else
    ``("archive", path)`` for the archive in a local directory or in ``orig_dir``, else
    None (it must be downloaded)."""
    member = corpus.members[lang]
    for d in local_dirs:
        for candidate in (os.path.join(d, os.path.basename(member)), os.path.join(d, member)):
            if os.path.isfile(candidate):
                return ("file", candidate)
    for d in list(local_dirs) + [orig_dir]:
        candidate = os.path.join(d, corpus.archive)
        if os.path.isfile(candidate):
            return ("archive", candidate)
    return None


def download(url: str, dest: str, timeout: float = 60.0) -> str:
    """Stream ``url`` to ``dest`` (through ``dest.part``, renamed when complete)."""
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part = dest + ".part"
    print(f"downloading {url} -> {dest}", flush=True)
    try:  # (a KeyboardInterrupt leaves ``.part``, which is never read and is overwritten next time)
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
            size = response.headers.get("Content-Length")
            with progress(int(size) if size else None, os.path.basename(dest), unit="B") as bar:
                while True:
                    block = response.read(1 << 20)
                    if not block:
                        break
                    out.write(block)
                    bar.update(len(block))
    except (urllib.error.URLError, OSError, ValueError) as err:
        try:
            os.unlink(part)
        except OSError:
            pass
        raise PrepError(f"could not download {url}: {err}") from err
    os.replace(part, dest)
    return dest


def extract_members(archive: str, wanted: Dict[str, str], dest: Dict[str, str]) -> None:
    """Copy the members ``wanted[key]`` (matched by their path with any leading ``./``, or
    else by base name) of a tar archive to ``dest[key]``, atomically, in one pass."""
    todo = dict(wanted)
    try:
        with tarfile.open(archive, "r:*") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                name = info.name[2:] if info.name.startswith("./") else info.name
                for key, member in list(todo.items()):
                    if name == member or os.path.basename(name) == os.path.basename(member):
                        source = tar.extractfile(info)
                        tmp = _temp_beside(dest[key])
                        try:
                            with open(tmp, "wb") as out:
                                shutil.copyfileobj(source, out, 1 << 20)
                            os.replace(tmp, dest[key])
                        except BaseException:
                            _unlink_quietly(tmp)
                            raise
                        del todo[key]
                if not todo:
                    break
    except (tarfile.TarError, OSError, EOFError) as err:
        raise PrepError(f"cannot read archive {archive}: {err} (incomplete download? delete it "
                        f"and run again)") from err
    if todo:
        raise PrepError(f"archive {archive} lacks {sorted(todo.values())}")


def fetch_corpus(corpus: Corpus, raw_dir: str, local_dirs: Sequence[str], orig_dir: str,
                 allow_download: bool = True) -> Dict[str, str]:
    """Put the raw text of both sides of ``corpus`` into ``raw_dir/NAME.{en,de}`` (SGML
    test sets: their extracted segments) and check they have the same number of lines.
    Returns the sources used {lang: description}."""
    out = {l: os.path.join(raw_dir, f"{corpus.name}.{l}") for l in LANGS}
    sources, from_archive = {}, {}
    for lang in LANGS:
        where = locate(corpus, lang, local_dirs, orig_dir)
        if where is None:
            archive = os.path.join(orig_dir, corpus.archive)
            names = ", ".join(os.path.basename(m) for m in corpus.members.values())
            hint = (f"download {corpus.url} on a connected machine and pass --local-dir DIR "
                    f"holding {corpus.archive} or the extracted files ({names})")
            if not allow_download:
                raise PrepError(f"missing file: no {corpus.archive} and no {names} in "
                                f"{list(local_dirs) or 'any --local-dir'} or {orig_dir}; {hint}")
            try:
                download(corpus.url, archive)
            except PrepError as err:
                raise PrepError(f"{err}; offline? {hint}") from err
            where = ("archive", archive)
        kind, path = where
        if kind == "file":
            sources[lang] = path
            if corpus.sgml:
                write_lines_atomic(out[lang], extract_sgml(path))
            else:
                copy_atomic(path, out[lang])
        else:
            sources[lang] = f"{path}:{corpus.members[lang]}"
            from_archive[lang] = path
    if from_archive:
        by_archive = collections.defaultdict(dict)
        for lang, archive in from_archive.items():
            by_archive[archive][lang] = corpus.members[lang]
        for archive, wanted in by_archive.items():
            print(f"extracting {sorted(wanted.values())} from {archive}", flush=True)
            if corpus.sgml:
                with tempfile.TemporaryDirectory(dir=raw_dir) as tmp:
                    sgm = {l: os.path.join(tmp, os.path.basename(m)) for l, m in wanted.items()}
                    extract_members(archive, wanted, sgm)
                    for lang, path in sgm.items():
                        write_lines_atomic(out[lang], extract_sgml(path))
            else:
                extract_members(archive, wanted, {l: out[l] for l in wanted})
    check_parallel(out[SRC], out[TGT])
    return sources


def source_fingerprint(corpus: Corpus, local_dirs: Sequence[str], orig_dir: str) -> List[str]:
    """What the fetch step of ``corpus`` reads; when it changes the step runs again. A local
    file or archive is identified by path, size and modification time; the archive in
    ``orig_dir`` by its URL only, so that downloading it does not change the fingerprint."""
    result = []
    for lang in LANGS:
        where = locate(corpus, lang, local_dirs, orig_dir)
        in_orig = where is not None and os.path.dirname(os.path.abspath(where[1])) == os.path.abspath(orig_dir)
        if where is None or (where[0] == "archive" and in_orig):
            result.append(f"{lang}: {corpus.url} -> orig/{corpus.archive}:{corpus.members[lang]}")
        else:
            st = os.stat(where[1])
            result.append(f"{lang}: {where[0]} {os.path.abspath(where[1])} {st.st_size} {int(st.st_mtime)}")
    return result


# --------------------------------------------------------------------------- resumable steps

#: What a work directory of ``prepare.py`` holds at its top level (``data-bin.tmp``: the
#: staging name of older versions; ``text``, ``spm``, ``data-bin-spm``: ``--subword spm``);
#: anything else there is not ours.
WORKDIR_ENTRIES = ("orig", "raw", "tok", "clean", "bpe", "data-bin", "done", "data-bin.tmp",
                   "text", "spm", "data-bin-spm")


def _json_form(value):
    """``value`` as it reads back from a marker (tuples become lists, ...)."""
    return json.loads(json.dumps(value))


class Pipeline:
    """Runs named steps once. A step is skipped when its marker ``DONE_DIR/NAME.done``
    exists, records the same parameters, every output still has the size recorded
    when the step finished, and the markers of the steps it depends on are the ones it
    was built from (outputs are renamed into place before the marker is written, so an
    interrupted step leaves no marker and runs again). A step also runs again when one of
    the steps it depends on ran in this invocation."""

    def __init__(self, workdir: str, force: bool = False):
        self.workdir = workdir
        self.done_dir = os.path.join(workdir, "done")
        self.force = force
        self.ran: set = set()
        self.skipped: List[str] = []
        self.counts: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self.notes: Dict[str, dict] = {}

    def marker(self, name: str) -> str:
        return os.path.join(self.done_dir, name + ".done")

    def read_marker(self, name: str) -> Optional[dict]:
        """The record of step ``name``, or None (no marker, or an unreadable one)."""
        try:
            with open(self.marker(name), encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def marker_digest(self, name: str) -> Optional[str]:
        """SHA-256 of step ``name``'s marker file (None when it has none)."""
        try:
            with open(self.marker(name), "rb") as handle:
                return hashlib.sha256(handle.read()).hexdigest()
        except OSError:
            return None

    def _complete(self, name: str, outputs: Sequence[str], params: dict,
                  deps: Sequence[str] = ()) -> Optional[dict]:
        record = self.read_marker(name)
        if record is None:
            return None
        if record.get("params") != _json_form(params):
            return None
        if not all(os.path.exists(out) for out in outputs):
            return None
        if record.get("sizes") != self._sizes(outputs):
            return None
        # markers written before dependencies were recorded carry no "deps"
        if "deps" in record and record["deps"] != {d: self.marker_digest(d) for d in deps}:
            return None
        return record

    def _sizes(self, outputs: Sequence[str]) -> Dict[str, int]:
        """Size of every output file, and of every file inside an output directory."""
        sizes = {}
        for out in outputs:
            if os.path.isdir(out):
                for root, _, files in os.walk(out):
                    for name in files:
                        path = os.path.join(root, name)
                        sizes[os.path.relpath(path, self.workdir)] = os.path.getsize(path)
            elif os.path.isfile(out):
                sizes[os.path.relpath(out, self.workdir)] = os.path.getsize(out)
        return sizes

    def check(self, func: Callable[[], object]) -> None:
        """Run a check between steps (a :class:`Plan` skips it)."""
        func()

    def step(self, name: str, outputs: Sequence[str], params: dict, run: Callable[[], Optional[dict]],
             deps: Sequence[str] = (), count: Sequence[str] = ()) -> bool:
        """Run ``run()`` unless the step is complete. ``outputs``: files (or directories)
        the step produces; ``count``: the outputs whose line counts go into the summary;
        ``run`` may return a dict of notes for the summary. Returns True if it ran."""
        record = None if (self.force or self.ran.intersection(deps)) else \
            self._complete(name, outputs, params, deps)
        if record is not None:
            print(f"[skip] {name}: complete ({self.marker(name)})", flush=True)
            self.skipped.append(name)
            self.counts.update(record.get("counts", {}))
            if record.get("notes"):
                self.notes[name] = record["notes"]
            return False
        print(f"[run ] {name}", flush=True)
        try:
            os.unlink(self.marker(name))
        except FileNotFoundError:
            pass
        notes = run()
        notes = notes if isinstance(notes, dict) else {}
        counts = collections.OrderedDict(
            (os.path.relpath(p, self.workdir), count_lines(p)) for p in count)
        record = {"params": params, "counts": counts, "sizes": self._sizes(outputs), "notes": notes,
                  "outputs": [os.path.relpath(o, self.workdir) for o in outputs],
                  "deps": {d: self.marker_digest(d) for d in deps}}
        os.makedirs(self.done_dir, exist_ok=True)
        write_lines_atomic(self.marker(name), [json.dumps(record, indent=1, sort_keys=True)])
        self.ran.add(name)
        self.counts.update(counts)
        if notes:
            self.notes[name] = notes
        return True

    def summary(self) -> str:
        width = max([len(k) for k in self.counts] + [4])
        lines = [f"{'file'.ljust(width)}  lines"]
        lines += [f"{k.ljust(width)}  {v:,}" for k, v in self.counts.items()]
        for name, notes in self.notes.items():
            lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in notes.items()))
        return "\n".join(lines)


def _short(value) -> Optional[str]:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else None


class Plan(Pipeline):
    """The steps a build would run, recorded without running anything (``check`` is
    skipped too), to compare with what a work directory already holds before any file
    is touched."""

    def __init__(self, workdir: str):
        super().__init__(workdir)
        self.steps: "collections.OrderedDict[str, Tuple[List[str], dict, List[str]]]" = \
            collections.OrderedDict()

    def check(self, func) -> None:
        pass

    def step(self, name, outputs, params, run, deps=(), count=()) -> bool:
        self.steps[name] = (list(outputs), params, list(deps))
        return False

    def foreign_entries(self, inputs: Sequence[str] = ()) -> List[str]:
        """Top-level entries of the work directory that are not ``prepare.py``'s own
        (:data:`WORKDIR_ENTRIES`, staging siblings of ``data-bin``) and hold none of
        ``inputs`` (e.g. a ``--local-dir`` kept inside the work directory)."""
        if not os.path.isdir(self.workdir):
            return []
        staging = re.compile(r"^\.data-bin(-spm)?\.(tmp|old)-\d+-")
        held = [os.path.realpath(p) for p in inputs]
        foreign = []
        for entry in sorted(os.listdir(self.workdir)):
            if entry in WORKDIR_ENTRIES or staging.match(entry):
                continue
            path = os.path.realpath(os.path.join(self.workdir, entry))
            if any(h == path or h.startswith(path + os.sep) for h in held):
                continue
            foreign.append(entry)
        return foreign

    def changed_parameters(self) -> "collections.OrderedDict[str, List[str]]":
        """``{step: [description, ...]}`` for every planned step whose marker records other
        parameters, e.g. ``{"clean-train": ["max_len 80 -> 12"]}``."""
        changed = collections.OrderedDict()
        for name, (_, params, _) in self.steps.items():
            record = self.read_marker(name)
            if record is None or "params" not in record:
                continue
            old, new = record["params"], _json_form(params)
            if old == new:
                continue
            if not (isinstance(old, dict) and isinstance(new, dict)):
                changed[name] = ["parameters"]
                continue
            notes = []
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    a, b = _short(old.get(key)), _short(new.get(key))
                    notes.append(f"{key} {a} -> {b}" if a is not None and b is not None else f"{key} changed")
            changed[name] = notes
        return changed

    def stale_unplanned(self, rerun: Sequence[str]) -> List[str]:
        """Steps with a marker in ``done/`` that this build does not declare (e.g.
        ``binarize`` under ``--no-binarize``) and whose outputs were built from a step in
        ``rerun`` -- or from steps they did not record (older markers) -- so that they
        would be out of date once ``rerun`` has run."""
        invalid = set(rerun)
        for name, (_, _, deps) in self.steps.items():  # declared in dependency order
            if invalid.intersection(deps):
                invalid.add(name)
        if not invalid or not os.path.isdir(self.done_dir):
            return []
        undeclared = {}
        for entry in sorted(os.listdir(self.done_dir)):
            name = entry[:-len(".done")]
            if entry.endswith(".done") and name not in self.steps:
                undeclared[name] = (self.read_marker(name) or {}).get("deps")
        stale: List[str] = []
        grew = True
        while grew:  # through chains of undeclared steps (e.g. learn-spm -> apply-spm-*)
            grew = False
            for name, deps in undeclared.items():
                if name not in stale and (deps is None or invalid.intersection(deps)):
                    stale.append(name)
                    invalid.add(name)
                    grew = True
        return sorted(stale)

    def remove_step(self, name: str) -> List[str]:
        """Delete step ``name``'s marker, then the outputs it records; return the outputs."""
        record = self.read_marker(name) or {}
        try:
            os.unlink(self.marker(name))
        except FileNotFoundError:
            pass
        outputs = record.get("outputs") or sorted(record.get("sizes", {}))
        removed = []
        for rel in outputs:
            path = os.path.join(self.workdir, rel)
            if not os.path.realpath(path).startswith(os.path.realpath(self.workdir) + os.sep):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
            else:
                continue
            removed.append(rel)
        return removed


class WorkdirRefused(PrepError):
    """WORKDIR is not this run's to write (exit status 2 with an ``error:`` line)."""


def check_workdir(workdir: str, declare: Callable[["Plan"], object], inputs: Sequence[str] = (),
                  overwrite: bool = False, force: bool = False) -> None:
    """Refuse (:class:`WorkdirRefused` with the ``--overwrite`` hint) a work directory that
    holds foreign files or the output of other parameters, unless ``overwrite``/``force``;
    with them, delete the outputs of undeclared steps that the rerun would leave out of
    date. ``declare(plan)`` declares the build's steps on a :class:`Plan`; ``inputs``:
    input paths that may lie inside the work directory."""
    W = os.path.abspath(workdir)
    plan = Plan(W)
    declare(plan)
    foreign = plan.foreign_entries(inputs=inputs)
    changed = plan.changed_parameters()
    replace = overwrite or force
    if foreign and not replace:
        shown = ", ".join(foreign[:3]) + (f", ... ({len(foreign)} entries)" if len(foreign) > 3 else "")
        raise WorkdirRefused(f"work directory {W} is not empty and holds entries that are not "
                             f"prepare.py's ({shown}); pass --overwrite to prepare into it "
                             "anyway, or choose another directory")
    if changed and not replace:
        shown = "; ".join(f"{name}: {', '.join(notes)}" for name, notes in list(changed.items())[:4])
        more = f"; ... ({len(changed)} steps)" if len(changed) > 4 else ""
        raise WorkdirRefused(f"work directory {W} holds the output of a run with other "
                             f"parameters ({shown}{more}); pass --overwrite to replace those "
                             "steps' outputs (or --force to rerun every step), or choose "
                             "another directory")
    if replace:
        rerun = list(plan.steps) if force else list(changed)
        for name in plan.stale_unplanned(rerun):
            removed = plan.remove_step(name)
            print(f"[del ] {name}: built from steps that run again; removed "
                  f"{', '.join(removed) or 'its marker'}", flush=True)
