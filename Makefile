# sut-fairseq: two commands do all the set-up on a fresh machine.
#   make demo   install into .venv if needed, then train + decode sut_tiny on generated data
#   make test   install into .venv if needed, then run the test suite (not the `slow` tests)
#
# Install order matters (see README "Installation"):
#   1. torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
#   2. fairseq-fixed built WITHOUT build isolation (its build env would otherwise fetch
#      another torch) and WITHOUT its dependency list (it asks for torchaudio, which pins
#      its own torch and is used only by fairseq's speech tasks); its real runtime
#      dependencies are listed in FAIRSEQ_DEPS instead.
#   3. the rest, then this package in editable mode.

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
TORCH_SPEC ?= torch==2.13.0
FAIRSEQ_SPEC ?= fairseq-fixed==0.12.3.1
FAIRSEQ_DEPS := scikit-learn cffi hydra-core==1.3.2 omegaconf==2.3.0 regex "sacrebleu>=2.0" tqdm bitarray packaging "numpy>=1.21.3"
TOOLS := "triton==3.9.0" sacremoses subword-nmt sentencepiece ptflops matplotlib pytest hypothesis
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all clean-venv

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

test: install
	$(PY) -m pytest -q tests

test-all: install
	$(PY) -m pytest -q -m "slow or not slow" tests

clean-venv:
	rm -rf $(VENV)
