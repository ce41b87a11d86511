"""The dispatcher (ElasticDL's and DLRover's "master"): it hands out data, paces the workers, closes
steps.

The data is ``num_batches`` batches, numbered, cut into shards of ``shard_size`` consecutive
batches. A worker leases a shard and takes its batches one step at a time; when it goes silent for
``worker_timeout_s`` its lease goes back to the front of the queue from its first unfinished batch,
so every batch is consumed exactly once (``log``). Workers may register at any time.

Note [pacing]
    A worker's clock is the number of steps it has finished. At staleness k > 0 a worker may begin
    step c + 1 only while c - (the smallest clock among the other working workers) <= k:
    stale-synchronous parallel (Ho et al. 2013). A worker waiting for data (every shard leased, some
    to a worker that may yet die) and a worker with nothing left do not hold the others back.
    Servers apply each push as it comes. At staleness 0 the workers move in lockstep and a step is
    closed by the dispatcher: once every working worker has finished it (or died, or is waiting for
    data), each server applies the step's staged pushes of the finished batches as one mean
    gradient, which is synchronous SGD over the step's batches.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# Worker states.
WORKING, WAITING, DONE, DEAD = "working", "waiting", "done", "dead"


@dataclass
class _Worker:
    clock: int  # steps finished
    seen: float
    state: str = WORKING
    lease: list[int] | None = None  # [next batch, shard end)
    batch: int | None = None  # the batch of the step in progress
    step_done: bool = False  # staleness 0: finished the open step


@dataclass
class Dispatcher:
    """Data shards, worker liveness and pacing; ``apply_step`` closes a step on every server
    (staleness 0)."""

    staleness: int
    worker_timeout_s: float
    apply_step: Callable[[int, list[int]], Awaitable[None]]
    todo: deque = field(default_factory=deque)  # shards (start, stop) not leased
    workers: dict[str, _Worker] = field(default_factory=dict)
    # (batch, worker, step), each batch once
    log: list[tuple[int, str, int]] = field(default_factory=list)
    # (worker, step, slowest clock) at each begin
    pacing: list[tuple[str, int, int]] = field(default_factory=list)
    num_batches: int | None = None
    closed: int = 0  # staleness 0: the last step applied
    # staleness 0: batch -> worker, the open step
    step_batches: dict[int, str] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    # ---- data ---------------------------------------------------------------------------------

    async def create_dataset(self, num_batches: int, shard_size: int) -> int:
        """Cut the data into shards, once (later calls, from workers that join, only read it
        back)."""
        if self.num_batches is None:
            self.num_batches = num_batches
            self.todo.extend(
                (s, min(s + shard_size, num_batches)) for s in range(0, num_batches, shard_size)
            )
        elif self.num_batches != num_batches:
            raise ValueError(f"the data was given as {self.num_batches} batches, not {num_batches}")
        return self.num_batches

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's dispatcher state: what it consumed stays consumed."""
        self.num_batches, self.log, self.closed = (
            state["num_batches"],
            list(map(tuple, state["log"])),
            state["closed"],
        )
        consumed = {batch for batch, _, _ in self.log}
        self.todo = deque((b, b + 1) for b in range(self.num_batches) if b not in consumed)
        for worker in self.workers.values():
            worker.lease, worker.batch, worker.clock, worker.step_done = (
                None,
                None,
                self.closed,
                False,
            )

    def state(self) -> dict:
        """What a checkpoint keeps: the batches consumed and, at staleness 0, the last step
        closed."""
        return {"num_batches": self.num_batches, "log": list(self.log), "closed": self.closed}

    # ---- workers ------------------------------------------------------------------------------

    async def register(self, name: str) -> int:
        """A worker joins (or comes back under a new name); returns the step it begins with."""
        async with self.changed:
            start = self.closed if self.staleness == 0 else self._slowest(exclude=name, default=0)
            self.workers[name] = _Worker(clock=start, seen=time.monotonic())
            self.changed.notify_all()
            return start + 1

    async def begin(self, name: str) -> tuple[int, int] | None:
        """Wait until ``name`` may begin its next step (Note [pacing]); its (step, batch), or None
        at the end."""
        async with self.changed:
            while True:
                worker = self._alive(name)
                worker.seen = time.monotonic()
                step = worker.clock + 1
                if not self._paced(name, step):
                    await self._wait()
                    continue
                batch = self._next_batch(worker)
                if batch is None:
                    if not self._outstanding(name):
                        worker.state = DONE
                        self.changed.notify_all()
                        await self._maybe_close()
                        return None
                    worker.state = WAITING  # every shard is leased: wait in case a holder dies
                    await self._maybe_close()
                    await self._wait()
                    continue
                worker.state, worker.batch, worker.step_done = WORKING, batch, False
                slowest = self._slowest(exclude=name, default=worker.clock)
                self.pacing.append((name, step, slowest))
                if self.staleness == 0:
                    self.step_batches[batch] = name
                return step, batch

    async def finish(self, name: str, step: int, batch: int) -> None:
        """``name`` pushed its gradients of ``batch`` to every server."""
        async with self.changed:
            worker = self._alive(name)
            if worker.batch != batch or worker.clock + 1 != step:
                raise ValueError(f"{name} finished batch {batch} of step {step}, not its own")
            worker.seen, worker.batch = time.monotonic(), None
            if self.staleness == 0:
                worker.step_done = True
                await self._maybe_close()
            else:
                worker.clock = step
                self.log.append((batch, name, step))
                self.changed.notify_all()

    async def heartbeat(self, name: str) -> None:
        """A worker is alive (sent by a thread of each worker while it computes)."""
        self._alive(name).seen = time.monotonic()

    async def reap(self) -> list[str]:
        """Take silent workers for dead and re-queue their leases; the names taken."""
        async with self.changed:
            now, dead = time.monotonic(), []
            for name, worker in self.workers.items():
                if worker.state in (WORKING, WAITING) and now - worker.seen > self.worker_timeout_s:
                    worker.state = DEAD
                    dead.append(name)
                    if worker.lease is not None:
                        start = worker.batch if worker.batch is not None else worker.lease[0]
                        if start < worker.lease[1]:
                            self.todo.appendleft((start, worker.lease[1]))
                        worker.lease = None
                    if worker.batch is not None:
                        self.step_batches.pop(worker.batch, None)
                    worker.batch = None
            if dead:
                self.changed.notify_all()
                await self._maybe_close()
            return dead

    def finished(self) -> bool:
        """Every batch consumed."""
        return self.num_batches is not None and len(self.log) == self.num_batches

    async def wait_finished(self) -> None:
        """Return once every batch is consumed and every worker has been told so (or is dead)."""
        async with self.changed:
            while not (
                self.finished() and all(w.state in (DONE, DEAD) for w in self.workers.values())
            ):
                await self._wait()

    # ---- internals ----------------------------------------------------------------------------

    async def _wait(self) -> None:
        # Wake at least every second: reap() runs from a timer, and a join changes who is slowest.
        try:
            await asyncio.wait_for(self.changed.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass

    def _alive(self, name: str) -> _Worker:
        worker = self.workers.get(name)
        if worker is None or worker.state == DEAD:
            raise LookupError(
                f"worker {name} is not registered or was taken for dead (silent >"
                f" {self.worker_timeout_s} s); its data went to the others: restart it to join"
                " again"
            )
        return worker

    def _next_batch(self, worker: _Worker) -> int | None:
        if worker.lease is None or worker.lease[0] >= worker.lease[1]:
            worker.lease = list(self.todo.popleft()) if self.todo else None
        if worker.lease is None:
            return None
        batch = worker.lease[0]
        worker.lease[0] += 1
        return batch

    def _outstanding(self, name: str) -> bool:
        """Some other live worker holds a lease with batches left (it may die and give them
        back)."""
        return any(
            w.state in (WORKING, WAITING)
            and (w.batch is not None or (w.lease and w.lease[0] < w.lease[1]))
            for n, w in self.workers.items()
            if n != name
        )

    def _working(self, exclude: str | None = None) -> list[_Worker]:
        return [w for n, w in self.workers.items() if n != exclude and w.state == WORKING]

    def _slowest(self, exclude: str, default: int) -> int:
        clocks = [w.clock for w in self._working(exclude)]
        return min(clocks) if clocks else default

    def _paced(self, name: str, step: int) -> bool:
        # lockstep: one batch per worker per step, the next once the step is applied
        if self.staleness == 0:
            return step == self.closed + 1 and not self.workers[name].step_done
        return (step - 1) - self._slowest(exclude=name, default=step - 1) <= self.staleness

    async def _maybe_close(self) -> None:
        """Staleness 0: close the open step once no working worker is still computing it."""
        if self.staleness != 0 or not self.step_batches:
            return
        if any(w.state == WORKING and not w.step_done for w in self.workers.values()):
            return
        step, batches = self.closed + 1, dict(self.step_batches)
        await self.apply_step(step, sorted(batches))
        for batch, name in sorted(batches.items()):
            self.log.append((batch, name, step))
        self.step_batches.clear()
        self.closed = step
        for worker in self.workers.values():
            if worker.state != DEAD:
                worker.clock, worker.step_done = step, False
        self.changed.notify_all()
