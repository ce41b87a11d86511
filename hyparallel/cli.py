"""The ``hyparallel`` command line.

User errors (a bad file, an unknown model, an untraceable model, a malformed command line, a number
out of range) print one line to stderr and exit 2 with no traceback; anything else is a bug and
keeps its traceback. Numeric flags are bounded by hyparallel.spec.limits, the same bounds the plan
schema uses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from rich.console import Console
from rich.table import Table

from hyparallel.spec import limits
from hyparallel.spec.errors import HyparallelError

EXAMPLES = {
    "models": "example:\n  hyparallel models\n  hyparallel models --json",
    "clusters": "example:\n  hyparallel clusters",
    "show": (
        "examples:\n  hyparallel show plan.yaml                 # a plan from `hyparallel plan -o"
        " plan.yaml`\n  hyparallel show configs/plans/gpt-175b-a100-1024.yaml --model gpt-175b   #"
        " a hand plan, completed\n  hyparallel show my-plan.yaml --yaml"
    ),
    "trace": (
        "examples:\n  hyparallel trace --model gpt-175b --seq-len 2048\n  hyparallel trace --model"
        " hf:LlamaForCausalLM num_hidden_layers=4 hidden_size=512 --seq-len 256\n  hyparallel trace"
        " --model mypkg.models:make_model --json"
    ),
    "demo": "example:\n  hyparallel demo",
    "check": (
        "examples:\n  hyparallel check hf:Qwen2ForCausalLM --tp 2 --pp 2      # a small copy of its"
        " config class\n  hyparallel check hf:MixtralForCausalLM --tp 1 --pp 1 --dp 2 --ep 2   #"
        " experts over 2 ranks\n  hyparallel check mypkg.models:make_model hidden=64 layers=2"
        " --tp 2 --dp 2"
        "   # your factory, small\n  hyparallel check hf:LlamaForCausalLM num_key_value_heads=1"
        " --tp 2 --json\nexit status: 0 equal, 1 differs or failed (a bug: please report it), 2"
        " refused or bad input"
    ),
    "simulate": (
        "examples:\n  hyparallel simulate plan.yaml --out timeline.png   # a plan from `hyparallel"
        " plan -o plan.yaml`\n  hyparallel simulate configs/plans/gpt-175b-a100-1024.yaml --out"
        " timeline.svg   # a hand plan: relative units\n  hyparallel simulate plan.yaml            "
        "           # the schedule as text, one column per time step"
    ),
    "checkpoint": (
        "examples:\n  hyparallel checkpoint export ckpt/ model.safetensors   # the newest complete"
        " checkpoint in ckpt/\n  hyparallel checkpoint export ckpt/step-00000100 model.pt\n "
        " hyparallel checkpoint export ckpt/ llama-ft/           # an hf: model: a folder"
        " from_pretrained loads\n  hyparallel checkpoint export ckpt/ Llama-3.1-8B-ft --format hf"
        " --max-shard-size 2GB"
    ),
    "plan": (
        "examples:\n  hyparallel plan --model gpt-175b --gpus 1024 --cluster a100-80g"
        " --global-batch 1536 --seq-len 2048 -o plan.yaml\n  hyparallel plan --model llama-70b"
        " --gpus 64 --cluster h100-sxm --tp 8 --top 5\n  hyparallel plan --model"
        " hf:LlamaForCausalLM num_hidden_layers=8 --gpus 8 --json\n  hyparallel plan --model"
        " mypkg.gpt:make_model --example-inputs mypkg.gpt:make_inputs --gpus 8 --seq-len 1024\n "
        " hyparallel plan --model gpt-13b --gpus 64 --cluster h100-sxm --mtbf 24 --checkpoint"
        " memory   # + checkpoint interval, goodput\n  hyparallel plan --model gpt-13b --gpus 64"
        " --cluster a100-80g --grad-compression any --top 5   # may compress dp gradients\n "
        " hyparallel plan --model dlrm-criteo-tb --gpus 8 --global-batch 65536 --top 3   #"
        " embedding tables: parameter servers or GPUs\n  hyparallel plan --model dlrm-tiny --gpus 2"
        " --global-batch 64 --ps-servers 2 -o ps.yaml"
    ),
    "calibrate": (
        "examples:\n  hyparallel calibrate --out my-cluster.yaml              # 8 gloo processes on"
        " a CPU; one per GPU on CUDA\n  hyparallel plan --model gpt-tiny --gpus 8 --cluster"
        " my-cluster.yaml --dtype fp32\n  hyparallel calibrate --base h200 --out my-h200.yaml     "
        " # datasheet peaks kept; efficiencies and links measured\n  torchrun --nproc_per_node 4 -m"
        " hyparallel calibrate --quick --out my-cluster.yaml   # inside a launch: its world\n "
        " hyparallel calibrate --from-run metrics.json --out corrected.yaml   # fit to a run's"
        " measured steps, then re-plan"
    ),
}


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.1f}"


def cmd_models(args: argparse.Namespace, out: Console) -> None:
    """List the model zoo."""
    from hyparallel import models
    from hyparallel.tools import views

    rows = models.entries()
    if args.json:
        print(json.dumps([row.__dict__ for row in rows], indent=2))
        return
    table = Table(title="hyparallel models (also: package.module:factory, hf:ARCH key=value ...)")
    for column in ("name", "family", "layers", "hidden", "heads (kv)", "vocab", "parameters"):
        table.add_column(column, justify="left" if column in ("name", "family") else "right")
    for row in rows:
        heads = f"{row.num_heads}" + (f" ({row.kv_heads})" if row.kv_heads != row.num_heads else "")
        table.add_row(
            row.name,
            row.family,
            str(row.num_layers),
            str(row.hidden_size),
            heads,
            str(row.vocab_size),
            views.count(row.num_params),
        )
    out.print(table)


def cmd_clusters(args: argparse.Namespace, out: Console) -> None:
    """List the cluster presets."""
    from hyparallel.spec.cluster import ClusterSpec

    specs = [ClusterSpec.preset(name) for name in ClusterSpec.presets()]
    if args.json:
        print(json.dumps([spec.model_dump(mode="json") for spec in specs], indent=2))
        return
    table = Table(
        title="hyparallel clusters (figures per device; --cluster also takes a YAML file)"
    )
    for column in (
        "name",
        "device",
        "per node",
        "memory GiB",
        "bf16 TFLOP/s",
        "intra-node GB/s",
        "inter-node GB/s",
        "backend",
    ):
        table.add_column(
            column, justify="left" if column in ("name", "device", "backend") else "right"
        )
    for spec in specs:
        table.add_row(
            spec.name,
            spec.device.name,
            str(spec.gpus_per_node),
            _gib(spec.device.memory_bytes),
            f"{spec.device.peak_flops.bf16 / 1e12:,.1f}",
            f"{spec.intra_node.bandwidth_bytes_per_s / 1e9:,.2f}",
            f"{spec.inter_node.bandwidth_bytes_per_s / 1e9:,.2f}",
            spec.backend,
        )
    out.print(table)


def cmd_show(args: argparse.Namespace, out: Console) -> None:
    """Check a plan file and print it, completed: mesh and device map, stages and memory, predicted
    time."""
    from hyparallel.spec.schema import Plan
    from hyparallel.tools import views

    plan = Plan.load(args.plan)
    # as parallelize reads it: one trace, the plan checked against it, then completed
    if args.model:
        from hyparallel import models
        from hyparallel.graph import trace
        from hyparallel.graph.checks import check_plan
        from hyparallel.planner import complete
        from hyparallel.planner.inputs import token_ids

        graph = trace(models.load(args.model).module, token_ids(plan))
        check_plan(plan, graph)
        plan = complete(plan, graph)
    if args.yaml:
        print(plan.to_yaml(), end="")
        return
    par, train = plan.parallel, plan.training
    out.print(
        f"{args.plan}: valid plan (version {plan.version})"
        + (", completed for the model by the planner" if args.model else ""),
        markup=False,
    )
    if plan.model:
        out.print(
            f"model    {plan.model.name}: {views.count(plan.model.num_params)} parameters, "
            f"{plan.model.num_layers} layers",
            markup=False,
        )
    if plan.cluster:
        c = plan.cluster
        out.print(
            f"cluster  {c.name}: {c.num_nodes} node(s) x {c.gpus_per_node} {c.device.name} ="
            f" {c.num_gpus} devices",
            markup=False,
        )
    out.print(
        f"training global batch {train.global_batch} = dp {par.dp} x {plan.num_microbatches}"
        f" micro-batches x {train.micro_batch}, seq_len {train.seq_len}, {train.dtype}"
    )
    mesh = " x ".join(f"{axis} {size}" for axis, size in plan.mesh_shape().items())
    out.print(
        f"parallel {mesh} = {plan.world_size} processes"
        + (f" (experts over ep {par.ep} of the dp ranks)" if par.ep > 1 else "")
        + f"; schedule {par.schedule}"
        + (f" ({par.virtual_stages} virtual stages)" if par.virtual_stages > 1 else "")
        + f", recompute {par.recompute}, ZeRO {par.zero}, sequence parallel"
        f" {'on' if par.sequence_parallel else 'off'}"
        + (
            f", loss {'vocab-parallel' if par.vocab_parallel_loss else 'on gathered logits'}"
            if par.tp > 1
            else ""
        )
        + (
            f", gradient compression {views.compression(plan)}"
            if par.dp > 1 and plan.ps is None
            else ""
        ),
        markup=False,
    )
    if plan.ps is not None:
        out.print(views.ps_line(plan), markup=False, highlight=False)
    groups = Table(title="process groups (ranks of the first group of each kind)")
    for column in ("axis", "groups", "first group", "link"):
        groups.add_column(column)
    for axis in ("tp", "cp", "dp", "pp") if par.cp > 1 else ("tp", "dp", "pp"):
        size = getattr(par, axis)
        groups.add_row(
            axis, str(plan.world_size // size), _ranks(_first_group(plan, axis)), _link(plan, axis)
        )
    if par.ep > 1:  # the first ep dp ranks (Note [expert parallelism])
        first = _first_group(plan, "dp")[: par.ep]
        label = "ep, a ModuleList's experts" if par.tp > 1 else "ep"
        groups.add_row(label, str(plan.world_size // par.ep), _ranks(first), _ep_link(plan))
    if par.ep > 1 and par.tp > 1:  # Note [tp folded into the experts' ranks]
        first = _first_folded_group(plan)
        groups.add_row(
            "ep, stacked experts",
            str(plan.world_size // par.ep),
            _ranks(first),
            _ep_link(plan, True),
        )
    out.print(groups)
    out.print(views.device_map(plan))
    out.print(views.stage_table(plan))
    if plan.predicted:
        out.print(views.time_breakdown(plan))
        if line := views.compression_line(plan):
            out.print(line, markup=False, highlight=False)
    else:
        out.print(
            "no predictions in this plan (stages, tensor-parallel styles and predictions come from"
            " the planner: `hyparallel plan`)"
        )
    for line in views.checkpoint_lines(plan) if plan.checkpoint else ():
        out.print(line, markup=False, highlight=False)


def _first_group(plan, axis: str) -> range:
    """The ranks of the first process group along ``axis`` (the others' coordinates 0), without
    listing every rank."""
    shape = plan.mesh_shape()
    axes = list(shape)
    stride = 1
    for inner in axes[axes.index(axis) + 1 :]:
        stride *= shape[inner]
    return range(0, shape[axis] * stride, stride)


def _first_folded_group(plan) -> range:
    """The first ep group of stacked experts under tp: ep consecutive ranks of the (dp, tp) block
    (pp is 1 under ep)."""
    shape = plan.mesh_shape()
    axes = list(shape)
    inner = max(axes.index("dp"), axes.index("tp"))
    stride = math.prod(shape[a] for a in axes[inner + 1 :])
    return range(0, plan.parallel.ep * stride, stride)


def _ranks(ranks: range) -> str:
    if len(ranks) > 2:
        return (
            f"{ranks[0]}..{ranks[-1]}"
            + (f" step {ranks.step}" if ranks.step > 1 else "")
            + f" ({len(ranks)})"
        )
    return str(list(ranks))


def _link(plan, axis: str) -> str:
    """Whether the groups along ``axis`` stay inside a node (the planner's rule) and the link they
    use."""
    from hyparallel.planner.search import axis_link

    if plan.cluster is None or getattr(plan.parallel, axis) == 1:
        return "-"
    sizes = plan.mesh_shape()  # a cp axis inside dp when above 1
    return axis_link(tuple(sizes), sizes, axis, plan.cluster).name


def _ep_link(plan, stacked: bool = False) -> str:
    """The link the planner prices an ep group's all-to-alls on (``stacked``: stacked experts')."""
    from hyparallel.planner.search import Config, ep_link

    if plan.cluster is None:
        return "-"
    par = plan.parallel
    config = Config(
        par.tp, par.pp, par.dp, 1, 1, "1f1b", 1, "none", 0, False, plan.placement.order, ep=par.ep
    )
    return ep_link(config, plan.cluster, stacked).name


def cmd_trace(args: argparse.Namespace, out: Console) -> None:
    """Trace a model on the meta device and print its graph summary."""
    from hyparallel import models
    from hyparallel.graph import trace
    from hyparallel.tools import views

    loaded = models.load(args.model)
    seq_len = args.seq_len or _max_seq_len(loaded.module) or 2048
    graph = trace(
        loaded.module,
        models.example_inputs(loaded.module, args.batch_size, seq_len),
        name=loaded.name,
    )
    if args.json:
        segments = [s.__dict__ for s in graph.segments()]
        print(
            json.dumps(
                {
                    "name": graph.name,
                    "method": graph.method,
                    "num_params": graph.num_params,
                    "flops": graph.flops,
                    "num_layers": graph.num_layers,
                    "fingerprint": graph.fingerprint,
                    "batch_size": args.batch_size,
                    "seq_len": seq_len,
                    "segments": segments,
                },
                indent=2,
            )
        )
        return
    out.print(
        graph.summary()
        + f"\n  inputs          batch {args.batch_size} x seq_len {seq_len}; fingerprint"
        f" {graph.fingerprint}",
        markup=False,
        highlight=False,
    )
    table = Table(title="segments (the units pipeline stages are made of)")
    for column in (
        "#",
        "segment",
        "ops",
        "parameters",
        "forward GFLOPs",
        "activations MiB",
        "sent onward MiB",
    ):
        table.add_column(column, justify="left" if column == "segment" else "right")
    for first, last, s in _runs(graph.segments()):
        label = (
            s.name
            if first == last
            else f"{s.name} .. {graph.segments()[last].name} (x{last - first + 1}, each)"
        )
        table.add_row(
            str(first) if first == last else f"{first}-{last}",
            label,
            str(len(s.ops)),
            views.count(s.param_count),
            f"{s.flops / 1e9:,.2f}",
            f"{s.activation_bytes / 2**20:,.1f}",
            f"{s.output_bytes / 2**20:,.2f}",
        )
    out.print(table)


def _runs(segments):
    """(first index, last index, segment) for runs of identical consecutive blocks; other segments
    alone."""

    def cost(s):
        return (s.is_block, len(s.ops), s.flops, s.param_count, s.activation_bytes, s.output_bytes)

    runs: list[list] = []
    for i, s in enumerate(segments):
        if runs and s.is_block and cost(runs[-1][2]) == cost(s):
            runs[-1][1] = i
        else:
            runs.append([i, i, s])
    return runs


def cmd_plan(args: argparse.Namespace, out: Console) -> None:
    """Search the best plan for a model on a cluster; print it, write it with -o."""
    from hyparallel import models
    from hyparallel.planner import PlanError, search, to_plan, with_goodput
    from hyparallel.planner.goodput import DEFAULT_RESTART_S, check_goodput_request
    from hyparallel.spec.cluster import ClusterSpec
    from hyparallel.spec.files import check_writable
    from hyparallel.tools import views

    if args.output:
        check_writable(args.output)  # before the search, not after it
    per_node = args.gpus_per_node
    base = ClusterSpec.resolve(args.cluster)
    per_node = per_node or min(base.gpus_per_node, args.gpus)
    if args.gpus % per_node:
        raise PlanError(
            f"--gpus {args.gpus} is not a multiple of --gpus-per-node {per_node}; use whole nodes"
        )
    cluster = base.resized(num_nodes=args.gpus // per_node, gpus_per_node=per_node)
    if args.mtbf is None and (args.restart_s is not None or args.checkpoint is not None):
        raise PlanError(
            "--restart-s and --checkpoint describe the checkpoint cost; add --mtbf HOURS to have it"
        )
    restart_s, storage = (
        (DEFAULT_RESTART_S if args.restart_s is None else args.restart_s),
        args.checkpoint or "disk",
    )
    if args.mtbf is not None:  # before the search, as the output path
        check_goodput_request(args.mtbf, restart_s, storage, cluster)
    compression = _compression_from_args(args)
    with (
        _logged(args.verbose),
        _progress(sys.stderr.isatty() and not args.json and not args.verbose) as progress,
    ):
        loaded = models.load(args.model)
        make_inputs = (
            models.load_callable(args.example_inputs, "example inputs")
            if args.example_inputs
            else None
        )
        seq_len = args.seq_len or _max_seq_len(loaded.module) or 2048
        progress("tracing", 0, 0)
        constraints = {
            k: getattr(args, k)
            for k in ("tp", "pp", "dp", "ep", "cp", "cp_attention")
            if getattr(args, k) is not None
        }
        constraints.update(compression)
        if args.no_vocab_parallel_loss:
            constraints["vocab_parallel_loss"] = False
        if args.expert_imbalance is not None:
            constraints["expert_imbalance"] = args.expert_imbalance
        if args.compile:
            constraints["compile"] = True
        result = search(
            loaded.module,
            cluster,
            args.global_batch,
            seq_len,
            args.dtype,
            example_inputs=make_inputs,
            name=loaded.name,
            top=max(args.top, 1),
            alternatives=args.top > 1,
            progress=progress,
            cache=not args.no_cache,
            ps_servers=args.ps_servers,
            **constraints,
        )
    plan = result.plan()
    if args.mtbf is not None:
        plan = with_goodput(plan, args.mtbf, restart_s=restart_s, storage=storage)
    if args.output:
        plan.save(args.output)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return
    _print_plan(plan, out)
    if args.top > 1 and result.best:
        _print_top(result, to_plan, out)
    if args.top > 1 and result.tables is not None:
        out.print(views.table_options(result.tables))
    out.print(
        f"searched {result.considered:,} configurations ({result.evaluated:,} costed exactly) in"
        f" {result.search_s:.2f}s"
        + (f"; wrote {args.output}" if args.output else "; pass -o plan.yaml to save it"),
        markup=False,
    )


def _compression_from_args(args: argparse.Namespace) -> dict:
    """--grad-compression and PowerSGD's flags as the planner's constraints; PowerSGD's flags need
    it allowed."""
    from hyparallel.planner import PlanError

    shaped = [
        flag
        for flag, value in (
            ("--powersgd-rank", args.powersgd_rank),
            ("--powersgd-start-step", args.powersgd_start_step),
        )
        if value is not None
    ]
    if shaped and args.grad_compression not in ("powersgd", "any"):
        raise PlanError(
            f"{' and '.join(shaped)} shape{'s' if len(shaped) == 1 else ''} PowerSGD, which"
            f" --grad-compression {args.grad_compression or 'none'} does not allow; add"
            " --grad-compression powersgd (or any)"
        )
    given = {
        "grad_compression": args.grad_compression,
        "powersgd_rank": args.powersgd_rank,
        "powersgd_start_step": args.powersgd_start_step,
    }
    return {k: v for k, v in given.items() if v is not None}


@contextlib.contextmanager
def _logged(verbose: bool):
    """With ``verbose``, hyparallel's loggers print on stderr at DEBUG level while the block
    runs."""
    if not verbose:
        yield
        return
    logger, handler = logging.getLogger("hyparallel"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def _progress(enabled: bool):
    """A progress(phase, done, total) callback: a transient bar on stderr when it is a terminal,
    else a no-op."""
    if not enabled:
        yield lambda phase, done, total: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total or None)
            bar.update(tasks[phase], completed=done, total=total or None)

        yield update


def _print_plan(plan, out: Console) -> None:
    from hyparallel.tools import views

    par, cluster = plan.parallel, plan.cluster
    out.print(
        f"{plan.model.name}: {views.count(plan.model.num_params)} parameters,"
        f" {plan.model.num_layers} layers, on {cluster.num_nodes} x {cluster.gpus_per_node}"
        f" {cluster.device.name} ({cluster.name})",
        markup=False,
    )
    mesh = " x ".join(f"{axis} {size}" for axis, size in plan.mesh_shape().items())
    out.print(
        f"mesh {mesh}; micro-batch {plan.training.micro_batch} x {plan.num_microbatches}; schedule"
        f" {par.schedule}"
        + (f" (v={par.virtual_stages})" if par.virtual_stages > 1 else "")
        + f"; recompute {par.recompute}; ZeRO {par.zero}; sequence parallel"
        f" {'on' if par.sequence_parallel else 'off'}"
        + (
            f"; loss {'vocab-parallel' if par.vocab_parallel_loss else 'on gathered logits'}"
            if par.tp > 1
            else ""
        )
        + (
            f"; gradient compression {views.compression(plan)}"
            if par.dp > 1 and plan.ps is None
            else ""
        ),
        markup=False,
    )
    if plan.ps is not None:
        out.print(views.ps_line(plan), markup=False, highlight=False)
    out.print(views.stage_table(plan))
    out.print(views.time_breakdown(plan))
    if line := views.compression_line(plan):
        out.print(line, markup=False, highlight=False)
    for line in views.checkpoint_lines(plan) if plan.checkpoint else ():
        out.print(line, markup=False, highlight=False)


def _print_top(result, to_plan, out: Console) -> None:
    from hyparallel.planner.api import why_slower

    table = Table(title=f"the {len(result.best)} best plans")
    for column in (
        "#",
        "tp",
        "pp",
        "dp",
        "ep",
        "cp",
        "rank order",
        "micro-batch",
        "schedule",
        "recompute",
        "ZeRO",
        "SP",
        "gradients",
        "step s",
        "saved s",
        "MFU",
        "peak GiB",
        "why not",
    ):
        table.add_column(column, justify="left" if column == "why not" else "right")
    winner = result.best[0]
    for rank, evaluation in enumerate(result.best):
        c, pred = evaluation.config, to_plan(result, evaluation).predicted
        schedule = c.schedule + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "")
        saved = (
            f"{pred.uncompressed.step_time_s - evaluation.step_time_s:.3f}"
            if pred.uncompressed
            else "-"
        )
        table.add_row(
            str(rank + 1),
            str(c.tp),
            str(c.pp),
            str(c.dp),
            str(c.ep),
            f"{c.cp} {c.cp_attention}" if c.cp > 1 else "1",
            ",".join(c.order),
            f"{c.micro_batch} x {c.num_microbatches}",
            schedule,
            c.recompute,
            str(c.zero),
            "on" if c.sequence_parallel else "off",
            c.compression if c.compressed else "-",
            f"{evaluation.step_time_s:.3f}",
            saved,
            f"{pred.mfu:.1%}",
            f"{max(pred.memory_gib):.1f}",
            "the pick" if rank == 0 else why_slower(evaluation, winner),
        )
    out.print(table)
    why = Table(title="why not the usual alternatives")
    for column in ("alternative", "tp", "pp", "dp", "ep", "cp", "why not"):
        why.add_column(column)
    for alt in result.alternatives:
        c = alt.evaluation.config if alt.evaluation else None
        why.add_row(
            alt.label,
            *(
                str(x) if c else "-"
                for x in ((c.tp, c.pp, c.dp, c.ep, c.cp) if c else (0, 0, 0, 0, 0))
            ),
            alt.why,
        )
    out.print(why)


def _max_seq_len(model) -> int | None:
    """The model's context (at most 2048), else its example_inputs' own default seq_len (1 for
    DLRM's samples)."""
    from hyparallel.planner.inputs import default_seq_len

    config = getattr(model, "config", None)
    for attr in ("max_seq_len", "n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return min(value, 2048)
    return default_seq_len(model)


def cmd_check(args: argparse.Namespace, out: Console) -> None:
    """Train a small copy under the layout in local gloo processes and compare with one process."""
    from hyparallel.tools.parity import check

    report = check(
        " ".join(args.model),
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        steps=args.steps,
        shrink=not args.as_given,
        **({"ep": args.ep} if args.ep > 1 else {}),
        **({"cp": args.cp} if args.cp > 1 else {}),
        timeout=args.timeout,
        loss=args.loss,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif report.verdict != "refused":
        out.print(report.table(), markup=False, highlight=False)
    if report.verdict == "refused":
        raise HyparallelError(
            f"{' x '.join(f'{k} {v}' for k, v in report.layout.items())}: refused: {report.reason}"
        )
    if report.verdict != "equal":
        raise SystemExit(1)


def cmd_demo(args: argparse.Namespace, out: Console) -> None:
    """Run the embedded default: plan GPT-3 175B for 1,024 A100s, then train a tiny model on the
    CPU."""
    from hyparallel.tools import demo

    demo.run(
        log=lambda text: out.print(text, markup=False, highlight=False),
        show_plan=lambda plan: _print_plan(plan, out),
    )


def cmd_checkpoint(args: argparse.Namespace, out: Console) -> None:
    """Consolidate a sharded checkpoint (saved under any plan) into one single-device state dict
    file."""
    from hyparallel.runtime import checkpoint

    written = checkpoint.export(
        args.path, args.out, format=args.format, max_shard_size=args.max_shard_size
    )
    files = sorted(written.iterdir()) if written.is_dir() else [written]
    size = sum(f.stat().st_size for f in files) / 2**20
    what = (
        f"{written}/ ({len(files)} files, {size:.1f} MiB)"
        if written.is_dir()
        else f"{written} ({size:.1f} MiB)"
    )
    out.print(f"wrote {what}", markup=False, highlight=False)


def cmd_calibrate(args: argparse.Namespace, out: Console) -> None:
    """Measure this machine's matmul, memory and collective speeds; print them and write a
    ClusterSpec."""
    from hyparallel.spec.files import check_writable
    from hyparallel.tools import calibrate

    if args.from_run is not None:
        _calibrate_from_run(args, out)
        return
    if args.model or args.cluster or args.switch_gain is not None:
        raise UsageError(
            "hyparallel calibrate", "--model, --cluster and --switch-gain go with --from-run FILE"
        )
    if args.out:
        check_writable(args.out)  # before minutes of measuring
    spec, measured = calibrate.calibrate(
        nproc=args.nproc,
        base=args.base,
        quick=args.quick,
        name=args.name,
        device=args.device,
        log=lambda text: out.print(text, markup=False, highlight=False),
    )
    if measured.rank != 0:
        return  # under torchrun rank 0 reports for everyone
    out.print(calibrate.measurements_table(measured))
    if args.out:
        calibrate.write(spec, measured, args.out)
        out.print(
            f"wrote {args.out}; plan with it: hyparallel plan --cluster {args.out} --gpus"
            f" {spec.gpus_per_node} ...",
            markup=False,
            highlight=False,
        )
    else:
        print(calibrate.cluster_yaml(spec, measured), end="")


def _calibrate_from_run(args: argparse.Namespace, out: Console) -> None:
    """`calibrate --from-run`: fit the run's cluster to its measured steps, write it with --out, and
    re-plan."""
    from hyparallel.planner import online
    from hyparallel.spec.files import check_writable

    given = [
        flag for flag in ("nproc", "base", "name", "device") if getattr(args, flag) is not None
    ]
    if given or args.quick:
        flags = ", ".join(f"--{flag}" for flag in given + (["quick"] if args.quick else []))
        raise UsageError(
            "hyparallel calibrate", f"{flags}: for measuring this machine, not with --from-run"
        )
    if args.out:
        check_writable(args.out)
    result = online.from_run(
        args.from_run,
        out=args.out,
        model=" ".join(args.model) if args.model else None,
        cluster=args.cluster,
    )
    gain = online.DEFAULT_SWITCH_GAIN if args.switch_gain is None else args.switch_gain
    out.print(result.line(gain), markup=False, highlight=False, soft_wrap=True)
    if not args.out:
        print(result.cluster.to_yaml(), end="")


def cmd_simulate(args: argparse.Namespace, out: Console) -> None:
    """Simulate one training step of a plan's pipeline schedule; draw it with --out, else print it
    as text."""
    from hyparallel.pipeline.schedule import format_schedule, lower, schedule, simulate
    from hyparallel.planner.timeline import timeline
    from hyparallel.spec.schema import Plan

    if args.out:
        from hyparallel.tools.pictures import check_picture_path

        check_picture_path(args.out)  # before simulating, not after
    plan = Plan.load(args.plan)
    result = timeline(plan)
    if result.units == "seconds":
        step = f"simulated step {result.total_s:.4g}s (planner: {result.predicted_step_s:.4g}s)"
    else:
        step = (
            f"simulated step {result.total_s:g} relative units (forward 1, backward 2: the plan has"
            " no planner timings)"
        )
    bubbles = ", ".join(
        f"{rank} {fraction:.0%}" for rank, fraction in result.bubble_fraction.items()
    )
    summary = f"{step}; bubble per rank {bubbles}"
    if args.out:
        from hyparallel.tools.pictures import render_timeline

        drawn = render_timeline(result, args.out)
        out.print(summary, markup=False, highlight=False, soft_wrap=True)
        out.print(
            f"wrote {drawn.path} ({drawn.compute_bars} forward and backward blocks)",
            markup=False,
            highlight=False,
        )
        return
    par = plan.parallel
    steps = simulate(
        lower(
            schedule(par.schedule, par.pp, plan.num_microbatches, par.virtual_stages),
            par.pp,
            par.virtual_stages,
        ),
        par.pp,
        par.virtual_stages,
    )
    lines = format_schedule(steps.timeline).splitlines()
    cut = any(len(line) > out.width for line in lines)
    out.print(
        "\n".join(
            line[: out.width - 2] + " ~" if len(line) > out.width else line for line in lines
        ),
        markup=False,
        highlight=False,
    )
    out.print(
        f"unit steps, '.' idle ({steps.steps} steps{', cut at the console width' if cut else ''});"
        f" {summary}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    out.print(
        "pass --out timeline.png (or .svg) for the timed picture of the step",
        markup=False,
        highlight=False,
    )


class UsageError(HyparallelError):
    """A command line argparse refuses; ``prog`` is the (sub)command whose ``--help`` explains
    it."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (a UsageError), not its usage block on stderr and
    SystemExit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def _int_in(high: int, low: int = 1) -> Callable[[str], int]:
    """An argparse ``type`` for an integer flag from ``low`` to ``high`` (the bounds of
    hyparallel.spec.limits)."""
    what = (
        f"a positive integer up to {high:,}" if low == 1 else f"an integer from {low:,} to {high:,}"
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise argparse.ArgumentTypeError(f"expected {what}, got '{shown}'")
        return value

    return parse


def _float_in(
    high: float, unit: str, positive: bool = False, low: float = 0.0
) -> Callable[[str], float]:
    """An argparse ``type`` for a number of ``unit`` from ``low`` (0 excluded when ``positive``)
    to ``high``."""
    what = (
        f"a number of {unit} " + ("above 0" if positive else f"from {low:g}") + f" up to {high:g}"
    )

    # Named apart from _int_in's `parse`: tests/test_fuzz_cli.py finds integer flags by that name.
    def parse_float(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan  # refused below, as inf is
        if not (0 < value <= high if positive else low <= value <= high):
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise argparse.ArgumentTypeError(f"expected {what}, got '{shown}'")
        return value

    return parse_float


DEVICES, PER_NODE = _int_in(limits.MAX_DEVICES), _int_in(limits.MAX_GPUS_PER_NODE)
SEQUENCES, SEQ_LEN = _int_in(limits.MAX_GLOBAL_BATCH), _int_in(limits.MAX_SEQ_LEN)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand; its errors raise :class:`UsageError`."""
    parser = _Parser(
        prog="hyparallel", description="Hybrid-parallel model partitioning for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable, help_text: str) -> argparse.ArgumentParser:
        command = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.set_defaults(func=func)
        return command

    add("models", cmd_models, "List the built-in models.").add_argument(
        "--json", action="store_true", help="print JSON"
    )
    add("clusters", cmd_clusters, "List the cluster presets.").add_argument(
        "--json", action="store_true", help="print JSON"
    )
    show = add(
        "show", cmd_show, "Check a plan file and print it, with the derived fields completed."
    )
    show.add_argument("plan", help="plan YAML file")
    show.add_argument("--yaml", action="store_true", help="print the completed plan as YAML")
    show.add_argument(
        "--model",
        nargs="+",
        metavar="MODEL",
        default=None,
        help=(
            "plan what a hand-written plan leaves open (stages, tensor-parallel map, predictions)"
            " for this model, as parallelize does; a name, package.module:factory or hf:ARCH, then"
            " key=value overrides"
        ),
    )
    trace = add(
        "trace",
        cmd_trace,
        "Trace a model on the meta device: parameters, FLOPs, blocks, cut points.",
    )
    trace.add_argument(
        "--model",
        nargs="+",
        required=True,
        metavar="MODEL",
        help=(
            "a name from `hyparallel models`, package.module:factory, or hf:ARCH, then key=value"
            " overrides"
        ),
    )
    trace.add_argument(
        "--batch-size", type=SEQUENCES, default=1, help="sequences per traced call (default 1)"
    )
    trace.add_argument(
        "--seq-len",
        type=SEQ_LEN,
        default=None,
        help="tokens per sequence (default: the model's, at most 2048)",
    )
    trace.add_argument("--json", action="store_true", help="print JSON on stdout and nothing else")
    plan = add(
        "plan",
        cmd_plan,
        "Find the fastest data x tensor x pipeline plan that fits memory, and write it as YAML.",
    )
    plan.add_argument(
        "--model",
        nargs="+",
        required=True,
        metavar="MODEL",
        help=(
            "a name from `hyparallel models`, package.module:factory, or hf:ARCH, then key=value"
            " overrides"
        ),
    )
    plan.add_argument(
        "--gpus", type=DEVICES, required=True, help="number of GPUs (processes) in all"
    )
    plan.add_argument(
        "--gpus-per-node",
        type=PER_NODE,
        default=None,
        help="GPUs per node (default: the cluster preset's)",
    )
    plan.add_argument(
        "--cluster",
        default="a100-80g",
        help="a preset from `hyparallel clusters` or a YAML file (default a100-80g)",
    )
    plan.add_argument(
        "--global-batch",
        type=SEQUENCES,
        default=512,
        help="sequences per optimizer step (default 512)",
    )
    plan.add_argument(
        "--seq-len",
        type=SEQ_LEN,
        default=None,
        help="tokens per sequence (default: the model's, at most 2048)",
    )
    plan.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="training precision (default bf16)",
    )
    for axis in ("tp", "pp", "dp"):
        plan.add_argument(f"--{axis}", type=DEVICES, default=None, help=f"fix the {axis} degree")
    plan.add_argument(
        "--ep",
        type=DEVICES,
        default=None,
        help=(
            "fix the expert-parallel degree (MoE experts over ep of the dp ranks; default: searched"
            " for a model with MoE layers)"
        ),
    )
    plan.add_argument(
        "--cp",
        type=DEVICES,
        default=None,
        help=(
            "fix the context-parallel degree (each sequence over cp ranks; default: searched for a"
            " model it can split)"
        ),
    )
    plan.add_argument(
        "--cp-attention",
        choices=("gather", "ring"),
        default=None,
        help="fix how attention crosses the cp ranks (default: the faster, searched)",
    )
    plan.add_argument(
        "--example-inputs",
        default=None,
        metavar="package.module:make_inputs",
        help=(
            "for a model without an example_inputs(batch_size, seq_len, device) method: a function"
            " make_inputs(batch_size, seq_len) returning one micro-batch of its inputs (a tensor, a"
            " tuple of args or a dict of kwargs) with the same meaning; the planner traces"
            " make_inputs(1, seq_len), and parallelize takes"
            " example_inputs=make_inputs(micro_batch, seq_len); token ids must be seq_len long,"
            " other inputs (images, audio features) are taken as they are. Hugging Face models need"
            " none: token ids, pixel_values or input_features by their config"
        ),
    )
    plan.add_argument(
        "--no-cache",
        action="store_true",
        help=(
            "trace the model again instead of reading its traced graph from the cache "
            "($HYPARALLEL_CACHE_DIR, else ~/.cache/hyparallel)"
        ),
    )
    plan.add_argument(
        "--top",
        type=_int_in(limits.MAX_TOP),
        default=1,
        help=(
            f"list the K best plans (at most {limits.MAX_TOP}) and why the usual alternatives lost"
        ),
    )
    plan.add_argument(
        "--grad-compression",
        choices=("none", "bf16", "fp16", "powersgd", "any"),
        default=None,
        help=(
            "how the data-parallel gradients are reduced: none (fp32, the default: compression"
            " changes the numerics), bf16 or fp16 (16-bit reductions, and 16-bit ZeRO gathers in"
            " 16-bit training), powersgd (low-rank, ZeRO 0 only), or any: the planner picks the"
            " fastest (docs/cost-model.md, 'Gradient compression')"
        ),
    )
    plan.add_argument(
        "--powersgd-rank",
        type=_int_in(limits.MAX_POWERSGD_RANK),
        default=None,
        metavar="N",
        help="with --grad-compression powersgd or any: the rank of PowerSGD's factors (default 4)",
    )
    plan.add_argument(
        "--powersgd-start-step",
        type=_int_in(limits.MAX_POWERSGD_START_STEP, low=2),
        default=None,
        metavar="N",
        help=(
            "with --grad-compression powersgd or any: steps reduced uncompressed before PowerSGD"
            " starts (default 1000)"
        ),
    )
    plan.add_argument(
        "--expert-imbalance",
        type=_float_in(limits.MAX_EXPERT_IMBALANCE, "times the mean load", low=1.0),
        default=None,
        metavar="X",
        help=(
            "the busiest expert-parallel rank's routed tokens over the mean, as a run measured it"
            " (pmodel.expert_imbalance(); default 1.2): what every MoE layer waits for"
        ),
    )
    plan.add_argument(
        "--no-vocab-parallel-loss",
        action="store_true",
        help=(
            "gather the logits for the loss (any loss_fn then works; tp times the loss's memory),"
            " instead of the vocab-parallel cross-entropy the planner sets wherever tp splits the"
            " head"
        ),
    )
    plan.add_argument(
        "--compile",
        action="store_true",
        help=(
            "write parallel.compile: true, so that parallelize runs each block under torch.compile"
            " (backend: $HYPARALLEL_COMPILE_BACKEND, else inductor); the predicted times do not"
            " count it"
        ),
    )
    plan.add_argument(
        "--ps-servers",
        type=_int_in(limits.MAX_DEVICES, low=0),
        default=None,
        metavar="N",
        help=(
            "plan parameter-server mode: the embedding tables and dense weights on N server"
            " processes, one worker per GPU (tp = pp = 1); 0 keeps the tables on the GPUs; without"
            " it a recommendation model gets whichever of servers and GPUs is faster"
        ),
    )
    plan.add_argument("-o", "--output", default=None, help="write the plan YAML here")
    plan.add_argument(
        "--json", action="store_true", help="print the plan as JSON on stdout and nothing else"
    )
    plan.add_argument(
        "--verbose",
        action="store_true",
        help="log the search on stderr: its phases and every configuration costed",
    )
    plan.add_argument(
        "--mtbf",
        type=_float_in(limits.MAX_MTBF_HOURS, "hours", positive=True),
        default=None,
        metavar="HOURS",
        help=(
            "the job's mean time between failures: add the checkpoint cost, the checkpoint interval"
            " that maximises goodput and the expected goodput to the plan (docs/cost-model.md)"
        ),
    )
    plan.add_argument(
        "--restart-s",
        type=_float_in(limits.MAX_RESTART_S, "seconds"),
        default=None,
        metavar="S",
        help=(
            "with --mtbf: seconds from a failure to training again, the checkpoint's load included"
            " (default 60)"
        ),
    )
    plan.add_argument(
        "--checkpoint",
        choices=("memory", "disk"),
        default=None,
        help=(
            "with --mtbf: how hp.checkpoint.save stores checkpoints: memory (blocks for the host"
            " copy; written to disk in the background) or disk (blocks for the write; the default)"
        ),
    )
    check = add(
        "check",
        cmd_check,
        "Check that a layout gives the single-device numbers for a model: a small copy, trained a"
        " few steps in local gloo processes and in one, every gradient and loss compared.",
    )
    check.add_argument(
        "model",
        nargs="+",
        metavar="MODEL",
        help=(
            "a name from `hyparallel models`, package.module:factory, or hf:ARCH, then key=value"
            " overrides (hf: the config class shrunk, your overrides on top; others: pass small"
            " sizes)"
        ),
    )
    for axis, default in (("tp", 2), ("pp", 2), ("dp", 1)):
        check.add_argument(
            f"--{axis}",
            type=PER_NODE,
            default=default,
            help=f"the {axis} degree (default {default})",
        )
    check.add_argument(
        "--ep",
        type=PER_NODE,
        default=1,
        help=(
            "the expert-parallel degree (default 1): each MoE layer's experts split over ep of the"
            " dp ranks; ep divides dp"
        ),
    )
    check.add_argument(
        "--cp",
        type=PER_NODE,
        default=1,
        help=(
            "the context-parallel degree (default 1): each sequence split over cp ranks (dp x cp x"
            " tp x pp processes in all)"
        ),
    )
    check.add_argument(
        "--steps", type=_int_in(100), default=3, help="SGD steps compared (default 3)"
    )
    check.add_argument(
        "--as-given", action="store_true", help="build hf: models as given, not shrunk"
    )
    check.add_argument(
        "--loss",
        default=None,
        metavar="package.module:fn",
        help=(
            "the loss you train with, fn(output, targets) -> a scalar mean (targets: class ids over"
            " the logits' last dim, else floats shaped like the output's first tensor); default"
            " token cross-entropy on the logits"
        ),
    )
    check.add_argument(
        "--timeout", type=_int_in(3600), default=600, help="seconds for the launch (default 600)"
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    add(
        "demo",
        cmd_demo,
        "The embedded default: plan GPT-3 175B for 1,024 A100s, then train a tiny model on the"
        " CPU.",
    )
    ckpt = add(
        "checkpoint",
        cmd_checkpoint,
        "Consolidate a sharded checkpoint into one single-device state dict.",
    )
    ckpt.add_argument("action", choices=("export",), help="what to do (export)")
    ckpt.add_argument(
        "path", help="a checkpoint directory (its newest complete checkpoint) or one step-* folder"
    )
    ckpt.add_argument(
        "out",
        help=(
            "output: a .safetensors file; a folder (a name without suffix, ending in /, or an"
            " existing folder) for a Hugging Face folder of an hf: model; any other name a"
            " torch.save file"
        ),
    )
    ckpt.add_argument(
        "--format",
        choices=("auto", "hf", "safetensors", "torch"),
        default="auto",
        help="what to write, whatever OUT's name (default auto: by the name, as above)",
    )
    ckpt.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="a Hugging Face folder's largest safetensors file (default 5GB; e.g. 500MB)",
    )
    calibrate = add(
        "calibrate",
        cmd_calibrate,
        "Measure this machine (matmul, memory, collectives) and write a ClusterSpec.",
    )
    calibrate.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the ClusterSpec YAML here (default: print it)",
    )
    calibrate.add_argument(
        "--nproc",
        type=PER_NODE,
        default=None,
        metavar="N",
        help=(
            "local processes to measure with "
            "(default: the GPU count on CUDA, else 8; torchrun's world inside a launch)"
        ),
    )
    calibrate.add_argument(
        "--base",
        default=None,
        metavar="PRESET",
        help=(
            "keep this preset's (or YAML file's) datasheet peaks and memory; set efficiencies from"
            " the measurements"
        ),
    )
    calibrate.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and shorter timings: seconds, less accurate",
    )
    calibrate.add_argument(
        "--name", default=None, help="the cluster's name (default calibrated-<hostname>)"
    )
    calibrate.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help=(
            "what to measure: the GPUs (nccl) or the CPU (gloo processes); default cuda when torch"
            " sees a GPU"
        ),
    )
    calibrate.add_argument(
        "--from-run",
        default=None,
        metavar="METRICS.json",
        help=(
            "measure nothing: fit the cluster of a run's plan to its measured steps (the file"
            " examples/train_gpt.py --metrics-out writes), write it with --out, and re-plan under"
            " it (docs/cost-model.md, 'Online calibration')"
        ),
    )
    calibrate.add_argument(
        "--model",
        nargs="+",
        default=None,
        metavar="MODEL",
        help="with --from-run: the model spec to re-plan (default: the one the run recorded)",
    )
    calibrate.add_argument(
        "--cluster",
        default=None,
        metavar="PRESET|FILE",
        help=(
            "with --from-run: the cluster to correct (default: the run's plan's; the same devices"
            " and backend)"
        ),
    )
    calibrate.add_argument(
        "--switch-gain",
        type=_float_in(1.0, "fraction"),
        default=None,
        metavar="FRACTION",
        help=(
            "with --from-run: suggest another plan when it is predicted faster by more than this"
            " (default 0.05)"
        ),
    )
    simulate = add(
        "simulate",
        cmd_simulate,
        "Simulate one training step of a plan's pipeline schedule and draw it.",
    )
    simulate.add_argument(
        "plan",
        help=(
            "plan YAML file (from `hyparallel plan`, for seconds and GiB; a hand plan is drawn in"
            " relative units)"
        ),
    )
    simulate.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the picture here: .png or .svg (default: print the schedule as text)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hyparallel`` console script; returns the exit status (2 for a user
    error)."""
    try:
        args, extra = build_parser().parse_known_args(argv)
        # named here, not by the top-level parser, so the message points at the subcommand's --help
        if extra:
            raise UsageError(
                f"hyparallel {args.command}", f"unrecognized arguments: {' '.join(extra)}"
            )
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc}; see {exc.prog} --help", file=sys.stderr)
        return 2
    try:
        # Piped output gets a wide console: tables are read in logs and files, not wrapped at 80
        # columns.
        args.func(args, Console(width=None if sys.stdout.isatty() else 160))
    except HyparallelError as exc:
        print(f"hyparallel: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
