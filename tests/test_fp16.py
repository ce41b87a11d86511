"""fp16 plans scale the loss dynamically (Note [fp16 loss scaling] in
hyparallel/runtime/parallel.py; fp16_worker.py).

Without scaling, a small loss's gradients flush to zero in fp16's backward and training degrades
without an error; with it, one train_step's gradients are fp32's within fp16's rounding. An inf on
one rank skips the optimizer step on every rank of the tp, pp and dp axes and halves the scale; the
scaler's state comes back from a checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from hyparallel.runtime.loss import LossScaler, scale_grad

from .conftest import torchrun

CASES = ("dp2-pp2", "tp2-pp2")
# fp16 autocast rounds each matmul's inputs to 11 significant bits: the scaled gradients differ from
# fp32's by about 1e-3 relative (measured, worst parameter per rank: 0.7-1.5e-3), bounded at 2e-2.
# Unscaled, 92-95% of the gradient elements are zero against fp32's 0-17% (the embedding rows of
# tokens absent from the batch), and the worst parameter's gradient is off by 100%.
SCALED_RTOL = 2e-2


@pytest.fixture(scope="module")
def results(tmp_path_factory, repo):
    out = tmp_path_factory.mktemp("fp16") / "results.jsonl"
    return torchrun(repo, "tests/distributed/fp16_worker.py", out, 4, *CASES)


@pytest.mark.parametrize("case", CASES)
def test_scaling_keeps_the_gradients_that_plain_fp16_flushes_to_zero(results, case):
    for rank in results[case]:
        zeros = rank["zero_fraction"]
        assert rank["scaled_rel"] <= SCALED_RTOL
        assert zeros["scaled"] <= zeros["fp32"] + 0.01
        # what the scaler prevents
        assert zeros["plain"] >= zeros["fp32"] + 0.5 and rank["plain_rel"] > 0.5


@pytest.mark.parametrize("case", CASES)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(results, case):
    for rank in results[case]:
        assert rank["inf_skipped"] and rank["optimizer_state"] == 0
        before, after = rank["scale"]
        assert after == before / 2
        assert rank["clean_step_trained"]


@pytest.mark.parametrize("case", CASES)
def test_the_scaler_survives_a_checkpoint(results, case):
    for rank in results[case]:
        assert rank["resumed_scaler"] == rank["saved_scaler"]
        assert (
            rank["saved_scaler"]["growth_tracker"] == 1
            and rank["saved_scaler"]["skipped_steps"] == 1
        )


def test_the_scaler_backs_off_and_grows_as_grad_scaler_does():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0
    scaler.update(False)
    assert scaler.scale == 4.0
    scaler.update(False)
    assert scaler.scale == 8.0 and scaler.growth_tracker == 0
    reference = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    # the same defaults
    assert (reference.get_growth_factor(), reference.get_backoff_factor()) == (2.0, 0.5)


def test_scale_grad_leaves_the_value_and_scales_the_gradient():
    x = torch.tensor(3.0, requires_grad=True)
    y = scale_grad(x * 2, 0.25)
    y.backward()
    assert y.item() == 6.0 and x.grad.item() == 0.5
