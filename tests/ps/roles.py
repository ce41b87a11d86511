"""The processes of the parameter-server tests: each runs one rank (server or worker) of a plain
launch."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from torch import nn

import hyparallel as hp


class TinyRec(nn.Module):
    """Two bag tables, one plain table and a dense head: small, yet every kind of lookup the servers
    serve."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(37, 4, mode="sum")
        self.item = nn.EmbeddingBag(23, 4, mode="mean")
        self.cat = nn.Embedding(11, 4)
        self.head = nn.Sequential(nn.Linear(12 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, sparse):
        pooled = [self.user(sparse[:, 0:2]), self.item(sparse[:, 2:4]), self.cat(sparse[:, 4])]
        return self.head(torch.cat([*pooled, dense], dim=1)).squeeze(1)


def model(seed: int = 0) -> TinyRec:
    torch.manual_seed(seed)
    return TinyRec()


def batch(index: int, rows: int = 6):
    """Batch ``index`` of the test's data: any process regenerates it."""
    g = torch.Generator().manual_seed(1000 + index)
    dense = torch.randn(rows, 3, generator=g)
    sparse = torch.stack(
        [torch.randint(0, n, (rows,), generator=g) for n in (37, 37, 23, 23, 11)], dim=1
    )  # Zipf is not needed here: collisions within a batch come from the small tables
    clicks = (torch.rand(rows, generator=g) < 0.5).float()
    return (dense, sparse), clicks


def loss_fn(logits, clicks):
    return nn.functional.binary_cross_entropy_with_logits(logits, clicks)


class _DieBeforeFinish:
    """The dispatcher, except that reporting batch ``at`` kills this worker: its pushes landed, its
    report did not."""

    def __init__(self, dispatcher, at: int) -> None:
        self.dispatcher, self.at, self.seen = dispatcher, at, 0

    def __getattr__(self, name):
        if name != "finish":
            return getattr(self.dispatcher, name)
        self.seen += 1
        if self.seen > self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.dispatcher.finish


def _faults(pmodel) -> None:
    """PS_TEST_KILL_WORKER=rank:n: that worker dies reporting its (n+1)-th batch."""
    spec = os.environ.get("PS_TEST_KILL_WORKER")
    if spec:
        rank, at = map(int, spec.split(":"))
        if int(os.environ["RANK"]) == rank:
            pmodel.dispatcher = _DieBeforeFinish(pmodel.dispatcher, at)


def _kill_server(index: int) -> None:
    import ray

    pid = ray.get(ray.get_actor(f"server-{index}").pid.remote())
    os.kill(pid, signal.SIGKILL)


def main() -> None:
    plan = hp.Plan.load(sys.argv[1])
    num_batches, out = int(sys.argv[2]), sys.argv[3]
    slow = float(os.environ.get("PS_TEST_SLOW_S", "0"))
    pmodel = hp.parallelize(model(), plan)
    if pmodel.serve():
        # the servers' final weights and the dispatcher's log, for the test to compare
        if pmodel.rank == 0:
            torch.save({"state": pmodel.state_dict(), **pmodel.diagnostics()}, out)
        return
    record = []
    _faults(pmodel)
    if os.environ.get("PS_TEST_RESUME_DIR"):
        hp.checkpoint.load(pmodel, None, os.environ["PS_TEST_RESUME_DIR"])
    for index in pmodel.batches(num_batches, shard_size=int(os.environ.get("PS_TEST_SHARD", "2"))):
        inputs, clicks = batch(index)
        loss = pmodel.train_step(inputs, clicks, loss_fn)
        record.append({"batch": index, "loss": float(loss)})
        if os.environ.get("PS_TEST_CHECKPOINT_AT") == str(len(record)):
            hp.checkpoint.save(pmodel, None, os.environ["PS_TEST_CHECKPOINT_DIR"], step=len(record))
        if os.environ.get("PS_TEST_KILL_SERVER_AT") == str(len(record)) and os.environ[
            "RANK"
        ] == os.environ.get("PS_TEST_KILLER"):
            _kill_server(int(os.environ["PS_TEST_KILL_SERVER"]))
        if slow:
            import time

            time.sleep(slow)
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
