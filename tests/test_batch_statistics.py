"""Batch-statistics layers under data parallelism and micro-batches (issue 16): warned about,
sync_batchnorm refused on the CPU and with tp or pp; see Note [batch statistics] in
hyparallel.graph.checks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hyparallel as hp
from hyparallel.graph.checks import batch_statistics, batch_statistics_warning, check_plan
from hyparallel.spec.errors import ConfigError


def tiny_cnn(norm: type[nn.Module] = nn.BatchNorm2d) -> nn.Module:
    """Conv -> norm -> ReLU -> pooled linear head: 5 classes from 3 x 8 x 8 images."""
    layer = norm(4) if norm is not nn.GroupNorm else nn.GroupNorm(2, 4)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        layer,
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 5),
    )


def cnn_plan(dp: int = 1, micro_batches: int = 1, **parallel) -> hp.Plan:
    """A hand-written plan for the tiny CNN: 4 images per replica in ``micro_batches`` (no cluster,
    no predictions)."""
    return hp.Plan.from_dict(
        {
            "training": {
                "global_batch": 4 * dp,
                "micro_batch": 4 // micro_batches,
                "seq_len": 1,
                "dtype": "fp32",
            },
            "parallel": {"dp": dp, "tp": 1, "pp": 1, **parallel},
        }
    )


def images(micro_batches: int = 1) -> torch.Tensor:
    return torch.randn(4 // micro_batches, 3, 8, 8)


def batch_norm_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "batch-statistics" in str(w.message)]


def test_the_graph_finds_batch_norms_and_not_other_norms():
    assert batch_statistics(hp.trace(tiny_cnn(), images())) == ["1"]
    for norm in (nn.GroupNorm, nn.InstanceNorm2d):
        assert batch_statistics(hp.trace(tiny_cnn(norm), images())) == []


def test_two_micro_batches_warn_once_naming_the_module(world_of_one):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hp.parallelize(
            tiny_cnn(), cnn_plan(micro_batches=2), example_inputs=images(2), device="cpu"
        )
    messages = batch_norm_warnings(caught)
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "1 batch-statistics module(s) in training mode, first '1'" in messages[0]
    assert (
        "each of 2 micro-batches" in messages[0] and "parallel.sync_batchnorm: true" in messages[0]
    )
    assert all(w.category is UserWarning for w in caught if "batch-statistics" in str(w.message))


@pytest.mark.parametrize("case", ["no batch norm", "one micro-batch", "eval mode"])
def test_no_warning_when_the_statistics_are_the_single_devices(world_of_one, case):
    model = tiny_cnn(nn.GroupNorm) if case == "no batch norm" else tiny_cnn()
    if case == "eval mode":
        model.eval()
    micro = 1 if case == "one micro-batch" else 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hp.parallelize(
            model, cnn_plan(micro_batches=micro), example_inputs=images(micro), device="cpu"
        )
    assert batch_norm_warnings(caught) == []


def test_the_warning_names_dp_and_what_sync_batchnorm_leaves():
    dp2 = batch_statistics_warning(cnn_plan(dp=2), ["features.bn", "head.bn"])
    assert dp2.startswith("2 batch-statistics module(s) in training mode, first 'features.bn'")
    assert "each of dp = 2 ranks" in dp2 and "micro-batches" not in dp2
    assert batch_statistics_warning(cnn_plan(dp=2, sync_batchnorm=True), ["bn"]) is None
    synced = batch_statistics_warning(cnn_plan(dp=2, micro_batches=2, sync_batchnorm=True), ["bn"])
    assert (
        "each of 2 micro-batches" in synced
        and "dp = 2" not in synced
        and "num_microbatches: 1" in synced
    )


def test_sync_batchnorm_is_refused_on_the_cpu_before_any_collective(world_of_one):
    # torch 2.13's SyncBatchNorm raises "expected input tensor to be on GPU or XPU" on CPU tensors
    with pytest.raises(
        ConfigError, match=r"parallel.sync_batchnorm: torch.nn.SyncBatchNorm runs only on CUDA"
    ):
        hp.parallelize(
            tiny_cnn(), cnn_plan(sync_batchnorm=True), example_inputs=images(), device="cpu"
        )
    assert not dist.is_initialized()


@pytest.mark.parametrize("degrees", [{"tp": 2}, {"pp": 2}])
def test_sync_batchnorm_with_tp_or_pp_is_refused(degrees):
    plan = hp.Plan.from_dict(
        {
            "cluster": {"name": "cpu", "num_nodes": 1, "gpus_per_node": 2},
            "training": {"global_batch": 8, "micro_batch": 2, "seq_len": 16, "dtype": "fp32"},
            "parallel": {"dp": 1, "tp": 1, "pp": 1, **degrees, "sync_batchnorm": True},
        }
    )
    graph = hp.trace(hp.models.build("gpt-tiny"), torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(
        ConfigError, match=r"parallel.sync_batchnorm with tp = \d and pp = \d is not supported"
    ):
        check_plan(plan, graph, 2)


def test_sync_batchnorm_round_trips_and_defaults_to_false(tmp_path):
    assert cnn_plan().parallel.sync_batchnorm is False
    plan = cnn_plan(dp=2, sync_batchnorm=True)
    assert hp.Plan.from_dict(plan.to_dict()).parallel.sync_batchnorm is True
    plan.save(tmp_path / "plan.yaml")
    assert hp.Plan.load(tmp_path / "plan.yaml") == plan
    with pytest.raises(ConfigError, match=r"parallel.sync_batchnorm: expected true or false"):
        cnn_plan(sync_batchnorm="maybe")
