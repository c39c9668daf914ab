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

# every plugin distribution, and the example plugin of docs/plugins.md (installed and tested like one)
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml))) examples/erdma-example/

# system packages first: erdma-dpdk and erdma-quic compile their C shims against DPDK's / ngtcp2's headers
# when they are installed
$(VENV)/.test: $(VENV)/.core $(addsuffix pyproject.toml,$(PLUGINS)) $(wildcard plugins/*/setup.py)
	scripts/system-deps.sh test
	$(PIP) install -q -e '.[test]' 'torch==2.13.0' $(addprefix -e ,$(PLUGINS))
	touch $@

## demo: a 4-rank job on loopback with the embedded defaults; prints the allreduce table
demo: $(VENV)/.core
	$(VENV)/bin/erdma bench -n 4 --op allreduce --sizes 4K,64K,1M,16M --iters 10

## test: install everything (core, plugins/*, the example plugin) and run lint plus every suite: the core's,
## PyTorch's own distributed tests (a pytest process of their own: they set process-wide env), each plugin's
## in its folder (erdma-quic's on its default engine, the compiled one), and the core's collective and failure
## tests again over QUIC on aioquic (the reference engine), then over QUIC on the compiled engine (ngtcp2)
## striped across a worker, then over DPDK's memif (erdma-dpdk)
test: $(VENV)/.test
	scripts/system-deps.sh test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:randomly --ignore=tests/torch_suite
	cd tests/torch_suite && ../../$(PY) -m pytest -q -p no:randomly -p no:cacheprovider test_pytorch_distributed.py
	set -e; for p in $(PLUGINS); do (cd $$p && $(abspath $(PY)) -m pytest -q -p no:randomly); done
	ERDMA_TRANSPORT=quic ERDMA_TRANSPORT_QUIC_SECRET=ci-secret ERDMA_TRANSPORT_QUIC_ENGINE=aioquic \
		$(PY) -m pytest -q -p no:randomly tests/test_collectives.py tests/test_failures.py tests/test_progress.py
	ERDMA_TRANSPORT=quic ERDMA_TRANSPORT_QUIC_SECRET=ci-secret ERDMA_TRANSPORT_QUIC_ENGINE=ngtcp2 \
		ERDMA_TRANSPORT_QUIC_WORKERS=1 ERDMA_TRANSPORT_QUIC_PART_BYTES=65536 \
		$(PY) -m pytest -q -p no:randomly tests/test_collectives.py tests/test_failures.py tests/test_progress.py
	ERDMA_TRANSPORT=dpdk \
		$(PY) -m pytest -q -p no:randomly tests/test_collectives.py tests/test_failures.py tests/test_progress.py

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
