"""Parameter-server mode: the servers' update rules, the dispatcher's pacing and leases, and whole
runs.

The runs launch one process per rank (servers first, then workers), as torchrun would, and compare
with one process training the same batches: at staleness 0 the servers apply each step's mean
gradient, so the weights must match single-process training over the steps the dispatcher's log
records.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
import yaml

import hyparallel as hp
from hyparallel.runtime.ps.dispatcher import Dispatcher
from hyparallel.runtime.ps.optim import RowOptimizer
from hyparallel.runtime.ps.server import Push, ServerShard
from hyparallel.spec.errors import ConfigError
from tests.ps import roles

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("ray", reason="parameter-server mode runs on Ray: pip install -e '.[ps]'")

# fp32 tolerance: the servers sum the workers' gradients weighted by their samples, one process sums
# the whole batch's at once; the two orders of summation differ in the last bits (measured < 2e-7
# relative).
RTOL, ATOL = 1e-5, 1e-6


# ---- update rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_row_rules_match_torch_optimizers_on_the_rows_touched(rule):
    torch.manual_seed(0)
    weight = torch.randn(10, 3)
    reference = weight.clone().requires_grad_()
    torch_opt = (torch.optim.SGD if rule == "sgd" else torch.optim.Adagrad)([reference], lr=0.1)
    mine = RowOptimizer(rule, 0.1, weight)
    for step in range(3):
        rows = torch.tensor([1, 4, 7]) if step != 1 else torch.tensor([0, 4])
        grad = torch.randn(len(rows), 3)
        dense = torch.zeros(10, 3)
        dense[rows] = grad
        reference.grad = dense
        torch_opt.step()
        mine.apply(weight, rows, grad)
    torch.testing.assert_close(weight, reference.detach(), rtol=RTOL, atol=ATOL)


def test_rowwise_adam_keeps_one_second_moment_and_one_step_count_per_row():
    weight = torch.zeros(4, 2)
    opt = RowOptimizer("rowwise-adam", 0.1, weight)
    grad = torch.tensor([[1.0, 3.0]])
    opt.apply(weight, torch.tensor([2]), grad)
    # First step: m_hat = g, v_hat = mean(g^2) = 5, so the row moves by lr * g / sqrt(5).
    torch.testing.assert_close(weight[2], -0.1 * grad[0] / (5**0.5 + 1e-8))
    assert opt.state["v"].shape == (4,) and opt.state["steps"].tolist() == [0, 0, 1, 0]
    assert weight[[0, 1, 3]].abs().sum() == 0


def test_a_checkpoint_of_two_servers_loads_row_by_row_onto_three(tmp_path):
    full = torch.arange(22.0).reshape(11, 2)
    old = [
        ServerShard(i, 2, {"t": full[i::2]}, {}, "adagrad", 0.1, synchronous=False)
        for i in range(2)
    ]
    for i, shard in enumerate(old):
        shard.push(
            Push("w", 1, batch=i, samples=1, sparse={"t": (torch.tensor([0]), torch.ones(1, 2))})
        )
        shard.save(tmp_path / f"server-{i}.pt")
    updated = torch.cat([s.tables["t"] for s in old])  # rows 0 (server 0) and 1 (server 1) moved
    new = [
        ServerShard(i, 3, {"t": torch.zeros(len(range(i, 11, 3)), 2)}, {}, "adagrad", 0.1, False)
        for i in range(3)
    ]
    for shard in new:
        shard.load(sorted(tmp_path.glob("server-*.pt")))
    again = torch.empty(11, 2)
    for i, shard in enumerate(new):
        again[i::3] = shard.tables["t"]
    expected = full.clone()
    expected[0::2], expected[1::2] = old[0].tables["t"], old[1].tables["t"]
    torch.testing.assert_close(again, expected)
    # Exact on purpose: the pushes moved rows 0 and 1 by a whole Adagrad step, far from any
    # rounding.
    assert not torch.equal(updated, torch.cat([full[0::2], full[1::2]]))
    # row 0's Adagrad sum came along
    assert new[0].optimizers["t"].state["sum"][0].tolist() == [1.0, 1.0]
    assert all(s.applied == {0, 1} for s in new)


def test_a_push_for_a_batch_already_applied_is_dropped():
    shard = ServerShard(0, 1, {"t": torch.zeros(3, 1)}, {}, "sgd", 1.0, synchronous=False)
    push = Push("a", 1, batch=5, samples=1, sparse={"t": (torch.tensor([1]), torch.ones(1, 1))})
    assert shard.push(push) and not shard.push(Push("b", 1, 5, 1, push.sparse))
    assert shard.tables["t"][1].item() == -1.0 and shard.updates == [("a", 1, 5)]


def _ps_plan(**ps):
    training = {"global_batch": 12, "micro_batch": 6, "seq_len": 1, "dtype": "fp32"}
    return hp.Plan.from_dict(
        {"training": training, "parallel": {"dp": 2}, "ps": {"servers": 1, **ps}}
    )


@pytest.mark.parametrize(
    "make, ps, words",
    [
        (
            lambda: torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.BatchNorm1d(2)),
            {},
            "running statistics",
        ),
        (lambda: torch.nn.Sequential(torch.nn.Embedding(5, 2, max_norm=1.0)), {}, "max_norm"),
        (lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)), {}, "no nn.Embedding"),
        (lambda: torch.nn.Sequential(torch.nn.Embedding(5, 2)), {"tables": ["1"]}, "not a module"),
        (
            lambda: torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Linear(2, 2)),
            {"tables": ["1"]},
            "Linear",
        ),
    ],
)
def test_what_parameter_servers_cannot_hold_is_refused_before_anything_starts(
    monkeypatch, make, ps, words
):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=words) as error:
        hp.parallelize(make(), _ps_plan(**ps))
    assert "\n" not in str(error.value)


def test_a_ps_plan_without_ray_names_the_extra_in_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    # `import ray` raises ModuleNotFoundError, as when not installed
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(
        ConfigError, match=r"run on Ray, which is not installed: pip install 'hyparallel\[ps\]'"
    ) as error:
        hp.parallelize(torch.nn.Sequential(torch.nn.Embedding(5, 2)), _ps_plan())
    assert "\n" not in str(error.value)


def test_a_launch_of_the_wrong_size_names_workers_and_servers(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError, match=r"dp\(2\) workers \+ ps.servers\(1\) = 3 != WORLD_SIZE\(2\)"
    ):
        hp.parallelize(torch.nn.Embedding(5, 2), _ps_plan())


# ---- the dispatcher ---------------------------------------------------------------------------


def _dispatcher(staleness, timeout=60.0):
    steps = []

    async def apply_step(step, batches):
        steps.append((step, batches))

    return Dispatcher(staleness, timeout, apply_step), steps


def test_staleness_bounds_how_far_a_worker_runs_ahead_of_the_slowest():
    async def run():
        d, _ = _dispatcher(staleness=2)
        await d.create_dataset(40, shard_size=4)
        await d.register("fast")
        await d.register("slow")
        slow_step, slow_batch = await d.begin("slow")
        ahead = 0
        for _ in range(5):  # the fast worker finishes steps while the slow one sits in its first
            task = asyncio.ensure_future(d.begin("fast"))
            done, _ = await asyncio.wait([task], timeout=1.5)
            if not done:
                task.cancel()
                break
            step, batch = task.result()
            await d.finish("fast", step, batch)
            ahead += 1
        assert ahead == 3  # steps 1, 2, 3 while slow's clock is 0: then 3 - 0 > 2 blocks it
        await d.finish("slow", slow_step, slow_batch)
        assert all(step - 1 - slowest <= 2 for _, step, slowest in d.pacing)

    asyncio.run(run())


def test_at_staleness_0_a_worker_that_finished_the_step_waits_for_the_others():
    async def run():
        d, steps = _dispatcher(staleness=0)
        await d.create_dataset(10, shard_size=2)
        await d.register("a")
        await d.register("b")
        step, batch = await d.begin("a")
        await d.finish("a", step, batch)
        early = asyncio.ensure_future(d.begin("a"))
        done, _ = await asyncio.wait([early], timeout=1.5)
        assert not done  # one batch per worker per step: a waits for b's
        step_b, batch_b = await d.begin("b")
        await d.finish("b", step_b, batch_b)
        assert steps == [(1, sorted([batch, batch_b]))] and step == step_b == 1
        assert (await early)[0] == 2

    asyncio.run(run())


def test_a_silent_workers_lease_goes_back_to_the_queue_and_is_consumed_once():
    async def run():
        d, steps = _dispatcher(staleness=0, timeout=0.2)
        await d.create_dataset(6, shard_size=3)
        await d.register("a")
        await d.register("b")
        step_a, batch_a = await d.begin("a")
        await d.begin("b")  # b takes batch 3 of shard [3, 6) and is never heard of again
        await d.finish("a", step_a, batch_a)
        await asyncio.sleep(0.3)
        d.workers["a"].seen += 1.0  # a is alive
        assert await d.reap() == ["b"]
        while (given := await d.begin("a")) is not None:
            await d.finish("a", *given)
        assert sorted(b for b, _, _ in d.log) == list(range(6))
        assert Counter(w for _, w, _ in d.log) == {"a": 6}
        assert steps[0] == (1, [0])  # step 1 closed without b's staged batch

    asyncio.run(run())


# ---- whole runs -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    tmp_path,
    *,
    servers,
    workers,
    staleness,
    num_batches,
    optimizer="adagrad",
    replace=False,
    **env_extra,
):
    """One process per rank; ``replace``: a worker that dies is replaced by a new process of its
    rank (which joins)."""
    plan = {
        "training": {"global_batch": 6 * workers, "micro_batch": 6, "seq_len": 1, "dtype": "fp32"},
        "parallel": {"dp": workers},
        "ps": {
            "servers": servers,
            "staleness": staleness,
            "optimizer": optimizer,
            "lr": 0.1,
            "worker_timeout_s": 3,
        },
    }
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan))
    world = servers + workers
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TORCHELASTIC", "RAY_", "GROUP_", "LOCAL_"))
        },
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "PYTHONPATH": str(ROOT),
        **{k: str(v) for k, v in env_extra.items()},
    }

    def start(rank: int, out: str, **extra) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.ps.roles",
                str(plan_file),
                str(num_batches),
                str(tmp_path / out),
            ],
            env={**env, "RANK": str(rank), **extra},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"err-{out}", "w"),
        )

    procs = {r: start(r, f"out{r}") for r in range(world)}
    joined = {}
    try:
        deadline = time.monotonic() + 240
        while (
            any(p.poll() is None for p in [*procs.values(), *joined.values()])
            and time.monotonic() < deadline
        ):
            for r, p in procs.items():
                if replace and p.poll() == -signal.SIGKILL and r not in joined:
                    joined[r] = start(r, f"out{r}-joined", PS_TEST_KILL_WORKER="")
            time.sleep(0.1)
        codes = [procs[r].wait(timeout=1) for r in range(world)]
    finally:
        for p in [*procs.values(), *joined.values()]:
            p.kill()
    for r, p in joined.items():
        assert p.returncode == 0, (tmp_path / f"err-out{r}-joined").read_text()[-2000:]
    result = torch.load(tmp_path / "out0", weights_only=False)
    records = {
        r: json.loads((tmp_path / f"out{r}").read_text())
        for r in range(servers, world)
        if codes[r] == 0
    }
    records.update(
        {f"{r}-joined": json.loads((tmp_path / f"out{r}-joined").read_text()) for r in joined}
    )
    return codes, result, records


def _reference(log, optimizer_cls=torch.optim.Adagrad):
    """One process training the steps the log records, each on the concatenation of its batches."""
    model = roles.model()
    opt = optimizer_cls(model.parameters(), lr=0.1)
    by_step = defaultdict(list)
    for batch, _, step in log:
        by_step[step].append(batch)
    losses = {}
    for step in sorted(by_step):
        parts = [roles.batch(b) for b in sorted(by_step[step])]
        with torch.no_grad():
            for b, ((dense, sparse), clicks) in zip(sorted(by_step[step]), parts):
                losses[b] = roles.loss_fn(model(dense, sparse), clicks).item()
        dense = torch.cat([p[0][0] for p in parts])
        sparse = torch.cat([p[0][1] for p in parts])
        clicks = torch.cat([p[1] for p in parts])
        roles.loss_fn(model(dense, sparse), clicks).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), losses


def _assert_parity(result, records):
    reference, losses = _reference(result["log"])
    assert set(result["state"]) == set(reference)  # every parameter, by name
    for name, value in reference.items():
        torch.testing.assert_close(result["state"][name], value, rtol=RTOL, atol=ATOL, msg=name)
    for record in records.values():
        for entry in record:
            assert entry["loss"] == pytest.approx(losses[entry["batch"]], rel=RTOL, abs=ATOL)


def test_a_worker_killed_after_pushing_leaves_its_batch_to_the_others_once_and_a_new_one_joins(
    tmp_path,
):
    # Rank 1 (a worker) dies as it reports its 3rd batch: its pushes are staged on the server, its
    # report never arrives, and it is taken for dead after worker_timeout_s (3 s). A new process of
    # rank 1 then joins mid-run.
    codes, result, records = _launch(
        tmp_path,
        servers=1,
        workers=2,
        staleness=0,
        num_batches=60,
        replace=True,
        PS_TEST_KILL_WORKER="1:2",
        PS_TEST_SHARD=3,
        PS_TEST_SLOW_S=0.25,
    )
    assert codes == [0, -9, 0]
    log = result["log"]
    assert Counter(b for b, _, _ in log) == Counter(range(60))  # every batch consumed exactly once
    by_worker = Counter(w for _, w, _ in log)
    assert (
        len(by_worker) == 3
        and sum(n for w, n in by_worker.items() if w.startswith("worker-1-")) > 2
    )
    assert records["1-joined"]  # the newcomer trained
    _assert_parity(result, records)  # the dead worker's staged pushes counted nowhere


def test_staleness_2_is_stale_synchronous_and_a_killed_server_comes_back_from_its_checkpoint(
    tmp_path,
):
    codes, result, records = _launch(
        tmp_path,
        servers=2,
        workers=2,
        staleness=2,
        num_batches=16,
        PS_TEST_CHECKPOINT_AT=3,
        PS_TEST_CHECKPOINT_DIR=tmp_path / "ckpt",
        PS_TEST_KILL_SERVER_AT=5,
        PS_TEST_KILL_SERVER=1,
        PS_TEST_KILLER=2,
        PS_TEST_SLOW_S=0.05,
    )
    assert codes == [0, 0, 0, 0]
    assert Counter(b for b, _, _ in result["log"]) == Counter(range(16))
    assert result["restored_from"] == [None, str(tmp_path / "ckpt" / "step-00000003")]
    for updates in result["updates"]:  # no batch applied twice on any server
        assert len({b for _, _, b in updates}) == len(updates)
    assert all(step - 1 - slowest <= 2 for _, step, slowest in result["pacing"])
    assert all(torch.isfinite(v).all() for v in result["state"].values())


def test_staleness_0_equals_one_process_on_two_servers_and_on_one_resumed_from_their_checkpoint(
    tmp_path,
):
    # The parity test of the mode, on 2 servers and then on 1 (2 workers each): the second run
    # starts from the first run's checkpoint of step 2, re-sharded by row, and the weights still
    # match one process.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    ckpt = tmp_path / "ckpt"
    codes, before, records = _launch(
        first,
        servers=2,
        workers=2,
        staleness=0,
        num_batches=8,
        PS_TEST_CHECKPOINT_AT=2,
        PS_TEST_CHECKPOINT_DIR=ckpt,
    )
    assert codes == [0, 0, 0, 0]
    assert Counter(b for b, _, _ in before["log"]) == Counter(range(8))
    assert all(records.values())  # both workers trained
    _assert_parity(before, records)
    codes, result, records = _launch(
        second, servers=1, workers=2, staleness=0, num_batches=8, PS_TEST_RESUME_DIR=ckpt
    )
    assert codes == [0, 0, 0]
    log = result["log"]
    assert Counter(b for b, _, _ in log) == Counter(range(8))
    resumed = torch.load(ckpt / "step-00000002" / "ps" / "dispatcher.pt", weights_only=False)["log"]
    # the first run's steps, kept
    assert resumed and [tuple(e) for e in resumed] == log[: len(resumed)]
    assert all(
        entry["batch"] not in {b for b, _, _ in resumed} for r in records.values() for entry in r
    )
    # `hyparallel checkpoint export` puts the servers' rows back in order: the model after the
    # checkpoint's steps.
    exported = torch.load(hp.checkpoint.export(ckpt, tmp_path / "model.pt"), weights_only=True)
    roles.model().load_state_dict(exported, strict=True)
    for name, value in _reference(resumed)[0].items():
        torch.testing.assert_close(exported[name], value, rtol=RTOL, atol=ATOL, msg=name)
    _assert_parity(result, records)  # the re-sharded rows and Adagrad sums carried on exactly


def _processes(match) -> list[int]:
    """Live processes whose command line (and environment, for ``match``'s second part) match."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(cmdline, environ):
            found.append(int(proc.name))
    return found


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {timeout_s} s")


def test_the_example_under_torchrun_survives_a_killed_server_and_a_killed_worker(tmp_path):
    # One torchrun of examples/train_recsys.py (1 server, 2 workers, checkpoints every 5 steps,
    # --max-restarts 1). The server actor is SIGKILLed: Ray restarts it from the newest checkpoint,
    # and training goes on. Then a worker is SIGKILLed: torchrun restarts the group, which resumes
    # from the newest checkpoint. Every batch of the log is consumed once in the end (rank 0's
    # summary of the dispatcher's log).
    ckpt = tmp_path / "ckpt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "3",
        "--max-restarts",
        "1",
    ]
    cmd += [
        str(ROOT / "examples" / "train_recsys.py"),
        "--mode",
        "ps",
        "--batches",
        "400",
        "--batch",
        "32",
    ]
    cmd += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC", "RAY_", "MASTER_", "RANK"))
    }
    proc = subprocess.Popen(
        cmd,
        env={**env, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        steps = lambda: sorted(p.name for p in ckpt.glob("step-*"))  # noqa: E731
        _wait_for(steps, 120, "checkpoint")
        (server,) = _wait_for(
            lambda: _processes(lambda cmd, env: cmd.startswith(b"ray::_Server")), 60, "server"
        )
        os.kill(server, signal.SIGKILL)
        seen = steps()
        _wait_for(
            lambda: len(steps()) > len(seen) + 1, 120, "checkpoint after the server's restart"
        )
        worker_env = [b"RANK=2", b"TORCHELASTIC_RESTART_COUNT=0"]
        (worker,) = _processes(
            lambda cmd, env: b"train_recsys.py" in cmd and all(e in env for e in worker_env)
        )
        os.kill(worker, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-2000:]
    assert "hyparallel ps: 400 batches consumed, each once" in stdout
