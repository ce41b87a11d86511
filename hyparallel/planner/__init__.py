"""Cost model and exact search (pure: never imports torch.distributed).

``plan(model, cluster, global_batch, seq_len, dtype, **constraints) -> Plan`` is the entry point;
``search`` returns the ranked candidates behind it.
"""

from hyparallel.planner.api import Alternative, PlanError, SearchResult, plan, search, to_plan

__all__ = ["Alternative", "PlanError", "SearchResult", "plan", "search", "to_plan"]
