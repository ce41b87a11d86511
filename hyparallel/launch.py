"""The process group of a launch, made to survive restarts: one private store per round, bounded collectives.

``init_process_group()`` (``parallelize`` calls it when no group exists) reads the launch from the environment
(torchrun, ``dlrover-run``, or a plain RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) and starts the default group:

- Under an elastic agent that shares its rendezvous store with the workers (torchrun's default,
  ``TORCHELASTIC_USE_AGENT_STORE=True``), every round of workers runs in a namespace of that store of its own
  (Note [a store private to each round]), so a restarted group never reads the addresses its dead
  predecessors left there (pytorch/pytorch#167288, #135712). No environment variable is needed.
- Collectives are bounded (Note [how long a collective may wait]): a rank that hangs, is stopped or has died
  makes the others fail within ``HYPARALLEL_TIMEOUT`` seconds, and the agent restarts the group.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import uuid
from collections.abc import Iterator

import torch.distributed as dist

from hyparallel.errors import ConfigError

__all__ = [
    "background_group",
    "collective_timeout",
    "current_timeout",
    "init_process_group",
    "init_timeout",
    "long_timeouts",
    "round_store",
    "set_timeouts",
]

# Note [how long a collective may wait]
#     torch's defaults (30 min for gloo, 10 min for NCCL) turn a stopped or hung rank into half an hour of idle
#     cluster. hyparallel gives every process group two bounds, as torchtitan does (init and train timeouts):
#     - HYPARALLEL_INIT_TIMEOUT (default 600 s) while starting: the rendezvous, the first training step (each
#       rank materialises and, with NCCL, connects its communicators), and checkpoint saves and loads (a rank
#       may wait while others write gigabytes);
#     - HYPARALLEL_TIMEOUT once the first step is done (default 30 s on gloo, 120 s with NCCL): every later
#       collective, so a stopped rank (SIGSTOP), a dead peer or a stuck collective makes every other rank raise
#       within that bound; the process exits non-zero and the agent (torchrun, dlrover-run) restarts the group.
#     A step whose slowest collective legitimately waits longer than HYPARALLEL_TIMEOUT (a very slow rank, huge
#     buckets on a slow network) needs the variable raised (docs/elastic.md).
DEFAULT_INIT_TIMEOUT_S = 600.0
DEFAULT_TIMEOUT_S = {"gloo": 30.0, "nccl": 120.0}

# Note [a store private to each round]
#     torchrun (c10d rendezvous, torch >= 2.4) hosts one TCPStore in the agent and hands its address to every
#     round of workers (MASTER_ADDR/MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True). init_process_group then
#     keys the group by its name ("0/..."): the same keys in every round. A restarted round's gloo ranks read
#     the address each peer published, find the dead round's (set first, still there) and retry connecting to
#     a closed port until the 30-minute timeout; NCCL reads a stale unique id. TORCHELASTIC_RESTART_COUNT
#     cannot name the round: each agent counts its own restarts (a node whose workers were healthy restarts
#     them without counting), so two nodes can disagree.
#     What every worker of a round can rely on is that the previous round's workers are all dead before any
#     worker of this one starts (each agent stops its workers before it joins the next rendezvous). So:
#     - every worker takes a number from a counter in the shared store (`add` is atomic): a "tick", later than
#       anything a dead worker wrote;
#     - rank 0 draws a fresh random token and publishes "token tick" with a new tick, again and again, until
#       every other rank has reported in under that token;
#     - rank r > 0 accepts a published token only with a tick later than its own: it was written after rank r
#       started, so by this round's rank 0, never a dead one's.
#     The group then runs in a PrefixStore "hyparallel/<token>/" of the shared store: all its keys (and those of
#     every group made from it: the mesh's, DCP's) are new. A few store round trips per start.
_CLOCK, _CURRENT = "hyparallel/clock", "hyparallel/current"
_bound: datetime.timedelta | None = None  # what set_timeouts last applied; None: the groups are not ours to bound
_background: set = set()  # groups of background writers: always bounded by init_timeout()


def init_timeout() -> datetime.timedelta:
    """The bound on collectives while starting and checkpointing (HYPARALLEL_INIT_TIMEOUT, seconds)."""
    return datetime.timedelta(seconds=_seconds("HYPARALLEL_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT_S))


def collective_timeout(backend: str) -> datetime.timedelta:
    """The bound on every collective after the first step (HYPARALLEL_TIMEOUT, seconds; default per backend)."""
    return datetime.timedelta(seconds=_seconds("HYPARALLEL_TIMEOUT", DEFAULT_TIMEOUT_S.get(backend, 120.0)))


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{name}={text!r}: give the timeout in seconds, a positive number (e.g. {name}=60)")
    return value


def init_process_group(backend: str | None = None) -> None:
    """Start the default process group for this launch (a no-op when one exists).

    ``backend`` defaults to NCCL where CUDA is available, gloo otherwise. Under an elastic agent that shares its
    store, the group runs in a namespace of its own (Note [a store private to each round]); collectives are
    bounded by :func:`init_timeout` until :func:`set_timeouts` lowers them after the first step.
    """
    import torch

    global _bound
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    timeout = _bound = init_timeout()
    if world == 1:  # a world of one needs no rendezvous, whatever MASTER_ADDR a shell exported
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):  # rank 0 hosts a store of this round's own
        dist.init_process_group(backend, timeout=timeout)
        return
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    store = round_store(shared, rank, world, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def round_store(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """A PrefixStore of ``store`` that only this round of ``world`` workers uses (Note [a store private to each round]).

    Every rank calls it; it returns once all ``world`` ranks agreed on the round's token, or raises after
    ``timeout``.
    """
    deadline = time.monotonic() + timeout.total_seconds()

    def wait(what: str) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank}: no agreement on this round's store after {timeout.total_seconds():.0f} s ({what}); "
                "a rank of this round did not start: check every rank's log"
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
    return dist.PrefixStore(f"hyparallel/{token}/", store)


def set_timeouts(timeout: datetime.timedelta) -> None:
    """Bound every collective of every process group of this process (the default one, the mesh's, any other).

    A no-op for groups hyparallel did not start (a caller's own init_process_group keeps its own timeout)
    unless HYPARALLEL_TIMEOUT is set.
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
    """A new gloo group of every rank for background writers (every rank calls it at the same point).

    Its collectives wait up to :func:`init_timeout`, whatever the training bound: a writer waits on
    other ranks' disk writes, which may take long.
    """
    group = dist.new_group(backend="gloo", timeout=init_timeout())
    _background.add(group)
    return group


def current_timeout() -> datetime.timedelta | None:
    """What collectives of hyparallel's groups are bounded by now (None: the caller's groups, left alone)."""
    return _bound


@contextlib.contextmanager
def long_timeouts() -> Iterator[None]:
    """Collectives bounded by :func:`init_timeout` inside (checkpoint saves and loads), as they were after."""
    before = _bound
    if before is None or not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    set_timeouts(init_timeout())
    try:
        yield
    finally:
        set_timeouts(before)
