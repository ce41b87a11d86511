"""hyparallel.launch: a store private to each round (Note [a store private to each round]) and the timeouts."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from hyparallel import launch
from hyparallel.errors import ConfigError


def run_round(store_port: int, world: int, timeout_s: float = 20) -> list:
    """Every rank of one round, each in a thread with a client of its own; what round_store gave each."""
    results: list = [None] * world

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=30))
        try:
            prefixed = launch.round_store(client, r, world, datetime.timedelta(seconds=timeout_s))
            prefixed.set(f"address/{r}", f"round-address-{r}")  # what gloo does: each rank publishes, all read
            results[r] = [prefixed.get(f"address/{s}").decode() for s in range(world)]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(world))]  # rank 0 starts last
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


@pytest.fixture
def shared_store():
    """The agent's store (torchrun hosts one for every round of workers)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


def test_a_later_round_never_reads_an_earlier_rounds_keys(shared_store):
    first = run_round(shared_store.port, 3)
    assert all(r == [f"round-address-{s}" for s in range(3)] for r in first), first
    first_token = shared_store.get(launch._CURRENT).decode().split()[0]
    # A dead round's leftovers under the keys init_process_group would use without the prefix, and a published
    # token that a rank starting later must not take.
    shared_store.set("0/cpu/address/1", "dead-address")
    second = run_round(shared_store.port, 3)
    assert all(r == [f"round-address-{s}" for s in range(3)] for r in second), second
    third = run_round(shared_store.port, 2)  # a smaller world (a re-plan) after a restart
    assert all(r == ["round-address-0", "round-address-1"] for r in third), third
    assert shared_store.get(launch._CURRENT).decode().split()[0] != first_token


def test_a_rank_that_never_starts_fails_the_round_in_time(shared_store):
    client = dist.TCPStore("127.0.0.1", shared_store.port, is_master=False)
    with pytest.raises(RuntimeError, match="1 ranks reported in|of 2 ranks"):
        launch.round_store(client, 0, 3, datetime.timedelta(seconds=0.5))  # rank 0 of 3: one rank never comes
    with pytest.raises(RuntimeError, match="no token from this round's rank 0"):
        launch.round_store(client, 1, 3, datetime.timedelta(seconds=0.5))  # the token left is older than rank 1


@pytest.mark.parametrize("text", ["0", "-3", "soon", "nan"])
def test_a_bad_timeout_is_one_line(monkeypatch, text):
    monkeypatch.setenv("HYPARALLEL_TIMEOUT", text)
    with pytest.raises(ConfigError, match=r"HYPARALLEL_TIMEOUT=.*positive number") as info:
        launch.collective_timeout("gloo")
    assert "\n" not in str(info.value)


def test_the_timeouts_read_the_environment(monkeypatch):
    monkeypatch.delenv("HYPARALLEL_TIMEOUT", raising=False)
    monkeypatch.delenv("HYPARALLEL_INIT_TIMEOUT", raising=False)
    assert launch.collective_timeout("gloo").total_seconds() == launch.DEFAULT_TIMEOUT_S["gloo"]
    assert launch.collective_timeout("nccl").total_seconds() == launch.DEFAULT_TIMEOUT_S["nccl"]
    assert launch.init_timeout().total_seconds() == launch.DEFAULT_INIT_TIMEOUT_S
    monkeypatch.setenv("HYPARALLEL_TIMEOUT", "7.5")
    monkeypatch.setenv("HYPARALLEL_INIT_TIMEOUT", "90")
    assert launch.collective_timeout("nccl").total_seconds() == 7.5
    assert launch.init_timeout().total_seconds() == 90


def test_the_dlrover_launcher_without_dlrover_says_what_to_install(monkeypatch, capsys):
    import sys

    from hyparallel import dlrover_run

    monkeypatch.setitem(sys.modules, "dlrover", None)  # import dlrover... raises ImportError
    monkeypatch.setitem(sys.modules, "dlrover.trainer", None)
    monkeypatch.setitem(sys.modules, "dlrover.trainer.torch", None)
    with pytest.raises(SystemExit) as exit_:
        dlrover_run.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "dlrover is not installed" in err and "hyparallel[elastic]" in err
