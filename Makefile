# Every target installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CI and `make install` take the CPU wheel; for CUDA: make install TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
# The main job: a local cluster training on Fashion-MNIST.
RUN_ARGS ?= --workers 2 --policy delay-1 --model mlp --epochs 8

.PHONY: install data proto lint typecheck test test-unit run results image clean

install: $(VENV)/.installed data

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# Debian packages: Fashion-MNIST (dataset-fashion-mnist) for the main job; docker-compose
# (and with it docker.io) for deploy/ and its image test, iproute2 for the network-namespace
# cluster test, Slurm and munge for the Slurm job's test (started by the test, not by
# systemd). Installed when run as root; otherwise say what is missing.
DEB_PACKAGES := dataset-fashion-mnist docker-compose docker.io iproute2 slurmctld slurmd slurm-client munge

data:
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else \
		echo "Missing Debian packages:$$missing; run 'sudo apt-get install$$missing'. Without dataset-fashion-mnist, pass --data-dir with a folder of IDX files; the tests that need the others skip and say why."; \
	fi

# Regenerates paramserver/_proto from protos/ (the generated code is committed).
proto: $(VENV)/.installed
	rm -rf $(VENV)/proto-out && mkdir -p $(VENV)/proto-out
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$(VENV)/proto-out --pyi_out=$(VENV)/proto-out \
		--grpc_python_out=$(VENV)/proto-out protos/paramserver/v1/paramserver.proto
	sed -i 's/^from paramserver\.v1 import/from paramserver._proto import/' \
		$(VENV)/proto-out/paramserver/v1/paramserver_pb2_grpc.py
	cp $(VENV)/proto-out/paramserver/v1/paramserver_pb2*.py* paramserver/_proto/

lint: $(VENV)/.installed
	$(PY) -m ruff check paramserver tests
	$(PY) -m ruff format --check paramserver tests

typecheck: $(VENV)/.installed
	$(PY) -m mypy paramserver

# The whole suite on TEST_JOBS processes (pytest-xdist; 0: one), the tests of one
# machine-wide resource one at a time (xdist_group, tests/conftest.py). 2, the default,
# fits the 2-core machine: most tests wait on processes and sockets, and the processes
# they start are forked from a zygote (paramserver/cluster/zygote), not exec'd.
TEST_JOBS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup

# A faster subset for work in progress: tests/unit alone.
test-unit: install
	$(PY) -m pytest -q -n $(TEST_JOBS) tests/unit

run: install
	$(PY) -m paramserver launch $(RUN_ARGS)

# docs/RESULTS.md and README's results block from measured runs' JSON (docs/results/, and the
# dated latest lines of docs/bench/*.json): the main job per policy, a few minutes;
# RESULTS_ARGS=--resnet adds the ResNet (about 30 min), --render only rewrites the pages.
RESULTS_ARGS ?=
results: install
	$(PY) -m paramserver.bench.report.results $(RESULTS_ARGS)

# The Docker image (deploy/build-image.sh): needs a running Docker daemon, and works offline
# (a wheelhouse made here; a Debian base made with debootstrap when no registry answers).
IMAGE ?= paramserver:cpu
image: install
	PYTHON=$(PY) deploy/build-image.sh $(IMAGE)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
