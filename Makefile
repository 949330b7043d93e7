# rlhf-ops: `make demo` runs the whole pipeline on the embedded default; `make test` runs lint + tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint install generated clean

demo: $(STAMP)
	$(BIN)/rlhf run

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

install: $(STAMP)

# torch first (pinned: the CPU build here; an unpinned torch pulls the CUDA build), then DeepSpeed
# built against it, then the project with its dev extras, all under constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip setuptools wheel
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt --no-build-isolation deepspeed
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# files derived from the code and params.yaml (tests fail when they are stale)
generated: $(STAMP)
	$(BIN)/rlhf params docs > docs/params.md
	$(BIN)/rlhf k8s write-manifests

clean:
	rm -rf .rlhf data/prepared models checkpoints metrics plots reports dvc.lock
