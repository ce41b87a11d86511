"""hyparallel.runtime.launch: a store private to each round (Note [a store private to each round])
and the timeouts."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from hyparallel.runtime import launch
from hyparallel.spec.errors import ConfigError


def run_round(store_port: int, world: int, timeout_s: float = 20) -> list:
    """Every rank of one round, each in a thread with a client of its own; what round_store gave
    each."""
    results: list = [None] * world

    def rank(r: int) -> None:
        client = dist.TCPStore(
            "127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )
        try:
            prefixed = launch.round_store(client, r, world, datetime.timedelta(seconds=timeout_s))
            # what gloo does: each rank publishes, all read
            prefixed.set(f"address/{r}", f"round-address-{r}")
            results[r] = [prefixed.get(f"address/{s}").decode() for s in range(world)]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[r] = exc

    # rank 0 starts last
    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(world))]
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
    # A dead round's leftovers under the keys init_process_group would use without the prefix, and a
    # published token that a rank starting later must not take.
    shared_store.set("0/cpu/address/1", "dead-address")
    second = run_round(shared_store.port, 3)
    assert all(r == [f"round-address-{s}" for s in range(3)] for r in second), second
    third = run_round(shared_store.port, 2)  # a smaller world (a re-plan) after a restart
    assert all(r == ["round-address-0", "round-address-1"] for r in third), third
    assert shared_store.get(launch._CURRENT).decode().split()[0] != first_token


def test_a_rank_that_never_starts_fails_the_round_in_time(shared_store):
    client = dist.TCPStore("127.0.0.1", shared_store.port, is_master=False)
    with pytest.raises(RuntimeError, match="1 ranks reported in|of 2 ranks"):
        # rank 0 of 3: one rank never comes
        launch.round_store(client, 0, 3, datetime.timedelta(seconds=0.5))
    with pytest.raises(RuntimeError, match="no token from this round's rank 0"):
        # the token left is older than rank 1
        launch.round_store(client, 1, 3, datetime.timedelta(seconds=0.5))


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

    from hyparallel.tools import dlrover_run

    monkeypatch.setitem(sys.modules, "dlrover", None)  # import dlrover... raises ImportError
    monkeypatch.setitem(sys.modules, "dlrover.trainer", None)
    monkeypatch.setitem(sys.modules, "dlrover.trainer.torch", None)
    with pytest.raises(SystemExit) as exit_:
        dlrover_run.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "dlrover is not installed" in err and "hyparallel[elastic]" in err


class Ranks:
    """``world`` heartbeats in one process, each over a client of its own to one store; what each
    one was told."""

    def __init__(
        self, port: int, world: int, timeout_s: float, ranks=None, host: int | None = None
    ) -> None:
        self.told: dict[int, tuple[str, bool, float]] = {}
        self.beats = []
        for r in range(world) if ranks is None else ranks:
            connect = launch._connection("127.0.0.1", port, "round/heartbeat/", timeout_s)
            beat = launch._Heartbeat(
                connect, r, world, timeout_s, report=self.tell(r), end=lambda: None, host=host
            )
            self.beats.append(beat)
        self.started = time.monotonic()
        for beat in self.beats:
            beat.start()

    def tell(self, rank: int):
        def on_silent(who: str, found_here: bool) -> None:
            self.told[rank] = (who, found_here, time.monotonic() - self.started)

        return on_silent

    def stop_all(self) -> None:
        for beat in self.beats:
            beat.stop(gone=False)


def wait_until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_silent_rank_is_named_to_every_other_rank_within_the_bound(shared_store):
    ranks = Ranks(shared_store.port, 4, timeout_s=2.0)
    try:
        time.sleep(0.3)
        ranks.beats[2].stopped.set()  # rank 2 stops beating, as a stopped process does (no "gone")
        silenced = time.monotonic()
        wait_until(lambda: len(ranks.told) == 3, 15)
        assert sorted(ranks.told) == [0, 1, 3], ranks.told
        who, found_here, _ = ranks.told[1]  # rank 1 watches rank 2 (the next around the ring)
        assert found_here and who.startswith("rank 2 went silent") and "found by rank 1" in who, who
        assert all(not ranks.told[r][1] and ranks.told[r][0] == who for r in (0, 3))
        # the bound: the timeout plus a beat (timeout / 20) for the finder, a beat more for the
        # others; the slack is for a busy machine's thread scheduling (8 test processes on 2 cores)
        assert time.monotonic() - silenced < 2.0 + 4.0, ranks.told
    finally:
        ranks.stop_all()


def test_clean_exits_and_ranks_not_yet_started_are_not_silence(shared_store):
    ranks = Ranks(shared_store.port, 3, timeout_s=1.0)
    try:
        ranks.beats[1].stop(gone=True)  # rank 1 exits cleanly: rank 0 watches rank 2 instead
        time.sleep(0.3)
        assert not ranks.told
        time.sleep(3.0)  # three timeouts: nobody silent
        assert not ranks.told, ranks.told
        # now rank 2 goes silent: rank 0 (whose next rank left cleanly) finds it
        ranks.beats[2].stopped.set()
        wait_until(lambda: 0 in ranks.told, 10)
        assert ranks.told[0][0].startswith("rank 2 went silent") and ranks.told[0][1], ranks.told
    finally:
        ranks.stop_all()
    told = []
    connect = launch._connection("127.0.0.1", shared_store.port, "other/heartbeat/", 0.5)
    lonely = launch._Heartbeat(connect, 0, 2, 0.5, report=lambda who, here: told.append(who))
    # rank 1 of this round never beat (still importing, say): HYPARALLEL_INIT_TIMEOUT's, not silence
    lonely.start()
    time.sleep(2.0)
    lonely.stop()
    assert not told


def test_the_silent_ranks_last_phase_and_the_watchers_own_are_named(shared_store, monkeypatch):
    monkeypatch.setattr(launch, "_phases", {})
    launch.set_phase("training")
    with (
        launch.phase("the disk checkpoint save of step 8"),
        launch.phase("persisting step 4", role="writer"),
    ):
        assert (
            launch._describe() == "the disk checkpoint save of step 8 (writer: persisting step 4)"
        )
        ranks = Ranks(shared_store.port, 2, timeout_s=1.0)
        try:
            time.sleep(0.3)  # both published this process's phase
            ranks.beats[1].stopped.set()
            wait_until(lambda: 0 in ranks.told, 10)
        finally:
            ranks.stop_all()
    assert launch._describe() == "training"
    who = ranks.told[0][0]
    assert "in: the disk checkpoint save of step 8 (writer: persisting step 4)" in who, who


def test_the_heartbeat_timeout_reads_the_environment(monkeypatch):
    monkeypatch.delenv("HYPARALLEL_HEARTBEAT_TIMEOUT", raising=False)
    assert launch.heartbeat_timeout() == launch.DEFAULT_HEARTBEAT_TIMEOUT_S
    monkeypatch.setenv("HYPARALLEL_HEARTBEAT_TIMEOUT", "45")
    assert launch.heartbeat_timeout() == 45
    monkeypatch.setenv("HYPARALLEL_HEARTBEAT_TIMEOUT", "never")
    with pytest.raises(ConfigError, match="HYPARALLEL_HEARTBEAT_TIMEOUT='never'"):
        launch.heartbeat_timeout()


def test_a_store_hosted_by_a_stopped_rank_is_found_too(tmp_path):
    """Without an agent's store, rank 0's process hosts it: rank 0 stopped stops the store's answers
    as well."""
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0,"
                " is_master=True, wait_for_workers=False); print(s.port, flush=True);"
                " time.sleep(120)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(host.stdout.readline())
        # rank 0 (in the host process) never beats
        ranks = Ranks(port, 3, timeout_s=2.0, ranks=[1, 2], host=0)
        time.sleep(0.5)
        os.kill(host.pid, signal.SIGSTOP)
        wait_until(lambda: len(ranks.told) == 2, 15)
        assert sorted(ranks.told) == [1, 2], ranks.told
        assert all(
            "the launch's store did not answer" in who and "rank 0 hosts it" in who
            for who, *_ in ranks.told.values()
        )
        ranks.stop_all()
        os.kill(host.pid, signal.SIGCONT)
        # rank 0 exits and its store with it: the others' heartbeats go on quietly (its agent sees
        # the exit)
        ranks = Ranks(port, 3, timeout_s=2.0, ranks=[1, 2], host=0)
        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.PrefixStore("round/heartbeat/", client).set("gone/0", "1")
        time.sleep(0.3)
        host.kill()
        time.sleep(5.0)  # two and a half timeouts
        assert not ranks.told, ranks.told
        started = time.monotonic()
        ranks.stop_all()  # at exit: no store to answer, and no wait for it
        assert time.monotonic() - started < 5
    finally:
        host.kill()
        host.wait()
