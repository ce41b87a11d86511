# The two commands for a fresh machine (README.md): `make demo` and `make test`.
# Each one sets up its own virtual environment in .venv first.
PYTHON ?= python3
VENV ?= .venv
# The torch requirement installed first. On a machine without a GPU this exact
# version is the CPU build; on a GPU machine use e.g. `make test TORCH=torch`.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test bench sweep setup clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev,elastic,ps]"
	touch $@

demo: $(VENV)/.ready
	$(BIN)/hyparallel demo

# Lint and format check first (the [tool.ruff] settings in pyproject.toml): a finding fails the target.
test: $(VENV)/.ready
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

# Every benchmark against its peer, written to benchmarks/RESULTS.md (several minutes; a smoke test:
# $(BIN)/python benchmarks/run_all.py --quick).
bench: $(VENV)/.ready
	$(BIN)/python benchmarks/run_all.py

# Every causal-LM, masked-LM and encoder-decoder class of transformers, its image-classification, speech and a few
# text-classification classes, torch.nn-built, diffusers and torchtitan models (and hand-written ones) under tp 2,
# pp 2, tp 2 x pp 2 and dp 2 against one process; writes benchmarks/results/sweep.jsonl and docs/supported-models.md
# (hours on 2 cores; `$(BIN)/python benchmarks/sweep.py --only LlamaForCausalLM,Phi3ForCausalLM` reruns some,
# `--families vision --resume` one family). The sweep extra (pyproject.toml) first; torchtitan --no-deps: its own
# requirements (datasets, wandb, torchdata...) serve its trainer, not the model class the sweep builds, and the
# extra lists what that class imports. Neither install touches torch.
TORCHTITAN ?= torchtitan==0.3.0
sweep: $(VENV)/.ready
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev,elastic,ps,sweep]"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps "$(TORCHTITAN)"
	$(BIN)/python -m pytest -q -m sweep
	$(BIN)/python benchmarks/sweep.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
