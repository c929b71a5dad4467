"""Checks on the repository itself (no model code): the documentation it points to exists.

* No tracked file refers to the internal design document the project was first written
  from; users do not have it. Everything it said that matters is in ``docs/`` (the model:
  ``docs/model.md``; the data protocols: the task documents).
* Every ``docs/<file>.md#<anchor>`` reference in the code, the tests, the README and the docs
  names an existing file and an existing heading of it (GitHub's anchors), and every
  markdown link inside ``docs/`` to a heading (``[text](FILE.md#anchor)``, ``(#anchor)``)
  resolves too.
* The front doors -- ``README.md``, the documentation index ``docs/README.md`` and the
  results page ``docs/results/README.md`` -- exist, and every relative link and image in
  them names an existing file (and heading, when it has an anchor).
* No cell of a README table is longer than ``MAX_README_CELL`` characters (the README
  shows one line per task; the figures and caveats live in the result files).
"""
import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Set

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

#: The name of the external design document, as a whole, case-sensitive word.
EXTERNAL_DOCUMENT = re.compile(r"\bSPEC\b")

#: Where ``docs/<file>.md#<anchor>`` references are looked for (relative to the root).
REFERENCE_SOURCES = ("sut_fairseq", "scripts", "tests", "README.md", "docs", "configs", "data-prep",
                     "benchmarks")
TEXT_SUFFIXES = (".py", ".md", ".json", ".sh", ".txt", ".cfg", ".ini", ".toml", ".yaml", ".yml")

DOC_REFERENCE = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md)#([\w-]+)")
MARKDOWN_LINK = re.compile(r"\]\(([^()\s:]*?)#([\w-]+)\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def tracked_files() -> List[str]:
    """Paths (relative to the root) of the files git tracks; skips the test without git
    or outside a checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not available")
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"{ROOT} is not a git checkout")
    if os.path.realpath(top) != os.path.realpath(ROOT):
        pytest.skip(f"{ROOT} is not the top of a git checkout")
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def read_text(path: str) -> Optional[str]:
    """The file's text, or None for a binary (NUL bytes) or missing file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", "replace")


def test_no_reference_to_the_external_spec():
    hits = []
    for rel in tracked_files():
        text = read_text(os.path.join(ROOT, rel))
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if EXTERNAL_DOCUMENT.search(line):
                hits.append(f"{rel}:{number}: {line.strip()[:120]}")
    assert not hits, ("these lines refer to the external design document, which users do "
                      "not have; point to docs/ instead:\n" + "\n".join(hits))


# ------------------------------------------------------------------- docs anchors

def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation (anything but letters,
    digits, '_', '-' and spaces) removed, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors_of(markdown: str) -> Set[str]:
    """The anchors of a markdown file's ATX headings outside fenced code blocks;
    repeated headings get GitHub's ``-1``, ``-2`` suffixes."""
    anchors: Set[str] = set()
    seen: Dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match is None:
            continue
        anchor = github_anchor(match.group(2))
        if anchor in seen:
            seen[anchor] += 1
            anchors.add(f"{anchor}-{seen[anchor]}")
        else:
            seen[anchor] = 0
            anchors.add(anchor)
    return anchors


def reference_sources() -> List[str]:
    """Text files under ``REFERENCE_SOURCES`` (absolute paths)."""
    found = []
    for name in REFERENCE_SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isfile(path):
            found.append(path)
            continue
        for directory, subdirs, files in os.walk(path):
            subdirs[:] = [d for d in subdirs if d != "__pycache__" and not d.startswith(".")]
            found.extend(os.path.join(directory, f) for f in sorted(files)
                         if f.endswith(TEXT_SUFFIXES))
    return found


def test_github_anchor():
    assert github_anchor("Halting") == "halting"
    assert github_anchor("Mixture of feed-forward experts") == "mixture-of-feed-forward-experts"
    assert github_anchor("Target preprocessing (CFQ, §4.2)") == "target-preprocessing-cfq-42"
    assert github_anchor("`--task translation_exact_match`") == "--task-translation_exact_match"
    assert anchors_of("# A\n```\n# not a heading\n```\n## A\n## B c\n") == {"a", "a-1", "b-c"}


def test_docs_anchor_references_resolve():
    cache: Dict[str, Optional[Set[str]]] = {}

    def anchors(path: str) -> Optional[Set[str]]:
        if path not in cache:
            text = read_text(path) if os.path.isfile(path) else None
            cache[path] = None if text is None else anchors_of(text)
        return cache[path]

    problems, checked = [], 0
    for source in reference_sources():
        text = read_text(source)
        if text is None:
            continue
        rel_source = os.path.relpath(source, ROOT)
        for number, line in enumerate(text.splitlines(), 1):
            targets = [(os.path.join(ROOT, doc), doc, anchor)
                       for doc, anchor in DOC_REFERENCE.findall(line)]
            if source.endswith(".md") and rel_source.startswith("docs" + os.sep):
                for link, anchor in MARKDOWN_LINK.findall(line):
                    target = os.path.normpath(os.path.join(os.path.dirname(source), link)) if link else source
                    targets.append((target, link or rel_source, anchor))
            for target, shown, anchor in targets:
                checked += 1
                found = anchors(target)
                if found is None:
                    problems.append(f"{rel_source}:{number}: {shown} does not exist")
                elif anchor not in found:
                    problems.append(f"{rel_source}:{number}: {shown} has no heading #{anchor}")
    assert checked > 0, "no docs/<file>.md#<anchor> reference found: the pattern is broken"
    assert not problems, "broken documentation references:\n" + "\n".join(problems)


# ------------------------------------------------------------------- front doors

#: The pages a newcomer lands on; every link in them must resolve.
FRONT_DOORS = ("README.md", os.path.join("docs", "README.md"), os.path.join("docs", "results", "README.md"))
#: ``[text](target)`` and ``![alt](target)``; the target has no spaces or parentheses.
ANY_LINK = re.compile(r"\]\(([^()\s]+)\)")
MAX_README_CELL = 300


def outside_fences(markdown: str) -> List[str]:
    """The lines of a markdown file outside fenced code blocks."""
    lines, in_fence = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            lines.append(line)
    return lines


def test_front_door_links_resolve():
    problems, checked = [], 0
    for rel in FRONT_DOORS:
        path = os.path.join(ROOT, rel)
        assert os.path.isfile(path), f"{rel} is missing"
        for line in outside_fences(read_text(path)):
            for target in ANY_LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                checked += 1
                link, _, anchor = target.partition("#")
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), link)) if link else path
                if not os.path.exists(resolved):
                    problems.append(f"{rel}: ({target}): {link} does not exist")
                elif anchor and resolved.endswith(".md") and anchor not in anchors_of(read_text(resolved)):
                    problems.append(f"{rel}: ({target}): no heading #{anchor}")
    assert checked > 20, f"only {checked} links found in the front doors: the pattern is broken"
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_table_cells_are_short():
    long_cells = []
    for number, line in enumerate(read_text(os.path.join(ROOT, "README.md")).splitlines(), 1):
        if line.startswith("|"):
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
                if len(cell.strip()) > MAX_README_CELL:
                    long_cells.append(f"README.md:{number}: {len(cell.strip())} characters: {cell.strip()[:80]}...")
    assert not long_cells, (f"README table cells longer than {MAX_README_CELL} characters (move the detail "
                            "to the task's result file):\n" + "\n".join(long_cells))
