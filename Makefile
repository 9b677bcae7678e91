# specpool: the two commands of the README.
#   make demo   # install, serve the local default (deploy/local.yaml), answer a first request
#   make test   # install, run the test suite (what .ci/run calls)
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= def __init__(self

.PHONY: install demo serve test stubs bench sysdeps

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0          # the CPU wheel, before anything can pull CUDA builds
	$(PY) -m pip install -e ".[test,bench]"
	touch $@

demo: install
	$(VENV)/bin/specpool demo --config deploy/local.yaml --max-new-tokens 32 "$(PROMPT)"

serve: install
	$(VENV)/bin/specpool serve --config deploy/local.yaml

# The ray-up test runs a real sshd on 127.0.0.1: install sshd and rsync where missing, with root or
# passwordless sudo only, no service started or enabled (else the test skips, saying why).
sysdeps:
	@sh tools/ssh_tools.sh

test: install sysdeps
	$(PY) -m pytest -q --durations=25

stubs: install
	$(PY) -m protos.generate

bench: install
	$(PY) -m benchmarks.speedup --config deploy/local.yaml --out benchmarks/results
