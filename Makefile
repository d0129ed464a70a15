# souffle-tvm: `make install` then `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test test-all bench gpu-bundle lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(PY)
	$(PY) -m pip install --quiet -e '.[test]'

test: $(PY)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-all: $(PY)
	$(PY) -m pytest -q -m "slow or not slow" $(PYTEST_ARGS)

# The paper's evaluation side by side (docs/benchmarks.md): results/bench-<date>/
bench: $(PY)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) python/bench.py

# The GPU check's bundle (docs/gpu-check.md): build here, run on a lent GPU with python/gpu_check.py run
gpu-bundle: $(PY)
	$(PY) python/gpu_check.py prepare

lint: $(PY)
	$(PY) -m pyflakes souffle_tvm tests python

clean:
	rm -rf build *.egg-info .pytest_cache
