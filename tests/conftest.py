"""Shared fixtures: models built once per session (meta device unless a test needs weights)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import hyparallel as hp

REPO = Path(__file__).resolve().parent.parent

# Note [the suite's environment]
#     A user may run the suite from inside a launch, or with hyparallel's and Triton's switches
#     exported. torchrun's variables make parallelize join a launch that does not exist (MASTER_ADDR
#     alone made the in-process tests rendezvous), HYPARALLEL_TRITON=0 and TRITON_INTERPRET=1 change
#     which kernels run. Every test starts without them; a test or launch that needs one sets it
#     itself.
LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "TRITON_INTERPRET",
)
LAUNCH_PREFIXES = ("TORCHELASTIC_", "HYPARALLEL_", "DLROVER_")
# a file each launch's cases append their seconds to (profiling the suite), read before the
# environment is cleaned
CASE_TIMES = os.environ.get("HYPARALLEL_CASE_TIMES")


@pytest.fixture(scope="session", autouse=True)
def clean_launch_environment():
    """Every test (and every process a test starts) runs without launch or kernel variables.

    See Note [the suite's environment].
    """
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name in LAUNCH_VARIABLES or name.startswith(LAUNCH_PREFIXES):
                patch.delenv(name)
        yield


@pytest.fixture(autouse=True)
def own_graph_cache(tmp_path_factory, monkeypatch):
    """Each test (and every process it starts) reads and writes traced graphs in a cache of its own:
    a graph cached by one test (perhaps under a patched tracer) is never another's, and ~/.cache is
    left alone."""
    monkeypatch.setenv("HYPARALLEL_CACHE_DIR", str(tmp_path_factory.mktemp("graph-cache")))


@pytest.fixture
def world_of_one(monkeypatch):
    """parallelize in this process, a world of one without torchrun; the process group it made goes
    afterwards.

    Yields ``monkeypatch`` for tests that pretend to be one rank of a larger launch
    (``setenv("WORLD_SIZE", ...)``).
    """
    assert not dist.is_initialized()
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


# Tiny configs for Hugging Face models: small vocabularies make transformers warn about token ids.
logging.getLogger("transformers").setLevel(logging.ERROR)

HF_GPT2_TINY = (
    "hf:GPT2LMHeadModel n_layer=2 n_embd=64 n_head=4 vocab_size=128 n_positions=64 bos_token_id=0"
    " eos_token_id=0"
)
HF_LLAMA_TINY = (
    "hf:LlamaForCausalLM num_hidden_layers=2 hidden_size=64 num_attention_heads=4"
    " num_key_value_heads=2 intermediate_size=128 vocab_size=128 max_position_embeddings=64"
    " bos_token_id=0 eos_token_id=0"
)
HF_T5_TINY = (  # an encoder-decoder: its decoder needs decoder_input_ids
    "hf:T5ForConditionalGeneration d_model=32 d_kv=8 d_ff=64 num_layers=2 num_decoder_layers=2"
    " num_heads=4 vocab_size=128"
)


def have_triton() -> bool:
    """Whether triton is installed (pyproject installs it on Linux x86-64 only), without importing
    it here."""
    try:
        return importlib.util.find_spec("triton") is not None
    # ValueError: sys.modules["triton"] is None (imports of it blocked)
    except (ImportError, ValueError):
        return False


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root."""
    return REPO


@pytest.fixture(scope="session")
def gpt_tiny_graph():
    model = hp.models.build("gpt-tiny")
    return model, hp.trace(model, model.example_inputs(2, 16))


def torchrun(
    repo: Path,
    script: str,
    out: Path,
    processes: int,
    *args: str,
    env: dict | None = None,
    timeout: int = 900,
) -> dict[str, list[dict]]:
    """Launch ``script`` under torchrun with gloo; it writes its results to ``out`` (rank 0, after
    the last case). Returns them by case: case name -> every rank's result
    (tests/distributed/harness.run_cases).

    torchrun's agent with forked workers (tests/distributed/forked_torchrun.py, Note [forked
    workers]): torch and hyparallel imported once, not once a process.

    A launch whose results are complete but that aborted while the processes tore their gloo groups
    down ("terminate called ..." after ``destroy_process_group``, a known gloo shutdown race under
    load) is accepted: everything it checked was already gathered and written. Any other failure
    fails the test.
    """
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo), **(env or {})}
    proc = subprocess.run(
        [
            sys.executable,
            str(repo / "tests" / "distributed" / "forked_torchrun.py"),
            str(processes),
            str(repo / script),
        ]
        + [str(out), *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
    )
    # out is written after the last collective
    teardown_only = out.exists() and "terminate called" in proc.stderr
    failures = "\n".join(
        p.read_text() for p in sorted(out.parent.glob(f"{out.name}.rank*"))
    )  # tests/distributed/harness.py
    assert proc.returncode == 0 or teardown_only, (failures or proc.stderr)[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    if CASE_TIMES:
        with open(CASE_TIMES, "a") as times:
            for ranks in rows:
                seconds = max(r.get("case_seconds", 0.0) for r in ranks)
                times.write(f"{seconds:8.2f} {script} {ranks[0]['case']}\n")
    return {ranks[0]["case"]: ranks for ranks in rows}


def selected_cases(request: pytest.FixtureRequest, cases: list[str], sweep: list[str]) -> list[str]:
    """The ``cases`` a module's launch runs, in order: every one, except a case of ``sweep`` whose
    test (by its ``case`` parameter, marked ``sweep``) this run did not collect. `make test` leaves
    those out; `make sweep` (``pytest -m sweep``) runs them (pyproject.toml's markers)."""
    wanted = {
        item.callspec.params.get("case")
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    return [case for case in cases if case not in sweep or case in wanted]


def assert_every_parameter_compared(
    groups: list[list[str]], compared: dict[object, set[str]]
) -> None:
    """Each replica compared every parameter, by name: ``groups`` are the model's names (tied ones
    together, from tests/distributed/harness.parameter_groups), ``compared`` maps a replica (e.g. a
    dp rank) to the names its ranks compared. A name outside the model, or a parameter no rank of a
    replica compared, fails with its name.
    """
    known = {name for group in groups for name in group}
    assert compared, "no replica compared anything"
    for replica, names in compared.items():
        assert names <= known, (
            f"replica {replica} compared names the model does not have: {sorted(names - known)}"
        )
        missing = [group for group in groups if not names & set(group)]
        assert not missing, f"replica {replica} never compared {missing}"
