"""A user's own training loop reads the single device's numbers under every plan
(tests/distributed/loop_worker.py).

One launch of 4 gloo processes runs the matrix: dp, tp (vocab-parallel and gathered logits), pp
(GPipe, 1F1B, interleaved), mixes, ZeRO 1, one to four micro-batches, torch.fx and torch.export
stages; train_step's loss and every gradient for the default loss, a (total, count) loss and a mean
loss, accumulation over calls, eval_step on a batch of another size, the forward's logits, greedy
generation, and Hugging Face inputs the pipeline was not traced with. Note [the loss a user reads]
(hyparallel/runtime/loss.py) defines the numbers.
"""

from __future__ import annotations

import pytest

from .conftest import assert_every_parameter_compared, torchrun

CASES = (
    "dp4-m2",
    "dp2-tp2-m1",
    "dp2-tp2-gathered-m2",
    "dp2-pp2-gpipe-m4",
    "dp2-pp2-interleaved-m2",
    "tp2-pp2-1f1b-m4",
    "dp2-tp2-zero1-m2",
    "dp2-pp2-zero1-m2",
    "encoder-tp2-pp2-m4",
    "hf-llama-tp2-pp2",
)
GLOBAL_TOKENS = 8 * 16  # loop_worker's GLOBAL_BATCH x SEQ


@pytest.fixture(scope="module")
def results(tmp_path_factory, repo):
    out = tmp_path_factory.mktemp("loop") / "results.jsonl"
    return torchrun(repo, "tests/distributed/loop_worker.py", out, 4, *CASES)


@pytest.mark.parametrize("case", CASES)
def test_losses_gradients_and_outputs_are_the_single_devices(results, case):
    ranks = results[case]
    # each loss on every rank, within rtol 1e-5 (also asserted in the worker, by name)
    for rank in ranks:
        for key, (got, want) in rank["losses"].items():
            assert got == pytest.approx(want, rel=1e-5), (key, rank["rank"])
        assert "train_step already ran the backward" in rank["backward_refused"]
        assert all(value <= 1e-5 for key, value in rank.items() if key.startswith("grad_worst_"))
    compared: dict[int, set[str]] = {}
    for rank in ranks:
        compared.setdefault(rank["dp_rank"], set()).update(rank["compared"])
    assert_every_parameter_compared(ranks[0]["parameter_groups"], compared)


def test_the_matrix_covers_one_and_several_micro_batches_and_every_loss(results):
    microbatches = {results[case][0]["microbatches"] for case in CASES}
    assert 1 in microbatches and max(microbatches) >= 4
    keys = {key for case in CASES for key in results[case][0]["losses"]}
    assert {
        "train_default",
        "train_pair",
        "train_mean",
        "eval_default",
        "eval_pair",
        "eval_labels",
    } <= keys


@pytest.mark.parametrize("case", [c for c in CASES if "zero" in c])
def test_an_optimizer_made_after_an_eval_under_zero_updates_the_weights(results, case):
    # FSDP2 keeps a forward's gathered weights for its backward under ZeRO 1 and 2: an eval and a
    # call of the model hand them back, so the parameters an optimizer then holds are the shards
    # (compared after one SGD step)
    compared: dict[int, set[str]] = {}
    for rank in results[case]:
        compared.setdefault(rank["dp_rank"], set()).update(rank["stepped_after_eval"])
    assert_every_parameter_compared(results[case][0]["parameter_groups"], compared)


@pytest.mark.parametrize(
    "case", [c for c in CASES if "pp" in c and c != "dp2-pp2-interleaved-m2" and "zero" not in c]
)
def test_greedy_generation_under_a_pipeline_gives_the_single_devices_tokens(results, case):
    # exact token ids are well defined only where no greedy pick is near a tie (loop_worker:
    # generation_margin)
    assert all(rank["generation_margin"] > 100 * 1e-5 for rank in results[case])
    assert all(rank["generated_equal"] for rank in results[case])
    # three lengths, at most one pipeline traced for them: torch.export's stages keep the length
    # symbolic (Note [one export for every length]); torch.fx's run any length as traced
    assert all(rank["generate_pipelines"] <= 1 for rank in results[case])
    if case.startswith(("hf-", "encoder-")):  # exported: traced once, for every length
        assert all(rank["generate_pipelines"] == 1 for rank in results[case])


def test_a_measured_step_spans_the_calls_between_optimizer_steps(results):
    assert all(rank["metrics_last_tokens"] == 2 * GLOBAL_TOKENS for rank in results["dp4-m2"])
