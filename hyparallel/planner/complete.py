"""``complete(plan, graph)``: a hand-written plan's missing stages and tensor-parallel map, planned.

A plan written with only ``training`` and ``parallel`` (and a cluster) runs: what it leaves out, the
planner fills in with every degree and strategy the plan states fixed (it decides nothing else).
``graph`` is the model traced with one micro-batch, as ``parallelize`` and ``hyparallel show
--model`` trace it; the planner reads that same trace (no second one).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hyparallel.graph.model_graph import ModelGraph
from hyparallel.planner.api import search
from hyparallel.planner.inputs import read as read_inputs
from hyparallel.planner.inputs import token_ids
from hyparallel.spec.errors import ConfigError, HyparallelError
from hyparallel.spec.schema import Plan


def complete(
    plan: Plan, graph: ModelGraph, *, example_inputs: Any = None, module: nn.Module | None = None
) -> Plan:
    """``plan`` with its missing ``stages`` / ``tensor_parallel`` planned for ``graph``, every
    stated choice fixed.

    ``graph`` is the model traced with ``example_inputs`` (one micro-batch, as ``parallelize`` takes
    them; None: token ids of the plan's ``micro_batch x seq_len``), whose rows and length must be
    the plan's. A plan without predictions gets the planner's for its configuration when its stages
    are the planner's (what ``pmodel.metrics`` compares with); one the planner would refuse (e.g.
    over its memory estimate) runs without them. ``module``, the model ``graph`` was traced from,
    lets the planner keep replicated what cannot run at one rank's sizes (Note [the planner
    replicates what fails at one rank's sizes]).
    """
    par, tr = plan.parallel, plan.training
    needs_stages = par.pp > 1 and plan.stages is None
    needs_tp = par.tp > 1 and plan.tensor_parallel is None
    if plan.cluster is None and (needs_stages or needs_tp):
        raise ConfigError(
            f"the plan has pp = {par.pp}, tp = {par.tp} but no cluster, so its stages and"
            " tensor-parallel map cannot be planned; add `cluster: PRESET` (e.g. cpu, h100-sxm;"
            " `hyparallel clusters`) or list `stages` and `tensor_parallel` yourself"
        )
    if not (needs_stages or needs_tp or plan.predicted is None) or plan.cluster is None:
        return plan
    cluster = plan.cluster
    # a preset named without a size: the launch is the cluster
    if cluster.num_gpus != plan.world_size:
        per_node = (
            cluster.gpus_per_node
            if plan.world_size % cluster.gpus_per_node == 0
            else plan.world_size
        )
        cluster = cluster.resized(num_nodes=plan.world_size // per_node, gpus_per_node=per_node)
    rows, seq_len = tr.micro_batch, tr.seq_len
    if example_inputs is not None:  # the micro-batch graph was traced with: it must be the plan's
        batch = read_inputs(example_inputs)
        rows = batch.rows
        if batch.seq_len is not None and batch.seq_len != seq_len:
            raise ConfigError(
                f"seq_len={seq_len} but example_inputs hold sequences of {batch.seq_len} tokens; "
                "make them agree, or leave seq_len out"
            )
    try:
        fixed = search(
            graph,
            cluster,
            tr.global_batch,
            tr.seq_len,
            tr.dtype,
            traced_rows=rows,
            module=module,
            module_inputs=example_inputs if example_inputs is not None else token_ids(plan),
            micro_batch=tr.micro_batch,
            tp=par.tp,
            pp=par.pp,
            dp=par.dp,
            ep=par.ep,
            schedule=par.schedule,
            virtual_stages=par.virtual_stages,
            recompute=par.recompute,
            zero=par.zero,
            sequence_parallel=par.sequence_parallel,
            vocab_parallel_loss=par.vocab_parallel_loss,
            order=plan.placement.order,
            **compression_constraints(plan),
        ).plan()
    except HyparallelError:
        if needs_stages or needs_tp:
            raise
        return plan  # it runs; only the predictions are missing
    return _merged(plan, fixed, needs_tp)


def compression_constraints(plan: Plan) -> dict[str, Any]:
    """The plan's gradient compression as the search's constraints (PowerSGD's settings only under
    PowerSGD)."""
    par = plan.parallel
    if par.grad_compression != "powersgd":
        return {"grad_compression": par.grad_compression}
    return {
        "grad_compression": "powersgd",
        "powersgd_rank": par.powersgd_rank,
        "powersgd_start_step": par.powersgd_start_step,
    }


def _merged(plan: Plan, planned_plan: Plan, needs_tp: bool) -> Plan:
    """``plan`` with what it left out taken from the planner's plan for the same configuration."""
    data, planned = plan.to_dict(), planned_plan.to_dict()
    data["stages"] = data.get("stages") or planned.get("stages")
    if needs_tp:
        data["tensor_parallel"] = planned["tensor_parallel"]
    if not data.get("model"):
        data["model"] = planned["model"]
    if plan.predicted is None and [s["modules"] for s in data["stages"] or []] == [
        s["modules"] for s in planned.get("stages", [])
    ]:
        data["predicted"] = planned["predicted"]
    return Plan.from_dict(data, source="completed plan")
