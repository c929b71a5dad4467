"""Files written atomically: into a temporary file beside the target, then ``os.replace``.

A reader never sees a half-written file: it finds the old content or the new one. An
interruption removes the temporary file. The file gets the mode a plain ``open`` would
give (``0666 & ~umask``), not ``mkstemp``'s 0600.
"""
import contextlib
import json
import os
import tempfile
from typing import Iterable, Iterator

from .output_dir import umask


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success it is renamed to ``path``, on
    failure removed. (For writers that want a file name, e.g. ``savefig``.)"""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                               suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_lines_atomic(path: str, lines: Iterable[str]) -> None:
    """Write ``lines``, each followed by a newline."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as handle:
        for line in lines:
            handle.write(line)
            handle.write("\n")


def write_text_atomic(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)


def write_json_atomic(path: str, obj) -> None:
    """``obj`` as indented JSON and a final newline."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
