"""The Ray actors of parameter-server mode: one per server, one dispatcher
(docs/parameter-server.md).

Note [why Ray]
    The mode's requirements pick the engine: a worker's death must not stop the others, a worker may
    join mid-run, and a server that crashes must come back from its checkpoint and rejoin. Measured
    on this project's CI machine (2 cores, torch 2.13 CPU, Ray 2.60): torch.distributed.rpc answers
    a 16 KiB request in 0.75 ms (Ray: 1.9 ms) and 2 MiB in 2.5 ms (Ray: 10.7 ms), but its group is
    fixed at init: a member's death makes every later ``rpc.shutdown`` fail, and no process can take
    the dead one's name. A Ray actor with ``max_restarts`` is restarted by Ray (1.8 s here after a
    SIGKILL) under the same name, calls to it wait for the restart (``max_task_retries``), and any
    process may connect to the cluster at any time. So the servers and the dispatcher are Ray
    actors; workers are plain processes that connect.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
from pathlib import Path

import torch

from hyparallel.runtime.ps.dispatcher import Dispatcher
from hyparallel.runtime.ps.server import Push, ServerShard
from hyparallel.spec.files import CHECKPOINT_MARKER as MARKER

NAMESPACE_PREFIX = "hyparallel-ps"
DISPATCHER = "dispatcher"
REAP_EVERY_S = 0.5  # how often the dispatcher looks for silent workers


def server_name(index: int) -> str:
    """The Ray actor name of server ``index``."""
    return f"server-{index}"


def shard_file(directory: str | Path, index: int) -> Path:
    """Where server ``index`` keeps its shard inside a checkpoint's directory."""
    return Path(directory) / "ps" / f"server-{index}.pt"


class _Server:
    """A :class:`ServerShard` as an actor; on a restart it loads the newest checkpoint the
    dispatcher knows."""

    def __init__(
        self, index: int, servers: int, init: dict, rule: str, lr: float, synchronous: bool
    ) -> None:
        import ray

        self.shard = ServerShard(
            index, servers, init["tables"], init["dense"], rule, lr, synchronous
        )
        self.restored_from = None
        if ray.get_runtime_context().was_current_actor_reconstructed:
            dispatcher = ray.get_actor(DISPATCHER)
            directory = ray.get(dispatcher.checkpoint_dir.remote())
            if directory is not None:
                self.load(directory)

    def pid(self) -> int:
        return os.getpid()

    def pull(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.shard.pull(rows)

    def pull_dense(self) -> dict[str, torch.Tensor]:
        return self.shard.pull_dense()

    def push(self, push: Push) -> bool:
        return self.shard.push(push)

    def apply_step(self, step: int, batches: list[int]) -> list[int]:
        return self.shard.apply_step(step, batches)

    def save(self, directory: str) -> None:
        self.shard.save(shard_file(directory, self.shard.index))

    def load(self, directory: str) -> None:
        files = sorted((Path(directory) / "ps").glob("server-*.pt"))
        self.shard.load(files)
        self.restored_from = directory

    def updates(self) -> list[tuple[str, int, int]]:
        return list(self.shard.updates)

    def snapshot(self) -> dict:
        return {
            "tables": self.shard.tables,
            "dense": self.shard.dense,
            "restored_from": self.restored_from,
            "updates": list(self.shard.updates),
        }


class _Dispatcher:
    """A :class:`Dispatcher` as an async actor, closing steps on the server actors and reaping
    silent workers."""

    def __init__(self, servers: int, staleness: int, worker_timeout_s: float) -> None:
        self.servers = servers
        self.core = Dispatcher(staleness, worker_timeout_s, self._apply_step)
        self.saved_dir: str | None = None
        self.saved_step = -1
        self.reaper = None
        self.handles = None

    def _handles(self):
        """The server actors (looked up once: a handle stays good across the actor's restarts)."""
        import ray

        if self.handles is None:
            self.handles = [ray.get_actor(server_name(i)) for i in range(self.servers)]
        return self.handles

    async def _apply_step(self, step: int, batches: list[int]) -> None:
        await asyncio.gather(*[h.apply_step.remote(step, batches) for h in self._handles()])

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            await self.core.reap()

    async def start(self) -> None:
        if self.reaper is None:
            self.reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def create_dataset(self, num_batches: int, shard_size: int) -> int:
        return await self.core.create_dataset(num_batches, shard_size)

    async def register(self, name: str) -> int:
        return await self.core.register(name)

    async def begin(self, name: str):
        return await self.core.begin(name)

    async def finish(self, name: str, step: int, batch: int) -> None:
        await self.core.finish(name, step, batch)

    async def heartbeat(self, name: str) -> None:
        await self.core.heartbeat(name)

    async def wait_finished(self) -> None:
        await self.core.wait_finished()

    async def checkpoint(self, root: str, step: int, marker: dict) -> str:
        """Save every server's shard and the dispatcher's log as ``root/step-N``, once per step; its
        path.

        Written into a temporary folder, given hyparallel's checkpoint marker and renamed into
        place, as hp.checkpoint's own disk checkpoints are: a crash mid-save leaves the previous one
        current.
        """
        final = Path(root) / f"step-{step:08d}"
        # no step closes, no batch is handed out, while the shards are written
        async with self.core.changed:
            # saved already by another worker (or older than the newest)
            if step <= self.saved_step:
                return str(final)
            temporary = Path(root) / f".step-{step:08d}.tmp"
            shutil.rmtree(temporary, ignore_errors=True)
            (temporary / "ps").mkdir(parents=True)
            await asyncio.gather(*[h.save.remote(str(temporary)) for h in self._handles()])
            torch.save(self.core.state(), temporary / "ps" / "dispatcher.pt")
            (temporary / MARKER).write_text(json.dumps(marker, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            temporary.rename(final)
            self.saved_dir, self.saved_step = str(final), step
            return str(final)

    async def load(self, directory: str) -> None:
        """Every server takes its rows of a checkpoint (any number of servers wrote it); the log
        continues."""
        async with self.core.changed:
            if self.saved_dir == directory:  # another worker of this run loaded it already
                return
            await asyncio.gather(*[h.load.remote(directory) for h in self._handles()])
            self.core.restore(
                torch.load(Path(directory) / "ps" / "dispatcher.pt", weights_only=False)
            )
            # Steps go on from the checkpoint's: a later save of a smaller step would hide behind
            # this one.
            self.saved_dir, self.saved_step = (
                directory,
                json.loads((Path(directory) / MARKER).read_text())["step"],
            )

    async def checkpoint_dir(self) -> str | None:
        return self.saved_dir

    async def log(self) -> list[tuple[int, str, int]]:
        return list(self.core.log)

    async def pacing(self) -> list[tuple[str, int, int]]:
        return list(self.core.pacing)

    async def dead(self) -> list[str]:
        return [name for name, w in self.core.workers.items() if w.state == "dead"]


@functools.cache
def actor_classes():
    """The Ray actor classes (built on first use: importing hyparallel never imports Ray)."""
    import ray

    # Restart a crashed server for ever, and retry the calls it was serving: they wait for it.
    server = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)(_Server)
    # max_concurrency: begin() waits inside the actor while other workers call in.
    dispatcher = ray.remote(num_cpus=0, max_concurrency=1000)(_Dispatcher)
    return server, dispatcher
