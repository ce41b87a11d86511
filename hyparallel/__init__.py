"""hyparallel: hybrid-parallel model partitioning for PyTorch.

trace a model (``trace``) -> plan data x tensor x pipeline parallelism for a cluster (``Plan``,
``ClusterSpec``) -> run it. README.md is the guide; docs/ holds the reference pages (the plan file,
cluster files, the cost model).
"""

from hyparallel import models
from hyparallel.cluster import ClusterSpec
from hyparallel.errors import ConfigError, HyparallelError, ModelSpecError, TraceError
from hyparallel.graph import ModelGraph, trace
from hyparallel.planner import PlanError, plan, search
from hyparallel.schema import Plan

__version__ = "0.1.0"

# The runtime loads on first use: `hyparallel plan` and friends start without torch.distributed.checkpoint.
_LAZY = {
    "parallelize": "hyparallel.parallel",
    "ParallelModel": "hyparallel.parallel",
    "check": "hyparallel.parity",
    "checkpoint": None,
    "tracking": None,
}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        module = import_module(_LAZY[name] or f"hyparallel.{name}")
        return module if _LAZY[name] is None else getattr(module, name)
    raise AttributeError(f"module 'hyparallel' has no attribute '{name}'")


__all__ = [
    "ClusterSpec",
    "ConfigError",
    "HyparallelError",
    "ModelGraph",
    "ModelSpecError",
    "ParallelModel",
    "Plan",
    "PlanError",
    "TraceError",
    "checkpoint",
    "models",
    "parallelize",
    "plan",
    "search",
    "trace",
    "tracking",
    "check",
    "__version__",
]
