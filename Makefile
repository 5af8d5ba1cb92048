# Everything runs from .venv, created on first use, so a fresh clone needs only Python 3.11 + pip.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: run test lint bench loadtest clean

# Integration modules that run in step 1, on a session cluster of their own after the two-node
# modules (conftest.py orders those first), and e2e modules that run after the unit tests:
# each mostly waits (Serve's periods, signals, subprocesses), so beside the load test they
# use cores that step 1 leaves idle, and step 2 loses their time.
STEP1_INTEGRATION := tests/integration/test_ray_internals.py tests/integration/test_versions.py \
	tests/integration/test_listeners.py tests/integration/test_prefix_routing.py \
	tests/integration/test_gpu_pool.py tests/integration/test_lora_replicas.py \
	tests/integration/test_ray_init_signals.py
STEP1_E2E := tests/e2e/test_signals.py

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build; otherwise a dependency may pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,s3,models]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ember run ember.deployments.embeddings:app

# Six pytest runs in two steps. First, side by side: the two-node cluster's tests followed,
# in the same process, by STEP1_INTEGRATION on a session cluster; the unit tests (no cluster,
# one core) followed by STEP1_E2E; and the load tests' short run. The load test alone keeps
# the machine 43% busy (it mostly waits on servers, scale-downs and rollout steps), so the
# rest fits beside it; their output is printed after the two-node lane's. Then the rest of the
# integration tests beside the rest of the e2e tests. docs/testing.md gives the lanes' times
# and what failed in lanes tried before. Each prints its slowest tests, so a run's log says
# where its time went.
test: $(STAMP)
	$(BIN)/ruff check src tests examples bench loadtests
	# Bytecode for the project's own sources, written once: every Ray worker that hosts a
	# replica or an edge imports ember, and where PYTHONDONTWRITEBYTECODE is set (or the tree
	# is fresh) each would compile what it imports again.
	$(BIN)/python -m compileall -q src tests examples bench loadtests
	$(BIN)/mypy
	$(BIN)/lint-imports
	log=$$(mktemp); loadlog=$$(mktemp); \
	{ $(BIN)/python -m pytest tests/unit --durations=10 -p no:cacheprovider && \
		$(BIN)/python -m pytest $(STEP1_E2E) --durations=5 -p no:cacheprovider; } \
		> $$log 2>&1 & unit=$$!; \
	$(BIN)/python -m pytest tests/integration/test_loadtests.py --durations=5 \
		-p no:cacheprovider > $$loadlog 2>&1 & load=$$!; \
	trap 'kill $$unit $$load 2>/dev/null; rm -f $$log $$loadlog' EXIT; \
	$(BIN)/python -m pytest tests/integration/test_two_nodes*.py $(STEP1_INTEGRATION) \
		--durations=10; nodes=$$?; \
	wait $$unit; units=$$?; echo "== tests/unit, then $(STEP1_E2E) (run beside them)"; cat $$log; \
	wait $$load; loads=$$?; echo "== tests/integration/test_loadtests.py (run beside them)"; \
	cat $$loadlog; \
	test $$nodes -eq 0 && test $$units -eq 0 && test $$loads -eq 0
	# The end-to-end tests start their own `ember run` clusters, so they run beside the
	# integration tests' session cluster: much of either is waiting (scale-downs, rollouts),
	# and side by side the two take about 8.5 minutes (docs/testing.md).
	log=$$(mktemp); \
	$(BIN)/python -m pytest tests/e2e $(STEP1_E2E:%=--ignore=%) --durations=10 -p no:cacheprovider \
		> $$log 2>&1 & e2e=$$!; \
	trap 'kill $$e2e 2>/dev/null; rm -f $$log' EXIT; \
	$(BIN)/python -m pytest tests/integration --ignore-glob='tests/integration/test_two_nodes*' --ignore=tests/integration/test_loadtests.py \
		$(STEP1_INTEGRATION:%=--ignore=%) --durations=10; integration=$$?; \
	wait $$e2e; e2es=$$?; echo "== tests/e2e (run beside the integration tests)"; cat $$log; \
	test $$integration -eq 0 && test $$e2es -eq 0

lint: $(STAMP)
	$(BIN)/ruff check src tests examples bench loadtests
	$(BIN)/mypy
	$(BIN)/lint-imports

# The peer loaders bench/coldstart_sizes.py times beside Ember's (the `bench` extra): without
# them a size run records each missing peer as an error instead of its time.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,s3,models,bench]'
	touch $(BENCH_STAMP)

# Every benchmark, one after another, in its quick form (about 1-3 minutes each); results in
# bench/results/<name>.short.json. Full runs (README's figures): bench/run_all.py without --short.
bench: $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py --short

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Locust scenarios (coldstart, steady, overload) against a local `ember run`, each failing
# when it misses its budgets; report in loadtests/reports/index.html. CI runs the short
# version: make loadtest LOADTEST_ARGS=--short
loadtest: $(STAMP)
	$(BIN)/python loadtests/run.py $(LOADTEST_ARGS)
