"""Where a model's embedding tables go: parameter servers, the workers' GPUs (the search's plans),
or split.

For a recommendation model (embedding tables, no repeated transformer blocks) ``choose`` prices
three options with the cost functions of ``hyparallel.planner.servers`` and the search's own:

* ``ps``: the tables and dense weights on parameter servers, one worker per GPU (Plan.ps), at the
  server count that is fastest (the fewest within PS_SERVERS_WITHIN of the fastest), or the count
  asked for;
* ``workers``: the tables kept on the GPUs, as the data/tensor/pipeline search plans them
  (replicated under data parallelism, or sharded by ZeRO): its best evaluation, or why none fits;
* ``split``: each table whole on one GPU and the pooled embeddings exchanged all-to-all (TorchRec's
  table-wise sharding). Priced for comparison only: no plan can say it and the runtime cannot run
  it, so it is never picked.

The pick is the fastest option that fits and runs; ``ps_servers`` given, it is the ps option at that
count. Note [which models compare tables]: the comparison runs for recommendation models unless a
constraint asks for what ps mode cannot do (tp or pp above 1, dp other than the GPUs, ZeRO,
recomputation, sequence parallelism, gradient compression, virtual stages); transformers keep the
search's plan unless ``ps_servers`` is given. A recommendation model is one whose untied embedding
tables hold more than half of its parameters, with no repeated
blocks: "no blocks" alone also took an LSTM language model and a block reused at every depth (their
blocks are not seen) for one, and gave them parameter servers and server-side Adagrad in place of
the user's optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from hyparallel.graph import ModelGraph
from hyparallel.graph.checks import check_plan
from hyparallel.planner import costs
from hyparallel.planner import servers as ps_costs
from hyparallel.planner.api import SearchResult, round_figures, stage_module_lists, step_parts
from hyparallel.planner.constraints import count_message
from hyparallel.planner.profile import ModelProfile
from hyparallel.planner.search import Evaluation
from hyparallel.spec import limits
from hyparallel.spec.cluster import ClusterSpec
from hyparallel.spec.errors import ConfigError, PlanError
from hyparallel.spec.schema import ModelInfo, Plan, PsOptimizer

OptionKind = Literal["ps", "workers", "split"]
# what a planned ps section asks the servers for (PsConfig's default)
PS_OPTIMIZER: PsOptimizer = "adagrad"
# A server count is taken over a smaller one only if it is more than this much faster: a process per
# 1% is not worth its host.
PS_SERVERS_WITHIN = 0.01
# What ps mode cannot run: constraint -> the one value it runs with.
_PS_REFUSES = {
    "tp": 1,
    "pp": 1,
    "zero": 0,
    "recompute": "none",
    "sequence_parallel": False,
    "virtual_stages": 1,
    "grad_compression": "none",
}


@dataclass(frozen=True)
class Table:
    """One embedding table of the traced model: its module path, shape, and ids it looks up per
    sample."""

    path: str
    rows: int
    dim: int
    ids_per_sample: float

    @property
    def values(self) -> int:
        """rows x dim."""
        return self.rows * self.dim

    @property
    def weight_bytes(self) -> float:
        """The fp32 table."""
        return self.values * ps_costs.VALUE_BYTES


def embedding_tables(graph: ModelGraph, traced_rows: int = 1) -> list[Table]:
    """The nn.Embedding / nn.EmbeddingBag tables ps mode can hold: each embedding op of its own
    module, its weight tied to nothing (a tied embedding and head share one tensor, which a server
    cannot hold for one of them)."""
    tied = {name for tie in graph.ties for name in tie}
    tables, seen = [], set()
    for op in graph.ops:
        if op.kind != "embedding" or not op.module or len(op.params) != 1 or op.module in seen:
            continue
        if op.params[0] in tied or len(op.param_shapes[0]) != 2:
            continue
        seen.add(op.module)
        rows, dim = op.param_shapes[0]
        ids = math.prod(op.input_shapes[0]) / traced_rows if op.input_shapes else 1.0
        tables.append(Table(op.module, int(rows), int(dim), float(ids)))
    return tables


def is_recommendation(graph: ModelGraph) -> bool:
    """A model whose embedding tables hold most of its parameters and that has no repeated blocks
    (transformer layers): DLRM, wide-and-deep, two-towers. An LSTM or a block reused at every depth
    under a small token embedding has no blocks either, but its tables are no reason for parameter
    servers (Note [which models compare tables])."""
    tables = embedding_tables(graph)
    if graph.blocks or not tables:
        return False
    return 2 * sum(t.values for t in tables) > sum(op.param_count for op in graph.ops)


@dataclass
class Option:
    """One place for the tables, priced: whether it fits, its step time and memory, and what took
    the time."""

    kind: OptionKind
    label: str
    fits: bool
    runnable: bool = True
    step_time_s: float = math.inf
    gpu_memory_bytes: float = math.inf  # peak of the busiest GPU, reserved memory not included
    server_memory_bytes: float | None = None  # ps: the busiest server's host memory
    servers: int = 0
    workers: int = 0  # ps: the worker processes (Note [servers inside the launch])
    micro_batch: int = 0
    parts: dict[str, float] = field(default_factory=dict)  # seconds per step by what takes them
    reason: str = ""  # why it does not fit (or was not priced)
    evaluation: Evaluation | None = None  # workers: the search's best


@dataclass
class TableChoice:
    """The options compared for a model's tables and the one picked (forced: ``ps_servers`` was
    given)."""

    options: list[Option]
    pick: Option
    forced: bool = False

    def why_not(self, option: Option) -> str:
        """One line: why ``option`` was not picked (or "the pick")."""
        pick = self.pick
        if option is pick:
            return "the pick" + (" (ps_servers asks for it)" if self.forced else "")
        if not option.fits:
            return option.reason
        versus = f"{_ms(option.step_time_s)}/step vs {pick.label} {_ms(pick.step_time_s)}"
        if not option.runnable:
            faster = "faster, " if option.step_time_s < pick.step_time_s else ""
            return (
                f"{versus} ({faster}but hyparallel has no table-wise sharding: no plan says it, no"
                " runtime runs it)"
            )
        if self.forced and option.step_time_s < pick.step_time_s:
            return f"{versus}: faster, but ps_servers asks for parameter servers"
        excess = {
            name: seconds - pick.parts.get(name, 0.0) for name, seconds in option.parts.items()
        }
        # where it loses the most time to the pick
        part = max(excess, key=excess.get) if excess else None
        return versus + (f", mostly {part} {_ms(option.parts[part])}" if part else "")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def check_request(
    ps_servers: object, constraints: dict, cluster: ClusterSpec, global_batch: int
) -> None:
    """A one-line PlanError for a ``ps_servers`` that is not a count, or that constraints ps mode
    cannot run."""
    if ps_servers is None or ps_servers == 0:  # 0: no servers, the tables stay on the GPUs
        return
    if (
        not isinstance(ps_servers, int)
        or isinstance(ps_servers, bool)
        or not 1 <= ps_servers <= limits.MAX_DEVICES
    ):
        high = (
            limits.MAX_DEVICES
            if isinstance(ps_servers, int) and ps_servers > limits.MAX_DEVICES
            else None
        )
        raise PlanError(count_message("ps_servers", ps_servers, high))
    for key, allowed in _PS_REFUSES.items():
        if key in constraints and constraints[key] != allowed:
            raise PlanError(
                f"ps_servers (parameter-server mode) needs {key} {allowed}, not {constraints[key]}:"
                f" each worker runs the whole dense model on one GPU; drop {key} or ps_servers"
            )
    n = cluster.num_gpus
    if constraints.get("dp", n) != n:
        raise PlanError(
            f"ps_servers (parameter-server mode) runs one worker per GPU, dp {n}, not dp"
            f" {constraints['dp']}; drop dp or ps_servers"
        )
    if global_batch % n:
        raise PlanError(
            f"global batch {global_batch} is not divisible by the {n} ps workers (one per GPU)"
        )


def applies(graph: ModelGraph, constraints: dict, ps_servers: int | None) -> bool:
    """Whether to compare where the tables go (Note [which models compare tables]); ``ps_servers``
    given, a model without tables is a PlanError; 0 keeps the tables on the GPUs (no comparison)."""
    if ps_servers == 0:
        return False
    if ps_servers is not None:
        if not embedding_tables(graph):
            raise PlanError(
                f"ps_servers: {graph.name} has no nn.Embedding or nn.EmbeddingBag table (untied) to"
                " put on parameter servers; plan it without ps_servers"
            )
        return True
    if not is_recommendation(graph):
        return False
    return all(constraints.get(key, allowed) == allowed for key, allowed in _PS_REFUSES.items())


@dataclass
class _Setting:
    """What every option is priced from."""

    graph: ModelGraph
    profile: ModelProfile
    cluster: ClusterSpec
    global_batch: int
    dtype: str
    micro_batch: int | None  # fixed by a constraint
    # ps workers, when servers take some of the GPUs' processes; None: one per GPU
    worker_count: int | None = None
    tables: list[Table] = field(init=False)
    dense: list[tuple[int, int]] = field(init=False)  # (values, rows) of each dense parameter
    # distinct rows of each table a worker's samples look up
    per_worker: list[float] = field(init=False)
    # ... the step's: the rows updated (pushes are summed per row)
    per_step: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.tables = embedding_tables(self.graph, self.profile.traced_rows)
        paths = {f"{t.path}.weight" for t in self.tables}
        shapes = {}
        for op in self.graph.ops:
            for name, shape in zip(op.params, op.param_shapes):
                if name not in paths:
                    shapes.setdefault(name, shape)
        self.dense = [(math.prod(s), s[0] if len(s) > 1 else 1) for s in shapes.values()]
        self.per_worker = self.unique_rows(self.global_batch / self.workers)
        self.per_step = self.unique_rows(self.global_batch)

    @property
    def workers(self) -> int:
        return self.worker_count or self.cluster.num_gpus

    @property
    def dense_params(self) -> int:
        return sum(values for values, _ in self.dense)

    def unique_rows(self, samples: float) -> list[float]:
        """Distinct rows of each table among ``samples`` samples' lookups (an upper bound)."""
        return [
            ps_costs.expected_unique_ids(t.rows, samples * t.ids_per_sample) for t in self.tables
        ]

    def worker_fit(self, held_bytes: float) -> _Fit:
        """One GPU's micro-batch, compute and peak: the largest micro-batch (or the fixed one) at
        which ``held_bytes`` and the micro-batch's activations fit it; when none does, the
        smallest's
        peak."""
        batch = self.global_batch // self.workers
        usable = self.cluster.device.usable_memory_bytes
        sizes = (
            [self.micro_batch]
            if self.micro_batch
            else [b for b in range(batch, 0, -1) if batch % b == 0]
        )
        fit = _Fit(False, 0, math.inf, math.inf)
        for micro_batch in (b for b in sizes if batch % b == 0):
            segments = self.profile.segment_costs(
                1, False, micro_batch, "none", self.cluster.intra_node
            )
            seconds = sum(s.forward_s + s.backward_s for s in segments) * (batch // micro_batch)
            activations = sum(s.activation_bytes for s in segments) + self.backward_working_bytes(
                micro_batch
            )
            fit = _Fit(
                held_bytes + activations <= usable, micro_batch, seconds, held_bytes + activations
            )
            if fit.fits:
                break
        return fit

    def backward_working_bytes(self, micro_batch: int) -> float:
        """The backward's transient at its largest op (Note [backward's own] in profile.py) without
        a table's weight gradient, which the search counts whole: off the GPU a table's gradient is
        the pulled rows' (ps), or the rows the fused update writes (split), both counted apart."""
        activation = (
            max(max(raw.backward_working, raw.loss_working) for raw in self.profile.raw)
            * micro_batch
        )
        weight_bytes = costs.GRAD_BYTES_PER_PARAM + (
            0 if self.dtype == "fp32" else costs.DTYPE_BYTES[self.dtype]
        )
        return activation + max((values for values, _ in self.dense), default=0) * weight_bytes


@dataclass(frozen=True)
class _Fit:
    """A GPU's micro-batch, its compute seconds per step and its peak bytes; ``fits`` in its
    memory."""

    fits: bool
    micro_batch: int
    compute_s: float
    peak_bytes: float


def choose(
    graph: ModelGraph,
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch: int,
    dtype: str,
    constraints: dict,
    *,
    dense_best: list[Evaluation],
    dense_frugal: Evaluation | None,
    ps_servers: int | None = None,
    dense_searched: bool = True,
) -> TableChoice:
    """Price ps, the search's plans and a table-wise split for ``graph``'s tables, and pick (see the
    module doc)."""
    setting = _Setting(graph, profile, cluster, global_batch, dtype, constraints.get("micro_batch"))
    ps_option = _best_ps(setting, ps_servers)
    workers = _workers_option(setting, dense_best, dense_frugal, dense_searched)
    options = [ps_option, workers, _split_option(setting)]
    if ps_servers is not None:
        if not ps_option.fits:
            raise PlanError(f"ps_servers {ps_servers}: {ps_option.reason}")
        return TableChoice(options, ps_option, forced=True)
    runnable = [o for o in options if o.fits and o.runnable]
    if not runnable:
        raise PlanError(
            "nothing fits: " + "; ".join(f"{o.label}: {o.reason}" for o in options if o.runnable)
        )
    return TableChoice(options, min(runnable, key=lambda o: o.step_time_s))


# Note [servers inside the launch]
#     A plan for N GPUs runs in a launch of N processes. So the planner's own ps option puts its
#     servers on some of those processes, ranks 0 .. s-1 (their GPUs idle: a server is a CPU
#     process), and the other N - s are the workers: priced with the same hardware as the search's
#     plans, not with s more processes. Only ``ps_servers`` (`hyparallel plan --ps-servers`) adds
#     servers beside one worker per GPU: the user asks for those processes, and the plan's summary
#     says the launch size.


def _best_ps(setting: _Setting, ps_servers: int | None) -> Option:
    """The ps option at ``ps_servers`` (beside one worker per GPU), or, inside the GPUs' processes
    (Note [servers inside the launch]), at the fewest servers within PS_SERVERS_WITHIN of the
    fastest count."""
    if ps_servers is not None:
        if setting.global_batch % setting.workers:
            return Option(
                "ps",
                "parameter servers",
                False,
                reason=(
                    f"global batch {setting.global_batch} is not divisible by the {setting.workers}"
                    " workers"
                ),
            )
        return _ps_option(setting, ps_servers, _ps_worker(setting))
    n = setting.cluster.num_gpus
    splits = [replace(setting, worker_count=n - servers) for servers in range(1, n)]
    splits = [inside for inside in splits if setting.global_batch % inside.workers == 0]
    if not splits:
        why = (
            "one process: none left for a server"
            if n == 1
            else (
                f"no split of the {n} processes into servers and workers divides global batch"
                f" {setting.global_batch}"
            )
        )
        return Option("ps", "parameter servers", False, reason=why)
    options = [_ps_option(inside, n - inside.workers, _ps_worker(inside)) for inside in splits]
    fitting = [o for o in options if o.fits]
    if not fitting:
        return options[0]
    fastest = min(o.step_time_s for o in fitting)
    return next(o for o in fitting if o.step_time_s <= fastest * (1 + PS_SERVERS_WITHIN))


def _ps_worker(setting: _Setting) -> _Fit:
    """A ps worker's GPU: the dense model, the rows it pulls for its samples and their gradients,
    its activations."""
    pulled = sum(u * t.dim for u, t in zip(setting.per_worker, setting.tables))
    return setting.worker_fit(
        ps_costs.ps_worker_memory_bytes(setting.dense_params, setting.dtype, pulled, 0.0)
    )


def _ps_option(setting: _Setting, servers: int, worker: _Fit) -> Option:
    """Parameter servers at ``servers``: Note [where the servers run] in planner/servers.py, and
    docs/cost-model.md."""
    label = f"parameter servers ({servers})"
    usable = setting.cluster.device.usable_memory_bytes
    if not worker.fits:
        return Option(
            "ps",
            label,
            False,
            servers=servers,
            workers=setting.workers,
            reason=(
                f"a worker needs {worker.peak_bytes / 2**30:.1f} GiB per GPU (the dense model, the"
                f" pulled rows and a micro-batch's activations) on {usable / 2**30:.1f} GiB usable"
            ),
        )
    micro_batch, compute_s, worker_peak = worker.micro_batch, worker.compute_s, worker.peak_bytes
    tables, n, link = setting.tables, setting.workers, setting.cluster.inter_node
    per_worker, per_step = setting.per_worker, setting.per_step
    dense_bytes = setting.dense_params * ps_costs.VALUE_BYTES
    loads = ps_costs.dense_loads_bytes(
        [values * ps_costs.VALUE_BYTES for values, _ in setting.dense], servers
    )
    busiest_dense = max(loads)
    dense_rows = sum(rows for _, rows in setting.dense) * (
        busiest_dense / dense_bytes if dense_bytes else 0.0
    )
    worker_bytes = ps_costs.transfer_bytes(per_worker, [t.dim for t in tables], dense_bytes)
    # its share of every worker's
    server_bytes = n * ((worker_bytes - dense_bytes) / servers + busiest_dense)
    holders = sum(1 for load in loads if load > 0)
    # Besides the servers' requests, a step begins and finishes with one call to the dispatcher
    # each.
    pull_s = ps_costs.ps_link_s(
        worker_bytes, server_bytes, ps_costs.pull_requests(per_worker, servers, holders) + 1, link
    )
    # the pushes go out together; then finish
    push_s = ps_costs.ps_link_s(worker_bytes, server_bytes, 2, link)
    updated = [u / servers for u in per_step]
    update_bytes = sum(
        ps_costs.update_traffic_bytes(PS_OPTIMIZER, rows * t.dim, rows)
        for rows, t in zip(updated, tables)
    ) + ps_costs.update_traffic_bytes(
        PS_OPTIMIZER, busiest_dense / ps_costs.VALUE_BYTES, dense_rows
    )
    update_s = ps_costs.server_update_s(
        update_bytes, server_bytes, server_bytes, ps_costs.SERVER_MEMORY_BANDWIDTH_BYTES_PER_S
    )
    host = ps_costs.server_memory_bytes(
        [(t.rows, t.dim) for t in tables],
        busiest_dense,
        dense_rows,
        PS_OPTIMIZER,
        servers,
        server_bytes,
    )
    capacity = setting.cluster.ps_server_memory_bytes or ps_costs.DEFAULT_SERVER_MEMORY_BYTES
    fits = host <= capacity
    return Option(
        "ps",
        label,
        fits,
        step_time_s=ps_costs.ps_step_s(compute_s, pull_s, push_s, update_s),
        gpu_memory_bytes=worker_peak,
        server_memory_bytes=host,
        servers=servers,
        workers=setting.workers,
        micro_batch=micro_batch,
        parts={"compute": compute_s, "pull": pull_s, "push": push_s, "server update": update_s},
        reason=(
            ""
            if fits
            else (
                f"{host / 2**30:.1f} GiB per server (its rows and {PS_OPTIMIZER} state) on"
                f" {capacity / 2**30:.0f} GiB of host memory (cluster.ps_server_memory_bytes); use"
                " more servers"
            )
        ),
    )


def _workers_option(
    setting: _Setting, best: list[Evaluation], frugal: Evaluation | None, searched: bool
) -> Option:
    """The search's best plan with the tables on the GPUs, or why it has none."""
    if best:
        e, c = best[0], best[0].config
        shape = (
            "replicated"
            if c.zero == 0 and c.tp == 1 and c.pp == 1
            else f"ZeRO {c.zero}"
            if c.zero
            else "on GPUs"
        )
        return Option(
            "workers",
            f"tables on the GPUs ({shape}: tp {c.tp} pp {c.pp} dp {c.dp})",
            True,
            step_time_s=e.step_time_s,
            gpu_memory_bytes=e.peak_memory_bytes,
            micro_batch=c.micro_batch,
            parts=step_parts(e),
            evaluation=e,
        )
    label = "tables on the GPUs (replicated)"
    if not searched:
        return Option(
            "workers", label, False, reason="not searched: ps_servers asks for parameter servers"
        )
    table_params = sum(t.values for t in setting.tables)
    usable = setting.cluster.device.usable_memory_bytes
    per_param = costs.state_bytes_per_param(setting.dtype, 0, setting.workers)
    with_state = ps_costs.replicated_memory_bytes(table_params, per_param)
    smallest = (
        f"; the smallest data/tensor/pipeline plan needs {frugal.peak_memory_bytes / 2**30:.1f} GiB"
        if frugal
        else ""
    )
    return Option(
        "workers",
        label,
        False,
        reason=(
            f"{table_params * ps_costs.VALUE_BYTES / 2**30:.1f} GiB of tables"
            f" ({with_state / 2**30:.0f} GiB with their gradients and AdamW state) on every GPU,"
            f" {usable / 2**30:.1f} GiB usable{smallest}"
        ),
    )


def _split_option(setting: _Setting) -> Option:
    """Each table whole on one GPU (TorchRec's table-wise sharding), the dense model replicated
    under DDP."""
    tables, n, cluster = setting.tables, setting.workers, setting.cluster
    label = f"table-wise split over {n} GPUs"
    if setting.global_batch % n:
        return Option(
            "split", label, False, False, reason=f"global batch not divisible by {n} GPUs"
        )
    link = cluster.intra_node if cluster.num_nodes == 1 else cluster.inter_node
    device = cluster.device
    assignment = ps_costs.table_wise_assignment(
        [t.weight_bytes for t in tables], [t.dim for t in tables], n
    )
    per_step = setting.per_step  # each device looks up its tables for every sample
    held, dims, updates = [0.0] * n, [0] * n, [0.0] * n
    for t, d, rows in zip(tables, assignment, per_step):
        held[d] += t.weight_bytes + ps_costs.optimizer_state_bytes(PS_OPTIMIZER, t.values, t.rows)
        # the step's row gradients, before the fused update
        held[d] += rows * t.dim * ps_costs.VALUE_BYTES
        dims[d] += t.dim
        updates[d] += ps_costs.update_traffic_bytes(PS_OPTIMIZER, rows * t.dim, rows)
    total_dims = sum(dims)
    exchange = [
        ps_costs.table_wise_exchange_bytes(dims[d], total_dims, setting.global_batch, n)
        for d in range(n)
    ]
    # Per device: the dense model under DDP with AdamW (the search's figure), its tables, and the
    # all-to-all's buffers: the pooled rows sent and received, and their gradients (4 x the larger
    # direction, a bound).
    dense_state = setting.dense_params * costs.state_bytes_per_param(setting.dtype, 0, n)
    busiest = max(range(n), key=lambda d: held[d] + 4 * exchange[d])
    worker = setting.worker_fit(dense_state + held[busiest] + 4 * exchange[busiest])
    if not worker.fits:
        largest = max(tables, key=lambda t: t.weight_bytes)
        return Option(
            "split",
            label,
            False,
            False,
            reason=(
                f"the busiest GPU needs {worker.peak_bytes / 2**30:.1f} GiB (the largest table,"
                f" {largest.path}, is {largest.weight_bytes / 2**30:.1f} GiB before its"
                f" {PS_OPTIMIZER} state) on {device.usable_memory_bytes / 2**30:.1f} GiB usable"
            ),
        )
    micro_batch, compute_s, peak = worker.micro_batch, worker.compute_s, worker.peak_bytes
    micro_batches = setting.global_batch // n // micro_batch
    all_to_all = 2 * micro_batches * ps_costs.all_to_all_s(max(exchange) / micro_batches, n, link)
    update_s = max(
        ps_costs.device_update_s(u, device.memory_bandwidth_bytes_per_s, device.memory_efficiency)
        for u in updates
    )
    dense_sync = costs.ring_allreduce_s(setting.dense_params * costs.GRAD_BYTES_PER_PARAM, n, link)
    dense_step = ps_costs.device_update_s(
        setting.dense_params * costs.adam_step_bytes_per_param(setting.dtype),
        device.memory_bandwidth_bytes_per_s,
        device.memory_efficiency,
    )
    parts = {
        "compute": compute_s,
        "all-to-all": all_to_all,
        "table update": update_s,
        "dense sync": dense_sync + dense_step,
    }
    return Option(
        "split",
        label,
        True,
        False,
        step_time_s=sum(parts.values()),
        gpu_memory_bytes=peak,
        micro_batch=micro_batch,
        parts=parts,
    )


def write_plan(result: SearchResult, option: Option) -> Plan:
    """The ps option as the Plan the runtime reads: ``option.workers`` workers, ``option.servers``
    servers (inside the GPUs' processes or beside them: Note [servers inside the launch]), every
    table."""
    graph, profile, cluster = result.graph, result.profile, result.cluster
    n, micro_batch, step = option.workers, option.micro_batch, option.step_time_s
    segments = graph.segments()
    costs_now = profile.segment_costs(1, False, micro_batch, "none", cluster.intra_node)
    forward = sum(s.forward_s for s in costs_now)
    backward = sum(s.backward_s for s in costs_now)
    reserved = cluster.device.reserved_bytes
    memory_gib = (option.gpu_memory_bytes + reserved) / 2**30
    tflops = (
        costs.model_flops_per_step(profile.forward_flops, result.global_batch)
        / step
        / cluster.num_gpus
        / 1e12
    )
    comm = option.parts["pull"] + option.parts["push"] + option.parts["server update"]
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
        "cluster": cluster,
        "training": {
            "global_batch": result.global_batch,
            "micro_batch": micro_batch,
            "seq_len": result.seq_len,
            "dtype": result.dtype,
        },
        "parallel": {
            "dp": n,
            "tp": 1,
            "pp": 1,
            "num_microbatches": result.global_batch // (n * micro_batch),
        },
        "stages": [
            {
                "index": 0,
                "modules": stage_module_lists(segments, [(0, len(segments))])[0],
                "num_params": graph.num_params,
                "compute_s": forward + backward,
                "memory_gib": memory_gib,
                "forward_s": forward,
                "backward_s": backward,
                "activation_gib": sum(s.activation_bytes for s in costs_now) / 2**30,
            }
        ],
        "predicted": {
            "step_time_s": step,
            "tokens_per_s": result.global_batch * result.seq_len / step,
            "tflops_per_gpu": tflops,
            "mfu": tflops * 1e12 / getattr(cluster.device.peak_flops, result.dtype),
            "bubble_fraction": 0.0,
            "memory_gib": [memory_gib],
            "comm_s": {"tp": 0.0, "dp": comm, "pp": 0.0},
        },
        "ps": {
            "servers": option.servers,
            "tables": [t.path for t in embedding_tables(graph, profile.traced_rows)],
            "staleness": 0,
            "optimizer": PS_OPTIMIZER,
        },
    }
    plan = Plan.from_dict(round_figures(data), source="the planner's ps plan")
    try:
        check_plan(plan, graph)  # Note [the runtime's checks] in api.py
    except ConfigError as error:
        raise PlanError(
            f"the planner's ps plan ({option.label}) is refused by the runtime: {error}"
        ) from None
    return plan
