# Two commands on a fresh machine (Python 3.10+ with pip; nvcc optional):
#   make train   the main job (see README)
#   make test    the test suite (what CI runs)
# Both create .venv, install torch and build distopt._C on first use.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.distopt-built
SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: train test env clean

train: $(STAMP)
	$(PY) examples/train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest

env: $(STAMP)

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch ninja "pytest>=8" hypothesis numpy matplotlib expecttest
	# the integrations are tested with the real frameworks (optional at run time: see pyproject extras)
	$(PY) -m pip install -q "transformers>=5.3" "accelerate>=1.1" "lightning>=2.6"
	# torchao: its AdamW8bit is the 8-bit moment format the low-precision tests compare with
	$(PY) -m pip install -q "torchao==0.18.0"
	# torchtitan's optimizer container and checkpointer need only tyro and spmd_types to import; its other
	# dependencies serve its trainer (datasets, wandb, tensorboard) and would pin huggingface_hub below 2.
	$(PY) -m pip install -q tyro "spmd_types==0.2.3; python_version >= '3.11'"
	$(PY) -m pip install -q --no-deps "torchtitan==0.3.0; python_version >= '3.11'"
	touch $@

# --no-build-isolation: link against the torch installed above (isolation would fetch a second one).
$(STAMP): $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

clean:
	rm -rf build distopt/_C*.so $(STAMP)
