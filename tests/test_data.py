"""The data sampler (hyparallel/runtime/data.py): global batches that do not depend on dp, a
position that counts what was consumed and resumes under another dp, in one process;
tests/test_compile_and_data.py resumes a checkpoint saved under dp 2 into dp 4 in 4 gloo processes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hyparallel as hp
from hyparallel import checkpoint
from hyparallel.runtime.data import DataPosition, DataSampler
from hyparallel.spec.errors import ConfigError

ROWS, GLOBAL = 30, 8  # 3 full global batches an epoch, 6 rows dropped


def sampler(dp: int, rank: int, **options) -> DataSampler:
    return DataSampler(range(options.pop("rows", ROWS)), GLOBAL, dp, rank, **options)


def global_batches(dp: int, **options) -> list[list[int]]:
    """Each global batch as dp samplers hand it out: rank 0's share, then rank 1's, ... (what
    shard() cuts)."""
    shares = [list(sampler(dp, rank, **options)) for rank in range(dp)]
    share = GLOBAL // dp
    return [
        [row for rank in range(dp) for row in shares[rank][s * share : (s + 1) * share]]
        for s in range(len(shares[0]) // share)
    ]


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_global_batches_are_the_same_under_any_dp(dp):
    # seed + epoch 0
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(7)).tolist()
    expected = [order[s * GLOBAL : (s + 1) * GLOBAL] for s in range(ROWS // GLOBAL)]
    assert global_batches(dp, seed=7) == expected
    assert len(sampler(dp, 0)) == (ROWS // GLOBAL) * (GLOBAL // dp)


def test_a_rank_takes_the_rows_shard_gives_it():
    everything = torch.arange(ROWS)
    # the first global batch, in dp order
    first = sampler(4, 0, seed=3).global_rows(0, 0, 1)[0].flatten()
    for rank in range(4):
        mine = list(sampler(4, rank, seed=3))[: GLOBAL // 4]
        # pmodel.shard's cut: chunk r of dim 0
        assert mine == everything[first].chunk(4)[rank].tolist()


def test_the_position_counts_consumed_batches_not_prefetched_ones():
    made = sampler(2, 1, seed=1)
    loader = iter(DataLoader(range(ROWS), batch_size=made.share, sampler=made))
    # a prefetching loader draws ahead of the loop
    drawn = [next(loader).tolist() for _ in range(3)]
    made.step_consumed()  # the loop trained on one
    assert made.position() == DataPosition(
        epoch=0, consumed=GLOBAL, seed=1, shuffle=True, dataset_rows=ROWS
    )
    assert (
        next(iter(DataLoader(range(ROWS), batch_size=made.share, sampler=made))).tolist()
        == drawn[1]
    )


def test_epochs_roll_over_after_the_last_full_batch():
    made = sampler(2, 0, seed=4)
    first_epoch = list(made)
    for _ in range(ROWS // GLOBAL):
        made.step_consumed()
    assert (made.epoch, made.consumed) == (1, 0)
    second_epoch = list(made)
    # seed + 1: another order
    assert len(second_epoch) == len(first_epoch) and second_epoch != first_epoch
    made.set_epoch(1)  # DistributedSampler's habit: the current epoch keeps its place
    made.step_consumed()
    made.set_epoch(1)
    assert made.consumed == GLOBAL
    made.set_epoch(5)
    assert (made.epoch, made.consumed) == (5, 0)


def test_without_drop_last_the_last_batch_wraps_round():
    batches = global_batches(2, seed=2, drop_last=False)
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2)).tolist()
    assert len(batches) == 4 and batches[-1] == order[24:] + order[:2]
    made = sampler(2, 0, drop_last=False)
    for _ in range(3):
        made.step_consumed()
    assert made.epoch == 0 and made.batches_left() == 1
    made.step_consumed()
    assert (made.epoch, made.consumed) == (1, 0)


@pytest.mark.parametrize("new_dp", [1, 4])
def test_a_position_resumes_under_another_dp(new_dp):
    saved = sampler(2, 0, seed=9)
    for _ in range(2):
        saved.step_consumed()
    # as a checkpoint's marker holds it: JSON-able, the same on every rank
    state = saved.state_dict()
    resumed_batches = []
    for rank in range(new_dp):
        resumed = sampler(new_dp, rank, seed=0)  # another seed: the saved order wins
        resumed.load_state_dict(state)
        resumed_batches.append(list(resumed))
    assert [row for rows in resumed_batches for row in rows[: GLOBAL // new_dp]] == global_batches(
        2, seed=9
    )[2]


def test_an_evaluation_sampler_is_never_advanced():
    made = sampler(2, 1, shuffle=False, train=False)
    assert list(made) == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    made.step_consumed()
    assert made.consumed == 0


def test_bad_inputs_are_one_line_each():
    with pytest.raises(ConfigError, match=r"fewer than one global batch \(8\)") as info:
        sampler(2, 0, rows=5)
    assert "\n" not in str(info.value)
    assert len(sampler(2, 0, rows=5, drop_last=False)) == 4  # one wrapped batch
    with pytest.raises(ConfigError, match="the data position is not"):
        DataPosition.from_dict({"epoch": 1}, "ckpt/hyparallel.json: data")
    with pytest.raises(ConfigError, match="consumed=-8 is not a valid int"):
        DataPosition.from_dict(
            {"epoch": 0, "consumed": -8, "seed": 0, "shuffle": True, "dataset_rows": 30},
            "ckpt/hyparallel.json: data",
        )
    other = sampler(1, 0, rows=40)
    with pytest.warns(UserWarning, match="dataset of 30 rows, this one has 40"):
        other.resume(DataPosition(0, 16, 0, True, 30))
    assert other.consumed == 16


@pytest.fixture
def one_process(world_of_one):
    """A gpt-tiny ParallelModel in this process (a world of one); the group goes afterwards."""

    def start(seed: int = 0):
        model = hp.models.load("gpt-tiny num_layers=1").module
        cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=1)
        plan = hp.plan(model, cluster, 4, 16, "fp32", dp=1, tp=1, pp=1, micro_batch=4)
        return hp.parallelize(model, plan, seed=seed, device="cpu")

    return start


def test_a_checkpoint_saves_the_position_and_a_later_sampler_takes_it(one_process, tmp_path):
    dataset = TensorDataset(torch.randint(0, 256, (20, 17)))
    pmodel = one_process()
    assert pmodel.data_sampler is None
    evaluation = pmodel.sampler(dataset, shuffle=False, train=False)
    assert pmodel.data_sampler is None and evaluation.share == 4
    made = pmodel.sampler(dataset, seed=2)
    assert pmodel.data_sampler is made
    for (batch,) in DataLoader(dataset, batch_size=made.share, sampler=made):
        # counts each batch (DataSampler.step_consumed)
        pmodel.train_step(batch[:, :-1], batch[:, 1:])
        if made.consumed == 12:
            break
    checkpoint.save(pmodel, None, tmp_path, step=3)
    assert checkpoint._read_marker(checkpoint.latest(tmp_path))["data"] == made.state_dict()

    fresh = one_process(seed=1)
    checkpoint.load(fresh, None, tmp_path)
    # kept until a sampler is made
    assert fresh.data_sampler is None and fresh.data_position() == made.position()
    later = fresh.sampler(dataset)  # seed 0 asked, the checkpoint's 2 resumes
    assert later.position() == made.position() and list(later) == list(made)
    later.step_consumed()
    checkpoint.load(fresh, None, tmp_path)  # a sampler already there resumes at once
    assert later.position() == made.position()
