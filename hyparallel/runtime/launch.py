"""The process group of a launch, made to survive restarts: one private store per round, bounded
collectives.

``init_process_group()`` (``parallelize`` calls it when no group exists) reads the launch from the
environment (torchrun, ``dlrover-run``, or a plain RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) and
starts the default group:

- Under an elastic agent that shares its rendezvous store with the workers (torchrun's default,
  ``TORCHELASTIC_USE_AGENT_STORE=True``), every round of workers runs in a namespace of that store
  of its own (Note [a store private to each round]), so a restarted group never reads the addresses
  its dead predecessors left there (pytorch/pytorch#167288, #135712). No environment variable is
  needed.
- Collectives are bounded (Note [how long a collective may wait]): a rank that hangs, is stopped or
  has died makes the others fail within ``HYPARALLEL_TIMEOUT`` seconds, and the agent restarts the
  group.
- Every rank beats a heartbeat through the launch's store (Note [a heartbeat no stopped process can
  send]): a rank that goes silent (stopped, frozen, cut off) is found within
  ``HYPARALLEL_HEARTBEAT_TIMEOUT`` seconds in any phase, a checkpoint's save or load included; every
  other rank prints one line naming it and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import torch.distributed as dist

from hyparallel.spec.errors import ConfigError

__all__ = [
    "background_group",
    "collective_timeout",
    "current_timeout",
    "heartbeat_timeout",
    "init_process_group",
    "init_timeout",
    "long_timeouts",
    "phase",
    "round_store",
    "round_token",
    "set_phase",
    "set_timeouts",
]

# Note [how long a collective may wait]
#     torch's defaults (30 min for gloo, 10 min for NCCL) turn a stopped or hung rank into half an
#     hour of idle cluster. hyparallel gives every process group two bounds, as torchtitan does
#     (init and train timeouts):
#     - HYPARALLEL_INIT_TIMEOUT (default 600 s) while starting: the rendezvous, the first training
#       step (each rank materialises and, with NCCL, connects its communicators), and checkpoint
#       saves and loads (a rank may wait while others write gigabytes);
#     - HYPARALLEL_TIMEOUT once the first step is done (default 30 s on gloo, 120 s with NCCL):
#       every later collective, so a stopped rank (SIGSTOP), a dead peer or a stuck collective makes
#       every other rank raise within that bound; the process exits non-zero and the agent
#       (torchrun, dlrover-run) restarts the group.
#     A step whose slowest collective legitimately waits longer than HYPARALLEL_TIMEOUT (a very slow
#     rank, huge buckets on a slow network) needs the variable raised (docs/elastic.md).
DEFAULT_INIT_TIMEOUT_S = 600.0
DEFAULT_TIMEOUT_S = {"gloo": 30.0, "nccl": 120.0}

# Note [a store private to each round]
#     torchrun (c10d rendezvous, torch >= 2.4) hosts one TCPStore in the agent and hands its address
#     to every round of workers (MASTER_ADDR/MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True).
#     init_process_group then keys the group by its name ("0/..."): the same keys in every round. A
#     restarted round's gloo ranks read the address each peer published, find the dead round's (set
#     first, still there) and retry connecting to a closed port until the 30-minute timeout; NCCL
#     reads a stale unique id. TORCHELASTIC_RESTART_COUNT cannot name the round: each agent counts
#     its own restarts (a node whose workers were healthy restarts them without counting), so two
#     nodes can disagree. What every worker of a round can rely on is that the previous round's
#     workers are all dead before any worker of this one starts (each agent stops its workers before
#     it joins the next rendezvous). So:
#     - every worker takes a number from a counter in the shared store (`add` is atomic): a "tick",
#       later than anything a dead worker wrote;
#     - rank 0 draws a fresh random token and publishes "token tick" with a new tick, again and
#       again, until every other rank has reported in under that token;
#     - rank r > 0 accepts a published token only with a tick later than its own: it was written
#       after rank r started, so by this round's rank 0, never a dead one's.
#     The group then runs in a PrefixStore "hyparallel/<token>/" of the shared store: all its keys
#     (and those of every group made from it: the mesh's, DCP's) are new. A few store round trips
#     per start.
_CLOCK, _CURRENT = "hyparallel/clock", "hyparallel/current"
# what set_timeouts last applied; None: the groups are not ours to bound
_bound: datetime.timedelta | None = None
_background: set = set()  # groups of background writers: always bounded by init_timeout()


def init_timeout() -> datetime.timedelta:
    """The bound on collectives while starting and checkpointing (HYPARALLEL_INIT_TIMEOUT,
    seconds)."""
    return datetime.timedelta(seconds=_seconds("HYPARALLEL_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT_S))


def collective_timeout(backend: str) -> datetime.timedelta:
    """The bound on every collective after the first step (HYPARALLEL_TIMEOUT, seconds; default per
    backend)."""
    return datetime.timedelta(
        seconds=_seconds("HYPARALLEL_TIMEOUT", DEFAULT_TIMEOUT_S.get(backend, 120.0))
    )


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"{name}={text!r}: give the timeout in seconds, a positive number (e.g. {name}=60)"
        )
    return value


def init_process_group(backend: str | None = None) -> None:
    """Start the default process group for this launch (a no-op when one exists).

    ``backend`` defaults to NCCL where CUDA is available, gloo otherwise. Under an elastic agent
    that shares its store, the group runs in a namespace of its own (Note [a store private to each
    round]); collectives are bounded by :func:`init_timeout` until :func:`set_timeouts` lowers them
    after the first step.
    """
    import torch

    global _bound
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    timeout = _bound = init_timeout()
    if world == 1:  # a world of one needs no rendezvous, whatever MASTER_ADDR a shell exported
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    # rank 0 hosts a store of this round's own
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=timeout)
        _start_heartbeat(rank, world, "hyparallel/heartbeat/", host=0)
        return
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    token = round_token(shared, rank, world, timeout)
    store = dist.PrefixStore(f"hyparallel/{token}/", shared)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    _start_heartbeat(rank, world, f"hyparallel/{token}/heartbeat/")


def round_store(
    store: dist.Store, rank: int, world: int, timeout: datetime.timedelta
) -> dist.Store:
    """A PrefixStore of ``store`` that only this round of ``world`` workers uses (Note [a store
    private to each round]).

    Every rank calls it; it returns once all ``world`` ranks agreed on the round's token, or raises
    after ``timeout``.
    """
    return dist.PrefixStore(f"hyparallel/{round_token(store, rank, world, timeout)}/", store)


def round_token(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> str:
    """The token every rank of this round agrees on (Note [a store private to each round]); see
    :func:`round_store`."""
    deadline = time.monotonic() + timeout.total_seconds()

    def wait(what: str) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank}: no agreement on this round's store after"
                f" {timeout.total_seconds():.0f} s ({what}); a rank of this round did not start:"
                " check every rank's log"
            )
        time.sleep(0.005)

    if rank == 0:
        token = uuid.uuid4().hex
        reported = f"hyparallel/{token}/reported"
        while True:
            store.set(_CURRENT, f"{token} {store.add(_CLOCK, 1)}")
            if store.add(reported, 0) >= world - 1:
                break
            wait(f"{store.add(reported, 0)} of {world - 1} ranks reported in")
    else:
        mine = store.add(_CLOCK, 1)
        while True:
            if store.check([_CURRENT]):
                token, tick = store.get(_CURRENT).decode().split()
                if int(tick) > mine:
                    break
            wait("no token from this round's rank 0")
        store.add(f"hyparallel/{token}/reported", 1)
    return token


def set_timeouts(timeout: datetime.timedelta) -> None:
    """Bound every collective of every process group of this process (the default one, the mesh's,
    any other).

    A no-op for groups hyparallel did not start (a caller's own init_process_group keeps its own
    timeout) unless HYPARALLEL_TIMEOUT is set.
    """
    global _bound
    if not dist.is_initialized() or (_bound is None and "HYPARALLEL_TIMEOUT" not in os.environ):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        if dist.get_rank(group) >= 0 and group not in _background:  # a member
            _set_pg_timeout(timeout, group)
    _bound = timeout


def background_group():
    """A new gloo group of every rank for background writers (every rank calls it at the same
    point).

    Its collectives wait up to :func:`init_timeout`, whatever the training bound: a writer waits on
    other ranks' disk writes, which may take long.
    """
    group = dist.new_group(backend="gloo", timeout=init_timeout())
    _background.add(group)
    return group


def current_timeout() -> datetime.timedelta | None:
    """What collectives of hyparallel's groups are bounded by now (None: the caller's groups, left
    alone)."""
    return _bound


@contextlib.contextmanager
def long_timeouts() -> Iterator[None]:
    """Collectives bounded by :func:`init_timeout` inside (checkpoint saves and loads), as they were
    after."""
    before = _bound
    if before is None or not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    set_timeouts(init_timeout())
    try:
        yield
    finally:
        set_timeouts(before)


# Note [a heartbeat no stopped process can send]
#     A collective's timeout cannot tell a peer that is slow from one that will never come: a
#     checkpoint's save waits while other ranks write gigabytes, so its collectives have the long
#     bound (HYPARALLEL_INIT_TIMEOUT), and a rank stopped (SIGSTOP, a frozen VM or node) or cut off
#     inside a save kept its peers waiting ten minutes. So every rank of a group hyparallel starts
#     also beats a heartbeat that a stopped process cannot send:
#     - a daemon thread adds 1 to the rank's counter in the launch's store every beat (the timeout /
#       20, at most 1 s), over a store connection of its own (the main thread may block in a store
#       wait, holding its connection), under the round's namespace (Note [a store private to each
#       round]): a new round's counters start afresh;
#     - the same thread reads one peer's counter: the next rank around the ring that has not exited
#       cleanly (an exiting process marks itself gone). Every rank watching one keeps the store's
#       load at four small operations per rank and beat, and whatever set of ranks stops, some live
#       rank watches a stopped one;
#     - a counter that has not moved for HYPARALLEL_HEARTBEAT_TIMEOUT seconds (default 20) of the
#       watcher's own running time means the peer is gone without its agent seeing it: the watcher
#       writes which rank and the phase it last reported (phase(): starting, training, a save or
#       load of step N, the background writer) to the store, prints one line and exits; every other
#       rank reads that within a beat, prints its own line (with its own phase), and each exits once
#       all have (or a few beats passed: the agent stops the whole group as soon as one exits); the
#       agent restarts the group. Exiting is how torch's NCCL watchdog ends a hung collective too: a
#       thread cannot end another thread's wait inside a collective.
#     - the store itself: without an agent's store (a plain RANK/MASTER_ADDR launch), rank 0's
#       process hosts it, and a TCPStore operation on a stopped host waits for ever (measured: no
#       client timeout applies to add/check). A guard thread, which makes no store operation, ends
#       the process (with its one line) once an operation has waited HYPARALLEL_HEARTBEAT_TIMEOUT. A
#       connection that breaks (the host exited or died: its agent sees that) is made anew each
#       beat; after HYPARALLEL_HEARTBEAT_TIMEOUT without one the heartbeat stops quietly (the end of
#       a run whose rank 0 left first).
#     The bound from a stop to the peers' exit is HYPARALLEL_HEARTBEAT_TIMEOUT plus a beat, in any
#     phase: a save or load, the background writer of memory checkpoints, a step, tracing after the
#     rendezvous. Before every rank has beaten once (imports, the rendezvous) a peer is not watched:
#     HYPARALLEL_INIT_TIMEOUT bounds that. What it does not see: a process alive but stuck (its
#     heartbeat thread beats on). A stuck step still times out after HYPARALLEL_TIMEOUT, a stuck
#     save or load after HYPARALLEL_INIT_TIMEOUT. A process holding Python's GIL in one C call for
#     longer than the bound would read as silent: raise the variable for such a program.
DEFAULT_HEARTBEAT_TIMEOUT_S = 20.0
# what this process is doing, by role ("" the main loop; the background writer)
_phases: dict[str, str] = {}
_heartbeat: _Heartbeat | None = None


def heartbeat_timeout() -> float:
    """Seconds of silence after which a peer counts as gone (HYPARALLEL_HEARTBEAT_TIMEOUT; default
    20)."""
    return _seconds("HYPARALLEL_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT_S)


def set_phase(text: str, role: str = "") -> None:
    """Say what this process is doing now (the heartbeat reports it to the peers if this rank goes
    silent)."""
    if text:
        _phases[role] = text
    else:
        _phases.pop(role, None)


@contextlib.contextmanager
def phase(text: str, role: str = "") -> Iterator[None]:
    """:func:`set_phase` for a block; the phase before it is restored after."""
    before = _phases.get(role, "")
    set_phase(text, role)
    try:
        yield
    finally:
        set_phase(before, role)


def _describe() -> str:
    main = _phases.get("", "no phase reported")
    others = "; ".join(f"{role}: {text}" for role, text in sorted(_phases.items()) if role)
    return f"{main} ({others})" if others else main


class _Heartbeat:
    """One rank's heartbeat and its watch over one peer (Note [a heartbeat no stopped process can
    send]).

    Two daemon threads: one makes every store operation (beats, reads); a guard, which makes none,
    ends the process when one of them has waited ``timeout`` seconds for an answer (the store's host
    stopped: a TCPStore operation then waits for ever).
    """

    def __init__(
        self,
        connect,
        rank: int,
        world: int,
        timeout: float,
        report=None,
        end=None,
        host: int | None = None,
    ) -> None:
        # connect(): a new store
        self.connect, self.rank, self.world, self.timeout = connect, rank, world, timeout
        self.store = connect()
        self.host = host  # the rank whose process hosts the store (no agent's store), if any
        self.beat = min(1.0, timeout / 20)
        self.report = report or _report_silent_peer  # report(who, found_here): the one line
        self.end = end or _end_process
        self.stopped = threading.Event()
        self.leaving = False  # stop(): tell the peers this rank exits cleanly
        self.asking: float | None = None  # since when the store thread waits for an answer
        self.done = False  # reported: the guard stays quiet
        self.published = ""
        # peer, its count, when it moved
        self.watch: tuple[int | None, int, float] = (None, 0, time.monotonic())
        self.thread = threading.Thread(target=self._run, name="hyparallel-heartbeat", daemon=True)
        self.guard = threading.Thread(
            target=self._guard, name="hyparallel-heartbeat-guard", daemon=True
        )

    def start(self) -> _Heartbeat:
        self._publish()  # what this rank is doing, before anything can stop it
        self.store.add(f"beat/{self.rank}", 1)  # reported in: from now on the peers time this rank
        self.thread.start()
        self.guard.start()
        return self

    def _publish(self) -> None:
        described = _describe()
        if described != self.published:
            self.store.set(f"phase/{self.rank}", described)
            self.published = described

    def stop(self, gone: bool = True) -> None:
        """Stop beating; ``gone``: tell the peers this rank exits cleanly (they stop watching it).
        Waits a few beats at most: a store that does not answer is not waited for."""
        self.leaving = gone
        self.stopped.set()
        for thread in (self.thread, self.guard):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=2 * self.beat + 1)

    def _run(self) -> None:
        previous = answered = time.monotonic()
        while not self.stopped.wait(self.beat):
            now = time.monotonic()
            # this process did not run between beats: nobody's silence
            if now - previous > 3 * self.beat:
                self.watch = (self.watch[0], self.watch[1], now)
                answered = now
            try:
                # the connection broke: a new one (bounded: it raises), or an error
                if self.store is None:
                    self.store = self.connect()
                # an operation on a connection made waits for ever if the store's host stopped
                self.asking = now
                if self._beat_and_watch(now):
                    return
                answered = now
            except Exception:  # a store hiccup: this beat is skipped, the connection made anew
                self.store = None
                # the store's host is gone: its agent sees that
                if time.monotonic() - answered >= self.timeout:
                    return
            finally:
                self.asking = None
                previous = time.monotonic()  # the next beat's gap is this thread's wait alone
        if self.leaving and self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"gone/{self.rank}", "1")

    def _beat_and_watch(self, now: float) -> bool:
        """One beat: this rank's counter and phase, another rank's finding, the watched peer's
        counter (``watch``). True when a silent rank was reported."""
        peer, last, moved = self.watch
        self.store.add(f"beat/{self.rank}", 1)
        self._publish()
        if self.store.add("silent", 0):  # another rank found one silent
            self._give_up(self.store.get("silent/who").decode(), found_here=False)
            return True
        watched = self._watched()
        if watched is None:
            return False
        count = self.store.add(f"beat/{watched}", 0)
        # a new peer, a beat, or not yet reported in
        if watched != peer or count != last or count == 0:
            self.watch = (watched, count, now)
            return False
        if now - moved < self.timeout or self.store.check([f"gone/{watched}"]):
            return False
        its = (
            self.store.get(f"phase/{watched}").decode()
            if self.store.check([f"phase/{watched}"])
            else ""
        )
        who = f"rank {watched} went silent (no heartbeat for {now - moved:.0f} s"
        who += f"{', in: ' + its if its else ''}; found by rank {self.rank})"
        self.store.set("silent/who", who)
        self.store.add("silent", 1)
        self._give_up(who, found_here=True)
        return True

    def _guard(self) -> None:
        previous = time.monotonic()
        while not self.stopped.wait(self.beat):
            now, asking = time.monotonic(), self.asking
            if (
                now - previous <= 3 * self.beat
                and asking is not None
                and now - asking >= self.timeout
            ):
                if not self.done:
                    hosted = (
                        f"rank {self.host} hosts it: it is stopped or cut off"
                        if self.host is not None
                        else ""
                    )
                    self.done = True
                    self.report(
                        f"the launch's store did not answer for {now - asking:.0f} s"
                        f" ({hosted or 'its host'})",
                        True,
                    )
                self.end()
                return
            previous = now

    def _give_up(self, who: str, found_here: bool) -> None:
        """Report, then end once every other live rank reported too (or after a few beats): the
        agent stops the group as soon as one rank exits, and each surviving rank is to say what it
        saw."""
        self.done = True
        self.report(who, found_here)
        try:  # a store that fails here must not keep this rank alive: it ends in any case
            reported = self.store.add("silent/reported", 1)
            live = self.world - 1 - sum(self.store.check([f"gone/{r}"]) for r in range(self.world))
            deadline = time.monotonic() + max(1.0, 3 * self.beat)
            while reported < live and time.monotonic() < deadline:
                time.sleep(self.beat / 10)
                reported = self.store.add("silent/reported", 0)
        finally:
            self.end()

    def _watched(self) -> int | None:
        """The next rank around the ring that has not exited cleanly (None: every other rank
        has)."""
        for step in range(1, self.world):
            candidate = (self.rank + step) % self.world
            if not self.store.check([f"gone/{candidate}"]):
                return candidate
        return None


def _report_silent_peer(who: str, found_here: bool) -> None:
    """The one line a surviving rank prints (stderr) about a silent peer."""
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    bound = f"HYPARALLEL_HEARTBEAT_TIMEOUT={heartbeat_timeout():g} s"
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.stderr.write(
        f"hyparallel: {who}; rank {rank} was in: {_describe()}; exiting so that the launcher"
        f" restarts the group ({bound}; docs/elastic.md)\n"
    )
    with contextlib.suppress(Exception):
        sys.stderr.flush()


def _end_process() -> None:
    """End the process: its collectives would wait on the silent rank (the agent restarts the
    group)."""
    os._exit(1)


def _start_heartbeat(rank: int, world: int, prefix: str, host: int | None = None) -> None:
    """Start this rank's heartbeat over a connection of its own to the launch's store
    (MASTER_ADDR:MASTER_PORT)."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
    set_phase("starting: materialising and the first step")
    connect = _connection(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), prefix, heartbeat_timeout()
    )
    _heartbeat = _Heartbeat(connect, rank, world, heartbeat_timeout(), host=host).start()


def _connection(host: str, port: int, prefix: str, timeout: float):
    """What makes the heartbeat's connection to the store (again, after one broke): a client of its
    own."""

    def connect() -> dist.Store:
        wait = datetime.timedelta(seconds=max(0.5, timeout / 4))
        return dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=wait))

    return connect


@atexit.register
def _stop_heartbeat() -> None:
    """A clean exit: the peers stop watching this rank (its agent reports a failed exit)."""
    if _heartbeat is not None:
        _heartbeat.stop()
