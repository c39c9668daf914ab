# Two entry points on a fresh machine: `make demo` and `make test`. Both build their own venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip

.PHONY: demo test bench bench-quick lint clean

$(VENV)/.core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(PIP) install -q -e '.[test]' 'torch==2.13.0'
	touch $@

## demo: a 4-rank job on loopback with the embedded defaults; prints the allreduce table
demo: $(VENV)/.core
	$(VENV)/bin/erdma run -n 4 -- $(PY) -m erdma_core.bench --op allreduce --sizes 4K,64K,1M,16M --iters 10

## test: install everything and run lint plus the whole suite
## (PyTorch's own distributed tests run in a pytest process of their own: they set process-wide env)
test: $(VENV)/.test
	scripts/system-deps.sh test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:randomly --ignore=tests/torch_suite
	cd tests/torch_suite && ../../$(PY) -m pytest -q -p no:randomly -p no:cacheprovider test_pytorch_distributed.py

$(VENV)/.bench: $(VENV)/.test
	scripts/system-deps.sh bench
	$(PIP) install -q -e '.[test,bench]' 'torch==2.13.0'
	touch $@

## bench: eRDMA vs Gloo vs Open MPI on loopback and emulated WAN links; rewrites docs/benchmarks.md (root)
bench: $(VENV)/.bench
	benchmarks/reproduce.sh

bench-quick: $(VENV)/.bench
	QUICK=1 benchmarks/reproduce.sh

clean:
	rm -rf $(VENV) build *.egg-info
