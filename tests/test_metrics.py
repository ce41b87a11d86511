"""Run-time figures (hyparallel.runtime.metrics): what a step is, the derived rates, and predictions
next to them."""

from __future__ import annotations

import pytest
import torch

import hyparallel as hp
from hyparallel.runtime import metrics
from hyparallel.runtime.metrics import RunMetrics


def cpu_plan(**parallel) -> hp.Plan:
    return hp.Plan.from_dict(
        {
            "cluster": {"name": "cpu", "gpus_per_node": 1},
            "parallel": parallel,
            "training": {"global_batch": 4, "micro_batch": 2, "seq_len": 16, "dtype": "fp32"},
        }
    )


def test_a_step_is_the_time_from_one_train_step_to_the_next(monkeypatch):
    meter = RunMetrics(cpu_plan(), flops_per_token=1e6, device=torch.device("cpu"), pp_rank=0)
    assert meter.last() is None and meter.summary() is None
    # a fake clock: what is measured is the arithmetic, not this machine
    clock = iter([10.0, 10.2, 10.25, 10.32])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    for _ in range(3):  # steps of 0.2 s (warm-up, left out of the summary), 0.05 s and 0.07 s
        meter.step_started(tokens=1000)
    assert len(meter.steps()) == 2  # the third is still open
    summary = meter.summary()  # closes it
    # the median of 0.05 and 0.07
    assert summary.steps == 2 and summary.step_time_s == pytest.approx(0.06)
    # the median of the rates
    assert summary.tokens_per_s == pytest.approx((1000 / 0.05 + 1000 / 0.07) / 2)
    assert summary.tflops_per_gpu == pytest.approx(3 * 1e6 * summary.tokens_per_s / 1e12)
    # the cpu preset's fp32 peak
    assert summary.mfu == pytest.approx(summary.tflops_per_gpu * 1e12 / 36.6e9)
    assert summary.predicted_step_time_s is None  # a plan without predictions
    # the CPU stand-in (Note [peak memory on the CPU]): peak resident set beyond the preset's
    # reserve
    assert summary.peak_memory_gib is not None and summary.peak_memory_gib >= 0
    # newest first, warm-up in
    assert meter.last(5).steps == 3 and meter.last().step_time_s == pytest.approx(0.07)
    assert meter.last(5).step_time_s == pytest.approx(0.07)  # the median of 0.2, 0.05 and 0.07
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: 11.0)
    meter.step_started(tokens=1000)  # training may go on after a summary: a new step opens
    assert len(meter.steps()) == 3


def test_parallel_model_measures_its_steps_against_the_plans_prediction(world_of_one):
    model = hp.models.build("gpt-tiny")
    pmodel = hp.parallelize(
        model, cpu_plan(), seed=0, device="cpu"
    )  # a hand plan: the planner's prediction is filled in
    assert pmodel.plan.predicted is not None and pmodel.plan.predicted.step_time_s > 0
    graph = hp.trace(hp.models.build("gpt-tiny"), torch.zeros(1, 16, dtype=torch.long))
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
    summary = pmodel.metrics.summary()
    assert summary.steps == 2 and summary.step_time_s > 0
    assert summary.tflops_per_gpu == pytest.approx(
        3 * graph.flops / 16 * summary.tokens_per_s / 1e12, rel=1e-6
    )
    assert summary.predicted_step_time_s == pmodel.plan.predicted.step_time_s
    # compared with allocated memory: no reserve
    reserve = pmodel.plan.cluster.device.reserved_bytes / 2**30
    assert summary.predicted_memory_gib == pytest.approx(
        pmodel.plan.predicted.memory_gib[0] - reserve
    )
    assert "predicted" in summary.line() and "tokens/s" in summary.line()
