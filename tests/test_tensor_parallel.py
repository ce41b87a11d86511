"""Tensor parallelism against the single-device model: 4 gloo processes, tp = 2 and 4, one launch
for every case.

The worker (tests/distributed/tp_worker.py) checks logits, loss and every parameter's gradient at
fp32, rtol 1e-5 / atol 1e-6 (the reason is in its docstring); this module reports each case
separately.
"""

from __future__ import annotations

import pytest

from .conftest import assert_every_parameter_compared, have_triton, torchrun

NO_TRITON = "triton is not installed: the fused kernels run under its CPU interpreter"

MODELS = ("gpt", "llama", "hf-gpt2", "hf-llama")
CASES = [f"{m}-tp2{suffix}" for m in MODELS for suffix in ("", "-vocab-loss", "-sp")]
# the vocab-parallel loss at tp 2 only
CASES += [f"{m}-tp4{suffix}" for m in MODELS for suffix in ("", "-sp")]
CASES += [
    f"{m}-tp{tp}-meta" for tp in (2, 4) for m in MODELS
]  # materialised slice by slice (GPT-2: Conv1D's (in, out))
# fused GeLU / SiLU epilogues in Triton (interpreter on the CPU)
CASES += ["gpt-tp2-triton", "hf-llama-tp2-triton"]


def launch(repo, out, processes: int, *extra: str, env: dict | None = None) -> dict:
    """case -> the result of each rank (the worker checked every rank's logits, loss and
    gradients)."""
    return torchrun(
        repo, "tests/distributed/tp_worker.py", out, processes, *extra, env=env, timeout=600
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory, repo):
    main = launch(repo, tmp_path_factory.mktemp("tp") / "results.jsonl", 4)
    if not have_triton():
        return main
    triton = launch(
        repo,
        tmp_path_factory.mktemp("tp") / "triton.jsonl",
        2,
        "triton",
        env={"TRITON_INTERPRET": "1"},
    )
    return {**main, **triton}


@pytest.mark.parametrize("case", CASES)
def test_matches_single_device(results, case):
    if case.endswith("-triton"):
        pytest.importorskip("triton", reason=NO_TRITON)
    ranks = results[case]
    # Each rank compared the gradient of every parameter by name (its slice of the split ones).
    assert_every_parameter_compared(
        ranks[0]["parameter_groups"], {r["rank"]: set(r["checked_params"]) for r in ranks}
    )
    result = ranks[0]
    if case.endswith("-sp"):
        # norms (and row biases) see part of the sequence: their gradients are summed
        assert result["synced"] > 0
    # The MLP activation module (GeLU; transformers' SiLU after gate_proj) moves into its column
    # Linear's epilogue, one per layer; the zoo Llama calls F.silu, a function, which stays where it
    # is.
    assert result["fused"] == (0 if case.startswith("llama-") else 2)
    if case.endswith("-triton"):
        assert result["triton"]  # the Triton path really ran


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith(("gpt-", "hf-gpt2-"))])
def test_each_rank_holds_its_share_of_split_weights(results, case):
    if case.endswith("-triton"):
        pytest.importorskip("triton", reason=NO_TRITON)
    for rank in results[case]:
        assert rank["split_fraction"] == pytest.approx(1 / rank["tp"], rel=1e-12)


def test_replicated_key_value_heads_cost_one_head_per_rank(results):
    # llama-tiny: hidden 64, 4 query heads of 16, 2 key/value heads, MLP 160, 2 layers, an untied
    # 256-row head. At tp=4 each rank holds one query head, the one key/value head it attends with
    # (half of k and v, not a quarter), and a quarter of the rest.
    h, head, ffn, vocab = 64, 16, 160, 256
    full = 2 * (h * h + 2 * (2 * head) * h + h * h + 3 * ffn * h) + vocab * h
    local = 2 * (head * h + 2 * head * h + head * h + 3 * (ffn // 4) * h) + vocab // 4 * h
    assert results["llama-tp4"][0]["split_fraction"] == pytest.approx(local / full, rel=1e-12)
    assert results["llama-tp2"][0]["split_fraction"] == pytest.approx(0.5, rel=1e-12)
