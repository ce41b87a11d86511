"""parallel.compile (hyparallel/runtime/compile.py) and the data position across a change of dp, in
one launch of 4 gloo processes (tests/distributed/compile_data_worker.py), and compile's one-process
refusals and planner flag.

Compiled with aot_eager (the CPU's backend: the ATen ops eager mode runs), one train_step's loss and
every gradient slice match a single device's, uncompiled, at rtol 1e-5 / atol 1e-6 (the bound of the
uncompiled parity tests).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import hyparallel as hp
from hyparallel.cli import main as cli
from hyparallel.runtime.compile import BACKEND_ENV, compile_backend
from hyparallel.spec.errors import ConfigError

from .conftest import assert_every_parameter_compared, torchrun

COMPILE = ["dp2-tp2-compile", "tp2-pp2-compile"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, repo):
    folder = tmp_path_factory.mktemp("compile-data")
    args = (str(folder / "ckpt"), *COMPILE, "data")
    return torchrun(
        repo, "tests/distributed/compile_data_worker.py", folder / "results.jsonl", 4, *args
    )


@pytest.mark.parametrize("case", COMPILE)
def test_compiled_training_equals_uncompiled_and_single_device(results, case):
    ranks = results[case]
    for rank in ranks:
        # each block compiled (pp = 1), or each rank's stage graph (pp = 2: one stage a rank)
        assert rank["compiled"] and rank["compiled_regions"] == (2 if case.startswith("dp2") else 1)
        assert rank["loss"] == pytest.approx(rank["ref_loss"], rel=1e-5)  # the single device's loss
        assert rank["grad_worst_rel"] <= 1e-5  # every gradient slice, elementwise in the worker
    compared: dict[int, set[str]] = {}
    for rank in ranks:
        compared.setdefault(rank["dp_rank"], set()).update(rank["grads_checked"])
    assert_every_parameter_compared(ranks[0]["parameter_groups"], compared)


def test_the_same_rows_on_every_dp_rank_are_warned_about_once(results):
    for rank in results["dp2-tp2-compile"]:
        # the whole batch on each rank: the same; asked again: checked already; each rank's shard:
        # different
        assert rank["same_rows"] == [True, False, False]
        warned = rank["same_rows_warnings"]
        if rank["rank"] == 0:
            assert len(warned) == 1 and "the same on all 2 data-parallel ranks" in warned[0]
            assert "pmodel.sampler(dataset)" in warned[0] and "\n" not in warned[0]
        else:
            assert warned == []


def test_the_data_position_resumes_under_another_dp(results):
    for rank in results["data"]:
        # dp 2 x tp 2 saved after 3 steps; dp 4 resumed: the 4th global batch is the same rows, so
        # the same loss
        assert rank["resumed_position"] == {**rank["position_after_4"], "consumed": 3 * 8}
        assert rank["loaded_share"] == 2
        assert rank["loaded_rows"] == rank["saved_rows"][3]
        assert rank["loaded_loss"] == pytest.approx(rank["saved_losses"][3], rel=1e-5)
        # 4 batches, no row twice
        assert len({row for rows in rank["saved_rows"] for row in rows}) == 32


def test_a_bad_backend_is_refused_before_any_collective(world_of_one, monkeypatch):
    with pytest.raises(
        ConfigError, match=r"compile_backend: torch.compile has no backend 'fast'; use one of"
    ) as info:
        compile_backend("fast")
    assert "\n" not in str(info.value)
    monkeypatch.setenv(BACKEND_ENV, "nope")
    with pytest.raises(ConfigError, match=rf"{BACKEND_ENV}: torch.compile has no backend 'nope'"):
        compile_backend()
    assert compile_backend("aot_eager") == "aot_eager"
    monkeypatch.delenv(BACKEND_ENV)
    assert compile_backend() == "inductor"
    model = hp.models.build("gpt-tiny")
    plan = hp.Plan.from_dict(
        {"training": {"global_batch": 2, "seq_len": 16}, "parallel": {"compile": True}}
    )
    with pytest.raises(ConfigError, match="no backend 'fast'"):
        hp.parallelize(model, plan, device="cpu", compile_backend="fast")
    assert not dist.is_initialized()


def test_the_planner_writes_compile_as_asked(capsys):
    # with 1 layer its embeddings would be planned onto parameter servers
    model = hp.models.build("gpt-tiny")
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    assert hp.plan(model, cluster, 4, 16, "fp32", dp=2, compile=True).parallel.compile
    assert not hp.plan(model, cluster, 4, 16, "fp32", dp=2).parallel.compile
    code = cli(
        ["plan", "--model", "gpt-tiny", "--gpus", "2", "--cluster", "cpu", "--global-batch", "4"]
        + ["--seq-len", "16", "--dp", "2", "--compile", "--json"]
    )
    assert code in (0, None) and '"compile": true' in capsys.readouterr().out
