"""A pipeline stage follows the model's mode (Note [a stage follows the model's mode],
hyparallel/pipeline/split.py).

A traced program keeps the mode it was traced in; before, eval_step at pp 2 drew dropout masks in
eval mode.
"""

from __future__ import annotations

import pytest

from .conftest import torchrun

CASES = ("hf-gpt2", "gpt-tiny")


@pytest.fixture(scope="module")
def results(tmp_path_factory, repo):
    out = tmp_path_factory.mktemp("eval-mode") / "results.jsonl"
    return torchrun(repo, "tests/distributed/eval_mode_worker.py", out, 2, *CASES, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_eval_step_under_a_pipeline_is_the_single_devices_eval(results, case):
    result = next(r for r in results[case] if r["rank"] == 1)  # the last stage computes the loss
    first, second = result["eval"]
    # the same masks-free forward, its micro-batches summed in another order: rounding only
    assert first == pytest.approx(result["want"], rel=1e-5) and second == pytest.approx(
        first, rel=1e-6
    )
    # in training mode the stages still draw dropout
    assert result["train"][0] != result["train"][1]
