# The two commands of the README. Each creates .venv from nothing on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/pixelrl: pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements/cpu.txt -e '.[test,ocr]'
	touch $(BIN)/pixelrl

demo: $(BIN)/pixelrl
	$(BIN)/pixelrl demo

test: $(BIN)/pixelrl
	$(BIN)/python -m pytest -q

bench: $(BIN)/pixelrl
	$(BIN)/python benchmarks/bench_flow_grpo.py

clean:
	rm -rf $(VENV) runs
