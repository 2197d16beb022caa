# Two entry points (see README): `make demo` runs the demo, `make test` the test suite.
# Both create .venv and install the package into it on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch that lies on this machine image's disk; override on other machines.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# The GPU machine's Triton, for compiling the Gluon kernels as it will (tests/test_gluon_compile.py).
VENV36 ?= .venv-triton36

.PHONY: demo test test-oldest verify bench lint clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test,plot]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/sparse-mla demo

# The quick verification sweep runs inside tests/test_kernel_compile.py (it records the sweep's
# kernel launches and fails if a case does), so it is not run a second time here.
$(VENV36)/bin/.installed:
	$(PYTHON) -m venv $(VENV36)
	$(VENV36)/bin/pip install -q "triton==3.6.0"
	touch $@

test: $(BIN)/.installed $(VENV36)/bin/.installed
	$(BIN)/ruff check src tests benchmarks
	SPARSE_MLA_TRITON36_PYTHON=$(VENV36)/bin/python $(BIN)/python -m pytest -n 2 --durations=15 tests

# The oldest Triton pyproject claims, beside the newest (.venv's): the quick sweep under each,
# in the interpreter. Not part of `make test` (about 25 CPU-minutes in all): run it before a
# release and whenever the Triton range changes (README, "Supported GPUs and versions").
TRITON_OLDEST ?= 3.3.0
VENV_OLDEST ?= .venv-triton-oldest

$(VENV_OLDEST)/bin/.installed:
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV_OLDEST)/bin/pip install -q "triton==$(TRITON_OLDEST)" numpy
	$(VENV_OLDEST)/bin/pip install -q --no-deps -e .
	touch $@

test-oldest: $(BIN)/.installed $(VENV_OLDEST)/bin/.installed
	$(VENV_OLDEST)/bin/sparse-mla verify --quick
	$(BIN)/sparse-mla verify --quick

verify: $(BIN)/.installed
	$(BIN)/sparse-mla verify

bench: $(BIN)/.installed
	$(BIN)/sparse-mla bench

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) $(VENV36) $(VENV_OLDEST) results
