"""Pipeline parallelism: stage splitting (``split``), the schedule IR (``schedule``), the engine
(``executor``).

The package does not import the engine (torch.distributed point-to-point): ``hyparallel simulate``
needs only the schedule and the planner's timeline. Import it from its module:
``from hyparallel.pipeline.executor import PipelineRuntime``.
"""

from hyparallel.pipeline.schedule import (
    Action,
    SimulationResult,
    format_schedule,
    lower,
    p2p_order_mismatches,
    parse_action,
    schedule,
    simulate,
    validate,
)
from hyparallel.pipeline.split import PipelineSplit, Stage, StageIO, split_model

__all__ = [
    "Action",
    "PipelineSplit",
    "SimulationResult",
    "Stage",
    "StageIO",
    "format_schedule",
    "lower",
    "p2p_order_mismatches",
    "parse_action",
    "schedule",
    "simulate",
    "split_model",
    "validate",
]
