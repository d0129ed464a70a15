# souffle-tvm: `make install` then `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test test-all bench bench-plausibility gpu-bundle microbench-bundle snapshot lint clean

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

# the slow tests too; the gpu-marked ones need a lent GPU and a bundle (souffle_experiments gpu-check tests)
test-all: $(PY)
	$(PY) -m pytest -q $(XDIST) -m "not gpu" $(PYTEST_ARGS)

# The experiments under python/ are one package, souffle_experiments (installed by `make install`):
# `$(PY) -m souffle_experiments --help` lists its commands.
EXP = $(PY) -m souffle_experiments

# The paper's evaluation side by side (docs/benchmarks.md): results/bench-<date>/
bench: $(PY)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(EXP) bench

# Re-pricing (latency model before/after, per model and kernel class) and the fraction-of-peak check
# of a bench run: plausibility.md and .png beside its bench.json (make bench writes them too).
# BENCH=results/bench-<date>/bench.json; default the last one by name
BENCH ?= $(lastword $(sort $(wildcard results/bench-*/bench.json)))
bench-plausibility: $(PY)
	$(EXP) bench-plausibility $(BENCH)

# The GPU check's bundle (docs/gpu-check.md): build here, run on a lent GPU with `gpu-check run`
gpu-bundle: $(PY)
	$(EXP) gpu-check prepare

# Per-kernel microbenchmarks (issue 32): microbench_bundle/ + .tgz and the committed predictions
# data/latency/microbench-predictions-<date>.json (docs/gpu-check.md)
microbench-bundle: $(PY)
	$(EXP) microbench prepare --out microbench_bundle

# What the compiler decides at BASE against this tree (souffle_experiments.behaviour_snapshot): BASE
# checked out in a temporary git worktree, the snapshot run there with the worktree first on the
# path (-P: not the working directory), so BASE's souffle_tvm is imported by today's snapshot
# script; then this tree's; then --compare (exit 1 on any difference). QUICK=1: the small models
# only; ONLY='mmoe/small lstm/full': case prefixes. SNAPSHOT_DIR keeps the two .jsonl (default a
# new temporary folder, printed).
BASE ?= $(shell git rev-parse --verify --quiet origin/main >/dev/null 2>&1 && echo origin/main || echo HEAD)
QUICK ?=
ONLY ?=
SNAPSHOT_DIR ?=
SNAPSHOT_ARGS = $(if $(filter-out 0,$(QUICK)),--quick) $(if $(ONLY),--only $(ONLY))
snapshot: $(PY)
	@set -e; wt="$$(mktemp -d)/base"; out="$(or $(SNAPSHOT_DIR),$$(mktemp -d))"; \
	trap 'git worktree remove --force "$$wt" 2>/dev/null || true; rmdir "$$(dirname "$$wt")"' EXIT; \
	mkdir -p "$$out"; rm -f "$$out/before.jsonl" "$$out/after.jsonl"; \
	git worktree add --quiet --detach "$$wt" "$(BASE)"; \
	echo "snapshot of $(BASE) ($$(git -C "$$wt" rev-parse --short HEAD)) -> $$out/before.jsonl"; \
	PYTHONPATH="$$wt" $(PY) -P -m souffle_experiments snapshot --out "$$out/before.jsonl" $(SNAPSHOT_ARGS); \
	echo "snapshot of this tree -> $$out/after.jsonl"; \
	PYTHONPATH="$(CURDIR)" $(PY) -P -m souffle_experiments snapshot --out "$$out/after.jsonl" $(SNAPSHOT_ARGS); \
	$(EXP) snapshot --compare "$$out/before.jsonl" "$$out/after.jsonl"

lint: $(PY)
	$(PY) -m pyflakes souffle_tvm tests python

clean:
	rm -rf build *.egg-info .pytest_cache
