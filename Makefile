# The two commands of the README: `make serve` (install, then run the proxy on the embedded default)
# and `make test` (install, then lint, type-check and run the test suite against real llama-server).
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: serve test lint bench server

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar off -e '.[test]'
	touch $(STAMP)

# The patched llama-server: compiled once (10-20 min on 2 cores), again only when a patch or CMAKE_ARGS changes.
server: $(STAMP)
	$(BIN)/adaptive-spec build-server

serve: server
	$(BIN)/adaptive-spec serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	# No cache: a stale one once passed here what a clean checkout failed (~17 s either way).
	$(BIN)/mypy --cache-dir=/dev/null
	$(BIN)/lint-imports

test: lint server
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks.overhead.side_by_side
