# sut-fairseq: two commands do all the set-up on a fresh machine.
#   make demo   install into .venv if needed, then train + decode sut_tiny on generated data
#   make test   install into .venv if needed, then run the test suite (not the `slow` tests)
#               on every core (pytest-xdist, TEST_WORKERS=auto; TEST_WORKERS=0: one process)
#   make mutation   mutation testing of the model core (mutmut; hours; resumable),
#               see docs/testing.md
#
# Install order matters (see README "Installation"):
#   1. torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
#   2. fairseq-fixed built WITHOUT build isolation (its build env would otherwise fetch
#      another torch) and WITHOUT its dependency list (it asks for torchaudio, which pins
#      its own torch and is used only by fairseq's speech tasks); its real runtime
#      dependencies are listed in FAIRSEQ_DEPS instead.
#   3. the rest, then this package in editable mode.
#
# Offline installation (README "Installing on an offline GPU node"):
#   make wheelhouse [PYVER=3.12] [WHEELHOUSE=wheelhouse]   on a machine with internet
#   make install-offline WHEELHOUSE=dir [PY=python] [INSTALL_TARGET=dir]   on the node,
#       over the torch and triton already installed there (no package index).

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
TORCH_SPEC ?= torch==2.13.0
FAIRSEQ_SPEC ?= fairseq-fixed==0.12.3.1
FAIRSEQ_DEPS := scikit-learn cffi hydra-core==1.3.2 omegaconf==2.3.0 regex "sacrebleu>=2.0" tqdm bitarray packaging "numpy>=1.21.3"
TOOLS := "triton==3.9.0" sacremoses subword-nmt sentencepiece ptflops matplotlib pytest hypothesis pytest-xdist
STAMP := $(VENV)/.installed

.PHONY: install xdist demo test test-all mutation clean-venv wheelhouse install-offline

install: $(STAMP)

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install "setuptools<81" wheel cython $(FAIRSEQ_DEPS)
	$(PY) -c "import fairseq" 2>/dev/null || $(PIP) install --no-build-isolation --no-deps "$(FAIRSEQ_SPEC)"
	$(PIP) install $(TOOLS)
	$(PIP) install --no-build-isolation --no-deps -e .
	$(PY) -c "import torch, fairseq, sut_fairseq; print('installed: torch', torch.__version__, '| fairseq', fairseq.__version__)"
	@touch $(STAMP)

demo: install
	$(PY) -m sut_fairseq.demo

# one worker per core; a test file stays on one worker (its module fixtures run once), the
# files in tests/conftest.py's order (the heavy ones first; xdist would otherwise start
# with the files of most tests, the quick unit tests, and leave the long smokes for last)
TEST_WORKERS ?= auto
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# (a .venv installed before pytest-xdist was in TOOLS gets it here)
xdist: install
	@$(PY) -c "import xdist" 2>/dev/null || $(PIP) install pytest-xdist

test: xdist
	$(PY) -m pytest -q $(XDIST) --durations=30 tests

test-all: xdist
	$(PY) -m pytest -q $(XDIST) -m "slow or not slow" tests

# mutation testing (docs/testing.md): hours on 2 cores, resumable, not part of `make test`;
# MUTATION_ARGS="--only 'sut_fairseq/ops/*'" narrows it, "--report" prints the last results
MUTMUT_SPEC ?= mutmut==3.8.1
MUTATION_ARGS ?=
mutation: install
	@$(PY) -c "import mutmut" 2>/dev/null || $(PIP) install "$(MUTMUT_SPEC)"
	nice -n 19 $(PY) scripts/mutation.py $(MUTATION_ARGS)

clean-venv:
	rm -rf $(VENV)

# ---------------------------------------------------------------------------------------
# Offline installation for air-gapped GPU nodes (Linux x86-64; torch and triton already
# installed there, so neither they nor torch's own dependencies go into the wheelhouse).
PYVER      ?= 3.12
WHEELHOUSE ?= wheelhouse
# The node's glibc: torch >= 2.6 wheels need manylinux_2_28, so every tag up to it is safe.
OFFLINE_PLATFORMS := manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64
# What fairseq-fixed needs to build without build isolation (torch comes from the node).
OFFLINE_BUILD := "setuptools<81" wheel cython "numpy>=1.21.3"
# Every run-time dependency, transitive ones included (the wheelhouse is downloaded with
# --no-deps): FAIRSEQ_DEPS and TOOLS (less triton), then what they pull in on Linux with
# Python >= 3.11. Keep this list complete: in a venv, install-offline resolves it against
# the wheelhouse and the site packages alone and stops on the first missing name.
OFFLINE_DEPS := $(FAIRSEQ_DEPS) $(filter-out "triton%,$(TOOLS)) \
    antlr4-python3-runtime==4.9.3 PyYAML \
    portalocker tabulate colorama lxml \
    scipy joblib cloudpickle threadpoolctl narwhals \
    pycparser \
    contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil tzdata \
    iniconfig pluggy pygments sortedcontainers execnet \
    click mock
# Have no wheel on PyPI; pure Python, so their sdists are taken (built on the node).
OFFLINE_SDIST_ONLY := antlr4-python3-runtime
# NODE_HAS="numpy scipy ...": distributions the node's Python already has, left out of the
# wheelhouse and of the offline install (their site versions are used). GPU images with
# the scientific stack have most of the big ones; e.g. for this workplace's CUDA image:
#   make wheelhouse PYVER=3.12 NODE_HAS="$(CUDA_IMAGE_HAS)"     (14 MiB instead of 110)
NODE_HAS ?=
CUDA_IMAGE_HAS := numpy scipy scikit-learn matplotlib pillow contourpy cycler fonttools \
    kiwisolver pyparsing python-dateutil joblib threadpoolctl cloudpickle narwhals pytest \
    hypothesis iniconfig pluggy pygments sortedcontainers click sentencepiece regex tqdm \
    PyYAML portalocker tabulate colorama lxml sacrebleu packaging cython wheel
# the requirements of a list whose names are not in NODE_HAS, one per line
not_on_node = for d in $(1); do n=$${d%%[=<>]*}; \
    case " $(NODE_HAS) " in *" $$n "*) ;; *) printf '%s\n' "$$d";; esac; done
OFFLINE_WANTED = $(call not_on_node,$(OFFLINE_BUILD) $(OFFLINE_DEPS))
OFFLINE_TAGS = --python-version $(PYVER) --implementation cp --abi cp$(subst .,,$(PYVER)) \
    $(addprefix --platform ,$(OFFLINE_PLATFORMS))

# Runs in .venv (`install` first): fairseq-fixed's setup.py imports torch even to
# report its metadata, which `pip download` asks for.
wheelhouse: install
	@mkdir -p "$(WHEELHOUSE)"
	$(OFFLINE_WANTED) | xargs -d '\n' $(PIP) download --dest "$(WHEELHOUSE)" --no-deps \
	    $(OFFLINE_TAGS) --only-binary=:all: $(addprefix --no-binary=,$(OFFLINE_SDIST_ONLY))
	$(PIP) download --dest "$(WHEELHOUSE)" --no-deps --no-binary :all: --no-build-isolation \
	    "$(FAIRSEQ_SPEC)"
	@# this package, built from a copy of the checkout (no build/ left in the tree)
	rm -f "$(WHEELHOUSE)"/sut_fairseq-*.whl
	tmp=$$(mktemp -d) && cp -R setup.py sut_fairseq "$$tmp"/ && \
	    $(PIP) wheel --no-deps --no-build-isolation --wheel-dir "$(WHEELHOUSE)" "$$tmp"; \
	    rc=$$?; rm -rf "$$tmp"; exit $$rc
	@echo "wheelhouse $(WHEELHOUSE) for CPython $(PYVER), Linux x86-64:" \
	    "$$(ls "$(WHEELHOUSE)" | wc -l) files, $$(du -sh "$(WHEELHOUSE)" | cut -f1)"

# PY on the command line names the Python to install into; otherwise the python3 on PATH
# (an activated venv made with --system-site-packages over the site Python with torch).
ifeq ($(origin PY),command line)
OFFLINE_PY := $(PY)
else
OFFLINE_PY := python3
endif
INSTALL_TARGET ?=
# INSTALL_TARGET=dir: pip --target dir (everything from the wheelhouse, no dependency
# resolution); the recipe puts dir on PYTHONPATH, and so must its users.
OFFLINE_ENV = $(if $(INSTALL_TARGET),PYTHONPATH="$(abspath $(INSTALL_TARGET))$${PYTHONPATH:+:$$PYTHONPATH}")
OFFLINE_PIP = $(OFFLINE_ENV) $(OFFLINE_PY) -m pip --disable-pip-version-check install \
    --no-index --find-links "$(abspath $(WHEELHOUSE))" \
    $(if $(INSTALL_TARGET),--target "$(abspath $(INSTALL_TARGET))" --upgrade)
# fairseq builds CUDA extensions (NAT models, n-gram blocking) when CUDA_HOME is set;
# the plugin uses none of them and they need an nvcc matching torch's CUDA.
FAIRSEQ_BUILD_ENV ?= env -u CUDA_HOME

install-offline:
	@test -d "$(WHEELHOUSE)" || { echo "install-offline: WHEELHOUSE=$(WHEELHOUSE) is not a directory (make it with 'make wheelhouse' where there is internet)" >&2; exit 1; }
	@$(OFFLINE_ENV) $(OFFLINE_PY) -W ignore -c "import torch; print('install-offline: using torch', torch.__version__, 'from', torch.__file__)" || \
	    { echo "install-offline: 'import torch' fails in $(OFFLINE_PY): install the site torch first, or create the venv with --system-site-packages over the Python that has it" >&2; exit 1; }
ifeq ($(INSTALL_TARGET),)
	$(call not_on_node,$(OFFLINE_BUILD)) | xargs -d '\n' $(OFFLINE_PIP)
	$(FAIRSEQ_BUILD_ENV) $(OFFLINE_PIP) --no-build-isolation --no-deps "$(FAIRSEQ_SPEC)"
	$(call not_on_node,$(OFFLINE_DEPS)) | xargs -d '\n' $(OFFLINE_PIP) --no-build-isolation
	$(OFFLINE_PIP) --no-deps --force-reinstall sut-fairseq
else
	@# `pip install --target --upgrade` replaces the target's bin/ on every call, so
	@# everything goes in one call (fairseq builds with the build requirements in it).
	($(OFFLINE_WANTED); echo "$(FAIRSEQ_SPEC)"; echo sut-fairseq) | \
	    xargs -d '\n' $(FAIRSEQ_BUILD_ENV) $(OFFLINE_PIP) --no-build-isolation --no-deps
endif
	@# (the current directory is taken off sys.path: the checkout's sut_fairseq must not count)
	$(OFFLINE_ENV) $(OFFLINE_PY) -c "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; \
	    import torch, fairseq, sut_fairseq, importlib.metadata as m; \
	    print('installed: torch', torch.__version__, '| fairseq', fairseq.__version__, '| sut_fairseq', m.version('sut-fairseq'), 'from', sut_fairseq.__path__[0])"
