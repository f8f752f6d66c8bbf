# Two commands do all the set-up on a fresh machine:
#   make explore   -- the main job: explore the installed DeepSpeed, write zerostate-report/
#   make test      -- the tests: pytest generated_tests
# Both create .venv on first use: torch 2.13.0 (CPU build) first, then zerostate and its pins.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.zerostate-installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

.PHONY: setup explore test check bench
setup: $(STAMP)

explore: $(STAMP)
	$(BIN)/zerostate explore $(ARGS)

test: $(STAMP)
	CI=$${CI:-} $(BIN)/python -m pytest generated_tests $(ARGS)

check: $(STAMP)
	$(BIN)/zerostate check $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)
