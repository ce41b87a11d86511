"""``hyparallel-dlrover-run``: DLRover's ``dlrover-run`` (same arguments), carrying the one fix it
needs on new torch.

Note [the dlrover fix]
    dlrover 0.6.1 (the release on PyPI) starts its standalone local master with
    ``SubprocessHandler(cmd, args, {}, "", "", 0)`` (dlrover/trainer/torch/elastic_run.py,
    ``_launch_dlrover_local_master``). torch 2.10 added a required ``numa_options`` argument to
    ``torch.distributed.elastic.multiprocessing.subprocess_handler.SubprocessHandler``, so
    ``dlrover-run --standalone`` dies with ``TypeError: ... missing 1 required positional argument:
    'numa_options'`` before any worker starts. The fix: the handler dlrover's launcher builds gets
    ``numa_options=None`` (no NUMA binding, torch's own default for its launcher) when not given.
    Nothing else is changed; everything else runs as ``dlrover-run`` runs. On Kubernetes (a master
    started by the DLRover operator) and with ``--nnodes`` and an external master, plain
    ``dlrover-run`` works: the code path is only the standalone one. tests/test_dlrover.py fails
    once a dlrover release no longer needs the fix: then delete this module and its console script.
"""

from __future__ import annotations

import inspect
import sys


def needs_fix() -> bool:
    """Whether the installed dlrover builds torch's SubprocessHandler without an argument torch
    requires."""
    from dlrover.trainer.torch import elastic_run
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    required = inspect.signature(SubprocessHandler.__init__).parameters.get("numa_options")
    if required is None or required.default is not inspect.Parameter.empty:
        return False
    return "numa_options" not in inspect.getsource(elastic_run._launch_dlrover_local_master)


def apply_fix() -> None:
    """Give dlrover's launcher a SubprocessHandler whose ``numa_options`` defaults to None (Note
    [the dlrover fix])."""
    from dlrover.trainer.torch import elastic_run
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class _Handler(SubprocessHandler):
        def __init__(
            self, entrypoint, args, env, stdout, stderr, local_rank_id=0, numa_options=None
        ):
            super().__init__(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)

    elastic_run.SubprocessHandler = _Handler


def main() -> None:
    """Run ``dlrover-run`` with the command line given, the fix applied where the installed dlrover
    needs it."""
    try:
        from dlrover.trainer.torch import elastic_run
    except ImportError as exc:
        print(
            f"hyparallel-dlrover-run: dlrover is not installed ({exc}); pip install"
            " 'hyparallel[elastic]'",
            file=sys.stderr,
        )
        sys.exit(2)
    if needs_fix():
        apply_fix()
    sys.exit(elastic_run.main())


if __name__ == "__main__":
    main()
