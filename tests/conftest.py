"""Shared fixtures: models built once per session (meta device unless a test needs weights)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hyparallel as hp

REPO = Path(__file__).resolve().parent.parent

# Tiny configs for Hugging Face models: small vocabularies make transformers warn about token ids.
logging.getLogger("transformers").setLevel(logging.ERROR)

HF_GPT2_TINY = "hf:GPT2LMHeadModel n_layer=2 n_embd=64 n_head=4 vocab_size=128 n_positions=64 bos_token_id=0 eos_token_id=0"
HF_LLAMA_TINY = (
    "hf:LlamaForCausalLM num_hidden_layers=2 hidden_size=64 num_attention_heads=4 num_key_value_heads=2 "
    "intermediate_size=128 vocab_size=128 max_position_embeddings=64 bos_token_id=0 eos_token_id=0"
)


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root."""
    return REPO


@pytest.fixture(scope="session")
def gpt_tiny_graph():
    model = hp.models.build("gpt-tiny")
    return model, hp.trace(model, model.example_inputs(2, 16))


def torchrun(repo: Path, script: str, out: Path, processes: int, *args: str, env: dict | None = None,
             timeout: int = 900) -> None:
    """Launch ``script`` under torchrun with gloo; it writes its results to ``out`` (rank 0, after the last case).

    A launch whose results are complete but that aborted while the processes tore their gloo groups down
    ("terminate called ..." after ``destroy_process_group``, a known gloo shutdown race under load) is
    accepted: everything it checked was already gathered and written. Any other failure fails the test.
    """
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
         str(repo / script), str(out), *args],
        capture_output=True, text=True, env=environ, timeout=timeout,
    )
    teardown_only = out.exists() and "terminate called" in proc.stderr  # out is written after the last collective
    assert proc.returncode == 0 or teardown_only, proc.stderr[-4000:]
