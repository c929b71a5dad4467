"""Mutation testing of the model core with mutmut (``make mutation``; docs/testing.md).

    python scripts/mutation.py [--only GLOB ...] [--workdir runs/mutation]
                               [--max-children N] [--changed-since REV] [--list] [--report]

Every target module (``TARGETS``: ``sut_fairseq/modules``, ``sut_fairseq/ops``,
``sut_fairseq/criterions`` and the data generators' samplers) is mutated on its own, in a
work directory of its own (``WORKDIR/<module path, / as .>``: a copy of the package, the
tests and what they read), and each mutant is tried against that module's own test files
only (mutmut then runs, per mutant, the tests among them that execute the mutated
function). A module missing from ``TARGETS`` is tried against the test files that name
it, with a warning.

A change, not the whole module: ``--changed-since REV`` tries only the mutants of the
functions and methods whose code differs from REV's (their syntax trees compared with the
docstrings left out; a module new since REV whole), and the score counts only them. The
other functions' mutants are those the run at REV judged (mutmut mutates code inside
functions only, so a function whose code is unchanged has the same mutants).

Resumable: mutmut keeps every mutant's result in the work directory; running again tests
only the mutants without a result (or whose function changed since). When the module's
test files changed since its last run (a new or sharper test), mutmut's map of which
tests run which function is collected again and the surviving mutants are tried again.
``--report`` tests nothing and prints the table of what is there (mutants an interrupted
run has not tried yet are counted apart, outside the score).

The score counts a mutant as killed when a test failed (or timed out) on it; timed-out
mutants are tried once more at the end of every module's run (a loaded machine times
tests out), so a timeout counted as killed happened twice. Mutants
listed as equivalent in docs/testing.md (a backquoted mutant name in a row of its
"Equivalent mutants" table) that survived leave N; every other survivor is printed, and so
is every listed mutant a test kills (it counts as killed; its row's reason is wrong). The
run ends with::

    mutation score: K killed of N (P%)

Exit status: 0 when the score was computed for every selected module (whatever it is),
1 when mutmut failed on a module.
"""
import argparse
import ast
import filecmp
import fnmatch
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "testing.md")
# what the tests read besides the package and themselves
SYNCED = ("sut_fairseq", "tests", "data-prep", "benchmarks", "scripts", "configs", "pytest.ini",
          "setup.py")
ALSO_COPY = ("pytest.ini", "data-prep", "benchmarks", "scripts", "configs", "setup.py")
TARGET_DIRS = ("sut_fairseq/modules", "sut_fairseq/ops", "sut_fairseq/criterions")

# module -> its own test files, by file name (the core's modules and the data generators' samplers)
TARGETS: Dict[str, Tuple[str, ...]] = {
    "sut_fairseq/modules/accounting.py": ("test_step_accounting.py", "test_halting_rules.py", "test_chunked.py"),
    "sut_fairseq/modules/chunk_cache.py": ("test_chunk_cache.py", "test_chunked.py"),
    "sut_fairseq/modules/chunked_recurrence.py": ("test_chunk_layout.py", "test_chunked_halting_result.py",
                                                  "test_chunked_recurrence.py", "test_chunked.py"),
    "sut_fairseq/modules/decoder_cache.py": ("test_decoder_cache.py", "test_incremental.py", "test_encoder_reorder.py"),
    "sut_fairseq/modules/dropout.py": ("test_dropout.py",),
    "sut_fairseq/modules/exits.py": ("test_exit_contract.py", "test_exits.py"),
    "sut_fairseq/modules/expert_linear.py": ("test_expert_layers.py",),
    "sut_fairseq/modules/flex_attention.py": ("test_flex_attention.py",),
    "sut_fairseq/modules/halting.py": ("test_halting_per_position.py", "test_halting_rules.py"),
    "sut_fairseq/modules/hyper_block.py": ("test_hyper_block.py", "test_hyper_ut.py"),
    "sut_fairseq/modules/hyper_module.py": ("test_hyper_module.py", "test_hyper_ut.py"),
    "sut_fairseq/modules/memory.py": ("test_memory.py", "test_chunked.py"),
    "sut_fairseq/modules/moe_ffd.py": ("test_expert_layers.py", "test_checkpoint_golden.py"),
    # incremental decoding (one query row, beams grouped over shared keys), FlexAttention,
    # an old checkpoint's parameter names
    "sut_fairseq/modules/momha.py": ("test_expert_layers.py", "test_decoder_cache.py", "test_incremental.py",
                                     "test_flex_attention.py", "test_checkpoint_golden.py",
                                     "test_decoding_golden.py"),
    "sut_fairseq/modules/recurrence.py": ("test_recurrence_step.py", "test_halting_per_position.py",
                                          "test_incremental.py", "test_step_embedding.py", "test_hyper_ut.py",
                                          "test_halting_kv.py", "test_tlb_unshared.py", "test_recurrent_side.py",
                                          "test_lean_step.py", "test_compiled_step.py",
                                          "test_decoding_golden.py"),  # the compacted decoder step
    "sut_fairseq/modules/relative_position.py": ("test_relative_position.py", "test_expert_layers.py",
                                                "test_flex_attention.py", "test_incremental.py"),
    "sut_fairseq/modules/router.py": ("test_router.py", "test_expert_layers.py", "test_router_losses.py",
                                      "test_lean_ops.py", "test_route_op.py"),
    "sut_fairseq/modules/step_embedding.py": ("test_step_embedding_values.py", "test_step_embedding.py",
                                              "test_recurrence_step.py"),
    "sut_fairseq/modules/sut_block.py": ("test_sut_block.py", "test_incremental.py", "test_expert_layers.py",
                                        "test_options_off.py"),
    # the Triton branches by stand-ins of the kernels (the interpreted kernels' tests run in a
    # child pytest that imports the installed package, not the mutants, so they kill none)
    "sut_fairseq/ops/label_smoothed_ce.py": ("test_label_smoothed_ce.py",),
    "sut_fairseq/ops/route_op.py": ("test_route_op.py",),
    "sut_fairseq/ops/short_softmax.py": ("test_short_softmax.py",),
    "sut_fairseq/ops/routed_linear.py": ("test_routed_linear_api.py", "test_custom_ops.py", "test_expert_layers.py",
                                        "test_compiled_step.py"),
    "sut_fairseq/ops/routing.py": ("test_routing_layout.py", "test_expert_layers.py"),
    "sut_fairseq/ops/reference_linear.py": ("test_custom_ops.py", "test_routed_linear_api.py", "test_expert_layers.py",
                                           "test_kernels_interpret.py"),
    "sut_fairseq/ops/masked_linear_op.py": ("test_custom_ops.py", "test_lean_ops.py", "test_compiled_step.py"),
    "sut_fairseq/criterions/auxiliary.py": ("test_classifier.py", "test_router_losses.py",
                                            "test_criterion_metrics.py"),
    "sut_fairseq/criterions/losses.py": ("test_router_losses.py",),
    "sut_fairseq/criterions/sut_classification.py": ("test_classifier.py",),
    "sut_fairseq/criterions/sut_label_smoothed_cross_entropy.py": (
        "test_criterion_metrics.py", "test_router_losses.py", "test_label_smoothed_ce.py", "test_exits.py", "test_offramps_freeze.py"),
    "sut_fairseq/data/cpvr.py": ("test_cpvr_data.py",),
    "sut_fairseq/data/flipflop.py": ("test_flipflop_data.py",),
    "sut_fairseq/data/listops.py": ("test_listops_data.py",),
    "sut_fairseq/data/logic_inference.py": ("test_logic_data.py",),
    "sut_fairseq/models/config.py": ("test_sut_config.py", "test_config_errors.py", "test_hydra_train.py",
                                     "test_checkpoint_golden.py"),
    "sut_fairseq/models/recurrent_side.py": ("test_recurrent_side.py", "test_checkpoint_golden.py", "test_options_off.py",
                                             "test_chunk_positions.py",
                                             "test_incremental.py",
                                             "test_recurrence_step.py", "test_halting_kv.py", "test_halting_rules.py",
                                             "test_halting_per_position.py", "test_exits.py", "test_chunked.py",
                                             "test_tlb_unshared.py", "test_step_embedding.py", "test_hyper_ut.py",
                                             "test_compiled_step.py"),
    "sut_fairseq/models/validation.py": ("test_config_errors.py", "test_exits.py", "test_chunked.py",
                                         "test_hyper_ut.py"),
    "sut_fairseq/models/sut_classifier.py": ("test_classifier.py",),
    "sut_fairseq/models/transformer_classifier.py": ("test_classifier.py",),
    "sut_fairseq/models/sut_transformer.py": ("test_incremental.py", "test_recurrence_step.py",
                                              "test_halting_kv.py", "test_chunked.py", "test_hyper_ut.py",
                                              "test_options_off.py", "test_exits.py", "test_chunk_positions.py",
                                              "test_chunk_cache.py", "test_step_accounting.py",
                                              "test_step_embedding.py", "test_decoding_golden.py",
                                              "test_encoder_reorder.py",
                                              "test_checkpoint_golden.py", "test_halting_rules.py", "test_sut_model.py"),
    # last: its tests compile (tens of seconds per mutant)
    "sut_fairseq/compiler.py": ("test_compiled_step.py",),
}
# test files never used for a module found by name: training runs, GPU, whole recipes
HEAVY = re.compile(r"test_(end_to_end|distributed|gpu\w*|\w+_recipe|benchmarks_smoke|exit_sweep|"
                   r"exact_resume|cfq_pipeline|package_layers|repository|readme\w*|kernels_\w+)\.py$")
DETECTED = ("killed", "timeout", "segfault")
PENDING = "not checked"   # mutmut's status of a mutant not tried yet (an interrupted run)
SEP = "\u01c1"   # mutmut's separator of class and method in a mutant's name


def test_files() -> Dict[str, str]:
    """``{file name: path under tests/}`` of every test file (tests/ is split by concept)."""
    tests_dir = os.path.join(REPO, "tests")
    return {os.path.basename(p): os.path.relpath(p, tests_dir)
            for p in sorted(glob.glob(os.path.join(tests_dir, "**", "test_*.py"), recursive=True))}


def discover() -> Dict[str, Tuple[str, ...]]:
    """TARGETS plus every module of TARGET_DIRS missing from it (tests: the test files
    that name the module, heavy ones excluded), each test file as its path under tests/;
    the modules that no longer exist dropped."""
    files = test_files()
    targets = {m: tuple(files[t] for t in tests) for m, tests in TARGETS.items()
               if os.path.exists(os.path.join(REPO, m))}
    for directory in TARGET_DIRS:
        for name in sorted(os.listdir(os.path.join(REPO, directory))):
            module = f"{directory}/{name}"
            if not name.endswith(".py") or name == "__init__.py" or module in targets:
                continue
            stem = name[:-3]
            found = tuple(sorted(
                rel for f, rel in files.items() if not HEAVY.search(f) and re.search(
                    rf"\b{stem}\b", open(os.path.join(REPO, "tests", rel), encoding="utf-8").read())))
            print(f"warning: {module} is not in scripts/mutation.py TARGETS; its tests by name: "
                  f"{', '.join(found) or 'none'}", file=sys.stderr)
            if found:
                targets[module] = found
    return targets


def sync(src: str, dst: str) -> None:
    """Copy ``src`` (file or tree) to ``dst``, rewriting only files whose content changed
    (mutmut's results stay valid for unchanged sources) and removing files gone from src."""
    if os.path.isfile(src):
        if not (os.path.exists(dst) and filecmp.cmp(src, dst, shallow=False)):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst)
        return
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", ".pytest_cache", ".hypothesis")]
        rel = os.path.relpath(root, src)
        for f in files:
            if not f.endswith((".pyc", ".pyo")):
                sync(os.path.join(root, f), os.path.join(dst, rel, f))
    for root, dirs, files in os.walk(dst, topdown=False):
        rel = os.path.relpath(root, dst)
        for f in files:
            if not os.path.exists(os.path.join(src, rel, f)) and not f.endswith(".pyc"):
                os.remove(os.path.join(root, f))


def write_config(workdir: str, module: str, tests: Tuple[str, ...]) -> None:
    """mutmut's configuration (setup.cfg) of one module's work directory."""
    lines = ["[mutmut]", "source_paths = sut_fairseq", f"only_mutate = {module}",
             "also_copy ="] + [f"    {p}" for p in ALSO_COPY] + [
             "pytest_add_cli_args_test_selection ="] + [f"    tests/{t}" for t in tests] + [
             "pytest_add_cli_args =", "    -p", "    no:cacheprovider", "    -p", "    no:xdist",
             # torch is not fork-safe once a test ran: fork the mutants from a clean server
             "process_isolation = forkserver", "use_git_change_detection = false", ""]
    text = "\n".join(lines)
    path = os.path.join(workdir, "setup.cfg")
    if not (os.path.exists(path) and open(path).read() == text):
        with open(path, "w") as f:
            f.write(text)


def tests_fingerprint(workdir: str, tests: Tuple[str, ...]) -> str:
    """sha256 of the module's test files and the helpers they share (conftest.py and the
    other non-test modules of tests/), as copied into the work directory."""
    tests_dir = os.path.join(workdir, "tests")
    helpers = sorted(f for f in os.listdir(tests_dir) if f.endswith(".py") and not f.startswith("test_"))
    digest = hashlib.sha256()
    for name in helpers + list(tests):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(tests_dir, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _code_of_functions(source: str) -> Dict[str, str]:
    """{"f" or "Class.f": the function's syntax tree without docstrings, as text} of a
    module's top-level functions and its classes' methods."""
    def without_docstrings(node):
        for inner in ast.walk(node):
            body = getattr(inner, "body", None)
            if (isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                inner.body = body[1:] or [ast.Pass()]
        return ast.dump(node)

    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = without_docstrings(node)
        elif isinstance(node, ast.ClassDef):
            for inner in node.body:
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{inner.name}"] = without_docstrings(inner)
    return found


def changed_since(module: str, rev: str) -> Optional[List[str]]:
    """mutmut's mutant-name globs for the functions of ``module`` (a path under the
    repository) whose code differs from revision ``rev``'s, docstrings aside; None when the
    module did not exist at ``rev`` (every mutant). mutmut names the mutants of function f
    ``<module>.x_f__mutmut_N`` and those of method C.f ``<module>.xǁCǁf__mutmut_N``."""
    old = subprocess.run(["git", "show", f"{rev}:{module}"], cwd=REPO, capture_output=True, text=True)
    if old.returncode != 0:
        if subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=REPO,
                          capture_output=True).returncode != 0:
            raise SystemExit(f"--changed-since: {rev!r} is not a revision of this repository")
        return None
    before = _code_of_functions(old.stdout)
    with open(os.path.join(REPO, module), encoding="utf-8") as f:
        now = _code_of_functions(f.read())
    dotted = module[:-3].replace("/", ".")
    return [f"{dotted}.x_{name}__mutmut_*" if "." not in name
            else f"{dotted}.x{SEP}{name.replace('.', SEP)}__mutmut_*"
            for name, code in now.items() if before.get(name) != code]


def _selected(name: str, patterns: Optional[List[str]]) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def run_module(workdir: str, tests: Tuple[str, ...], max_children: int,
               patterns: Optional[List[str]] = None) -> bool:
    """``mutmut run`` in a synced work directory (only the mutants matching ``patterns``,
    when given); with test files changed since the last run, first drop mutmut's
    tests-per-function map, then retry the survivors; then the timed-out mutants once
    more. Returns whether mutmut succeeded."""
    stamp = os.path.join(workdir, "mutants", "tests.sha256")
    fingerprint = tests_fingerprint(workdir, tests)
    before = {n: s for n, s in results(workdir).items() if _selected(n, patterns)}
    # no results yet: a fresh work directory, nothing to redo; results without a stamp:
    # an unknown test state, redone
    changed = (not os.path.exists(stamp) or open(stamp).read() != fingerprint) and bool(before)
    if changed:
        stats = os.path.join(workdir, "mutants", "mutmut-stats.json")
        if os.path.exists(stats):
            os.remove(stats)
    if patterns is None:
        ok = mutmut(workdir, "run", "--max-children", str(max_children), check=False).returncode == 0
        status = results(workdir)
    else:
        # mutmut runs again every mutant it is given by name: the globs on a fresh work
        # directory, then only the selected mutants not tried yet. A run first generates the
        # mutants of functions changed since the last one (new names, not tried yet): with
        # nothing left to try, one tried mutant runs again to have them made, and a second
        # pass tries them.
        todo = sorted(n for n, s in before.items() if s == PENDING) if before else list(patterns)
        ok = mutmut(workdir, "run", "--max-children", str(max_children), *(todo or sorted(before)[:1]),
                    check=False).returncode == 0
        status = results(workdir)
        made = sorted(n for n, s in status.items() if s == PENDING and _selected(n, patterns))
        if ok and before and made:
            ok = mutmut(workdir, "run", "--max-children", str(max_children), *made,
                        check=False).returncode == 0
            status = results(workdir)
    survivors = [n for n, s in status.items() if s not in DETECTED and s != PENDING and _selected(n, patterns)]
    if ok and changed and survivors:
        print(f"   the tests changed: trying the {len(survivors)} survivors again", flush=True)
        ok = mutmut(workdir, "run", "--max-children", str(max_children), *survivors,
                    check=False).returncode == 0
        status = results(workdir)
    # a loaded machine (another job taking the core) times tests out: every run tries the
    # timed-out mutants once more, so a timeout that counts as killed happened twice
    timeouts = [n for n, s in status.items() if s == "timeout" and _selected(n, patterns)]
    if ok and timeouts:
        print(f"   trying the {len(timeouts)} timed-out mutants again", flush=True)
        ok = mutmut(workdir, "run", "--max-children", str(max_children), *timeouts,
                    check=False).returncode == 0
    if ok:
        with open(stamp, "w") as f:
            f.write(fingerprint)
    return ok


def mutmut(workdir: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "mutmut")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("PYTHONPATH", None)
    return subprocess.run([exe, *args], cwd=workdir, env=env, check=check, text=True,
                          stdout=subprocess.PIPE if args[0] == "results" else None)


def results(workdir: str) -> Dict[str, str]:
    """{mutant name: status} of a work directory (``mutmut results --all true``)."""
    if not os.path.isdir(os.path.join(workdir, "mutants")):
        return {}
    out = mutmut(workdir, "results", "--all", "true").stdout
    found = {}
    for line in out.splitlines():
        match = re.match(r"^\s+(\S+__mutmut_\d+): (.+)$", line)
        if match:
            found[match.group(1)] = match.group(2).strip()
    return found


def equivalent_mutants() -> Dict[str, str]:
    """{mutant name: reason} from the "Equivalent mutants" table of docs/testing.md."""
    if not os.path.exists(DOC):
        return {}
    text = open(DOC, encoding="utf-8").read()
    section = text.split("## Equivalent mutants", 1)[-1].split("\n## ", 1)[0] if "## Equivalent mutants" in text else ""
    found = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`([\w.]+__mutmut_\d+)`", cells[0]) if cells else []
        for name in names:
            found[name] = cells[-1]
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="GLOB",
                        help="modules to run (globs on their paths, e.g. 'sut_fairseq/ops/*')")
    parser.add_argument("--workdir", default=os.path.join(REPO, "runs", "mutation"))
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1,
                        help="mutants tested at once (default: the cores)")
    parser.add_argument("--changed-since", metavar="REV",
                        help="only the mutants of the functions whose code changed since REV (docstrings aside)")
    parser.add_argument("--list", action="store_true", help="print the modules and their tests, run nothing")
    parser.add_argument("--report", action="store_true", help="run nothing; the table of the results there")
    args = parser.parse_args(argv)

    targets = discover()
    if args.only:
        targets = {m: t for m, t in targets.items() if any(fnmatch.fnmatch(m, g) for g in args.only)}
        if not targets:
            parser.error(f"--only {' '.join(args.only)} matches no module")
    if args.list:
        for module, tests in targets.items():
            print(f"{module}: {' '.join(tests)}")
        return 0

    equivalent = equivalent_mutants()
    rows, failed, wrongly_listed = [], [], []
    for module, tests in targets.items():
        workdir = os.path.join(args.workdir, module[:-3].replace("/", "."))
        patterns = changed_since(module, args.changed_since) if args.changed_since else None
        if patterns == []:
            print(f"== {module}: no function changed since {args.changed_since}", flush=True)
            continue
        if not args.report:
            os.makedirs(workdir, exist_ok=True)
            for item in SYNCED:
                sync(os.path.join(REPO, item), os.path.join(workdir, item))
            write_config(workdir, module, tests)
            scope = "" if patterns is None else f"; the {len(patterns)} functions changed since {args.changed_since}"
            print(f"== {module} against {' '.join(tests)} ({workdir}{scope})", flush=True)
            if not run_module(workdir, tests, args.max_children, patterns):
                failed.append(module)
        status = {n: s for n, s in results(workdir).items() if _selected(n, patterns)}
        pending = sum(s == PENDING for s in status.values())
        status = {n: s for n, s in status.items() if s != PENDING}
        equiv = [n for n in status if n in equivalent and status[n] not in DETECTED]
        wrongly_listed += sorted(n for n in status if n in equivalent and status[n] in DETECTED)
        counted = {n: s for n, s in status.items() if n not in equiv}
        killed = sum(s in DETECTED for s in counted.values())
        survivors = sorted(n for n, s in counted.items() if s not in DETECTED)
        rows.append((module, len(counted), killed, len(equiv), survivors, counted, pending))

    total = sum(r[1] for r in rows)
    killed = sum(r[2] for r in rows)
    pending = sum(r[6] for r in rows)
    print("\n| module | mutants | killed | score | equivalent | survivors | not tried yet |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for module, n, k, e, survivors, _, p in rows:
        score = f"{100.0 * k / n:.1f} %" if n else "not run"
        print(f"| {module} | {n} | {k} | {score} | {e} | {len(survivors)} | {p} |")
    for module, _, _, _, survivors, counted, _ in rows:
        for name in survivors:
            print(f"survivor: {name} ({counted[name]}); mutmut show {name}  (in its work directory)")
    for name in wrongly_listed:  # a test tells it apart: the table's reason is wrong
        print(f"listed as equivalent but killed (take it out of the table): {name}")
    not_run = [r[0] for r in rows if r[1] == 0]
    if not_run:
        print(f"not run (no results yet): {', '.join(not_run)}")
    if pending:
        print(f"not tried yet (left out of the score): {pending} mutants")
    percent = 100.0 * killed / total if total else 0.0
    scope = f" (the functions changed since {args.changed_since})" if args.changed_since else ""
    print(f"mutation score: {killed} killed of {total} ({percent:.1f}%){scope}")
    if failed:
        print(f"mutmut failed on: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
