# The two commands of the README: `make demo` and `make test`. Both build .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-opinfo lint bench bench-quick clean

$(BIN)/braze: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(BIN)/braze

demo: $(BIN)/braze
	$(BIN)/braze demo

test: $(BIN)/braze
	$(BIN)/ruff check braze tests examples benchmarks
	$(BIN)/ruff format --check braze tests examples benchmarks
	$(BIN)/python -m pytest

# The whole OpInfo sweep: every float32 CPU op on both capture paths, 1 and 2 threads, strided
# and transposed inputs (tests/opinfo.py; `make test` runs a subset).
test-opinfo: $(BIN)/braze
	BRAZE_OPINFO=full $(BIN)/python -m pytest tests/test_opinfo.py

bench: $(BIN)/braze
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/braze bench --out bench-out

bench-quick: $(BIN)/braze
	$(BIN)/braze bench --quick --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache .ruff_cache
