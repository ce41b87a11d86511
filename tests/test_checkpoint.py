"""Checkpoints: saved under one plan, loaded under another (4 gloo processes), in one process, and
exported.

tests/distributed/checkpoint_worker.py saves after 2 AdamW steps under dp 2 x tp 2 with ZeRO 1 and
loads into tp 2 x pp 2; here the same checkpoint loads into a single process and exports to one
state dict. Every comparison is with single-device training to the step saved; relative (norm) error
1e-5, the bound the parallel parity tests use after AdamW steps.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

import hyparallel as hp
from hyparallel import checkpoint
from hyparallel.cli import main as cli
from hyparallel.spec.errors import ConfigError

from .conftest import REPO, assert_every_parameter_compared, torchrun

sys.path.insert(0, str(REPO / "tests" / "distributed"))
from checkpoint_worker import GLOBAL_BATCH, GPT, SEED, SEQ, reference  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory, repo):
    folder = tmp_path_factory.mktemp("ckpt")
    out = folder / "results.json"
    results = torchrun(repo, "tests/distributed/checkpoint_worker.py", out, 4, str(folder / "run"))
    return folder / "run", results["save-dp2-tp2-zero1-load-tp2-pp2"]


def test_saved_under_one_plan_loads_under_another_and_training_continues(saved):
    _, ranks = saved
    # Weights and AdamW moments after 2-3 steps, ||parallel - single|| / ||single||: Adam's division
    # by the gradients' root mean square amplifies tp's rounding (the vocab-parallel loss's split
    # softmax among it), as in tests/distributed/parallel_worker.py's PARAM_RTOL: measured up to
    # 1.006e-5 here, bounded at 2e-5.
    for rank in ranks:
        assert rank["saved_error"] <= 2e-5  # dp2 x tp2 ZeRO 1 after 2 steps
        assert rank["loaded_error"] <= 2e-5  # tp2 x pp2: weights and both moments
        # step 3 under the new plan = the single device's step 3
        assert rank["continued_error"] <= 2e-5
        assert rank["step"] == 2 and rank["extra"] == {"samples_seen": 2 * GLOBAL_BATCH}
    loaded = {0: {name for rank in ranks for name in rank["loaded_checked"]}}  # dp 1: one replica
    assert_every_parameter_compared(ranks[0]["parameter_groups"], loaded)


@pytest.fixture
def one_process(world_of_one):
    """parallelize in this process (a world of one, no torchrun) for a model spec; the group goes
    afterwards."""

    def start(spec: str, global_batch: int, seed: int = 0):
        model = hp.models.load(spec).module
        plan = hp.plan(
            model,
            hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=1),
            global_batch,
            SEQ,
            "fp32",
            dp=1,
            tp=1,
            pp=1,
            micro_batch=global_batch,
        )
        return hp.parallelize(model, plan, seed=seed, device="cpu")

    return start


def test_loads_into_one_process(saved, one_process):
    directory, _ = saved
    pmodel = one_process(GPT, GLOBAL_BATCH, seed=SEED + 7)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1))
    # gradients but no optimizer state yet: it is made to load into
    pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
    assert checkpoint.load(pmodel, optimizer, directory)["step"] == 2
    ref_model, ref_optimizer = reference(2)
    ref = dict(ref_model.named_parameters())
    for name, param in pmodel.named_parameters():
        for got, want in (
            (param, ref[name]),
            (optimizer.state[param]["exp_avg"], ref_optimizer.state[ref[name]]["exp_avg"]),
        ):
            assert ((got - want).norm() / want.norm()).item() <= 1e-5, name


def test_export_gives_a_single_device_state_dict(saved, tmp_path, capsys):
    directory, _ = saved
    assert cli(["checkpoint", "export", str(directory), str(tmp_path / "model.pt")]) == 0
    assert "wrote" in capsys.readouterr().out
    model = hp.models.load(GPT, device="cpu").module
    # strict: every name, the tied head included
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    ref = dict(reference(2)[0].named_parameters())
    for name, param in model.named_parameters():
        assert ((param - ref[name]).norm() / ref[name].norm()).item() <= 1e-5, name


def test_a_checkpoint_cut_off_mid_write_is_passed_over(saved, tmp_path):
    directory, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    good = checkpoint.latest(copy)
    broken = copy / "step-00000009"  # renamed but its files cut short: no marker
    shutil.copytree(good, broken)
    (broken / checkpoint.MARKER).unlink()
    next(broken.glob("*.distcp")).write_bytes(b"")
    (copy / ".step-00000010.tmp").mkdir()  # a save that died before its rename
    (copy / "latest").write_text(broken.name)  # and a stale pointer
    assert checkpoint.latest(copy) == good
    newer = copy / "step-00000012"  # complete, but the crash came before the pointer moved
    shutil.copytree(good, newer)
    (copy / "latest").write_text(good.name)
    assert checkpoint.latest(copy) == newer
    empty = tmp_path / "empty"
    empty.mkdir()
    assert checkpoint.latest(empty) is None
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        checkpoint.load(None, None, empty)
    assert cli(["checkpoint", "export", str(empty), str(tmp_path / "x.pt")]) == 2


def test_a_checkpoint_of_another_model_is_refused(saved, one_process):
    directory, _ = saved
    pmodel = one_process("llama-tiny", 2)
    with pytest.raises(ConfigError, match=r"saved from model 'GPT', not 'Llama'"):
        checkpoint.load(pmodel, None, directory)


def test_factored_optimizer_state_is_refused_not_saved_wrong(tmp_path, one_process):
    pmodel = one_process("gpt-tiny", 2)
    optimizer = torch.optim.Adafactor(pmodel.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, SEQ + 1))
    pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    with pytest.raises(ConfigError, match="factored state .* cannot be resharded"):
        checkpoint.save(pmodel, optimizer, tmp_path / "ck", step=1)


def test_only_the_newest_checkpoints_are_kept(tmp_path, one_process):
    pmodel = one_process("gpt-tiny", 2)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, SEQ + 1))
    directory = tmp_path / "ck"
    for step in range(1, 5):
        pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
        checkpoint.save(pmodel, optimizer, directory, step=step, keep=2)
    assert sorted(p.name for p in directory.iterdir()) == [
        "latest",
        "step-00000003",
        "step-00000004",
    ]
    assert checkpoint.load(pmodel, optimizer, directory)["step"] == 4
    with pytest.raises(ConfigError, match="keep=0: the number of checkpoints to keep"):
        checkpoint.save(pmodel, optimizer, directory, step=5, keep=0)
    # refused before anything was written
    assert checkpoint.latest(directory).name == "step-00000004"


def test_a_memory_checkpoint_that_cannot_be_written_is_one_line(tmp_path, one_process, monkeypatch):
    pmodel = one_process("gpt-tiny", 2)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")  # the memory folder's parent is a file: nothing can be written under it
    monkeypatch.setenv(checkpoint.MEMORY_ENV, str(blocked))
    with pytest.raises(
        ConfigError, match="a memory checkpoint of step 1 failed .*HYPARALLEL_MEMORY_DIR"
    ) as info:
        checkpoint.save(pmodel, optimizer, tmp_path / "ck", step=1, storage="memory")
    assert "\n" not in str(info.value)
    assert checkpoint.latest(tmp_path / "ck") is None


def test_memory_checkpoints_resume_only_their_own_run(tmp_path, one_process, monkeypatch):
    """Note [memory checkpoints]: memory wins when it is this run's and as new as disk; else disk,
    else nothing."""
    monkeypatch.setenv(checkpoint.MEMORY_ENV, str(tmp_path / "shm"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    pmodel = one_process("gpt-tiny", 2)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, SEQ + 1))
    directory = tmp_path / "ck"
    for step in (1, 2):
        pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
        checkpoint.save(
            pmodel, optimizer, directory, step=step, storage="memory", extra={"seen": step}
        )
    pmodel._checkpoint_writer.wait_idle()
    snapshots = sorted(p.name for p in (checkpoint.memory_dir(directory) / "rank-0").glob("step-*"))
    assert snapshots == ["step-00000002"]  # the previous one went once the new one was complete
    assert checkpoint.load(pmodel, optimizer, directory) | {"path": None} == {
        "step": 2,
        "extra": {"seen": 2},
        "path": None,
        "storage": "memory",
    }
    # another launch: its memory is not this run's
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")
    assert checkpoint.load(pmodel, optimizer, directory)["storage"] == "disk"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    shutil.rmtree(directory)  # the directory removed: a fresh start, whatever memory holds
    assert checkpoint.load(pmodel, optimizer, directory, missing_ok=True) is None
    checkpoint.finish(pmodel, directory)
    assert not checkpoint.memory_dir(directory).exists()
