"""hp.tracking.Tracker: the loss, the caller's scalars and each step's measured figures to
TensorBoard (read back from the event file) and W&B (offline, only where wandb is installed), from
rank 0 only."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import hyparallel as hp
from hyparallel.spec.errors import ConfigError


@pytest.fixture
def pmodel(world_of_one):
    model = hp.models.load("gpt-tiny num_layers=1").module
    plan = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=1),
        2,
        16,
        "fp32",
        dp=1,
        tp=1,
        pp=1,
    )
    return hp.parallelize(model, plan, device="cpu")


def test_tensorboard_gets_the_loss_the_scalars_and_the_step_figures(pmodel, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    with hp.tracking.Tracker(pmodel, tensorboard_dir=tmp_path / "tb") as tracker:
        for step in range(3):
            loss = pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
            losses.append(loss.item())
            tracker.log(
                step, loss=loss, lr=torch.tensor(0.5 / (step + 1)), tokens_seen=(step + 1) * 32
            )
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss",
        "lr",
        "tokens_seen",
        "perf/step_time_s",
        "perf/tokens_per_s",
        "perf/tflops_per_device",
    } <= tags
    assert "perf/mfu" in tags  # the cpu preset gives a peak to divide by
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, rel=1e-6)
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([0.5, 0.25, 0.5 / 3])
    # figures from the second log on: a step closes when the next one starts (Note [what a measured
    # step is])
    assert [e.step for e in events.Scalars("perf/step_time_s")] == [1, 2]
    assert all(e.value > 0 for e in events.Scalars("perf/tokens_per_s"))


def test_other_ranks_write_nothing(tmp_path):
    # nothing else of the model is read on rank 1
    stub = SimpleNamespace(env=SimpleNamespace(rank=1))
    tracker = hp.tracking.Tracker(stub, tensorboard_dir=tmp_path / "tb", wandb_project="never")
    tracker.log(0, loss=1.0)
    tracker.close()
    assert not (tmp_path / "tb").exists()


def test_missing_packages_and_bad_values_are_one_line(monkeypatch, tmp_path):
    stub = SimpleNamespace(env=SimpleNamespace(rank=0), metrics=SimpleNamespace(last=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match="needs the wandb package; pip install wandb") as info:
        hp.tracking.Tracker(stub, wandb_project="gpt")
    assert "\n" not in str(info.value)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(
        ConfigError, match=r'needs the tensorboard package; pip install "hyparallel\[track\]"'
    ):
        hp.tracking.Tracker(stub, tensorboard_dir=tmp_path / "tb")
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard")
    tracker = hp.tracking.Tracker(stub, tensorboard_dir=tmp_path / "tb")
    with pytest.raises(ConfigError, match=r"Tracker.log: lr='high' is not a number"):
        tracker.log(0, lr="high")
    tracker.close()


def test_wandb_offline_gets_the_same_values(pmodel, tmp_path, monkeypatch):
    wandb = pytest.importorskip(
        "wandb", reason="wandb is not installed (it is optional: pip install wandb)"
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = hp.tracking.Tracker(pmodel, wandb_project="hyparallel-test", config={"lr": 0.5})
    run, logged = tracker._wandb, []
    assert run.config["parallel"]["dp"] == 1 and run.config["lr"] == 0.5
    # an offline run keeps no summary to read back: what reaches wandb's own log is checked
    log = run.log
    monkeypatch.setattr(
        run, "log", lambda values, step: (logged.append((values, step)), log(values, step=step))
    )
    tracker.log(0, loss=2.5, lr=0.5)
    tracker.close()
    # no step closed yet: no perf/ figures
    assert wandb.run is None and logged == [({"lr": 0.5, "loss": 2.5}, 0)]
