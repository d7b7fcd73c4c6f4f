# Every target does its own set-up: a fresh machine needs only python3.11 and make.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
SPECDEC := $(VENV)/bin/specdec
STAMP := $(VENV)/.installed

.PHONY: setup promtool lint test test-fast test-cluster demo bench bench-guidellm clean proto image image-test \
	image-clean

setup: $(STAMP) promtool

# promtool (Debian's prometheus package, where apt-get is) for the alert rules' tests: scripts/install_promtool.sh.
promtool:
	scripts/install_promtool.sh

$(STAMP): pyproject.toml tests/clients/node/package-lock.json
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build on disk, never a CUDA download.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The cross-stack client test (Node's @grpc/grpc-js) runs where node is installed.
	if command -v npm >/dev/null; then npm ci --prefix tests/clients/node --no-audit --no-fund --silent; fi
	touch $(STAMP)

# Dependencies run one way (pyproject.toml's [tool.importlinter]); ruff's checks and format; mypy on the engine.
lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy specdec_core

# The whole suite (what CI runs), after lint. Only the `cluster` tests run apart (test-cluster).
test: lint
	$(PY) -m pytest -q

# The inner loop: the suite without the tests that start Ray or Ray Serve (`serve`: every test on the session's
# cluster, tests/conftest.py), the long statistical checks (`slow`) and the multi-node tests (`cluster`). No lint.
test-fast: setup
	$(PY) -m pytest -q -m "not serve and not slow and not cluster"

# The multi-node tests (tests/cluster): several Ray nodes on this machine, nodes lost under load. A pytest session of
# their own: the suite keeps one Ray cluster per session (pyproject's addopts leave out the `cluster` mark).
test-cluster: setup
	$(PY) -m pytest -q -m cluster tests/cluster

# The main job: pull the demo pair once into $(SPECDEC_HOME) (default ~/.cache/specdec), serve it on a local
# Ray Serve (gRPC, port 9000) and stream one completion with speculation on and off.
demo: setup
	$(SPECDEC) models pull qwen2.5-coder-1.5b-instruct
	$(SPECDEC) models pull qwen2.5-coder-0.5b-instruct
	$(SPECDEC) demo deployments/configs/demo_cpu.yaml

# The in-process benchmark of the demo pair (target-only vs speculative, same prompts, one process).
bench: setup
	$(SPECDEC) models pull qwen2.5-coder-1.5b-instruct
	$(SPECDEC) models pull qwen2.5-coder-0.5b-instruct
	$(SPECDEC) bench offline --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
		--prompts benchmarks/prompts/demo.jsonl --max-new-tokens 96 --temperature 0 --dtype bfloat16 \
		--num-speculative-tokens auto --draft-quantization int8 --json out/demo.json

# guidellm (an outside load generator) next to `specdec bench serve`, on the demo pair's HTTP API, speculation on and
# off (scripts/bench_guidellm.sh; reports in $(GUIDELLM_OUT)). guidellm gets its own venv: it pins its own torch and
# transformers. torch first and pinned, as in setup: the CPU build, never a CUDA download.
GUIDELLM_VENV ?= .venv-guidellm
GUIDELLM_CONFIG ?= deployments/configs/demo_cpu.yaml
GUIDELLM_OUT ?= out/guidellm

$(GUIDELLM_VENV)/bin/guidellm:
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(GUIDELLM_VENV)/bin/pip install --quiet guidellm==0.8.1

bench-guidellm: setup $(GUIDELLM_VENV)/bin/guidellm
	$(SPECDEC) models pull qwen2.5-coder-1.5b-instruct
	$(SPECDEC) models pull qwen2.5-coder-0.5b-instruct
	GUIDELLM=$(GUIDELLM_VENV)/bin/guidellm SPECDEC=$(SPECDEC) scripts/bench_guidellm.sh $(GUIDELLM_CONFIG) $(GUIDELLM_OUT)

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache

# Regenerate the checked-in gRPC stubs after editing proto/specdec/v1/*.proto (a test checks they match).
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto --grpc_python_out=proto proto/specdec/v1/*.proto

# The container image (k8s/image/Containerfile) with podman: on a Debian rootfs made here with debootstrap from this
# machine's apt mirror (kept in $(IMAGE_CACHE), imported once as localhost/specdec-base:<release>), or on BASE, e.g.
# BASE=rayproject/ray:2.60.0-py311-cpu. torch as setup installs it: the wheel this machine's pip finds, else
# TORCH_INDEX_URL (default: the CPU index). Settings: scripts/image_build.sh. docs/deploy.md#the-image
IMAGE ?= specdec:dev
BASE ?=
TORCH_INDEX_URL ?=
IMAGE_CACHE ?= $(HOME)/.cache/specdec/image
PODMAN_RUN_FLAGS ?= --runtime runc --ulimit nofile=20000:20000 --ulimit nproc=32768:32768

image:
	IMAGE='$(IMAGE)' BASE='$(BASE)' TORCH_INDEX_URL='$(TORCH_INDEX_URL)' IMAGE_CACHE='$(IMAGE_CACHE)' \
		PYTHON='$(PYTHON)' scripts/image_build.sh

# The image serves the tiny pair (built here, mounted read-only) and answers a client outside it over gRPC and HTTP.
image-test: setup image
	$(PY) scripts/image_smoke.py --image '$(IMAGE)' --run-flags '$(PODMAN_RUN_FLAGS)'

# Forget the base: the next `make image` runs debootstrap again and rebuilds every layer.
image-clean:
	podman image rm --ignore '$(IMAGE)' $$(podman images --format '{{.Repository}}:{{.Tag}}' localhost/specdec-base)
	rm -rf '$(IMAGE_CACHE)' build/image
