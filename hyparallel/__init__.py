"""hyparallel: hybrid-parallel model partitioning for PyTorch.

trace a model (``trace``) -> plan data x tensor x pipeline parallelism for a cluster (``Plan``,
``ClusterSpec``) -> run it. README.md is the guide; docs/ holds the reference pages (the plan file,
cluster files, the cost model).
"""

from hyparallel import models
from hyparallel.graph import ModelGraph, trace
from hyparallel.planner import PlanError, plan, search
from hyparallel.spec.cluster import ClusterSpec
from hyparallel.spec.errors import ConfigError, HyparallelError, ModelSpecError, TraceError
from hyparallel.spec.schema import Plan

__version__ = "0.1.0"

# The runtime loads on first use: `hyparallel plan` and friends start without
# torch.distributed.checkpoint.
_LAZY = {
    "parallelize": "hyparallel.runtime.parallel",
    "ParallelModel": "hyparallel.runtime.parallel",
    "check": "hyparallel.tools.parity",
    "checkpoint": "hyparallel.runtime.checkpoint",  # modules: hp.checkpoint.save(...)
    "tracking": "hyparallel.runtime.tracking",
}
_MODULES = {"checkpoint", "tracking"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        module = import_module(_LAZY[name])
        return module if name in _MODULES else getattr(module, name)
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
