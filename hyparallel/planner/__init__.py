"""Cost model and exact search (pure: never imports torch.distributed).

``plan(model, cluster, global_batch, seq_len, dtype, **constraints) -> Plan`` is the entry point (or
``constraints=Constraints(...)``); ``search`` returns the ranked candidates behind it;
``complete(plan, graph)`` fills what a hand-written plan leaves out; ``with_goodput(plan,
mtbf_hours)`` adds the checkpoint cost, the best checkpoint interval and the expected goodput.
"""

from hyparallel.planner.api import Alternative, SearchResult, plan, search, to_plan
from hyparallel.planner.complete import complete
from hyparallel.planner.constraints import Constraints
from hyparallel.planner.goodput import checkpoint_cost, with_goodput
from hyparallel.spec.errors import PlanError

__all__ = [
    "Alternative",
    "Constraints",
    "PlanError",
    "SearchResult",
    "checkpoint_cost",
    "complete",
    "plan",
    "search",
    "to_plan",
    "with_goodput",
]
