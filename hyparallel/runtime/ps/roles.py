"""``parallelize`` in parameter-server mode: each rank takes the role the plan gives it.

    pmodel = hp.parallelize(model, plan)      # ranks 0 .. servers-1 serve, the others are workers
    # a server serves here until the data is consumed: True
    if pmodel.serve():
        return
    # the dispatcher's data shards (re-queued if a worker dies)
    for batch in pmodel.batches(num_batches):
        loss = pmodel.train_step(inputs_of(batch), targets_of(batch), loss_fn)

Rank 0 starts a Ray cluster in its own process (or joins the one ``RAY_ADDRESS`` names) and the
dispatcher; each server rank starts its server actor from its rows of the model's (seeded,
identical) weights. Workers find them by name, pull rows and dense weights, push gradients, and
report each batch to the dispatcher.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyparallel.runtime.ps import actors
from hyparallel.runtime.ps.remote import RemoteEmbedding, unsupported
from hyparallel.runtime.ps.server import Push, assemble
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.schema import LossFn, Plan

ADDRESS_KEY = "hyparallel-ps/ray-address"
CONNECT_TIMEOUT_S = 120.0  # a worker waits this long for rank 0's cluster and the servers' actors


def table_modules(model: nn.Module, plan: Plan) -> dict[str, nn.Module]:
    """The tables ``plan.ps.tables`` names (``auto``: every nn.Embedding / nn.EmbeddingBag),
    checked."""
    modules = dict(model.named_modules())
    if plan.ps.tables == "auto":
        names = [n for n, m in modules.items() if isinstance(m, nn.Embedding | nn.EmbeddingBag)]
        if not names:
            raise ConfigError(
                f"ps.tables is auto but {type(model).__name__} has no nn.Embedding or"
                " nn.EmbeddingBag"
            )
    else:
        names = list(plan.ps.tables)
    for name in names:
        if name not in modules:
            raise ConfigError(
                f"ps.tables names '{name}', which is not a module of {type(model).__name__}"
            )
        if reason := unsupported(modules[name]):
            raise ConfigError(f"ps.tables: '{name}' {reason}; leave it off ps.tables")
    return {name: modules[name] for name in names}


def dense_owners(model: nn.Module, tables: dict[str, nn.Module], servers: int) -> dict[str, int]:
    """Each dense parameter -> the server holding it: largest first onto the least loaded (same on
    every rank)."""
    skip = {f"{t}.weight" for t in tables}
    params = sorted(
        ((p.numel(), n) for n, p in model.named_parameters() if n not in skip),
        key=lambda x: (-x[0], x[1]),
    )
    load, owners = [0] * servers, {}
    for numel, name in params:
        server = min(range(servers), key=lambda s: (load[s], s))
        owners[name], load[server] = server, load[server] + numel
    return owners


def parallelize_ps(model: nn.Module, plan: Plan, rank: int, world_size: int) -> PSServer | PSWorker:
    """This rank's role in ``plan``'s parameter-server mode (the launch size is already checked)."""
    try:
        import ray  # noqa: F401  (the servers are Ray actors)
    except ImportError:
        raise ConfigError(
            "this plan runs parameter servers (its ps: section), and they run on Ray, which is not"
            " installed: pip install 'hyparallel[ps]', or plan without servers (hyparallel plan"
            " --ps-servers 0)"
        ) from None
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(
            "parameter-server mode starts the servers from the model's weights: build the model on"
            " the CPU (the same seed on every rank), not on the meta device"
        )
    for name, module in model.named_modules():
        if getattr(module, "track_running_stats", False):
            raise ConfigError(
                f"parameter-server mode: '{name}' ({type(module).__name__}) keeps running"
                " statistics, which each worker would update on its own batches only; set"
                " track_running_stats=False or train it without ps"
            )
    tables = table_modules(model, plan)
    servers = plan.ps.servers
    namespace = _connect(rank)
    if rank < servers:
        return PSServer(rank, model, plan, tables, namespace)
    return PSWorker(rank, model, plan, tables, namespace)


def _store(rank: int):
    """The launch's key-value store: torchrun's agent store, or one rank 0 hosts (a plain
    launch)."""
    host, port = (
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ.get("MASTER_PORT", "29500")),
    )
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return torch.distributed.TCPStore(
        host, port, is_master=(rank == 0 and not agent), wait_for_workers=False, timeout=_timeout()
    )


def _timeout():
    import datetime

    return datetime.timedelta(seconds=CONNECT_TIMEOUT_S)


def _connect(rank: int) -> str:
    """Join (rank 0: start) this job's Ray cluster; returns the job's Ray namespace.

    A cluster rank 0 starts is the job's own: its authentication token is made here and handed to
    the other ranks through the launch's store, as the cluster address is (nothing is read from or
    written to ~/.ray).
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    job = os.environ.get("TORCHELASTIC_RUN_ID", os.environ.get("MASTER_PORT", "0"))
    namespace = f"{actors.NAMESPACE_PREFIX}-{job}-{restart}"
    store = _store(rank)
    key = f"{ADDRESS_KEY}/{restart}"
    if rank == 0:
        address = os.environ.get("RAY_ADDRESS")
        token = "" if address else secrets.token_hex(32)
        ray = _ray_with_token(token)
        if address:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, namespace=namespace, log_to_driver=False)
        store.set(
            key, json.dumps({"address": ray.get_runtime_context().gcs_address, "token": token})
        )
    else:
        given = json.loads(store.get(key).decode())
        ray = _ray_with_token(given["token"])
        ray.init(address=given["address"], namespace=namespace, log_to_driver=False)
    _STORES.append((store, key))  # kept open: rank 0 may host it
    return namespace


_STORES: list = []
# how long rank 0, on its way out, waits for the other server ranks to leave its cluster first
LEAVE_TIMEOUT_S = 10.0


# Note [the servers leave before rank 0 stops the cluster]
#     A server rank's actor lives as long as its process (Ray ties an actor to the driver that made
#     it), so every server rank stays until training is over and rank 0, which may still read the
#     actors (state_dict, diagnostics), has finished with them. Rank 0 stops the cluster at exit. A
#     rank still connected then spends seconds in Ray's own exit, retrying a cluster that is gone
#     (measured 5.5 s a rank on 2 cores). So rank 0, at exit and before Ray's own exit handler,
#     says it is leaving in the launch's store and waits (at most LEAVE_TIMEOUT_S) until each other
#     server rank has disconnected from the live cluster and said so. A server rank whose rank 0
#     died without a word still ends when the cluster stops answering.
def _leaving_keys(key: str, servers: int) -> tuple[str, list[str]]:
    return f"{key}/leaving", [f"{key}/left/{rank}" for rank in range(1, servers)]


def _let_the_servers_leave(servers: int) -> None:
    """Rank 0's exit (Note [the servers leave before rank 0 stops the cluster])."""
    store, key = _STORES[-1]
    leaving, left = _leaving_keys(key, servers)
    try:
        store.set(leaving, "1")
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while left and not store.check(left) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 -- the store gone: nobody left to wait for
        pass


def _ray_with_token(token: str):
    """Ray, imported with token authentication set to ``token`` (left as the user set it when
    empty)."""
    if token:
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    import ray

    if token:
        # Ray reads RAY_AUTH_MODE into a cached config when first imported: refresh it if Ray came
        # in earlier. A Ray release without token authentication has no such config: nothing to
        # refresh then.
        try:
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):
            pass
    return ray


def _initial_shard(
    model: nn.Module, tables: dict[str, nn.Module], owners: dict[str, int], index: int, servers: int
):
    params = dict(model.named_parameters())
    return {
        "tables": {name: m.weight.detach()[index::servers].clone() for name, m in tables.items()},
        "dense": {
            name: params[name].detach().clone() for name, owner in owners.items() if owner == index
        },
    }


def _wait_actor(name: str):
    import ray

    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return ray.get_actor(name)
        except ValueError:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"parameter-server mode: no actor '{name}' after {CONNECT_TIMEOUT_S:.0f} s; did"
                    " every server rank start (ranks 0 .. ps.servers - 1)?"
                ) from None
            time.sleep(0.2)


class PSServer:
    """A server rank: it starts its server actor (rank 0 the dispatcher too) and serves until the
    data is used."""

    is_server = True

    def __init__(
        self, rank: int, model: nn.Module, plan: Plan, tables: dict[str, nn.Module], namespace: str
    ) -> None:
        import ray

        server_cls, dispatcher_cls = actors.actor_classes()
        ps = plan.ps
        self.rank, self.namespace, self.servers = rank, namespace, ps.servers
        if rank == 0:
            self.dispatcher = dispatcher_cls.options(name=actors.DISPATCHER).remote(
                ps.servers, ps.staleness, ps.worker_timeout_s
            )
            ray.get(self.dispatcher.start.remote())
            # registered after ray.init: runs before Ray's own exit handler
            atexit.register(_let_the_servers_leave, ps.servers)
        else:
            self.dispatcher = _wait_actor(actors.DISPATCHER)
        owners = dense_owners(model, tables, ps.servers)
        init = _initial_shard(model, tables, owners, rank, ps.servers)
        self.actor = server_cls.options(name=actors.server_name(rank)).remote(
            rank, ps.servers, init, ps.optimizer, ps.lr, ps.staleness == 0
        )
        ray.get(self.actor.pid.remote())  # started

    def serve(self) -> bool:
        """Block until every batch of the data is consumed; True (this rank is a server).

        Rank 0 hosts the Ray cluster, so it returns at once then (it may still read the servers:
        :meth:`state_dict`); the other server ranks keep their actors up until rank 0 has gone.
        """
        import ray

        ray.get(self.dispatcher.wait_finished.remote())
        if self.rank == 0:
            log, dead = self.log(), ray.get(self.dispatcher.dead.remote())
            once = len({batch for batch, _, _ in log}) == len(log)
            print(
                f"hyparallel ps: {len(log)} batches consumed"
                + (", each once" if once else ", SOME TWICE")
                + f", by {len({worker for _, worker, _ in log})} worker(s); {len(dead)} taken for"
                " dead",
                flush=True,
            )
            return True
        store, key = _STORES[-1]
        leaving, left = _leaving_keys(key, self.servers)
        try:
            while not store.check([leaving]):
                # a call that returns at once (training is over): is rank 0's cluster still up?
                ray.get(self.dispatcher.wait_finished.remote(), timeout=10)
                time.sleep(0.2)
        except Exception:  # rank 0 left and took the cluster with it: training is over
            return True
        # Note [the servers leave before rank 0 stops the cluster]
        ray.shutdown()
        store.set(left[self.rank - 1], "1")
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, the tables reassembled from every server's rows (for export or
        a check)."""
        import ray

        snapshots = ray.get(
            [_wait_actor(actors.server_name(i)).snapshot.remote() for i in range(self.servers)]
        )
        return assemble([{**snap, "index": i} for i, snap in enumerate(snapshots)])

    def log(self) -> list[tuple[int, str, int]]:
        """The dispatcher's log: (batch, worker, step) of every batch consumed, each once."""
        import ray

        return [tuple(entry) for entry in ray.get(self.dispatcher.log.remote())]

    def diagnostics(self) -> dict:
        """What the run did: the dispatcher's log and pacing, each server's updates and checkpoint
        restored."""
        import ray

        snapshots = ray.get(
            [_wait_actor(actors.server_name(i)).snapshot.remote() for i in range(self.servers)]
        )
        return {
            "log": self.log(),
            "pacing": [tuple(p) for p in ray.get(self.dispatcher.pacing.remote())],
            "updates": [s["updates"] for s in snapshots],
            "restored_from": [s["restored_from"] for s in snapshots],
        }

    def parameters(self) -> Iterator[nn.Parameter]:
        """None: a server rank trains nothing itself."""
        return iter(())


class PSWorker:
    """A worker rank: the model with its tables on the servers, trained by ``train_step`` one batch
    at a time."""

    is_server = False
    ps_mode = True  # hp.checkpoint saves and loads it through the servers

    def __init__(
        self, rank: int, model: nn.Module, plan: Plan, tables: dict[str, nn.Module], namespace: str
    ) -> None:
        import ray

        self.plan, self.servers, self.module = plan, plan.ps.servers, model
        self.name = f"worker-{rank}-{uuid.uuid4().hex[:6]}"
        self.dispatcher = _wait_actor(actors.DISPATCHER)
        self.server_actors = [_wait_actor(actors.server_name(i)) for i in range(self.servers)]
        self.owners = dense_owners(model, tables, self.servers)
        self.remote: dict[str, RemoteEmbedding] = {}
        for name, module in tables.items():
            remote = RemoteEmbedding(module, name, self.servers, self._pull)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, remote)
            self.remote[name] = remote
        self.step = ray.get(self.dispatcher.register.remote(self.name))
        self.current: tuple[int, int] | None = None
        self.bytes_moved = 0  # pulled + pushed, since the start
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def serve(self) -> bool:
        """False: a worker goes on to train."""
        return False

    def parameters(self) -> Iterator[nn.Parameter]:
        """The local copies of the dense weights (the servers update them; a local optimizer sees no
        gradient)."""
        return self.module.parameters()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def batches(self, num_batches: int, shard_size: int = 16) -> Iterator[int]:
        """The batch numbers this worker trains, from the dispatcher, one per step until the data is
        consumed."""
        import ray

        ray.get(self.dispatcher.create_dataset.remote(num_batches, shard_size))
        while True:
            given = ray.get(self.dispatcher.begin.remote(self.name))
            if given is None:
                return
            self.current = tuple(given)
            yield given[1]
            if self.current is not None:
                raise RuntimeError(
                    f"batch {given[1]} was not trained: call train_step once per batch"
                )

    def train_step(self, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """Pull, forward, backward, push one batch (the one ``batches`` gave last); returns the
        loss."""
        import ray

        if self.current is None:
            raise RuntimeError(
                "train_step in parameter-server mode trains the batch pmodel.batches() gave"
            )
        step, batch = self.current
        self._pull_dense()
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        loss = loss_fn(self.module(*args), targets)
        loss.backward()
        pushes = self._pushes(step, batch, samples=len(targets))
        ray.get([self.server_actors[s].push.remote(p) for s, p in pushes.items()])
        for remote in self.remote.values():
            remote.clear()
        ray.get(self.dispatcher.finish.remote(self.name, step, batch))
        self.current = None
        return loss.detach()

    def save_checkpoint(self, directory: str, step: int, extra: dict | None = None) -> Path:
        """``directory/step-N``: every server's shard and the dispatcher's log (once per step,
        whoever asks)."""
        import ray

        from hyparallel.runtime.checkpoint import FORMAT

        marker = {
            "format": FORMAT,
            "step": step,
            "extra": extra or {},
            "ps": self.plan.ps.model_dump(),
        }
        return Path(ray.get(self.dispatcher.checkpoint.remote(str(directory), step, marker)))

    def load_checkpoint(self, path: str | Path) -> None:
        """The servers take their rows of the checkpoint at ``path``, written by any number of
        servers."""
        import ray

        ray.get(self.dispatcher.load.remote(str(path)))

    # ---- internals ----------------------------------------------------------------------------

    def _pull(self, table: str, asks: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        import ray

        servers = list(asks)
        answers = ray.get([self.server_actors[s].pull.remote({table: asks[s]}) for s in servers])
        rows = {s: a[table] for s, a in zip(servers, answers)}
        self.bytes_moved += sum(r.numel() * r.element_size() for r in rows.values())
        return rows

    def _pull_dense(self) -> None:
        import ray

        holders = sorted(set(self.owners.values()))
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for values in ray.get([self.server_actors[s].pull_dense.remote() for s in holders]):
                for name, value in values.items():
                    params[name].copy_(value)
                    self.bytes_moved += value.numel() * value.element_size()

    def _pushes(self, step: int, batch: int, samples: int) -> dict[int, Push]:
        pushes = {s: Push(self.name, step, batch, samples, {}) for s in range(self.servers)}
        for name, remote in self.remote.items():
            for server, (rows, grad) in remote.gradients().items():
                pushes[server].sparse[name] = (rows, grad)
                self.bytes_moved += grad.numel() * grad.element_size() + rows.numel() * 8
        for name, param in self.module.named_parameters():
            if param.grad is not None:
                pushes[self.owners[name]].dense[name] = param.grad.detach().clone()
                self.bytes_moved += param.grad.numel() * param.grad.element_size()
                param.grad = None  # consumed: the servers apply it
        return pushes

    def _heartbeat(self) -> None:
        every = self.plan.ps.worker_timeout_s / 4
        while True:
            time.sleep(every)
            try:
                self.dispatcher.heartbeat.remote(self.name)
            except Exception:  # the cluster is gone (the job ended): stop beating
                return
