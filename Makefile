# Quick start: `make test` (sets up .venv, runs the test suite) and `make demo` (sets up, then runs the
# correctness-and-speed report of every op against its reference on this machine).
# On a CPU-only machine the Triton kernels run under TRITON_INTERPRET=1 (tiny shapes); on a GPU they
# run natively. `make gpu` is the one-call GPU job (tests + benchmarks into $OUT) used on the device.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: test demo gpu clean

$(VENV)/.ready: requirements-test.txt setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip "setuptools>=64" wheel
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test: $(VENV)/.ready
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS)

demo: $(VENV)/.ready
	$(PY) benchmarks/report.py

gpu:
	bash benchmarks/gpu_run.sh

clean:
	rm -rf $(VENV) build *.egg-info
