"""`torchrun --standalone --nproc_per_node N SCRIPT ARGS...`, its workers forked from a process that
imported them once.

Usage: ``python tests/distributed/forked_torchrun.py N SCRIPT ARGS...`` (tests/conftest.torchrun).

Note [forked workers]
    torchrun starts each worker as a fresh interpreter, and each one imports torch and hyparallel
    again, and torch.export's machinery at its first trace: about 2.5 s of CPU a process, 10 s of an
    8-process launch on 2 cores before any case runs (measured: a trivial 8-process launch 10.4 s,
    4.5 s with this). This is torchrun's own agent (torch.distributed.run's arguments and
    --standalone rendezvous, its environment for the workers, its monitor, and its
    stop-everyone-when-one-fails: Note [a failing rank ends the launch]), given the worker as a
    function with ``--start-method forkserver``: multiprocessing's fork server, a fresh
    single-threaded process that imports PRELOAD and the worker script's module once, forks each
    worker, which runs the script as ``__main__`` with its arguments, as ``python SCRIPT ARGS...``
    would. Not plain ``fork``: the agent runs its rendezvous store's thread, and a process forked
    while another thread holds a lock can hang (one launch did, in init_process_group). The elastic
    tests (tests/test_elastic.py) and the example's (tests/test_parallel.py) launch real torchrun.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import runpy
import sys
import uuid

# Modules every worker imports: the tracer's torch.export machinery (torch._dynamo) is imported at a
# rank's first trace. Not transformers: measured, preloading it saved nothing (a Hugging Face case's
# time is its work).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.export",
    "hyparallel",
    "hyparallel.runtime.parallel",
]


def worker(script: str, args: list[str]) -> None:
    """One rank: the script as ``python SCRIPT ARGS...`` runs it (its directory first on sys.path),
    with a fresh interpreter's random states: torch's default seed, Python's and NumPy's drawn from
    the system (not the fork server's, which every worker would share)."""
    import random

    import numpy
    import torch

    torch.manual_seed(torch.initial_seed())  # the default seed, its state as before any draw
    random.seed()
    numpy.random.seed()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    processes, script, args = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3:]
    here, folder = os.path.dirname(os.path.abspath(__file__)), os.path.dirname(script)
    # The fork server imports by name: this module (the workers' function), the script's (its
    # imports), harness.
    path = [here, folder, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)
    sys.path[:0] = [here, folder]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        [*PRELOAD, "forked_torchrun", os.path.splitext(os.path.basename(script))[0]]
    )
    # it imports while this process imports torch below: 2 cores
    multiprocessing.forkserver.ensure_running()

    import forked_torchrun  # worker, by a name the fork server's children find
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    options = parse_args(
        ["--nproc_per_node", processes, "--start-method", "forkserver", script, *args]
    )
    # torchrun's --standalone (torch.distributed.run.run): a c10d rendezvous on a free local port.
    options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id = (
        "c10d",
        "localhost:0",
        str(uuid.uuid4()),
    )
    config, _, _ = config_from_args(options)
    elastic_launch(config, forked_torchrun.worker)(script, args)


if __name__ == "__main__":
    main()
