"""Output directories of the data-preparation scripts: refuse, stage, commit.

Standard library only, like everything in ``sut_fairseq.data``.

The rules every data-preparation script follows:

* :func:`check_output_dir` -- an output directory that exists and is not empty is refused
  (:class:`OutputExistsError`; the scripts print ``error: ...`` and exit with status
  :data:`EXIT_REFUSED`) unless ``--overwrite`` (:data:`OVERWRITE_FLAG`) is given. With
  ``--overwrite`` the directory is replaced as a whole, so no file of an earlier run is
  left next to the new ones; an input of the command that lies inside it is refused.
* :class:`StagedDir` -- everything is written into a temporary sibling directory
  ``.NAME.tmp-PID-XXXX`` (files written by a subprocess such as ``fairseq-preprocess``
  too) that is renamed to ``NAME`` only when the whole output is complete. A failure or
  an interruption deletes the temporary directory and leaves ``NAME`` as it was; a run
  killed outright (SIGKILL, power loss) leaves only the temporary sibling, whose name no
  reader ever opens, and :func:`remove_stale` deletes it on the next run once its process
  is gone. A directory with the final name is therefore always a complete output.
"""
import os
import re
import shutil
import sys
import tempfile
from typing import Iterable, List, Optional

OVERWRITE_FLAG = "--overwrite"
#: Exit status of a script that refuses to write into an existing output.
EXIT_REFUSED = 2


def umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class OutputExistsError(Exception):
    """The output directory exists and is not empty (or is not a directory)."""


def _is_inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def contents(path: str) -> List[str]:
    """The entries of directory ``path`` (sorted; empty when it does not exist)."""
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def check_output_dir(path: str, overwrite: bool = False, inputs: Iterable[Optional[str]] = (),
                     flag: str = OVERWRITE_FLAG) -> bool:
    """Whether ``path`` may be written: True when it holds an earlier output that
    ``overwrite`` allows to replace, False when it is missing or empty. Raises
    :class:`OutputExistsError` (a one-line message naming ``path`` and ``flag``) when it
    is not a directory, when it is not empty and ``overwrite`` is false, or when one of
    ``inputs`` (paths the command reads) lies inside it and would be deleted."""
    if not os.path.lexists(path):
        return False
    if not os.path.isdir(path):
        raise OutputExistsError(f"output directory {path} exists and is not a directory")
    entries = contents(path)
    if not entries:
        return False
    if not overwrite:
        shown = ", ".join(entries[:3]) + (f", ... ({len(entries)} entries)" if len(entries) > 3 else "")
        raise OutputExistsError(f"output directory {path} is not empty (it holds {shown}); "
                                f"pass {flag} to replace it, or choose another directory")
    for source in inputs:
        if source and os.path.exists(source) and _is_inside(source, path):
            raise OutputExistsError(f"{flag} would delete {path}, which holds the input "
                                    f"{source}; choose another output directory")
    return True


def refuse(err: Exception) -> int:
    """Print ``error: MESSAGE`` on stderr; return :data:`EXIT_REFUSED`."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    return EXIT_REFUSED


def claim(path: str, overwrite: bool = False, inputs: Iterable[Optional[str]] = ()) -> Optional[int]:
    """A script's start on its one output directory: :func:`check_output_dir`, then
    :func:`remove_stale`. Returns None when ``path`` may be written, else the exit status
    of the refusal (its ``error: ...`` printed by :func:`refuse`)."""
    try:
        check_output_dir(path, overwrite, inputs)
    except OutputExistsError as err:
        return refuse(err)
    remove_stale(path)
    return None


# ---------------------------------------------------------------------------------------
# Staging
# ---------------------------------------------------------------------------------------

def _parts(final: str):
    final = os.path.abspath(final)
    return os.path.dirname(final), os.path.basename(final)


def _temp_pattern(final: str, kind: str):
    return re.compile(r"^\." + re.escape(_parts(final)[1]) + r"\." + kind + r"-(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def temporaries(final: str) -> List[str]:
    """The temporary siblings of ``final`` (``.NAME.tmp-PID-*`` / ``.NAME.old-PID-*``)."""
    parent, _ = _parts(final)
    if not os.path.isdir(parent):
        return []
    tmp, old = _temp_pattern(final, "tmp"), _temp_pattern(final, "old")
    return sorted(os.path.join(parent, n) for n in os.listdir(parent) if tmp.match(n) or old.match(n))


def remove_stale(final: str) -> List[str]:
    """Delete the temporary siblings of ``final`` left by runs whose process is gone (a
    ``.old`` copy only when ``final`` itself exists again); return what was deleted."""
    removed = []
    tmp, old = _temp_pattern(final, "tmp"), _temp_pattern(final, "old")
    for path in temporaries(final):
        name = os.path.basename(path)
        match = tmp.match(name) or old.match(name)
        if _alive(int(match.group(1))):
            continue
        if old.match(name) and not os.path.lexists(final):
            continue  # the previous output, moved aside by a run killed mid-swap: keep it
        _remove(path)
        removed.append(path)
    return removed


class StagedDir:
    """``with StagedDir(final, overwrite) as stage:`` write into ``stage.path`` (a new
    temporary sibling of ``final``); on success it replaces ``final`` (an empty
    ``final`` is replaced in any case, a non-empty one only with ``overwrite``); on an
    exception it is deleted and ``final`` stays as it was."""

    def __init__(self, final: str, overwrite: bool = False):
        self.final = os.path.abspath(final)
        self.overwrite = overwrite
        self.path = None

    def __enter__(self) -> "StagedDir":
        parent, name = _parts(self.final)
        os.makedirs(parent, exist_ok=True)
        self.path = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-{os.getpid()}-")
        os.chmod(self.path, 0o777 & ~umask())  # not mkdtemp's 0700
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.discard()
            return False
        try:
            self.commit()
        except BaseException:
            self.discard()
            raise
        return False

    def discard(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def commit(self) -> None:
        """Rename the staged directory to ``final`` (moving an old ``final`` aside first
        and deleting it afterwards)."""
        final, aside = self.final, None
        if os.path.lexists(final):
            if os.path.isdir(final) and not os.path.islink(final) and not os.listdir(final):
                os.rmdir(final)
            elif self.overwrite:
                parent, name = _parts(final)
                aside = tempfile.mkdtemp(dir=parent, prefix=f".{name}.old-{os.getpid()}-")
                os.rmdir(aside)
                os.rename(final, aside)
            else:
                raise OutputExistsError(f"output directory {final} appeared while this "
                                        f"command ran; pass {OVERWRITE_FLAG} to replace it")
        os.rename(self.path, final)
        self.path = None
        if aside is not None:
            _remove(aside)
