"""Helpers of the tests of the command lines (recipes and data preparation): run one,
as a subprocess or in the test's own process, and read what it wrote."""
import contextlib
import importlib.util
import io
import logging
import os
import random
import re
import subprocess
import sys
import traceback
import warnings


def run_cli(script, *args):
    """Run ``python SCRIPT ARGS`` (each argument converted with ``str``); its
    CompletedProcess, output captured as text."""
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


# --------------------------------------------------------------------------- in process

#: path -> (module, whether ``__main__`` is ``sys.exit(main())``)
_SCRIPTS = {}
#: script directory -> {module name: module} of the sibling modules its scripts imported
_SIBLINGS = {}
_MISSING = object()
_MAIN_EXITS = re.compile(r"__name__\s*==\s*[\"']__main__[\"']\s*:\s*\n\s*sys\.exit\(\s*main\(")


def _module_dir(module):
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) if path else None


@contextlib.contextmanager
def _sibling_modules(directory):
    """The script's directory first on ``sys.path`` and its modules under their plain names
    in ``sys.modules`` (scripts/logic, scripts/cfq and scripts/wmt14 each have a
    ``summarize`` or an ``evaluate``): another directory's module of the same name is set
    aside for the call and put back after it, so that neither leaks into the other."""
    names = [f[:-3] for f in os.listdir(directory) if f.endswith(".py")]
    cache = _SIBLINGS.setdefault(directory, {})
    before = {name: sys.modules.get(name, _MISSING) for name in names}
    for name, module in before.items():
        if module is not _MISSING and _module_dir(module) == directory:
            cache.setdefault(name, module)
        if name in cache:
            sys.modules[name] = cache[name]
        else:
            sys.modules.pop(name, None)
    saved_path = list(sys.path)
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name, module in before.items():
            now = sys.modules.get(name, _MISSING)
            if now is not _MISSING and _module_dir(now) == directory:
                cache.setdefault(name, now)
            if module is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _load_script(path):
    """The script as a module (once per path), under a name of its own: not ``__main__``,
    so its ``if __name__ == "__main__"`` block does not run."""
    if path not in _SCRIPTS:
        name = "cli_script" + re.sub(r"\W", "_", path)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        with _sibling_modules(os.path.dirname(path)):
            spec.loader.exec_module(module)
        with open(path, encoding="utf-8") as handle:
            _SCRIPTS[path] = (module, bool(_MAIN_EXITS.search(handle.read())))
    return _SCRIPTS[path]


def _exit_status(code, stderr):
    """What ``sys.exit(code)`` makes the exit status (a message: printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


@contextlib.contextmanager
def _restored_random_state():
    """Python's, numpy's and torch's global generators (a generator script seeds them),
    torch's thread count and default dtype as they were before."""
    numpy = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    saved = (random.getstate(), numpy.random.get_state() if numpy else None,
             (torch.get_rng_state(), torch.get_num_threads(), torch.get_default_dtype()) if torch else None)
    try:
        yield
    finally:
        random.setstate(saved[0])
        if saved[1] is not None:
            numpy.random.set_state(saved[1])
        if saved[2] is not None:
            torch.set_rng_state(saved[2][0])
            if torch.get_num_threads() != saved[2][1]:
                torch.set_num_threads(saved[2][1])
            torch.set_default_dtype(saved[2][2])


@contextlib.contextmanager
def _restored_globals(env, cwd):
    """``os.environ`` (``env`` replaces it for the call), the working directory and the
    logging configuration as they were before, whatever the script changed."""
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    manager = logging.Logger.manager
    loggers = [logging.root] + [lg for lg in list(manager.loggerDict.values()) if isinstance(lg, logging.Logger)]
    saved_loggers = {lg: (lg.level, lg.disabled, lg.propagate, list(lg.handlers)) for lg in loggers}
    saved_disable = logging.root.manager.disable
    if env is not None:
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update({k: str(v) for k, v in env.items()})
    if cwd is not None:
        os.chdir(cwd)
    # a fresh process has no handler on the root logger: logging.basicConfig in the script
    # writes to the captured stderr, and without it the last-resort handler does
    logging.root.handlers = []
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        for key, value in saved_env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        for lg in list(manager.loggerDict.values()) + [logging.root]:
            if not isinstance(lg, logging.Logger):
                continue
            for handler in lg.handlers:
                if lg not in saved_loggers or handler not in saved_loggers[lg][3]:
                    handler.close()
            if lg in saved_loggers:
                lg.level, lg.disabled, lg.propagate, handlers = saved_loggers[lg]
                lg.handlers = handlers
            else:
                lg.handlers = []
        logging.disable(saved_disable)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Python's own printing of a warning, to the stderr of the moment (captured)."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _python_children_in_process():
    """``subprocess.run([sys.executable, SCRIPT.py, ...])`` with the output inherited (a
    recipe's ``run`` of another script of the repository, e.g. tables.py's ``train.py
    --dry-run``) becomes ``run_in_process`` too, its output written where the caller's
    goes; every other command is a real process."""
    real_run = subprocess.run

    def run(command, *popenargs, **kwargs):
        command_list = [str(c) for c in command] if isinstance(command, (list, tuple)) else None
        if (command_list and len(command_list) > 1 and command_list[0] == sys.executable
                and command_list[1].endswith(".py") and os.path.isfile(command_list[1])
                and not popenargs and set(kwargs) <= {"env", "cwd", "check"}):
            result = run_in_process(command_list[1], command_list[2:], env=kwargs.get("env"),
                                    cwd=kwargs.get("cwd"), children_in_process=True)
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
            if kwargs.get("check") and result.returncode:
                raise subprocess.CalledProcessError(result.returncode, command)
            return subprocess.CompletedProcess(command, result.returncode)
        return real_run(command, *popenargs, **kwargs)

    subprocess.run = run
    try:
        yield
    finally:
        subprocess.run = real_run


def run_in_process(script, args=(), env=None, cwd=None, children_in_process=False):
    """``python SCRIPT ARGS`` without a new interpreter: the script is loaded as a module
    (once per path) and its ``main(argv)`` called with stdout and stderr captured, with
    ``sys.argv`` as the script would see it (argparse's program name) and the script's
    directory first on ``sys.path``. ``SystemExit`` (argparse's status 2, ``sys.exit``)
    and uncaught exceptions (status 1, the traceback on stderr) become the return code;
    ``main``'s return value is the status where the script's entry point is
    ``sys.exit(main())``. ``sys.argv``, ``sys.path``, ``os.environ`` (``env``: the
    environment for the call, as subprocess's ``env``), the working directory
    (``cwd``), logging, the warning filters, the global random generators (Python's,
    numpy's, torch's) and torch's thread count are as they were afterwards.
    With ``children_in_process``, the repository's Python scripts that the script itself
    runs with ``subprocess.run`` and inherited output (a recipe's dry run of its train.py)
    are run in process the same way, their output in this one's.
    A ``subprocess.CompletedProcess`` with ``stdout``/``stderr`` as text."""
    path = os.path.abspath(str(script))
    argv = [str(a) for a in args]
    stdout, stderr = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    sys.argv = [path, *argv]
    try:
        with _sibling_modules(os.path.dirname(path)), _restored_globals(env, cwd), _restored_random_state(), \
                warnings.catch_warnings(), contextlib.redirect_stdout(stdout), \
                contextlib.redirect_stderr(stderr), \
                (_python_children_in_process() if children_in_process else contextlib.nullcontext()):
            warnings.resetwarnings()
            warnings.simplefilter("default")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)
            warnings.showwarning = _show_warning
            try:  # loaded (the first time) here: what its imports print or configure is undone
                module, main_exits = _load_script(path)
                returned = module.main(argv)
                code = _exit_status(returned if main_exits else None, stderr)
            except SystemExit as exit_:
                code = _exit_status(exit_.code, stderr)
            except Exception:  # what the interpreter prints for an uncaught exception
                traceback.print_exc(file=stderr)
                code = 1
    finally:
        sys.argv = saved_argv
    return subprocess.CompletedProcess([sys.executable, path, *argv], code, stdout.getvalue(), stderr.getvalue())


# --------------------------------------------------------------------------- files

def read_lines(path):
    """The lines of a text file, without their newlines."""
    with open(path) as handle:
        return handle.read().splitlines()


def check_refusals(script, out, cases, in_process=True):
    """Every ``(arguments, message)`` of ``cases`` is refused with exit status 2 and the
    message on stderr, and leaves no ``out`` behind; in the test's own process
    (``run_in_process``: an argument check starts no tool) unless ``in_process`` is false."""
    for args, message in cases:
        if in_process:
            bad = run_in_process(script, ["--out", out, *args])
        else:
            bad = run_cli(script, "--out", out, *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert not os.path.exists(out)


def run_binarized(script, out, *args):
    """``SCRIPT --out OUT ARGS --binarize``, which must succeed; its CompletedProcess."""
    result = run_cli(script, "--out", out, *args, "--binarize")
    assert result.returncode == 0, result.stderr
    return result
