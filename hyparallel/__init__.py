"""hyparallel: hybrid-parallel model partitioning for PyTorch.

trace a model (``trace``) -> plan data x tensor x pipeline parallelism for a cluster (``Plan``,
``ClusterSpec``) -> run it. See README.md and SPEC.md for the user-facing contract.
"""

from hyparallel import checkpoint, models
from hyparallel.cluster import ClusterSpec
from hyparallel.errors import ConfigError, HyparallelError, ModelSpecError, TraceError
from hyparallel.graph import ModelGraph, trace
from hyparallel.parallel import ParallelModel, parallelize
from hyparallel.planner import PlanError, plan
from hyparallel.schema import Plan

__version__ = "0.1.0"

__all__ = [
    "ClusterSpec", "ConfigError", "HyparallelError", "ModelGraph", "ModelSpecError", "ParallelModel", "Plan", "PlanError",
    "TraceError", "checkpoint", "models", "parallelize", "plan", "trace", "__version__",
]
