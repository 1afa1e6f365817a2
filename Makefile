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

# the run report's browser test renders the page in Debian's Chromium: installed here where the
# system allows (root, the package mirrors); elsewhere that one test says why it skips
test: $(BIN)/pixelrl
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		  apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; } || \
		echo "make: Chromium could not be installed here; the report's browser test will skip"
	$(BIN)/python -m pytest -q

bench: $(BIN)/pixelrl
	$(BIN)/python benchmarks/bench_flow_grpo.py

clean:
	rm -rf $(VENV) runs
