# Two commands set up a fresh machine (see README): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch, from pip's index unless TORCH_INDEX names one of PyTorch's: the one way to pick a build,
# here and in the Dockerfile (docs/gpu.md):
#   make torch TORCH_INDEX=https://download.pytorch.org/whl/cu128   # CUDA 12.8 build into .venv
#   make torch TORCH_INDEX=https://download.pytorch.org/whl/cpu     # CPU-only build
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# make up MODEL=DIR DEVICE=cuda: a checkpoint folder (or a hub id already downloaded) and a device.
MODEL ?=
DEVICE ?=
# Prometheus metrics on loopback under make up: blockd on METRICS_PORT, computed on the next
# ports, the gateway on GATEWAY_ADDR/metrics.
METRICS_PORT ?= 9100
UP_FLAGS = $(if $(MODEL),--model $(MODEL)) $(if $(DEVICE),--device $(DEVICE)) --metrics-port $(METRICS_PORT)
DEMO_FLAGS = $(if $(MODEL),--model $(MODEL))
TORCH_INDEX_FLAG = $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
RUN_DIR ?= run
BLOCKD_ADDR ?= 127.0.0.1:50051
COMPUTED_ADDR ?= 127.0.0.1:50052
COMPUTED2_ADDR ?= 127.0.0.1:50053
GATEWAY_ADDR ?= 127.0.0.1:8000
PYTEST_ARGS ?=

.PHONY: install native test-native torch proto proto-check test test-slow lint format bench bench-quick bench-peer bench-gateway up up2 down demo clean

install: $(VENV)/.installed $(VENV)/.kernels $(VENV)/.native

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" $(TORCH_INDEX_FLAG)
	$(BIN)/pip install -q -e ".[dev]"
	cd clients/node && npm install --no-audit --no-fund --silent
	touch $@

# computed's native CPU decode kernel, built once here so no daemon start waits for it.
$(VENV)/.kernels: $(VENV)/.installed $(wildcard computed/kernels/*.cpp computed/kernels/*.h)
	$(BIN)/python -m computed.kernels
	touch $@

# blockd's directory core compiled with mypyc (blockd/native.py); the daemon loads it when current.
$(VENV)/.native: $(VENV)/.installed $(wildcard blockd/*.py)
	$(BIN)/python -m blockd.native
	touch $@

native: $(VENV)/.native

# Replace .venv's torch with TORCH_SPEC from TORCH_INDEX (e.g. a CUDA build).
torch: $(VENV)/.installed
	$(BIN)/pip install -q --force-reinstall --no-deps "$(TORCH_SPEC)" $(TORCH_INDEX_FLAG)
	$(BIN)/pip install -q "$(TORCH_SPEC)" $(TORCH_INDEX_FLAG)
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'CUDA available:', torch.cuda.is_available())"

# Generated code lives in kvcache/ and is never edited by hand.
proto: install
	rm -rf kvcache
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/kvcache/v1/*.proto
	touch kvcache/__init__.py kvcache/v1/__init__.py

proto-check: install
	$(BIN)/buf lint

lint: install proto-check
	$(BIN)/ruff check blockd computed clients gateway tests bench tools
	$(BIN)/ruff format --check blockd computed clients gateway tests bench tools

format: install
	$(BIN)/ruff format blockd computed clients gateway tests bench tools
	$(BIN)/ruff check --fix blockd computed clients gateway tests bench tools

test: install
	$(BIN)/buf lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-native

# The directory core's tests again, in process, on its compiled build (blockd/native.py).
test-native: install
	BLOCKD_NATIVE=on $(BIN)/python -m pytest -q tests/blockd $(PYTEST_ARGS)

test-slow: install
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench

bench-quick: install
	$(BIN)/python -m bench --quick

# vLLM's CPU build side by side (not in CI: its install is minutes and gigabytes, in .venv-vllm).
bench-peer: install
	PY=$(PY) bash bench/peer/install_vllm.sh .venv-vllm
	$(BIN)/python -m bench --only peer

# The gateway against round robin and against calling computed directly (aiperf when AIPERF names it).
bench-gateway: install
	$(BIN)/python -m bench.gateway $(if $(AIPERF),--aiperf $(AIPERF))

up: install
	$(BIN)/python -m clients.stack up --run-dir $(RUN_DIR) --blockd $(BLOCKD_ADDR) --computed $(COMPUTED_ADDR) \
		--gateway $(GATEWAY_ADDR) $(UP_FLAGS)

up2: install
	$(BIN)/python -m clients.stack up --run-dir $(RUN_DIR) --blockd $(BLOCKD_ADDR) --computed $(COMPUTED_ADDR) \
		--computed $(COMPUTED2_ADDR) --gateway $(GATEWAY_ADDR) $(UP_FLAGS)

down:
	$(BIN)/python -m clients.stack down --run-dir $(RUN_DIR)

demo: install
	$(BIN)/python -m clients.demo --run-dir $(RUN_DIR) --blockd $(BLOCKD_ADDR) --computed $(COMPUTED_ADDR) \
		--gateway $(GATEWAY_ADDR) $(DEMO_FLAGS)

clean:
	rm -rf $(RUN_DIR) .pytest_cache
