# Two commands do all the set-up on a fresh machine:
#   make explore   -- the main job: explore the installed DeepSpeed, write zerostate-report/
#   make test      -- the tests: ruff, mypy, then pytest generated_tests (make test-fast: the fast tier)
# Both create .venv on first use: torch 2.13.0 (CPU build) first, then zerostate with the extra each
# needs (`explore`: DeepSpeed 0.19.8, hypothesis, networkx, Pillow + hf; `test`: explore + hf + pytest).
# A runtime user needs neither: `pip install --no-deps zerostate` into the DeepSpeed environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.zerostate-installed
EXPLORE_STAMP := $(VENV)/.zerostate-explore

# `make explore` / `make check` need the explore extra only; `make test` / `make bench` the test extra.
$(EXPLORE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[explore]'
	touch $(EXPLORE_STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP) $(EXPLORE_STAMP)

# The tests run derandomized (Hypothesis profile `ci`: the same examples every run) unless HYPOTHESIS_PROFILE
# says otherwise, on JOBS pytest-xdist workers, a test module whole on one of them (its DeepSpeed worker,
# Ray cluster or engine is started once and its tests keep their order).
JOBS ?= 2
PYTEST := CI=$${CI:-true} HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest

.PHONY: setup explore test test-fast lint check bench
setup: $(STAMP)

explore: $(EXPLORE_STAMP)
	$(BIN)/zerostate explore $(ARGS)

test: lint
	$(PYTEST) generated_tests -n $(JOBS) --dist loadfile $(ARGS)

test-fast: $(STAMP)
	$(PYTEST) generated_tests -m fast -n $(JOBS) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	PYTHON=$(BIN)/python tools/typecheck.sh all

check: $(EXPLORE_STAMP)
	$(BIN)/zerostate check $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)
