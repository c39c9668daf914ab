# Two entry points on a fresh machine: `make demo` and `make test`. Both build their own venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# the index torch is installed from; empty: pip's own configuration (its default index, or what the machine sets)
TORCH_INDEX ?=
TORCH  := 'torch==2.13.0'
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

.PHONY: demo test check fuzz bench bench-quick lint clean

$(VENV)/.core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

# every plugin distribution, and the example plugin of docs/plugins.md (installed and tested like one)
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml))) examples/erdma-example/

# erdma-verbs' guest image (minutes: erdma_verbs/guest/build.sh) starts building beside the installs; its tests
# wait for it to finish (or build it themselves when this build failed or could not start)
GUEST_BUILD := plugins/erdma-verbs/erdma_verbs/guest/build.sh

# system packages first: erdma-dpdk, erdma-quic and erdma-verbs compile their C sides against DPDK's / ngtcp2's /
# libibverbs' headers when they are installed
$(VENV)/.test: $(VENV)/.core $(addsuffix pyproject.toml,$(PLUGINS)) $(wildcard plugins/*/setup.py)
	scripts/system-deps.sh test
	if [ -f $(GUEST_BUILD) ] && [ "$$(id -u)" = 0 ] && command -v mmdebstrap > /dev/null; then \
		nohup bash $(GUEST_BUILD) > $(VENV)/guest-build.log 2>&1 & fi
	$(PIP) install -q $(TORCH_FROM) $(TORCH)
	$(PIP) install -q -e '.[test]' $(TORCH) $(addprefix -e ,$(PLUGINS))
	touch $@

## demo: a 4-rank job on loopback with the embedded defaults; prints the allreduce table
demo: $(VENV)/.core
	$(VENV)/bin/erdma bench -n 4 --op allreduce --sizes 4K,64K,1M,16M --iters 10

## test: install everything (core, plugins/*, the example plugin) and run lint plus every suite
## (scripts/test-all.sh: every step runs even when one fails; a summary of each, then the 20 slowest tests)
test: $(VENV)/.test
	scripts/system-deps.sh test
	VENV=$(VENV) scripts/test-all.sh

# the contributor's loop (CONTRIBUTING.md): a venv of its own with the core and its test tools only (no torch, no
# plugins, no system packages, no root), then ruff, mypy and the core's tests that need nothing else
CHECK_VENV ?= .venv-check
CHECK_TESTS := $(addprefix tests/test_,$(addsuffix .py,config config_verdict wire mailbox serial schedules plans \
	program topology progress progress_driver offload single_copy meet discovery leftovers layers docs bench_docs makefile))

$(CHECK_VENV)/.check: pyproject.toml
	$(PYTHON) -m venv $(CHECK_VENV)
	$(CHECK_VENV)/bin/pip install -q -e '.[check]'
	touch $@

## check: ruff, mypy on erdma_core and the in-process core tests, in under a minute (CONTRIBUTING.md)
check: $(CHECK_VENV)/.check
	$(CHECK_VENV)/bin/ruff check .
	$(CHECK_VENV)/bin/mypy erdma_core
	$(CHECK_VENV)/bin/python -m pytest -q -p no:randomly $(CHECK_TESTS)

## fuzz: 100,000 new random inputs to every parser that reads a peer's bytes (make test runs a fixed 2,000)
fuzz: $(VENV)/.test
	ERDMA_FUZZ_EXAMPLES=100000 $(VENV)/bin/python -m pytest -q -p no:randomly -n $${TEST_WORKERS:-3} tests/test_fuzz.py

$(VENV)/.bench: $(VENV)/.test
	scripts/system-deps.sh bench
	$(PIP) install -q $(TORCH_FROM) $(TORCH)
	$(PIP) install -q -e '.[test,bench]' $(TORCH)
	touch $@

## bench: eRDMA vs Gloo vs Open MPI on loopback and emulated WAN links; rewrites docs/benchmarks.md (root)
bench: $(VENV)/.bench
	benchmarks/reproduce.sh

bench-quick: $(VENV)/.bench
	QUICK=1 benchmarks/reproduce.sh

clean:
	rm -rf $(VENV) $(CHECK_VENV) build *.egg-info
