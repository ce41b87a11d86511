"""Memory the planner counts against what the runtime holds: each term by hand, the H200 rows, a
real CPU step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hyparallel as hp
from hyparallel.planner import costs, search
from hyparallel.planner.profile import ModelProfile
from tests.conftest import torchrun

GIB = 2**30


def test_after_backward_memory_by_hand():
    # Note [memory after the backward]: weights 4 + gradients 4 + m, v 8 (autocast's copy freed with
    # the step), plus the larger of AdamW foreach's sqrt (4 bytes per parameter stepped) and the
    # clip's float64 squares (16 bytes per element of the largest tensor).
    params, largest = 1_000_000, 200_000
    assert costs.after_backward_bytes(params, largest, "bf16", 0, 1) == 16 * params + 4 * params
    assert costs.after_backward_bytes(params, 400_000, "fp32", 0, 1) == 16 * params + 16 * 400_000
    # ZeRO 1 at dp 4: master and m, v sharded, weights gathered (4 + 2 copy) and gradients whole
    # (4); the step touches a quarter of the parameters.
    zero1 = (4 / 4 + 4 + 2 + 4 + 8 / 4) * params
    assert costs.after_backward_bytes(params, 10_000, "bf16", 1, 4) == pytest.approx(
        zero1 + 4 * params / 4
    )


def test_selective_recomputation_keeps_a_copy_per_microbatch_in_flight():
    # Note [16-bit copies under recomputation]: 2 bytes per parameter for each micro-batch in flight
    # beyond the one state_bytes_per_param counts; nothing under full recomputation, in fp32, or
    # under ZeRO 3.
    assert costs.recompute_copies_bytes_per_param("bf16", "selective", 0, 4.0) == 2 * 3
    assert costs.recompute_copies_bytes_per_param("bf16", "selective", 0, 1.0) == 0
    assert costs.recompute_copies_bytes_per_param("bf16", "full", 0, 4.0) == 0
    assert costs.recompute_copies_bytes_per_param("fp32", "selective", 0, 4.0) == 0
    assert costs.recompute_copies_bytes_per_param("bf16", "selective", 3, 4.0) == 0


def test_boundary_tensors_are_the_fp32_residual_stream():
    # Note [a pipeline stage's boundary tensors]: gpt-tiny's cut is the (s, h) hidden state, fp32
    # under autocast: 4 bytes per element in bf16 as in fp32 plans.
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    cluster = hp.ClusterSpec.preset("cpu")
    for dtype in ("bf16", "fp32"):
        assert ModelProfile(graph, cluster, dtype, 16).boundary_bytes == 16 * 64 * 4


# Note [the H200 rows]
#     benchmarks/results/gpu/step.json holds three gpt-1.3b rows measured one after another in one
#     process by benchmarks/gpu_step.py (planner's pick, micro-batch 4, full recomputation). A
#     ParallelModel holds reference cycles, so each variant's fp32 weights (4 bytes x 1,315,819,520
#     parameters = 4.90 GiB) outlived it until the garbage collector ran, and counted in the next
#     variants' peaks (gpu_step.py now collects and checks; shown on the CPU: the weights of a
#     variant are alive after it returns and gone after gc.collect()). The full- recomputation row
#     measured 51.82 GiB there, 42.01 in profile.txt (run 2) where it ran second; 51.82 - 42.01 =
#     9.81 GiB = 2 x 4.90. So the committed peaks are read less the weights of every earlier
#     variant: the pick 90.07 (first), micro-batch 4 45.23 - 4.90 = 40.33, full recomputation 51.82
#     - 9.80 = 42.02. The pick is also held to its committed figure as measured. A re-run of
#     gpu_check.sh on a lent GPU replaces the inference.
WEIGHTS_GIB = 4 * 1_315_819_520 / GIB
H200_ROWS = {  # variant: (constraints, earlier variants in the process)
    "planner's pick": ({}, 0),
    "micro-batch 4": ({"micro_batch": 4}, 1),
    "recompute full": ({"recompute": "full"}, 2),
}


@pytest.fixture(scope="module")
def h200_step(repo):
    return json.loads((repo / "benchmarks" / "results" / "gpu" / "step.json").read_text())


@pytest.mark.parametrize("variant", list(H200_ROWS))
def test_h200_rows_are_not_under_predicted(variant, h200_step):
    constraints, earlier = H200_ROWS[variant]
    model = hp.models.build("gpt-1.3b")
    cluster = hp.ClusterSpec.resolve("h200", num_nodes=1, gpus_per_node=1)
    result = search(model, cluster, 16, 2048, "bf16", tp=1, pp=1, dp=1, **constraints)
    predicted = result.best[0].peak_memory_bytes / GIB
    row = h200_step[variant]
    measured = row["peak_allocated_gib"] - earlier * WEIGHTS_GIB  # Note [the H200 rows]
    assert (
        row["config"]
        == f"micro-batch {result.plan().training.micro_batch} x {result.plan().num_microbatches}, "
        + f"recompute {result.plan().parallel.recompute}"
    )
    assert predicted >= measured, (
        f"{variant}: predicted {predicted:.2f} GiB < measured {measured:.2f} GiB"
    )
    assert predicted <= 1.15 * measured, (
        f"{variant}: predicted {predicted:.2f} GiB, far over {measured:.2f} GiB"
    )


def test_a_real_step_stays_under_the_prediction(tmp_path: Path, repo):
    # Two processes, two steps of gpt-tiny per plan (train_step, clip, AdamW): every rank's peak
    # tensor bytes, counted from before materialisation, within its stage's prediction, and at least
    # its state (so the count is not blind). The count sees frees made on gloo's threads (Note
    # [measuring a CPU peak]); measured over two runs of each (an Intel Xeon, 2 cores): pp
    # 0.91-0.94, dp 0.82-0.98, tp with the vocab-parallel loss 0.835, with sequence parallelism too
    # 0.87-0.90, tp with the logits gathered 0.90 (0.998 when gloo freed the logits' all-gather
    # late, in CI: Note [gloo's late frees] and Note [the gathered logits] in profile.py; 1.03 in CI
    # before the second).
    cases = (
        "pp2-1f1b-bf16",
        "pp2-1f1b-fp32",
        "dp2-bf16",
        "tp2-fp32",
        "tp2-sp-bf16",
        "tp2-gathered-fp32",
    )
    results = torchrun(
        repo, "tests/distributed/memory_worker.py", tmp_path / "out.jsonl", 2, *cases
    )
    assert set(results) == set(cases)
    for case, ranks in results.items():
        for r in ranks:
            assert r["state_bytes"] <= r["peak_bytes"] <= r["predicted_bytes"], (case, r)
