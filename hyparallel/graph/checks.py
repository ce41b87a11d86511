"""Every check a plan must pass before the first collective, in one pure function: ``check_plan``.

    checked = check_plan(plan, graph, world_size)   # raises ConfigError, or:
    # module path -> column | row | vocab, every glob of tensor_parallel expanded
    checked.styles
    checked.stage_of     # module path -> stage, for the paths the plan's stages list

``graph`` is the model traced once by ``hyparallel.trace`` (its ``structure`` is what tensor
parallelism may split, its ``modules`` every module path, its ops the execution order). Nothing here
touches a process group: a plan that cannot run is refused in one line naming the module and the
construct, on every rank alike, before ``parallelize`` builds its mesh. The tensor-parallel and
pipeline passes call the same checks for their own callers, so a rule is written once.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from hyparallel.graph.model_graph import ModelGraph
from hyparallel.graph.moe import expert_output_width
from hyparallel.graph.structure import TPAnalysis, holder, split_tie
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.schema import Plan, TPStyle


@dataclass(frozen=True)
class CheckedPlan:
    """What ``check_plan`` found the plan to mean for this model: the split styles and the stage of
    each listed path."""

    plan: Plan
    # module path -> style, replicated ones left out
    styles: dict[str, TPStyle] = field(default_factory=dict)
    stage_of: dict[str, int] | None = None  # listed module path -> stage; None without a stage map


def check_plan(plan: Plan, graph: ModelGraph, world_size: int | None = None) -> CheckedPlan:
    """Refuse, in one line, a plan that cannot run ``graph``'s model on ``world_size`` processes;
    see the module docstring.

    Checks what the plan states: the world size, the model (by fingerprint), a stage map (module
    paths, one stage each, in execution order, none empty), the tensor-parallel degree against the
    model's heads and widths, a tensor_parallel map (only the column/row pairs and vocab ops the
    dataflow allows, both halves of a pair), and what recomputation, sequence parallelism and ZeRO
    need. Parts the plan leaves out (stages, tensor_parallel) are for the planner to fill
    (``hyparallel.planner.complete``); check the completed plan again to get its styles.
    """
    par = plan.parallel
    if world_size is not None:
        check_world_size(plan, world_size)
    if (
        plan.model is not None
        and plan.model.fingerprint
        and plan.model.fingerprint != graph.fingerprint
    ):
        raise ConfigError(
            f"the plan was made for model '{plan.model.name}' ({plan.model.num_params:,}"
            f" parameters), not this {graph.name} ({graph.num_params:,} parameters, other names or"
            " shapes); plan this model with `hyparallel plan` or hp.plan"
        )
    stage_of = (
        check_stages(graph, [stage.modules for stage in plan.stages])
        if plan.stages is not None
        else None
    )
    styles = {}
    if par.tp > 1:
        check_tensor_parallel_degree(graph, par.tp)
        if par.zero > 0 and shares_heads(graph.structure, graph, par.tp):
            raise ConfigError(
                f"tp ({par.tp}) is more than the model's key/value heads, so ranks share heads, and"
                f" zero {par.zero} shards their gradients: not supported together yet; use zero: 0"
                " or a tp up to the key/value head count"
            )
        if par.sequence_parallel:
            check_blocks(graph, "sequence_parallel", "to shard between")
            if reason := graph.structure.whole_sequence(graph) or graph.structure.uneven_sequence(
                graph, par.tp
            ):
                raise ConfigError(reason)
    if par.pp > 1 and graph.custom_backwards:  # Note [a custom backward a traced stage cannot keep]
        where, function = graph.custom_backwards[0]
        raise ConfigError(
            f"pp {par.pp}: {where or graph.name} applies the custom autograd function {function},"
            " whose own backward a traced pipeline stage cannot keep (autograd would differentiate"
            " its forward instead); use pp: 1 (tp and dp keep it)"
        )
    if par.ep > 1:
        check_expert_parallel(graph, par.ep)
    if plan.tensor_parallel is not None:
        styles = check_styles(graph, plan.tensor_parallel)
    if par.vocab_parallel_loss:  # tp > 1 (the schema's check)
        check_vocab_parallel_loss(graph, styles if plan.tensor_parallel is not None else None)
    if par.recompute != "none" and par.pp == 1:
        check_blocks(graph, f"recompute: {par.recompute}", "to recompute")
    if par.sync_batchnorm and (par.tp > 1 or par.pp > 1):
        raise ConfigError(
            f"parallel.sync_batchnorm with tp = {par.tp} and pp = {par.pp} is not supported: the"
            " batch norms are converted on the whole model before data parallelism; use tp: 1 and"
            " pp: 1, or sync_batchnorm: false"
        )
    return CheckedPlan(plan=plan, styles=styles, stage_of=stage_of)


def check_expert_parallel(graph: ModelGraph, ep: int) -> None:
    """``parallel.ep``: the model has MoE layers the analysis read (Note [an MoE layer read from the
    trace]), each with a multiple of ep experts."""
    moe = graph.moe
    if not moe.layers:
        why = "; ".join(f"{path}: {reason}" for path, reason in moe.refused.items())
        raise ConfigError(
            f"parallel.ep {ep}: {graph.name} has no mixture-of-experts layer the analysis could"
            f" read{f' ({why})' if why else ''}, so there are no experts to split; use ep: 1"
        )
    for layer in moe.layers:
        if layer.num_experts % ep:
            raise ConfigError(
                f"parallel.ep {ep} does not divide the {layer.num_experts} experts of"
                f" {layer.experts}; use an ep that divides {layer.num_experts}"
            )
        if layer.layout == "list" and expert_output_width(graph, layer) is None:
            raise ConfigError(
                f"parallel.ep {ep}: the experts of {layer.experts} have no single output tensor in"
                " the trace, so a rank not holding one cannot receive it; use ep: 1"
            )


def check_vocab_parallel_loss(graph: ModelGraph, styles: dict[str, str] | None) -> None:
    """parallel.vocab_parallel_loss needs an output head split by vocabulary (in ``styles``, the
    plan's map, when it has one): refuse, in one line, a plan that states it without."""
    head = graph.structure.vocab_head
    if head is None:
        raise ConfigError(
            f"parallel.vocab_parallel_loss: {graph.name} has no output head tensor parallelism can"
            " split by vocabulary (a Linear outside the blocks whose logits span the token"
            " embedding's vocabulary and reach the output); set it to false, and the loss sees the"
            " logits whole"
        )
    path = graph.op(head).module
    if styles is not None and styles.get(path) != "vocab":
        raise ConfigError(
            "parallel.vocab_parallel_loss: the plan's tensor_parallel map keeps the output head"
            f" {path} {styles.get(path, 'replicate')}, not vocab; split it (vocab) or set"
            " vocab_parallel_loss to false"
        )


def check_world_size(plan: Plan, world_size: int) -> None:
    """WORLD_SIZE must be dp x tp x pp: the arithmetic and the fix in the message."""
    par = plan.parallel
    if plan.ps is not None:
        if world_size != plan.launch_size:
            raise ConfigError(
                f"dp({par.dp}) workers + ps.servers({plan.ps.servers}) = {plan.launch_size} != "
                f"WORLD_SIZE({world_size}); launch {plan.launch_size} processes "
                f"(torchrun --nproc_per_node {plan.launch_size}) or change dp or ps.servers"
            )
        return
    if world_size != plan.world_size:
        raise ConfigError(
            f"dp({par.dp}) * tp({par.tp}) * pp({par.pp}) = {plan.world_size} !="
            f" WORLD_SIZE({world_size}); launch {plan.world_size} processes (torchrun"
            f" --nproc_per_node {plan.world_size}) or re-plan with `hyparallel plan --gpus"
            f" {world_size}`"
        )


def check_blocks(graph: ModelGraph, what: str, purpose: str) -> None:
    """``what`` works on the model's repeated blocks (transformer layers): refuse a model without
    any."""
    if not graph.blocks:
        raise ConfigError(f"{what} needs repeated blocks (transformer layers) {purpose}")


# ---- tensor parallelism --------------------------------------------------------------------------


def check_tensor_parallel_degree(graph: ModelGraph, tp: int) -> None:
    """``tp`` must divide the model's heads and split widths (the planner's own check, on the same
    structure)."""
    if reason := graph.structure.nothing_split(tp, graph):
        raise ConfigError(reason)
    if reason := graph.structure.check(tp, graph):
        raise ConfigError(
            f"tp = {tp} does not fit {graph.name}: {reason}; choose a tp that divides it"
        )


def path_matches(path: str, pattern: str) -> bool:
    """Whether module ``path`` matches ``pattern``, component by component (``*`` never spans a
    dot)."""
    atoms, wanted = path.split("."), pattern.split(".")
    return len(atoms) == len(wanted) and all(
        fnmatch.fnmatchcase(a, w) for a, w in zip(atoms, wanted)
    )


def expand_styles(
    paths: Collection[str], tensor_parallel: dict[str, TPStyle], model_name: str
) -> dict[str, TPStyle]:
    """Module path -> style for every path a key (a path or a glob such as ``layers.*.attn.qkv``)
    names.

    ``paths`` are the model's module paths (``ModelGraph.modules``); a key naming none is refused. A
    glob is matched one dotted component at a time, as torch's ``parallelize_module`` does:
    ``layer.*.output.dense`` names each block's ``output.dense``, not also its
    ``attention.output.dense``.
    """
    styles: dict[str, TPStyle] = {}
    key = tuple(paths) if not isinstance(paths, tuple) else paths
    for pattern, style in tensor_parallel.items():
        matched = _matching(key, pattern)
        if not matched:
            raise ConfigError(
                f"tensor_parallel: '{pattern}' matches no module of {model_name}; "
                "check the module path (hyparallel trace lists them)"
            )
        for path in matched:
            styles[path] = style
    return styles


@functools.lru_cache(maxsize=256)
def _matching(paths: tuple[str, ...], pattern: str) -> tuple[str, ...]:
    """The paths ``pattern`` names, in order (kept: the planner checks the same map for every plan
    it writes)."""
    same_depth = [p for p in paths if p.count(".") == pattern.count(".")]  # `*` never spans a dot
    if any(c in pattern for c in "*?["):
        return tuple(p for p in same_depth if path_matches(p, pattern))
    return tuple(p for p in same_depth if p == pattern)


def check_styles(graph: ModelGraph, tensor_parallel: dict[str, TPStyle]) -> dict[str, TPStyle]:
    """The split modules of a ``tensor_parallel`` map (globs expanded), refused unless the dataflow
    allows them.

    A plan may split only the model's column/row pairs and vocab-parallel ops (``graph.structure``),
    and a pair only whole.
    """
    expanded = expand_styles(graph.modules, tensor_parallel, graph.name)
    styles = {p: s for p, s in expanded.items() if s != "replicate"}
    check_ties(graph, styles)
    analysis = graph.structure
    allowed = {
        graph.op(name).module: style
        for name, style in analysis.styles.items()
        if style != "replicate"
    }
    why = {graph.op(name).module: reason for name, reason in analysis.unsplittable.items()}
    wrong = [
        f"{path} ({style};"
        f" {why.get(path) or 'the dataflow allows ' + allowed.get(path, 'replicate')})"
        for path, style in styles.items()
        if allowed.get(path) != style
    ]
    if wrong:
        raise ConfigError(
            "tensor_parallel: cannot split"
            f" {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}; use the styles `hyparallel"
            " plan` writes, or replicate"
        )
    missing = [
        path for path, style in allowed.items() if style in ("column", "row") and path not in styles
    ]
    partners = {
        p for p in missing if any(p.rsplit(".", 1)[0] == q.rsplit(".", 1)[0] for q in styles)
    }
    if partners:
        raise ConfigError(
            f"tensor_parallel: {sorted(partners)[0]} must be split too: its column/row partner is; "
            "split both Linears of a pair or neither"
        )
    return styles


def check_ties(graph: ModelGraph, styles: dict[str, TPStyle]) -> None:
    """A tied parameter is one tensor: refuse a map splitting its holders differently (Note [tied
    parameters split one way] in hyparallel.graph.structure)."""
    if pair := split_tie(graph.ties, styles):
        (a, b), (ma, mb) = pair, (holder(pair[0]), holder(pair[1]))
        raise ConfigError(
            f"tensor_parallel: {ma or '(root)'} ({styles.get(ma, 'replicate')}) and"
            f" {mb or '(root)'} ({styles.get(mb, 'replicate')}) hold one tied parameter ({a} is"
            f" {b}), which cannot be split two ways; give both the same style, or replicate both"
        )


def shares_heads(analysis: TPAnalysis, graph: ModelGraph, tp: int) -> bool:
    """Whether some attention projection has fewer heads than tp (grouped-query key/value heads get
    replicated)."""
    for name, groups in analysis.head_groups.items():
        width = graph.op(name).output_shapes[0][-1]
        head_dim = width // groups
        if any(part // head_dim < tp for part in analysis.parts.get(name, [width])):
            return True
    return False


# ---- pipeline stages -----------------------------------------------------------------------------


def check_stages(graph: ModelGraph, stages: Sequence[Sequence[str]]) -> dict[str, int]:
    """Listed module path -> stage of a stage map, refused unless it names ``graph``'s modules and
    runs in order.

    The rule of Note [which stage runs a node] (hyparallel.pipeline.split), applied to the traced
    ops.
    """
    listed = listed_stages(graph.modules, stages, graph.name)
    assign_stages(listed, [op.module for op in graph.compute_ops()], len(stages), stages)
    return listed


def listed_stages(
    paths: Collection[str], stages: Sequence[Sequence[str]], model_name: str
) -> dict[str, int]:
    """Module path -> stage of a plan's stage map, refused in one line unless every path is one
    module of the model (``paths``: its module paths) listed in one stage (checked before anything
    is traced or allocated)."""
    known = set(paths)
    listed: dict[str, int] = {}
    for index, stage_paths in enumerate(stages):
        if not stage_paths:
            raise ConfigError(
                f"stages[{index}] lists no modules; give each stage at least one module path"
            )
        for path in stage_paths:
            if path not in known or not path:
                raise ConfigError(
                    f"stages[{index}]: '{path}' is not a module of {model_name}; "
                    "use module paths such as those `hyparallel trace` prints (e.g. 'layers.0')"
                )
            if path in listed and listed[path] != index:
                raise ConfigError(
                    f"module '{path}' is in stages {listed[path]} and {index}; each module belongs"
                    " to one stage"
                )
            listed[path] = index
    return listed


def assign_stages(
    listed: dict[str, int], owners: Iterable[str], num_stages: int, stages: Sequence[Sequence[str]]
) -> list[int]:
    """The stage of each operation, given the module each ran in (``owners``, in execution order).

    Note [which stage runs a node]: a listed module (or its longest listed ancestor) decides;
    unlisted glue runs in the stage before it. Refused: a listed module running after a later
    stage's, and a stage that runs nothing.
    """

    @functools.cache  # one answer per module: a block's ops share a few owners
    def listed_path(path: str) -> str | None:
        parts = path.split(".") if path else []
        return next(
            (p for end in range(len(parts), 0, -1) if (p := ".".join(parts[:end])) in listed), None
        )

    paths = [listed_path(owner) for owner in owners]
    first_listed = next((listed[p] for p in paths if p is not None), 0)
    current, current_path, result = None, None, []
    for path in paths:
        stage = (
            listed[path] if path is not None else (current if current is not None else first_listed)
        )
        if path is not None:
            if current is not None and stage < current:
                raise ConfigError(
                    f"module '{path}' (stage {stage}) runs after '{current_path}' (stage"
                    f" {current}); stages must follow the model's execution order: move one of them"
                )
            current, current_path = stage, path
        result.append(stage)
    used = set(result)
    empty = [k for k in range(num_stages) if k not in used]
    if empty:
        k = empty[0]
        raise ConfigError(
            f"stages[{k}] ({', '.join(stages[k])}) runs no operation of the traced model; "
            "give it a module that computes something, or use fewer stages"
        )
    return result


# ---- batch statistics ----------------------------------------------------------------------------

# Module types whose training forward normalises by the statistics of the batch it is given (Note
# [batch statistics]); InstanceNorm, GroupNorm, LayerNorm and RMSNorm normalise each sample alone
# and are not here.
BATCH_NORM_MODULES = frozenset(
    {
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "LazyBatchNorm1d",
        "LazyBatchNorm2d",
        "LazyBatchNorm3d",
        "SyncBatchNorm",
    }
)
BATCH_NORM_FUNCTIONS = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit"})


def batch_statistics(graph: ModelGraph) -> list[str]:
    """Module paths of ``graph``'s ops that normalise by batch statistics, in execution order, each
    once.

    A BatchNorm module's path, or the module calling ``F.batch_norm`` itself (the root is ``""``).
    Whether a module is in training mode is the caller's to ask (the trace does not record it).
    """
    paths: list[str] = []
    for op in graph.ops:
        batch_norm = (
            op.target in BATCH_NORM_MODULES or op.target.rpartition(".")[2] in BATCH_NORM_FUNCTIONS
        )
        if batch_norm and op.module not in paths:
            paths.append(op.module)
    return paths


# Note [batch statistics]
#     A batch norm in training mode normalises by the mean and variance of the rows it is given.
#     Under data parallelism each rank gives it its own rows, and with several micro-batches each
#     micro-batch is normalised alone: the statistics, hence the loss and every gradient, differ
#     from one device running the global batch (1.2e-3 relative, measured on a small CNN at dp 2).
#     parallel.sync_batchnorm converts the batch norms to SyncBatchNorm over the dp group, which
#     reduces the statistics over the ranks in every forward, but still per micro-batch: it matches
#     the single device only with one micro-batch per step.


def batch_statistics_warning(plan: Plan, paths: Sequence[str]) -> str | None:
    """The one-line warning for batch-statistics modules ``paths`` (in training mode) under
    ``plan``, or None.

    None when the statistics are the single device's: no such module, or dp = 1 and one micro-batch,
    or ``sync_batchnorm`` with one micro-batch. See Note [batch statistics].
    """
    par, micro = plan.parallel, plan.num_microbatches
    if not paths or (micro == 1 and (par.dp == 1 or par.sync_batchnorm)):
        return None
    first = paths[0] or "the root module"
    split = []
    if par.dp > 1 and not par.sync_batchnorm:
        split.append(f"each of dp = {par.dp} ranks")
    if micro > 1:
        split.append(f"each of {micro} micro-batches")
    where = " and ".join(split)
    sync = "set parallel.sync_batchnorm: true (CUDA) and one micro-batch"
    fix = "set num_microbatches: 1" if par.sync_batchnorm else sync
    return (
        f"{len(paths)} batch-statistics module(s) in training mode, first '{first}': they normalise"
        f" {where} by its own rows' mean and variance, so loss and gradients differ from a single"
        f" device; {fix}, or run dp 1 with one micro-batch"
    )
