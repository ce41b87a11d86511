"""Cost model and exact search (pure: never imports torch.distributed).

``plan(model, cluster, global_batch, seq_len, dtype, **constraints) -> Plan`` is the entry point;
``search`` returns the ranked candidates behind it; ``complete(plan, graph)`` fills what a hand-written
plan leaves out.
"""

from hyparallel.planner.api import Alternative, PlanError, SearchResult, plan, search, to_plan
from hyparallel.planner.complete import complete

__all__ = ["Alternative", "PlanError", "SearchResult", "complete", "plan", "search", "to_plan"]
