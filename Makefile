# souffle-tvm: `make install` then `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test test-all bench bench-plausibility gpu-bundle microbench-bundle lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	@# Best effort: headless Chromium checks the HTML report in tests/test_report_html.py (skipped without it).
	-@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		 chromium fonts-dejavu-core) >/dev/null 2>&1 || echo "note: chromium not installed; the HTML screenshot test will skip"; fi

# Two workers (pytest-xdist), each taking whole test files (their fixtures build once per file);
# WORKERS=0 runs in one process.
WORKERS ?= 2
XDIST    = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

test: $(PY)
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-all: $(PY)
	$(PY) -m pytest -q $(XDIST) -m "slow or not slow" $(PYTEST_ARGS)

# The paper's evaluation side by side (docs/benchmarks.md): results/bench-<date>/
bench: $(PY)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) python/bench.py

# Re-pricing (latency model before/after, per model and kernel class) and the fraction-of-peak check
# of a bench run: plausibility.md and .png beside its bench.json (make bench writes them too).
# BENCH=results/bench-<date>/bench.json; default the last one by name
BENCH ?= $(lastword $(sort $(wildcard results/bench-*/bench.json)))
bench-plausibility: $(PY)
	$(PY) python/bench_plausibility.py $(BENCH)

# The GPU check's bundle (docs/gpu-check.md): build here, run on a lent GPU with python/gpu_check.py run
gpu-bundle: $(PY)
	$(PY) python/gpu_check.py prepare

# Per-kernel microbenchmarks (issue 32): microbench_bundle/ + .tgz and the committed predictions
# results/latency/microbench-predictions-<date>.json (docs/gpu-check.md)
microbench-bundle: $(PY)
	$(PY) python/microbench.py prepare --out microbench_bundle

lint: $(PY)
	$(PY) -m pyflakes souffle_tvm tests python

clean:
	rm -rf build *.egg-info .pytest_cache
