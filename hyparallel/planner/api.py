"""``hyparallel.plan``: trace (if needed), search, and write the winning configuration as a Plan."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hyparallel.graph import ModelGraph
from hyparallel.graph import cache as graph_cache
from hyparallel.graph.checks import check_plan
from hyparallel.graph.context import at_degree, attention_interface, takes_positions
from hyparallel.graph.local_shapes import replicate_what_fails
from hyparallel.planner import costs
from hyparallel.planner.constraints import Constraints, count_message, default
from hyparallel.planner.goodput import DEFAULT_RESTART_S, check_goodput_request, with_goodput
from hyparallel.planner.inputs import default_seq_len
from hyparallel.planner.inputs import make as make_inputs
from hyparallel.planner.inputs import read as read_inputs
from hyparallel.planner.profile import ModelProfile
from hyparallel.planner.search import (
    Evaluation,
    Progress,
    Search,
    config_links,
    enumerate_configs,
    segment_costs_of,
    transfer_s,
)
from hyparallel.spec import limits
from hyparallel.spec.cluster import ClusterSpec
from hyparallel.spec.errors import ConfigError, PlanError
from hyparallel.spec.schema import CheckpointStorage, Plan


@dataclass
class Alternative:
    """A well-known plan shape (pure data parallel, most tensor parallel, most pipeline) and how it
    fared."""

    label: str
    evaluation: Evaluation | None
    why: str


@dataclass
class SearchResult:
    """What ``search`` found: the best evaluations, the alternatives that lost, and bookkeeping."""

    graph: ModelGraph
    cluster: ClusterSpec
    global_batch: int
    seq_len: int
    dtype: str
    best: list[Evaluation]
    alternatives: list[Alternative] = field(default_factory=list)
    considered: int = 0
    evaluated: int = 0
    search_s: float = 0.0
    profile: ModelProfile | None = None
    # fitted, but check_plan refused them (their reason)
    refused: list[Evaluation] = field(default_factory=list)
    # written into plans
    powersgd_start_step: int = field(default_factory=lambda: default("powersgd_start_step"))
    # a planner.tables.TableChoice: where a recommendation model's tables go (ps_servers=)
    tables: Any = None
    # parallel.compile, written into plans as asked (the costs do not model it)
    compile: bool = False

    def plan(self, rank: int = 0) -> Plan:
        """The ``rank``-th best evaluation as a Plan; rank 0 is the tables' pick when they were
        compared (a ps plan when parameter servers won)."""
        if rank == 0 and self.tables is not None and self.tables.pick.kind == "ps":
            from hyparallel.planner.tables import write_plan  # it imports this module

            return write_plan(self, self.tables.pick)
        return to_plan(self, self.best[rank])


# Note [example inputs]
# The planner costs everything per sequence and scales it to the micro-batch it considers. With no
# example_inputs (or a function making them) it traces one sequence, batch 1 x seq_len, from the
# model's example_inputs(batch_size, seq_len, device) method, Hugging Face's main_input_name, or the
# function given, and searches the micro-batch. example_inputs themselves are one micro-batch, as
# parallelize takes them: the graph is traced with them (on the meta device, dtypes kept), its
# figures are divided by their rows b into per-sequence ones, and the micro-batch is fixed to b. So
# the costs at micro-batch b are the traced graph's own, and the plan runs under parallelize with
# the same example_inputs (a torch.export trace, which the pipeline uses for models torch.fx cannot
# trace, fixes the micro-batch shape). seq_len may then be left out: dim 1 of the token ids gives
# it.


def plan(
    model: nn.Module | ModelGraph,
    cluster: ClusterSpec | str,
    global_batch: int,
    seq_len: int | None = None,
    dtype: str = "bf16",
    *,
    example_inputs: Any = None,
    name: str | None = None,
    constraints: Constraints | None = None,
    mtbf_hours: float | None = None,
    restart_s: float = DEFAULT_RESTART_S,
    checkpoint_storage: CheckpointStorage = "disk",
    ps_servers: int | None = None,
    **fixed: Any,
) -> Plan:
    """The fastest plan that fits memory for ``model`` on ``cluster``; constraints fix any decision.

    Args:
        model: a (meta-device) module, or a ModelGraph traced at batch 1 x ``seq_len``.
        cluster: a ClusterSpec, or a preset name or cluster YAML path as ``--cluster`` takes it.
        global_batch: sequences (samples) per optimizer step.
        seq_len: tokens per sequence (default: the model's, or ``example_inputs``').
        dtype: the training dtype (bf16, fp16, fp32).
        example_inputs, name, constraints, mtbf_hours, restart_s, checkpoint_storage, ps_servers,
        fixed: below.

    Returns:
        The :class:`~hyparallel.spec.schema.Plan`, with its predictions; ``plan.save("plan.yaml")``
        writes it.

    Raises:
        PlanError: nothing fits (the message names the smallest plan found and what it needs) or the
            constraints leave no plan.
        ConfigError: a constraint or an input out of range, in one line.

    Example::

        model = hp.models.build("gpt-175b")
        plan = hp.plan(model, "a100-80g", global_batch=1536, seq_len=2048, tp=8)
        plan.save("gpt-175b.yaml")

    ``example_inputs`` is one micro-batch for tracing, as ``parallelize`` takes it (a tensor, a
    tuple of args or a dict of kwargs; it fixes micro_batch to its rows and gives seq_len), or a
    function ``(batch_size, seq_len) -> inputs`` used as a model's ``example_inputs`` method is
    (Note [example inputs]). The constraints are ``constraints=Constraints(...)`` or the same names
    as keyword arguments: tp, pp, dp, micro_batch, schedule, virtual_stages, recompute, zero,
    sequence_parallel, vocab_parallel_loss (False: the logits gathered for a loss_fn of your own),
    order (placement.order, outermost axis first), and grad_compression (none, bf16, fp16, powersgd,
    or any: searched), powersgd_rank, powersgd_start_step: gradients are compressed only when asked
    (Note [gradient compression is asked for] in constraints.py), and compile (parallel.compile:
    torch.compile at run time; written as asked, not costed).

    ``mtbf_hours`` (the whole job's mean time between failures) adds the plan's ``checkpoint``
    section: the save time per checkpoint, the interval that maximises goodput and the goodput
    expected, with ``restart_s`` seconds per restart and checkpoints saved as
    ``hp.checkpoint.save(storage=checkpoint_storage)`` (``hyparallel.planner.with_goodput``, which
    adds it to any plan; docs/cost-model.md).

    ``ps_servers=N`` plans parameter-server mode with N servers (tp = pp = 1, one worker per GPU,
    every embedding table on the servers: the plan's ``ps`` section). Left out, a recommendation
    model (embedding tables, no transformer blocks) gets whichever is fastest of parameter servers
    (their count searched) and the tables on the GPUs (hyparallel.planner.tables;
    docs/cost-model.md, "Embedding tables: parameter servers or GPUs").
    ``cluster`` is a ClusterSpec, or a preset name or cluster YAML path as ``--cluster`` takes it.
    """
    if isinstance(cluster, (str, os.PathLike)):
        cluster = ClusterSpec.resolve(str(cluster))
    if mtbf_hours is not None:  # refused before the search, not after it
        check_goodput_request(mtbf_hours, restart_s, checkpoint_storage, cluster)
    best = search(
        model,
        cluster,
        global_batch,
        seq_len,
        dtype,
        example_inputs=example_inputs,
        name=name,
        constraints=constraints,
        ps_servers=ps_servers,
        **fixed,
    ).plan()
    if mtbf_hours is None:
        return best
    return with_goodput(
        best, mtbf_hours, restart_s=restart_s, storage=checkpoint_storage, cluster=cluster
    )


def search(
    model: nn.Module | ModelGraph,
    cluster: ClusterSpec | str,
    global_batch: int,
    seq_len: int | None = None,
    dtype: str = "bf16",
    *,
    example_inputs: Any = None,
    name: str | None = None,
    top: int = 1,
    alternatives: bool = False,
    progress: Progress | None = None,
    traced_rows: int | None = None,
    module: nn.Module | None = None,
    module_inputs: Any = None,
    constraints: Constraints | None = None,
    cache: bool = False,
    ps_servers: int | None = None,
    **fixed: Any,
) -> SearchResult:
    """Run the exact search and return the ``top`` best evaluations (and, optionally, the
    alternatives that lost).

    Args:
        model, cluster, global_batch, seq_len, dtype, example_inputs, name, constraints, ps_servers,
        fixed: as
            :func:`plan` takes them.
        top: how many of the best evaluations to keep; ``alternatives``: also the best of each
            losing choice.
        progress, traced_rows, module, module_inputs, cache: below.

    Returns:
        A SearchResult: ``best``, the ``top`` evaluations fastest first (``step_time_s``, stages,
        memory), ``alternatives``, and ``plan()``, the best as a Plan.

    Raises:
        PlanError: as :func:`plan`.

    Example::

        model = hp.models.build("llama-7b")
        result = hp.search(model, "h100-sxm", global_batch=512, seq_len=4096, top=3)
        print([e.step_time_s for e in result.best]); plan = result.plan()

    ``model``, ``example_inputs`` and the constraints are as ``plan`` takes them. ``progress(phase,
    done, total)`` is called as the search goes (a progress bar); the search logs to the
    ``hyparallel.planner`` logger (INFO: its phases, DEBUG: every configuration costed).
    ``traced_rows``: ``model`` is a ModelGraph traced with one micro-batch of that many rows (as
    ``parallelize`` traces it), not one sequence; it fixes micro_batch, as example_inputs of that
    many rows would (Note [example inputs]). ``module``: the module a ModelGraph ``model`` was
    traced from with ``module_inputs`` (parallelize's), so that splits its forward cannot run at one
    rank's sizes stay replicated (Note [the planner replicates what fails at one rank's sizes]); a
    module ``model`` is its own. ``cache``: a module ``model`` traced (and dry run) before with the
    same key is read from the disk cache instead (``hyparallel.graph.cache``; ``hyparallel plan``
    does so unless --no-cache).
    ``ps_servers``: as ``plan`` takes it; the result's ``tables`` then holds the options compared
    (also for a recommendation model without it), and ``plan()`` the pick.
    """
    from hyparallel.planner import tables  # it imports this module

    if isinstance(cluster, (str, os.PathLike)):
        cluster = ClusterSpec.resolve(str(cluster))
    given = _given(constraints, fixed)
    _check_request(cluster, global_batch, seq_len, dtype, given)
    tables.check_request(ps_servers, given, cluster, global_batch)
    degrees = _tp_degrees(cluster, given)
    graph, seq_len, rows, inputs, cache_key = _graph(
        model,
        global_batch,
        seq_len,
        name,
        example_inputs,
        given,
        traced_rows,
        degrees if cache and module_inputs is None else None,
    )
    module = model if isinstance(model, nn.Module) else module
    inputs = inputs if module_inputs is None else module_inputs
    if module is not None and inputs is not None:
        replicate_what_fails(module, graph, degrees, inputs)
        graph_cache.store(cache_key, graph)
    start = time.perf_counter()
    # not searched: on wherever tp splits the head, unless asked
    vocab_loss = given.get("vocab_parallel_loss", True)
    profile = ModelProfile(
        graph,
        cluster,
        dtype,
        seq_len,
        traced_rows=rows or 1,
        vocab_parallel_loss=vocab_loss,
        expert_imbalance=given.get("expert_imbalance") or costs.EXPERT_IMBALANCE,
        router_loss_gathered=_router_loss_gathered(module),
        takes_positions=takes_positions(module),
        attention_interface=attention_interface(module),
    )
    result = SearchResult(
        graph=graph,
        cluster=cluster,
        global_batch=global_batch,
        seq_len=seq_len,
        dtype=dtype,
        best=[],
        profile=profile,
        powersgd_start_step=given.get("powersgd_start_step", default("powersgd_start_step")),
        compile=given.get("compile", default("compile")),
    )
    engine = Search(profile, cluster, global_batch, dtype, progress, admit=Admission(result))
    compare = tables.applies(graph, given, ps_servers)
    # ps_servers N > 0 decides: the search only for comparison
    searched = not ps_servers or alternatives
    best, frugal = engine.best(given, top=top) if searched else ([], None)
    if compare:
        result.tables = tables.choose(
            graph,
            profile,
            cluster,
            global_batch,
            dtype,
            given,
            dense_best=best,
            dense_frugal=frugal,
            ps_servers=ps_servers,
            dense_searched=searched,
        )
    elif not best:
        raise PlanError(_nothing_found(engine, profile, cluster, global_batch, given, frugal))
    result.best = best
    if alternatives and best:
        result.alternatives = _alternatives(engine, profile, cluster, best[0], given)
    result.considered, result.evaluated, result.refused = (
        engine.considered,
        engine.evaluated,
        engine.refused,
    )
    result.search_s = time.perf_counter() - start
    return result


# Note [the runtime's checks]
# A plan the planner writes always runs: every candidate that fits is written as its Plan (to_plan)
# and checked by the runtime's own check_plan (hyparallel.graph.checks) on the traced graph, before
# it may rank. A refusal makes the candidate infeasible with the refusal as its reason (shown by
# --explain and by the error when nothing is left), never a plan. Candidates differing only in what
# check_plan does not read (micro-batch, schedule, order, timings) share one verdict.


class Admission:
    """``admit(evaluation)``: why the runtime would refuse the plan of ``evaluation`` (None: it
    runs)."""

    def __init__(self, result: SearchResult):
        self.result = result
        self.verdicts: dict[tuple, str | None] = {}

    def __call__(self, evaluation: Evaluation) -> str | None:
        c = evaluation.config
        key = (
            c.tp,
            c.pp,
            c.dp,
            c.virtual_stages,
            c.recompute,
            c.zero,
            c.sequence_parallel,
            c.grad_compression,
            c.powersgd_rank,
            c.ep,
            c.cp,
            tuple(evaluation.stages),
        )
        if key not in self.verdicts:
            self.verdicts[key] = refusal(self.result, evaluation)
        return self.verdicts[key]


def refusal(result: SearchResult, evaluation: Evaluation) -> str | None:
    """Why the runtime refuses ``evaluation`` written as a plan, in one line (None: check_plan
    accepts it)."""
    try:
        check_plan(_written(result, evaluation, uncompressed=False), result.graph)
    except ConfigError as error:
        return f"the runtime refuses it: {error}"
    return None


def _graph(
    model: nn.Module | ModelGraph,
    global_batch: int,
    seq_len: int | None,
    name: str | None,
    example_inputs: Any,
    constraints: dict,
    traced_rows: int | None = None,
    cache_degrees: list[int] | None = None,
) -> tuple[ModelGraph, int, int | None, Any, str | None]:
    """The graph to plan, its seq_len, the micro-batch example_inputs fix (None: searched; sets that
    constraint), the inputs it was traced with (None: a graph given traced, or read from the cache)
    and the key to cache it under (None: not cached). ``cache_degrees``: read a module's graph from
    the cache, keyed with these degrees."""
    from hyparallel import models
    from hyparallel.graph import trace

    name = name or type(model).__name__
    if isinstance(model, ModelGraph):
        if example_inputs is not None:
            raise PlanError(
                "example_inputs= are for tracing a module, and this ModelGraph is traced already;"
                " pass the module itself, or plan the graph without example_inputs="
            )
        if traced_rows is not None:  # one micro-batch, as parallelize traced it
            _fix_micro_batch(constraints, traced_rows, global_batch)
            return model, _needed(seq_len), traced_rows, None, None
        _batch_one(model)
        return model, _needed(seq_len), None, None, None
    if example_inputs is None or callable(example_inputs):
        seq_len = _needed(
            seq_len if seq_len is not None or example_inputs else default_seq_len(model)
        )
        batch = (
            make_inputs(example_inputs, 1, seq_len).inputs
            if example_inputs is not None
            else models.example_inputs(model, 1, seq_len)
        )
        cache_key = (
            graph_cache.key(model, batch, name, cache_degrees)
            if cache_degrees is not None
            else None
        )
        cached = graph_cache.load(cache_key)
        if cached is not None:
            return cached, seq_len, None, None, None
        return trace(model, batch, name=name), seq_len, None, batch, cache_key
    batch = read_inputs(example_inputs)
    if seq_len is not None and batch.seq_len is not None and seq_len != batch.seq_len:
        raise ConfigError(
            f"seq_len={seq_len} but example_inputs hold sequences of {batch.seq_len} tokens; "
            "make them agree, or leave seq_len out"
        )
    seq_len = seq_len or batch.seq_len or batch.fallback_seq_len
    _fix_micro_batch(constraints, batch.rows, global_batch)
    return trace(model, batch.inputs, name=name), seq_len, batch.rows, batch.inputs, None


def _tp_degrees(cluster: ClusterSpec, constraints: dict) -> list[int]:
    """The tensor-parallel degrees the search may pick: the fixed one, or every divisor of the GPUs
    in a node."""
    if "tp" in constraints:
        return [constraints["tp"]]
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)
    return [d for d in range(2, per_node + 1) if per_node % d == 0 and cluster.num_gpus % d == 0]


def _needed(seq_len: int | None) -> int:
    if seq_len is None:
        raise PlanError(
            "seq_len is not given: pass seq_len=, or example_inputs= whose token ids (batch,"
            " seq_len) give it"
        )
    _check_count("seq_len", seq_len)  # also when example_inputs gave it
    return seq_len


def _batch_one(graph: ModelGraph) -> None:
    """Refuse a graph traced with more than one row: its figures would be taken for one
    sequence's."""
    rows = next(
        (
            op.output_shapes[0][0]
            for op in graph.ops
            if op.kind == "input" and op.output_shapes and op.output_shapes[0]
        ),
        1,
    )
    if rows != 1:
        raise PlanError(
            f"the ModelGraph was traced with {rows} rows, and the planner reads a graph as one"
            " sequence; trace it at batch 1, or pass the module with example_inputs= of one"
            " micro-batch"
        )


def _fix_micro_batch(constraints: dict, rows: int, global_batch: int) -> None:
    """example_inputs are one micro-batch: the plan's micro_batch is their rows."""
    given = constraints.get("micro_batch")
    if given is not None and given != rows:
        raise ConfigError(
            f"micro_batch={given} but example_inputs are one micro-batch of {rows} rows; "
            f"pass example_inputs of {given} rows, or leave micro_batch out"
        )
    if global_batch % rows:
        raise PlanError(
            f"global batch {global_batch} is not a multiple of the micro-batch of example_inputs "
            f"({rows} rows); change either"
        )
    constraints["micro_batch"] = rows


def _given(constraints: Constraints | None, fixed: dict[str, Any]) -> dict[str, Any]:
    """The constraints the caller fixed, by name: ``constraints=`` or the keyword arguments, checked
    by Constraints."""
    if constraints is None:
        return Constraints(**fixed).given()
    if not isinstance(constraints, Constraints):
        raise PlanError(
            "constraints= takes a hyparallel.planner.Constraints, got"
            f" {type(constraints).__name__}; or pass the constraints as keyword arguments"
        )
    if fixed:
        raise PlanError(
            f"both constraints= and keyword constraints ({', '.join(fixed)}) are given; pass them"
            " one way, not both"
        )
    return constraints.given()


def _check_request(
    cluster: ClusterSpec, global_batch: int, seq_len: int | None, dtype: str, constraints: dict
) -> None:
    """dtype, global_batch and seq_len, then the (already valid) constraints against the cluster and
    the batch."""
    if dtype not in costs.DTYPE_BYTES:
        raise PlanError(f"dtype '{dtype}' is not one of {', '.join(costs.DTYPE_BYTES)}")
    for key, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if value is not None or key == "global_batch":  # seq_len may come from example_inputs
            _check_count(key, value)
    _check_layout(cluster, global_batch, constraints)


def _check_layout(cluster: ClusterSpec, global_batch: int, constraints: dict) -> None:
    """The fixed degrees fit the cluster's GPUs, and a fixed dp divides the global batch."""
    degrees = {k: constraints[k] for k in ("dp", "cp", "tp", "pp") if k in constraints}
    n = cluster.num_gpus
    product = 1
    for value in degrees.values():
        product *= value
    if all(k in degrees for k in ("tp", "pp", "dp")) and product != n:
        fixed = " * ".join(f"{k}({v})" for k, v in degrees.items())
        raise PlanError(f"{fixed} = {product} != {n} GPUs; change a degree or the number of GPUs")
    if n % product:
        fixed = " * ".join(f"{k}({v})" for k, v in degrees.items())
        raise PlanError(
            f"{fixed} = {product} does not divide the {n} GPUs; pick degrees whose product"
            f" divides {n}"
        )
    if "dp" in constraints and global_batch % constraints["dp"]:
        raise PlanError(
            f"global batch {global_batch} is not divisible by dp {constraints['dp']}; change either"
        )
    ep = constraints.get("ep", 1)
    if "dp" in constraints and constraints["dp"] % ep:
        raise PlanError(
            f"ep ({ep}) must divide dp ({constraints['dp']}): expert-parallel ranks are taken from"
            " the data-parallel ones; raise dp or lower ep"
        )
    if ep > 1 and n % ep:
        raise PlanError(f"ep ({ep}) does not divide the {n} GPUs; pick an ep that divides {n}")


# The schema's bounds (hyparallel.spec.limits), so the planner never accepts what a plan file would
# refuse; the constraints' own bounds are their fields' types (Constraints).
_BOUNDS = {"global_batch": limits.MAX_GLOBAL_BATCH, "seq_len": limits.MAX_SEQ_LEN}


def _check_count(key: str, value: object) -> None:
    high = _BOUNDS[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(count_message(key, value))
    if value > high:
        raise PlanError(count_message(key, value, high))


def _nothing_found(
    engine: Search,
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch: int,
    constraints: dict,
    frugal: Evaluation | None,
) -> str:
    analysis, graph = profile.tp_analysis, profile.graph
    cp = constraints.get("cp", 1)
    if cp > 1 and profile.cp_refusal:  # hyparallel.graph.context, as parallelize refuses it
        return at_degree(profile.cp_refusal, cp)
    if cp > 1 and profile.seq_len % (2 * cp):
        return (
            f"a sequence of {profile.seq_len} tokens does not cut into 2 x cp = {2 * cp} equal"
            " chunks; change the sequence length or cp"
        )
    if cp > 1 and constraints.get("pp", 1) > 1:
        return f"cp {cp} runs beside pp 1 only (parallelize refuses pipeline stages with cp)"
    if cp > 1 and constraints.get("recompute") == "selective":
        return (
            f"recompute selective beside cp {cp}: the split attention makes no (sequence x"
            " sequence) tensor for it to recompute; use recompute none or full"
        )
    if "tp" in constraints and (reason := analysis.nothing_split(constraints["tp"], graph)):
        return reason
    if "tp" in constraints and (reason := analysis.check(constraints["tp"], graph)):
        return f"{reason}; choose a tensor-parallel degree that divides it"
    if reason := _needs_blocks(graph, constraints):
        return reason
    if constraints.get("sequence_parallel") and (reason := analysis.whole_sequence(graph)):
        return reason
    if constraints.get("sequence_parallel") and (
        reason := analysis.uneven_sequence(graph, constraints.get("tp", 1))
    ):
        return reason
    if not enumerate_configs(engine.ctx, constraints):
        if not enumerate_configs(engine.ctx, {}):
            return (
                f"no dp x tp x pp layout of {cluster.num_gpus} GPUs suits this model and global"
                f" batch {global_batch}; use a GPU count or global batch with more divisors"
            )
        given = ", ".join(f"{k}={v}" for k, v in constraints.items())
        return (
            f"no configuration satisfies {given} for {cluster.num_gpus} GPUs and global batch"
            f" {global_batch}; relax a constraint"
        )
    limit = cluster.device.usable_memory_bytes / 2**30
    if frugal is not None and frugal.refused:
        return f"no plan that fits is one the runtime runs: {frugal.config}: {frugal.reason}"
    if frugal is None:
        need = engine.least_memory_bytes(constraints) or 0.0
        return (
            f"nothing fits in {limit:.1f} GiB per GPU: even spread evenly over the stages the"
            f" smallest plan needs {need / 2**30:.1f} GiB; use more GPUs, a smaller micro-batch or"
            " sequence length, or recomputation"
        )
    c = frugal.config
    return (
        f"nothing fits in {limit:.1f} GiB per GPU: the smallest plan found needs"
        f" {frugal.peak_memory_bytes / 2**30:.1f} GiB (tp {c.tp}, pp {c.pp}, dp {c.dp}, micro_batch"
        f" {c.micro_batch}, recompute {c.recompute}, ZeRO {c.zero}); use more GPUs, a smaller"
        " micro-batch or sequence length, or recomputation"
    )


def _needs_blocks(graph: ModelGraph, constraints: dict) -> str | None:
    """Why the fixed sequence_parallel / recompute cannot run on a model without repeated blocks
    (Note [what needs blocks] in hyparallel.planner.search), as check_plan would say it."""
    if graph.blocks:
        return None
    if constraints.get("sequence_parallel"):
        return (
            "sequence_parallel needs repeated blocks (transformer layers) to shard between, and"
            f" {graph.name} has none"
        )
    if constraints.get("recompute", "none") != "none" and constraints.get("pp", 1) == 1:
        return (
            f"recompute: {constraints['recompute']} without a pipeline needs repeated blocks"
            f" (transformer layers) to recompute, and {graph.name} has none; use recompute: none"
        )
    return None


def _alternatives(
    engine: Search,
    profile: ModelProfile,
    cluster: ClusterSpec,
    winner: Evaluation,
    constraints: dict,
) -> list[Alternative]:
    n = cluster.num_gpus
    tps = [
        t
        for t in range(1, min(n, cluster.gpus_per_node) + 1)
        if n % t == 0 and not profile.tp_analysis.check(t, profile.graph)
    ]
    shapes = [
        ("pure data parallel", {"tp": 1, "pp": 1}),
        ("most tensor parallel", {"tp": max(tps), "pp": 1}),
    ]
    pps = [p for p in range(1, min(n, len(profile.segments)) + 1) if n % p == 0]
    shapes.append(("most pipeline parallel", {"tp": 1, "pp": max(pps)}))
    # Note [expert parallelism's costs] (costs.py): a model with MoE layers compares the winner with
    # the best plan on the other side of ep > 1
    result = []
    if profile.expert_counts and "ep" not in constraints:
        if winner.config.ep > 1:
            shapes.append(("no expert parallelism", {"ep": 1}))
        else:
            shapes += [
                (f"expert parallelism {ep}", {"ep": ep})
                for ep in _expert_choices(profile, winner.config.dp)
            ]
    # Note [context parallelism's costs] (costs.py): a model cp can split compares the winner with
    # the best plan on the other side of cp > 1
    if profile.cp_refusal is None and "cp" not in constraints:
        if winner.config.cp > 1:
            shapes.append(("no context parallelism", {"cp": 1}))
        elif n % 2 == 0 and profile.seq_len % 4 == 0:
            shapes.append(("context parallelism 2", {"cp": 2, "pp": 1}))
    for label, shape in shapes:
        fixed = {**{k: v for k, v in constraints.items() if k not in ("tp", "pp", "dp")}, **shape}
        best, frugal = engine.best(fixed, top=1)
        if best:
            e = best[0]
            c = e.config
            why = why_slower(e, winner)
            if e.step_time_s > winner.step_time_s * (1 + 1e-9):
                why = (
                    f"at its best (ZeRO {c.zero}, recompute {c.recompute}, micro-batch"
                    f" {c.micro_batch}): {why}"
                )
            result.append(Alternative(label, e, why))
        elif frugal is not None:
            result.append(Alternative(label, frugal, frugal.reason))
        else:
            result.append(Alternative(label, None, _why_none(engine, profile, cluster, fixed)))
    return result


def _router_loss_gathered(module: nn.Module | None) -> bool:
    """Whether ``module``'s router loss gathers every dp rank's scores under parallelize (Note [the
    router's auxiliary loss over dp]); True, the larger cost, when the module is not at hand."""
    if module is None:
        return True
    from hyparallel.graph.router_loss import gathers

    return gathers(module)


def _expert_choices(profile: ModelProfile, dp: int) -> list[int]:
    """The largest ep > 1 dividing both ``dp`` and every MoE layer's experts (none: [])."""
    found = [
        e
        for e in range(2, dp + 1)
        if dp % e == 0 and all(n % e == 0 for n in profile.expert_counts)
    ]
    return found[-1:]


def step_parts(e: Evaluation) -> dict[str, float]:
    """An evaluation's step time in parts: compute, bubble, exposed tp / pp communication, dp sync +
    optimizer.

    The comm parts are the planner's own per-step figures; the rest of the step is compute and
    bubble, split by the bubble fraction (idle time over compute time).
    """
    comm = {
        "tp communication": e.comm_s["tp"],
        "pp sends": e.comm_s["pp"],
        "dp sync + optimizer": e.comm_s["dp"],
        "ep all-to-all": e.comm_s.get("ep", 0.0),
        "cp key/value traffic": e.comm_s.get("cp", 0.0),
    }
    rest = max(e.step_time_s - sum(comm.values()), 0.0)
    compute = rest / (1 + e.bubble_fraction)
    return {"compute": compute, "bubble": rest - compute, **comm}


def why_slower(loser: Evaluation, winner: Evaluation) -> str:
    """One line on why ``loser`` ranks below ``winner``: out of memory, or how much slower and
    mostly from what."""
    if not loser.feasible:
        return loser.reason or "does not fit in memory"
    slower = loser.step_time_s / winner.step_time_s - 1
    if slower < 1e-3:
        return "as fast as the winner (within 0.1%)"
    ours, theirs = step_parts(loser), step_parts(winner)
    part = max(ours, key=lambda k: ours[k] - theirs[k])
    detail = (
        f" ({loser.bubble_fraction:.0%} vs {winner.bubble_fraction:.0%})"
        if part == "bubble"
        else ""
    )
    if part == "compute":
        a, b = loser.config, winner.config
        differences = [
            f"{name} {x} vs {y}"
            for name, x, y in (
                ("recompute", a.recompute, b.recompute),
                ("micro-batch", a.micro_batch, b.micro_batch),
                ("tp", a.tp, b.tp),
                ("ep", a.ep, b.ep),
                ("cp", a.cp, b.cp),
            )
            if x != y
        ]
        detail = (
            f" ({', '.join(differences) or 'uneven stages: the slowest holds more than its share'})"
        )
    if (
        part == "dp sync + optimizer"
        and loser.config.grad_compression != winner.config.grad_compression
    ):
        detail = f" (gradients {loser.config.compression} vs {winner.config.compression})"
    return (
        f"{slower:.1%} slower ({loser.step_time_s - winner.step_time_s:.3g} s), mostly {part} "
        f"+{ours[part] - theirs[part]:.3g} s{detail}"
    )


def _why_none(engine: Search, profile: ModelProfile, cluster: ClusterSpec, fixed: dict) -> str:
    """Why a fixed shape (tp, pp, cp and the caller's other constraints) has no plan at all."""
    tp, pp, cp = fixed.get("tp", 1), fixed.get("pp", 1), fixed.get("cp", 1)
    if cp > 1 and pp > 1:
        return f"cp {cp} runs beside pp 1 only (parallelize refuses pipeline stages with cp)"
    if cp > 1 and profile.cp_refusal:
        return profile.cp_refusal
    dp = cluster.num_gpus // (tp * pp * cp)
    if reason := profile.tp_analysis.check(tp, profile.graph):
        return reason
    if engine.ctx.global_batch % dp:
        return f"global batch {engine.ctx.global_batch} is not divisible by dp {dp}"
    need = engine.least_memory_bytes(fixed)
    if need is not None:
        return (
            f"needs at least {need / 2**30:.1f} GiB per GPU for weights, gradients, optimizer state"
            f" and one micro-batch of activations; {cluster.device.usable_memory_bytes / 2**30:.1f}"
            " GiB are usable"
        )
    return "no configuration of this shape exists"


def to_plan(result: SearchResult, evaluation: Evaluation) -> Plan:
    """Write one evaluation as the Plan the runtime reads; a plan check_plan refuses is a one-line
    PlanError."""
    plan = _written(result, evaluation)
    try:
        check_plan(plan, result.graph)  # Note [the runtime's checks]
    except ConfigError as error:
        raise PlanError(
            f"the planner's plan ({evaluation.config}) is refused by the runtime: {error}"
        ) from None
    return plan


def _written(result: SearchResult, evaluation: Evaluation, uncompressed: bool = True) -> Plan:
    """One evaluation as a Plan, not yet checked against the graph (a schema refusal is a one-line
    ConfigError);
    ``uncompressed``: with the prediction of the same plan uncompressed (check_plan does not read
    it)."""
    from hyparallel.spec.schema import ModelInfo

    graph, profile, c = result.graph, result.profile, evaluation.config
    segments = graph.segments()
    peak = getattr(result.cluster.device.peak_flops, result.dtype)
    model_flops = costs.model_flops_per_step(profile.forward_flops, result.global_batch)
    step = evaluation.step_time_s
    reserved = result.cluster.device.reserved_bytes
    stages = []
    timings = _stage_timings(result, evaluation)
    stage_modules = stage_module_lists(segments, evaluation.stages)
    for index, (start, end) in enumerate(evaluation.stages):
        device = index % c.pp
        stages.append(
            {
                "index": index,
                "modules": stage_modules[index],
                "num_params": sum(s.param_count for s in segments[start:end]),
                "compute_s": float(
                    sum(
                        x.forward_s + x.backward_s
                        for x in segment_costs_of(profile, c, result.cluster)[start:end]
                    )
                ),
                "memory_gib": (evaluation.stage_memory_bytes[device] + reserved) / 2**30,
                **timings[index],
            }
        )
    tflops = model_flops / step / result.cluster.num_gpus / 1e12
    data = {
        "version": 1,
        "model": (
            ModelInfo(
                name=graph.name,
                num_params=graph.num_params,
                num_layers=graph.num_layers,
                fingerprint=graph.fingerprint,
            ).model_dump()
        ),
        "cluster": result.cluster,
        "training": {
            "global_batch": result.global_batch,
            "micro_batch": c.micro_batch,
            "seq_len": result.seq_len,
            "dtype": result.dtype,
        },
        "parallel": {
            "dp": c.dp,
            "tp": c.tp,
            "pp": c.pp,
            "ep": c.ep,
            "cp": c.cp,
            "cp_attention": c.cp_attention,
            "schedule": c.schedule,
            "virtual_stages": c.virtual_stages,
            "num_microbatches": c.num_microbatches,
            "recompute": c.recompute,
            "zero": c.zero,
            "sequence_parallel": c.sequence_parallel,
            "vocab_parallel_loss": profile.vocab_split(c.tp),
            "grad_compression": c.grad_compression,
            "powersgd_rank": c.powersgd_rank,
            "powersgd_start_step": result.powersgd_start_step,
            "compile": result.compile,
        },
        "placement": {"order": list(c.order)},
        "stages": stages,
        "tensor_parallel": _tp_map(graph, profile) if c.tp > 1 else None,
        "predicted": {
            "step_time_s": step,
            "tokens_per_s": result.global_batch * result.seq_len / step,
            "tflops_per_gpu": tflops,
            "mfu": tflops * 1e12 / peak,
            "bubble_fraction": evaluation.bubble_fraction,
            "memory_gib": [(m + reserved) / 2**30 for m in evaluation.stage_memory_bytes],
            "comm_s": {k: float(v) for k, v in evaluation.comm_s.items()},
            "expert_imbalance": profile.expert_imbalance if c.ep > 1 else None,
            "uncompressed": _uncompressed(result, evaluation) if uncompressed else None,
        },
    }
    return Plan.from_dict(
        round_figures({k: v for k, v in data.items() if v is not None}), source="the planner's plan"
    )


def _uncompressed(result: SearchResult, evaluation: Evaluation) -> dict[str, float] | None:
    """The same plan's step time and dp tail with grad_compression none (None: it compresses
    nothing)."""
    if not evaluation.config.compressed:
        return None
    engine = Search(result.profile, result.cluster, result.global_batch, result.dtype)
    plain = engine.uncompressed(evaluation)
    return {"step_time_s": plain.step_time_s, "dp_comm_s": float(plain.comm_s["dp"])}


def stage_module_lists(segments, ranges: list[tuple[int, int]]) -> list[list[str]]:
    """The module paths each (virtual) stage of segment ``ranges`` lists in a plan.

    A parent whose children are listed (Hugging Face's `transformer`, running position ids and
    masks) is left out: its own glue ops run where execution order puts them (Note [which stage runs
    a node]).
    """
    every = {m for s in segments for m in s.modules}
    # dotted prefixes
    parents = every & {m.rsplit(".", k)[0] for m in every for k in range(1, m.count(".") + 1)}
    return _stage_modules(segments, ranges, parents)


def _stage_modules(segments, ranges: list[tuple[int, int]], parents: set[str]) -> list[list[str]]:
    """The module paths each (virtual) stage lists: those its segments run, parents of listed ones
    left out.

    Note [a module called in several stages]: a module called in several places (T5's
    ``decoder.dropout`` before its first block and after its last) can run in two stages; listing it
    in either would claim all its calls for that stage, so it is listed in none, and each call runs
    where execution order puts it, as glue does (Note [which stage runs a node]). A stage left with
    nothing to list keeps its segments' own modules, and check_plan then refuses the candidate (Note
    [the runtime's checks]).
    """
    ran = [
        list(dict.fromkeys(m for s in segments[start:end] for m in s.modules))
        for start, end in ranges
    ]
    stages_of: dict[str, set[int]] = {}
    for index, modules in enumerate(ran):
        for module in modules:
            stages_of.setdefault(module, set()).add(index)
    result = []
    for modules in ran:
        own = [m for m in modules if len(stages_of[m]) == 1]
        result.append([m for m in own if m not in parents] or own or modules)
    return result


def _stage_timings(result: SearchResult, evaluation: Evaluation) -> list[dict]:
    """Per (virtual) stage, the per-micro-batch figures ``hyparallel simulate`` times the schedule
    with.

    Each segment's tensor-parallel all-reduces go to the direction that runs them. What the search
    charges a device per micro-batch beyond its segments and its transfers (ZeRO-2/3's traffic,
    which exists only with pp = 1) goes to the backward, so a device's forward_s + backward_s + 2 v
    p2p_s is its costed stage time.
    """
    profile = result.profile
    c = evaluation.config.costed()  # one cp rank's share under cp
    links = config_links(c, result.cluster)
    tp_link, pp_link = links["tp"], links["pp"]
    segment_costs = segment_costs_of(profile, c, result.cluster)
    tp_forward_s = [
        profile.tp_forward_comm_s(raw, c.tp, c.sequence_parallel, c.micro_batch, tp_link)
        for raw in profile.raw
    ]
    p2p_s = transfer_s(profile, c, pp_link)
    figures = []
    for start, end in evaluation.stages:
        parts = [(segment_costs[i], tp_forward_s[i]) for i in range(start, end)]
        figures.append(
            {
                "forward_s": sum(s.forward_s + fwd for s, fwd in parts),
                "backward_s": sum(
                    s.backward_s + s.tp_comm_s + s.ep_comm_s + s.cp_comm_s - fwd for s, fwd in parts
                ),
                "activation_gib": sum(s.activation_bytes for s, _ in parts) / 2**30,
            }
        )
    for device, stage_time_s in enumerate(evaluation.stage_time_s):
        chunks = figures[device :: c.pp]
        extra = (
            stage_time_s
            - 2 * c.virtual_stages * p2p_s
            - sum(f["forward_s"] + f["backward_s"] for f in chunks)
        )
        for figure in chunks:
            figure["backward_s"] += max(extra, 0.0) / len(chunks)
    for figure in figures[:-1] if c.pp > 1 else ():
        figure["p2p_s"] = p2p_s
    return figures


def round_figures(value, digits: int = 6):
    """Every float in ``value`` (nested dicts and lists) to ``digits`` significant digits;
    predictions use 6: readable YAML, and nothing the model knows more precisely."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: round_figures(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [round_figures(v, digits) for v in value]
    return value


def _tp_map(graph: ModelGraph, profile: ModelProfile) -> dict[str, str]:
    """Module path -> style, with one ``prefix.*.rest`` glob where every repeated block agrees."""
    block_of = {name: block.path for block in graph.blocks for name in block.ops}
    grouped: dict[str, dict[str, str]] = {}
    for name, style in profile.tp_analysis.styles.items():
        path = graph.op(name).module
        if not path and style == "replicate":
            # a function of the root's own forward (NeoMME's `hidden @ self.proj.weight`): no module
            # to name
            continue
        block = block_of.get(name)
        if block and "." in block and path.startswith(block + "."):
            key = f"{block.rsplit('.', 1)[0]}.*.{path[len(block) + 1 :]}"
        else:
            key = path
        grouped.setdefault(key, {})[path] = style
    result: dict[str, str] = {}
    for key, members in grouped.items():
        if len(set(members.values())) == 1:
            result[key] = next(iter(members.values()))
        else:
            result.update(members)
    return dict(sorted(result.items()))
