"""The package's import structure, read statically (no module is imported).

Every ``sut_fairseq/**/*.py`` is parsed with ``ast``; each ``import`` / ``from ... import``
statement that names a module of the package, absolutely (``sut_fairseq.x``) or relatively
(``from ..x import y``), is an edge from the importing module to the imported one. Imports
inside functions (the lazy imports of the command-line tools) count like top-level ones:
they run as soon as the function is called, so they join the same cycles; failure messages
mark them ``(in a function)``. Imports built at run time (``importlib.import_module`` in
``tasks/__init__.py``, ``python -m`` command lines) are not seen.

Packages and their ``__init__.py``:

* a package is one node, its ``__init__.py`` (``sut_fairseq`` = ``sut_fairseq/__init__.py``);
* ``from PKG import name`` is an edge to the submodule ``PKG.name`` when there is one,
  otherwise to ``PKG`` itself (its ``__init__``); ``import a.b.c`` is an edge to ``a.b.c``;
* the parent packages Python initialises before a submodule (``sut_fairseq`` and
  ``sut_fairseq.models`` before ``sut_fairseq.models.sut_transformer``) are not edges:
  they are always started first, so with them every ``__init__`` that imports its own
  submodules would be a cycle, and it is not one;
* an *explicit* import of a package is an edge to its ``__init__``: a submodule that
  runs ``import sut_fairseq`` (to have the plugin registered) while
  ``sut_fairseq/__init__.py`` imports it, directly or not, closes a cycle and is reported
  (it would see the half-initialised package).

Checked: (a) there is no import cycle among the package's modules; (b) the model core
(``models``, ``modules``, ``ops``, ``kernels``, ``criterions``, ``tasks``) imports nothing,
directly or through other modules, from the analysis tools, the recipes, the demo or the
self-test. The checker itself is tested on a small generated package with a cycle.
"""
import ast
import os
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PACKAGE = "sut_fairseq"

CORE = ("models", "modules", "ops", "kernels", "criterions", "tasks")
NOT_FOR_THE_CORE = ("analysis", "recipes", "demo", "selftest")


class Edge(NamedTuple):
    source: str  # importing module
    target: str  # imported module
    path: str  # file of the import, relative to the package's parent directory
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{self.path}:{self.line}" + (" (in a function)" if self.in_function else "")


def package_modules(parent_dir: str, package: str) -> Dict[str, str]:
    """Module name -> file (relative to ``parent_dir``) of every ``.py`` of ``package``."""
    modules = {}
    for directory, subdirs, files in os.walk(os.path.join(parent_dir, package)):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(directory, name), parent_dir)
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = rel
    return modules


def _imports(tree: ast.AST) -> Iterator[Tuple[ast.stmt, bool]]:
    """Every import statement of a module, and whether it sits inside a function."""
    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            yield from visit(child, in_function or isinstance(child, (ast.FunctionDef,
                                                                       ast.AsyncFunctionDef,
                                                                       ast.Lambda)))
    yield from visit(tree, False)


def _deepest_module(name: str, modules: Dict[str, str]) -> Optional[str]:
    """``name`` or its longest prefix that is a module of the package."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def import_graph(parent_dir: str, package: str) -> Tuple[Dict[str, str], List[Edge]]:
    """The package's modules and the import edges between them (see the module docstring)."""
    modules = package_modules(parent_dir, package)
    edges = []
    for module, rel in modules.items():
        with open(os.path.join(parent_dir, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        is_package = os.path.basename(rel) == "__init__.py"
        own_package = module if is_package else module.rpartition(".")[0]
        for node, in_function in _imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_deepest_module(alias.name, modules) for alias in node.names]
            else:
                if node.level:
                    base = own_package.split(".")
                    if node.level - 1 >= len(base):
                        raise AssertionError(f"{rel}:{node.lineno}: relative import beyond {package}")
                    base = base[:len(base) - (node.level - 1)]
                    if node.module:
                        base += node.module.split(".")
                    source = ".".join(base)
                else:
                    source = node.module or ""
                if source != package and not source.startswith(package + "."):
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in modules else _deepest_module(source, modules))
            for target in targets:
                if target is not None:
                    edges.append(Edge(module, target, rel, node.lineno, in_function))
    return modules, edges


def strongly_connected(nodes: Sequence[str], edges: Sequence[Edge]) -> List[List[str]]:
    """Tarjan's strongly connected components with more than one module, or one module
    importing itself: exactly the import cycles."""
    succ: Dict[str, List[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.source].append(e.target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components = []

    def visit(v):  # recursion depth <= number of modules (a few dozen)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in succ[v]:
                components.append(sorted(component))

    for n in sorted(nodes):
        if n not in index:
            visit(n)
    return components


def _path(start: str, goal: str, edges: Sequence[Edge], allowed: Optional[Set[str]] = None
          ) -> Optional[List[Edge]]:
    """Shortest chain of import edges from ``start`` to ``goal`` (breadth first)."""
    previous: Dict[str, Optional[Edge]] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for e in edges:
                if e.source != node or (allowed is not None and e.target not in allowed):
                    continue
                if e.target == goal:
                    chain = [e]
                    while previous[chain[0].source] is not None:
                        chain.insert(0, previous[chain[0].source])
                    return chain
                if e.target not in previous:
                    previous[e.target] = e
                    following.append(e.target)
        frontier = following
    return None


def describe_cycles(modules: Dict[str, str], edges: Sequence[Edge]) -> List[str]:
    """One message per cycle: its modules and one closed chain of imports through them."""
    messages = []
    for component in strongly_connected(list(modules), edges):
        chain = _path(component[0], component[0], edges, set(component))
        steps = "\n".join(f"    {e.source} -> {e.target}   {e.where()}" for e in chain)
        messages.append(f"import cycle among {', '.join(component)}:\n{steps}")
    return messages


def _under(module: str, prefixes: Sequence[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_violations(modules: Dict[str, str], edges: Sequence[Edge], package: str = PACKAGE
                     ) -> List[str]:
    """Core modules that reach an analysis / recipe / demo / self-test module."""
    core = [f"{package}.{c}" for c in CORE]
    forbidden = [f"{package}.{f}" for f in NOT_FOR_THE_CORE]
    messages = []
    for module in sorted(m for m in modules if _under(m, core)):
        for target in sorted(m for m in modules if _under(m, forbidden)):
            chain = _path(module, target, edges)
            if chain:
                steps = "\n".join(f"    {e.source} -> {e.target}   {e.where()}" for e in chain)
                messages.append(f"core module {module} imports {target}:\n{steps}")
    return messages


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT, PACKAGE)


def test_the_graph_sees_the_package(graph):
    """Not vacuous: the walker finds the modules and resolves relative, absolute, parent
    package and in-function imports."""
    modules, edges = graph
    found = {(e.source, e.target) for e in edges}
    assert {"sut_fairseq", "sut_fairseq.models", "sut_fairseq.models.sut_transformer",
            "sut_fairseq.analysis.macs", "sut_fairseq.eval.generate_output"} <= set(modules)
    assert ("sut_fairseq", "sut_fairseq.models") in found  # from . import ..., models
    assert ("sut_fairseq.models", "sut_fairseq.models.sut_transformer") in found
    assert ("sut_fairseq.models.sut_transformer", "sut_fairseq.models.architectures") in found
    assert ("sut_fairseq.models.sut_transformer", "sut_fairseq.modules.accounting") in found
    assert ("sut_fairseq.criterions.sut_label_smoothed_cross_entropy",
            "sut_fairseq.criterions.losses") in found
    # in a function, two levels up, and the explicit import of the top-level package
    assert ("sut_fairseq.analysis.macs", "sut_fairseq.models.standalone") in found
    assert any(e.source == "sut_fairseq.analysis.sweep" and e.target == "sut_fairseq"
               and e.in_function for e in edges)


def test_no_import_cycle(graph):
    modules, edges = graph
    cycles = describe_cycles(modules, edges)
    assert not cycles, "\n".join(cycles)


def test_the_core_imports_no_tool(graph):
    modules, edges = graph
    violations = layer_violations(modules, edges)
    assert not violations, "\n".join(violations)


def _write(root, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_cycles_and_layer_breaks(tmp_path):
    """On a generated package: an ``__init__`` importing its submodules is no cycle; a
    submodule importing the top-level package that imports it is one, and so are two
    modules importing each other (one of them in a function); a core module reaching
    ``analysis`` through another module is reported."""
    _write(tmp_path, {
        "pkg/__init__.py": "from . import models, tools\n",
        "pkg/models/__init__.py": "from . import model, presets\n",
        "pkg/models/model.py": "from ..modules import block\n",
        "pkg/models/presets.py": "X = 1\n",
        "pkg/modules/__init__.py": "",
        "pkg/modules/block.py": "import os\nfrom pkg.models.presets import X\n",
        "pkg/tools.py": "",
        "pkg/analysis/__init__.py": "",
        "pkg/analysis/report.py": "from ..models import model\n",
    })
    modules, edges = import_graph(str(tmp_path), "pkg")
    assert describe_cycles(modules, edges) == []
    assert layer_violations(modules, edges, "pkg") == []

    _write(tmp_path, {"pkg/models/presets.py": "import pkg\nX = 1\n"})
    modules, edges = import_graph(str(tmp_path), "pkg")
    (message,) = describe_cycles(modules, edges)
    assert message.startswith("import cycle among pkg, pkg.models, pkg.models.model, "
                              "pkg.models.presets, pkg.modules.block:")
    assert message.endswith("    pkg -> pkg.models   pkg/__init__.py:1\n"
                            "    pkg.models -> pkg.models.presets   pkg/models/__init__.py:1\n"
                            "    pkg.models.presets -> pkg   pkg/models/presets.py:1")

    _write(tmp_path, {
        "pkg/models/presets.py": "X = 1\ndef f():\n    from .model import Y\n",
        "pkg/models/model.py": "from .presets import X\nY = 2\n",
        "pkg/modules/block.py": "from ..tools import Z\n",
        "pkg/tools.py": "from pkg.analysis import report\n",
    })
    modules, edges = import_graph(str(tmp_path), "pkg")
    cycles = describe_cycles(modules, edges)
    assert any(m.startswith("import cycle among pkg.models.model, pkg.models.presets:")
               and "(in a function)" in m for m in cycles), cycles
    violations = layer_violations(modules, edges, "pkg")
    assert any(v.startswith("core module pkg.modules.block imports pkg.analysis.report:")
               for v in violations), violations
