# Two commands on a fresh machine (Python 3.10+ with pip; nvcc optional):
#   make train   the main job (see README): installs torch and distopt only
#   make test    the test suite (what CI runs in each torch): also the test tools and the integrations'
#                frameworks
#   make docs    the docs site, from what `make test` installs
# Both create .venv and install distopt from this checkout in editable mode on first use, built against
# .venv's own torch (--no-build-isolation: pip's isolated build would install a second torch, the newest,
# ~3 GB, into a throwaway environment). A local build: the CPU kernels, and the CUDA kernels only for the
# GPUs this machine sees (csrc/build_config.py); each long phase is announced by one line.
# `make test PIP_BUILD=` builds in pip's isolated environment instead; after editing csrc/,
# `make train` rebuilds, or `.venv/bin/python setup.py build_ext --inplace` (see README, Building).

PYTHON    ?= python3
PIP_BUILD ?= --no-build-isolation
VENV      := .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip install -q
STAMP     := $(VENV)/.distopt-built
TEST_DEPS := $(VENV)/.test-deps
SOURCES   := $(shell find csrc -type f -not -name '*.pyc') setup.py pyproject.toml

.PHONY: train test env docs clean

train: $(STAMP)
	$(PY) examples/train.py $(ARGS)

# pytest from .venv/bin, not `python -m pytest`: the latter puts the checkout first on sys.path, which is
# the same distopt here (editable) but not in CI, which tests an installed wheel the same way.
test: $(STAMP) $(TEST_DEPS)
	$(VENV)/bin/pytest

env: $(STAMP) $(TEST_DEPS)

# The docs site: README.md, docs/ and benchmarks/README.md, with the API reference generated from the
# docstrings (Sphinx, MyST, autodoc; docs/conf.py), warnings as errors. Needs only what `make env` installs.
docs: $(STAMP) $(TEST_DEPS)
	@test -x $(VENV)/bin/sphinx-build || { echo "distopt: no sphinx in $(VENV) (made before the docs tools joined the test tools): rm $(TEST_DEPS) && make env"; exit 1; }
	$(VENV)/bin/sphinx-build -W --keep-going -q -c docs . build/docs/html
	@echo "distopt: the docs are in build/docs/html (start at build/docs/html/docs/index.html)"

# numpy: torch warns "Failed to initialize NumPy" in every process that imports it without numpy (the
# main job's three). setuptools and ninja: the build, which runs in .venv (PIP_BUILD).
$(VENV)/.base:
	@echo "distopt: creating $(VENV) and installing torch (about 3 GB with its CUDA libraries: 1.5 min on a fast link)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch numpy setuptools ninja
	touch $@

# The test tools, and the integrations tested with the real frameworks (optional at run time: see the
# pyproject extras). torchtitan's optimizer container and checkpointer need only tyro and spmd_types to
# import; its other dependencies serve its trainer (datasets, wandb, tensorboard) and would pin
# huggingface_hub below 2. ninja and setuptools: the tests build distopt._C_emulated with this torch.
$(TEST_DEPS): $(VENV)/.base
	@echo "distopt: installing the test tools and the frameworks the integrations are tested with (about a minute)"
	$(PIP) ninja setuptools "pytest>=8" hypothesis numpy matplotlib expecttest import-linter
	$(PIP) "transformers>=5.3" "accelerate>=1.1" "lightning>=2.6"
	# torchao: its AdamW8bit is the 8-bit moment format the low-precision tests compare with
	$(PIP) "torchao==0.18.0"
	$(PIP) tyro "spmd_types==0.2.3; python_version >= '3.11'"
	$(PIP) "sybil>=10" sphinx myst-parser  # the docs: Sybil runs their snippets in the suite, Sphinx builds them
	$(PIP) --no-deps "torchtitan==0.3.0; python_version >= '3.11'"
	touch $@

# build_config.py --plan prints what the build compiles and roughly how long it takes (pip -q hides the
# build's own output).
$(STAMP): $(VENV)/.base $(SOURCES)
	@$(PY) csrc/build_config.py --plan
	$(PIP) $(PIP_BUILD) -e .
	touch $@

clean:
	rm -rf build distopt/_C*.so $(STAMP)
