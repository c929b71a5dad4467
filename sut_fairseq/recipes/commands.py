"""Command lines of a recipe: fairseq option lists, the console scripts, printing and
running commands (every command is printed, ``+ command [> log]``, before it runs)."""
import os
import shlex
import shutil
import subprocess
import sys
from collections import OrderedDict
from typing import List, Optional, Sequence

from ..user_dir import user_dir  # noqa: F401  (--user-dir of a recipe's commands)


class RecipeError(Exception):
    """A recipe cannot go on (a missing file, an unknown model, a failed command); the
    scripts print it as ``error: ...`` and exit non-zero."""


# --------------------------------------------------------------------------- options

def parse_flags(flags: Sequence[str]) -> "OrderedDict[str, List[str]]":
    """``["--a", "1", "--b", "--c", "x", "y"]`` -> {"--a": ["1"], "--b": [], "--c": ["x", "y"]}.
    A value is any token not starting with ``--`` (so ``-1`` and ``(0.9, 0.98)`` are values)."""
    parsed: "OrderedDict[str, List[str]]" = OrderedDict()
    current = None
    for token in flags:
        token = str(token)
        if token.startswith("--"):
            current = token.split("=", 1)[0]
            parsed[current] = [token.split("=", 1)[1]] if "=" in token else []
        elif current is None:
            raise RecipeError(f"value {token!r} before any --option in {list(flags)}")
        else:
            parsed[current].append(token)
    return parsed


def merge_flags(*groups: Sequence[str]) -> List[str]:
    """Concatenate option lists; an option given again replaces its earlier value in
    place, so a printed command holds each option once."""
    merged: "OrderedDict[str, List[str]]" = OrderedDict()
    for group in groups:
        for option, values in parse_flags(group).items():
            merged[option] = values
    out: List[str] = []
    for option, values in merged.items():
        out.append(option)
        out.extend(values)
    return out


def flag_values(command: Sequence[str], option: str) -> Optional[List[str]]:
    """The values following the last ``option`` in a command line (None when absent)."""
    command = [str(c) for c in command]
    if option not in command:
        return None
    i = len(command) - 1 - command[::-1].index(option)
    values = []
    for token in command[i + 1:]:
        if token.startswith("--"):
            break
        values.append(token)
    return values


def flag_value(command: Sequence[str], option: str) -> Optional[str]:
    """The single value of the last ``option`` ("" for a switch, None when absent)."""
    values = flag_values(command, option)
    return None if values is None else (values[0] if values else "")


# --------------------------------------------------------------------------- tools

def tool(name: str, required: bool = True, explicit: Optional[str] = None) -> str:
    """``explicit`` (a path the user gave), else the console script next to this
    interpreter (the venv's), else the one on PATH; with ``required=False`` the bare name
    when missing (for ``--dry-run``)."""
    if explicit:
        return explicit
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found:
        return found
    if required:
        raise RecipeError(f"{name} not found next to {sys.executable} or on PATH "
                          "(install fairseq-fixed: make install)")
    return name


# --------------------------------------------------------------------------- running

def format_command(command: Sequence[str], log: Optional[str] = None) -> str:
    text = " ".join(shlex.quote(str(c)) for c in command)
    return text + (f" > {shlex.quote(log)} 2>&1" if log else "")


def show(command: Sequence[str], log: Optional[str] = None) -> None:
    """Print ``+ command`` (and its ``> log``)."""
    print("+ " + format_command(command, log), flush=True)


def run(command: Sequence[str], log: Optional[str] = None, dry_run: bool = False,
        append: bool = False) -> None:
    """Print the command, then run it (unless ``dry_run``), with stdout and stderr into
    ``log`` when given (appended to with ``append``: a resumed training). A failure raises
    :class:`RecipeError` after printing the log's tail."""
    show(command, log)
    if dry_run:
        return
    command = [str(c) for c in command]
    if log is None:
        returncode = subprocess.run(command).returncode
    else:
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        with open(log, "a" if append else "w") as handle:
            returncode = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        if log is not None:
            with open(log, errors="replace") as handle:
                sys.stdout.write(handle.read()[-3000:])
        where = f"; log: {log}" if log else ""
        # a Python script is named by its file, a console script by itself
        name = command[0]
        if name == sys.executable and len(command) > 1:
            name = command[2] if command[1] == "-m" and len(command) > 2 else command[1]
        raise RecipeError(f"{os.path.basename(name)} failed (exit {returncode}){where}")
