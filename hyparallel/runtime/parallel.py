"""``parallelize(model, plan) -> ParallelModel``: data x tensor x pipeline parallelism under
torchrun.

    # in every process of `torchrun --nproc_per_node N`
    pmodel = hp.parallelize(model, plan)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=3e-4)
    loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets), loss_fn)
    opt.step(); opt.zero_grad()

``parallelize`` reads top to bottom as a line of passes (Note [what parallelize does]), each a
function with explicit inputs: trace -> check_plan -> planner.complete -> mesh ->
apply_tensor_parallel -> split -> materialize -> apply_recompute -> apply_compile ->
apply_data_parallel. ``ParallelModel`` holds what they built and steps it.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyparallel.graph import ModelGraph, trace
from hyparallel.graph.checks import (
    batch_statistics,
    batch_statistics_warning,
    check_plan,
    check_world_size,
)
from hyparallel.graph.local_shapes import block_modules
from hyparallel.graph.tracer import call_with, tracing_device
from hyparallel.pipeline.executor import PipelineRuntime, chunk_tree
from hyparallel.pipeline.forward import ForwardPipelines, sequence_divides
from hyparallel.pipeline.split import split_model
from hyparallel.planner import complete
from hyparallel.planner.inputs import token_ids
from hyparallel.runtime import launch
from hyparallel.runtime.compile import apply_compile, compile_backend_of
from hyparallel.runtime.context import ContextParallel, check_context_parallel
from hyparallel.runtime.data import DataPosition, DataSampler
from hyparallel.runtime.data_parallel import DataParallel, apply_data_parallel, micro_batch_hook
from hyparallel.runtime.experts import ExpertParallel, apply_expert_parallel
from hyparallel.runtime.loss import (
    IGNORE_INDEX,
    LossScaler,
    MicroBatchLoss,
    default_loss,
    detached_loss,
    global_loss,
    hook_optimizer_steps,
    scale_step_gradients,
    token_cross_entropy,
    user_loss,
)
from hyparallel.runtime.loss import logits_or_output as _logits
from hyparallel.runtime.recompute import apply_recompute
from hyparallel.runtime.router_loss import global_router_loss, traced_with
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.schema import LossFn, Plan
from hyparallel.tensor.apply import TensorParallelInfo, apply_tensor_parallel, check_local_shapes
from hyparallel.tensor.init import materialize_, refuse_unrecoverable_buffers
from hyparallel.tensor.layers import VocabParallelHead, whole_sequences

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

__all__ = ["IGNORE_INDEX", "LaunchEnv", "ParallelModel", "parallelize", "token_cross_entropy"]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK; one process
    without them)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        """Read the launch from the environment (torchrun sets it), or from an initialised process
        group."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), local_rank)
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), local_rank)


# Note [what parallelize does]
# 1. Trace once (Note [one trace]), then check the plan against the launch and the trace with no
#    process group touched (hyparallel.graph.checks.check_plan): WORLD_SIZE = dp * tp * pp (the
#    arithmetic and the fix in the message), the model is the one planned (parameter names and
#    shapes, by fingerprint), the plan's dimensions divide the model's, a hand-written stage map or
#    tensor_parallel map names this model's modules and splits only what its dataflow allows.
# 2. A plan written by hand with only `training` and `parallel` gets its stages and tensor_parallel
#    map from the planner (hyparallel.planner.complete) with every degree and strategy it states
#    fixed. With tp > 1 a meta copy then runs once at one rank's sizes (Note [one rank's sizes, run
#    on meta], hyparallel.tensor.apply): a module that sizes its tensors by the model's constants is
#    refused here, not inside torch on every rank.
# 3. init_device_mesh(device, shape, mesh_dim_names=placement.order): tp innermost by default. The
#    sub-meshes (`pmodel.mesh["dp"]`, ...) work with any torch API that takes a DeviceMesh.
# 4. Tensor parallelism swaps modules on the (meta) model; pipeline stages are cut from the swapped
#    model and each rank materialises only its stages' slices, from the same per-parameter random
#    streams a single device would use (`seed`): any plan of the same model starts from the same
#    weights.
# 5. Recomputation wraps each repeated block (pp = 1) or stage graph (pp > 1):
#    hyparallel.runtime.recompute. Under parallel.compile, torch.compile then compiles the same
#    regions' forwards: hyparallel.runtime.compile.
# 6. Data parallelism on the dp axis (hyparallel.runtime.data_parallel): DDP or the bucketed
#    all-reduce for ZeRO 0, FSDP2 for ZeRO 1-3.

# Note [one trace]
#     parallelize traces the model once, with one micro-batch (the caller's example_inputs, or token
#     ids of the plan's micro_batch x seq_len). That ModelGraph is what check_plan checks, what the
#     planner completes the plan from, what tensor parallelism splits by (its `structure`, computed
#     once) and, when nothing was swapped (tp = 1), what the pipeline cuts into stages. With tp > 1
#     and pp > 1 the swapped model is traced a second time: its per-rank shapes (heads, widths) and
#     collectives are what the stages run, and only a trace of the swapped modules has them.


def parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    example_inputs: Any = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    compile_backend: str | None = None,
) -> ParallelModel:
    """Run ``model`` as ``plan`` says, in every process of a torchrun launch; see Note [what
    parallelize does].

    Every check runs before the first collective (a plan that does not fit the model or the launch
    is refused in one line); then tensor parallelism, pipeline stages, recomputation, compilation
    and data parallelism are applied in turn. Under a plan with ``parallel.vocab_parallel_loss``
    (the planner's default wherever tp splits the head) ``train_step``'s default loss is token
    cross-entropy computed without gathering the logits; calling the model (``pmodel(inputs)``)
    returns the whole logits either way.

    Args:
        model: the model, best built on the meta device (``hp.models.build(name)``): no rank then
            allocates more than its share, initialised deterministically from ``seed``.
        plan: a :class:`~hyparallel.spec.schema.Plan` (``hp.plan(...)``, or
            ``Plan.load("plan.yaml")``); one with only ``training`` and ``parallel`` is completed by
            the planner.
        example_inputs: one micro-batch for tracing: a tensor, a tuple of args or a dict of kwargs
            (default: token ids of the plan's ``micro_batch x seq_len``).
        seed: the seed of every parameter's random stream: any plan of the same model starts from
            the same weights.
        device: the rank's device; default the CPU for a gloo cluster's plan, else cuda:LOCAL_RANK
            when there is a GPU (Note [which device a rank uses]).
        compile_backend: the torch.compile backend of a plan with ``parallel.compile`` (default
            ``$HYPARALLEL_COMPILE_BACKEND``, else inductor; hyparallel.runtime.compile).

    Returns:
        The :class:`ParallelModel` of this rank: ``train_step``, ``eval_step``, ``pmodel(inputs)``,
        ``sampler``, ``state_dict`` and the checkpoint functions take it.

    Raises:
        ConfigError: the plan and the launch or the model disagree (world size, dimensions that do
            not divide, a split the analysis cannot prove), in one line naming what and where,
            before any collective.

    Example::

        model = hp.models.build("gpt-tiny")  # meta device
        pmodel = hp.parallelize(model, hp.Plan.load("configs/plans/cpu-dp2-tp2-pp2.yaml"))
        optimizer = torch.optim.AdamW(pmodel.parameters(), lr=3e-4)
        sampler = pmodel.sampler(dataset)  # this rank's rows of each global batch
        for inputs, targets in DataLoader(dataset, batch_size=sampler.share, sampler=sampler):
            loss = pmodel.train_step(inputs, targets)  # the single device's loss
            optimizer.step(); optimizer.zero_grad()
    """
    env = LaunchEnv.from_environ()
    # before the trace: a launch of the wrong size is refused at once
    check_world_size(plan, env.world_size)
    if plan.ps is not None:  # parameter-server mode: this rank's role (hyparallel.runtime.ps.roles)
        from hyparallel.runtime.ps.roles import parallelize_ps

        return parallelize_ps(model, plan, env.rank, env.world_size)
    device = (
        rank_device(device, env.local_rank) if device is not None else default_device(env, plan)
    )
    # Note [exported for the device it runs on] (hyparallel.graph.tracer)
    with tracing_device(device):
        return _parallelize(
            model,
            plan,
            env=env,
            device=device,
            example_inputs=example_inputs,
            seed=seed,
            compile_backend=compile_backend,
        )


def _parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    env: LaunchEnv,
    device: torch.device,
    example_inputs: Any,
    seed: int,
    compile_backend: str | None = None,
) -> ParallelModel:
    """The line of passes (Note [what parallelize does]): one trace, every check, then each
    ``apply_*`` in turn."""
    # a bad name: refused before the trace
    backend = compile_backend_of(plan.parallel.compile, compile_backend)
    example = example_inputs if example_inputs is not None else token_ids(plan)
    graph = trace(model, example)  # Note [one trace]
    plan, styles = check_before_launch(
        model, plan, graph, env=env, device=device, example=example, example_inputs=example_inputs
    )
    par = plan.parallel
    # Note [context parallelism] (hyparallel.runtime.context): what the trace shows, refused here
    sites = check_context_parallel(model, plan, graph) if par.cp > 1 else []
    mesh = init_mesh(plan, env, device)  # the first collective
    tp_info = None
    if par.tp > 1:
        tp_info = apply_tensor_parallel(
            model,
            styles,
            mesh["tp"].get_group(),
            graph,
            sequence_parallel=par.sequence_parallel,
            gather_logits=not par.vocab_parallel_loss,
            fused_kernels=par.fused_kernels,
        )
    # Note [expert parallelism] (hyparallel.runtime.experts): on the meta model, before it is
    # materialised
    experts = apply_expert_parallel(model, graph, mesh, par.ep)
    # Note [the router's auxiliary loss over dp]: before a pipeline's stages are traced
    data_plan, data_mesh = gradient_sharing(plan, mesh)
    router_loss = data_plan.parallel.dp > 1 and global_router_loss(model, data_mesh.get_group())
    context = (
        ContextParallel(model, mesh["cp"].get_group(), par.cp_attention, sites)
        if par.cp > 1
        else None
    )
    autocast = Autocast(device, _DTYPES[plan.training.dtype])
    model, modules, blocks, pipeline = apply_stages(
        model,
        plan,
        mesh=mesh,
        example=example,
        graph=graph,
        # the first trace has none of the three
        swapped=tp_info is not None or experts is not None or router_loss,
        device=device,
        seed=seed,
        autocast=autocast,
    )
    apply_recompute(
        modules if pipeline is not None else blocks,
        par.recompute,
        plan.training.seq_len,
        split_attention=context is not None,
    )
    # the recomputed regions, each with its checkpoint (hyparallel.runtime.compile)
    if backend is not None:
        apply_compile(blocks or modules, backend)
    data_parallel = apply_data_parallel(
        modules,
        data_plan,
        data_mesh,
        device,
        blocks=blocks,
        pipelined=pipeline is not None,
        unused=unused_parameters(model, graph),
        find_unused=bool(graph.params_outside_logits),
        experts=experts,
    )
    return ParallelModel(
        model=model,
        plan=plan,
        env=env,
        device=device,
        mesh=mesh,
        graph=graph,
        example=example,
        modules=modules,
        tp_info=tp_info,
        pipeline=pipeline,
        data_parallel=data_parallel,
        autocast=autocast,
        experts=experts,
        context=context,
        data_mesh=data_mesh,
        # tp > 1 and a vocab-parallel head: check_plan saw to both
        vocab_parallel_loss=par.vocab_parallel_loss,
    )


def check_before_launch(
    model: nn.Module,
    plan: Plan,
    graph: ModelGraph,
    *,
    env: LaunchEnv,
    device: torch.device,
    example: Any,
    example_inputs: Any,
) -> tuple[Plan, dict]:
    """Every refusal parallelize makes, before the first collective: the plan as stated and as
    completed against the trace (check_plan), one rank's sizes run on meta, SyncBatchNorm's device,
    buffers with no value; warns of batch statistics a split changes. Returns the completed plan and
    its tensor-parallel styles."""
    check_plan(plan, graph, env.world_size)  # what the plan states, before anything is planned
    plan = complete(plan, graph, example_inputs=example_inputs, module=model)
    # the completed plan: its split modules and stages
    checked = check_plan(plan, graph, env.world_size)
    # Note [one rank's sizes, run on meta]
    check_local_shapes(model, graph, checked.styles, plan.parallel.tp, example)
    if message := batch_statistics_warning(plan, training_batch_statistics(model, graph)):
        # Note [batch statistics] (hyparallel.graph.checks)
        warnings.warn(message, UserWarning, stacklevel=3)
    check_sync_batchnorm(plan, device)
    # a meta buffer with no value: refused before any collective
    refuse_unrecoverable_buffers(model)
    return plan, checked.styles


def apply_stages(
    model: nn.Module,
    plan: Plan,
    *,
    mesh,
    example: Any,
    graph: ModelGraph,
    swapped: bool,
    device: torch.device,
    seed: int,
    autocast: Autocast,
) -> tuple[nn.Module, list[nn.Module], list[nn.Module], PipelineRuntime | None]:
    """This rank's share of the model, materialised on ``device``: its pipeline stages (pp > 1;
    ``swapped``: the model changed since ``graph`` was traced, by tensor or expert parallelism or
    the router loss over dp, so the stages are cut from a new trace), else
    the whole model (SyncBatchNorm converted when the plan asks). Returns the model, the modules
    that train here, the repeated blocks (pp = 1) and the pipeline engine (or None)."""
    if plan.parallel.pp > 1:
        pipeline = _pipeline(
            model, plan, mesh, example, None if swapped else graph, device, seed, autocast
        )
        return model, [stage.body for stage in pipeline.stages.values()], [], pipeline
    materialize(model, device, seed)
    if plan.parallel.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=mesh["dp"].get_group())
    blocks = [module for block in graph.blocks for module in block_modules(model, block.path)]
    return model, [model], blocks, None


def unused_parameters(model: nn.Module, graph: ModelGraph) -> list[str]:
    """Every name of each parameter the traced forward does not use or that does not reach its
    output: DDP collects a module's own parameters by name (Luke's entity decoder, tied to its
    unused entity embeddings, was waited for forever)."""
    read = {name for op in graph.ops for name in op.params}
    # the trace names a tied tensor by its first name
    first = {id(p): name for name, p in model.named_parameters()}
    return [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if first[id(p)] not in read or first[id(p)] in graph.unused_params
    ]


def training_batch_statistics(model: nn.Module, graph: ModelGraph) -> list[str]:
    """The paths of ``graph``'s batch-statistics modules (hyparallel.graph.checks.batch_statistics)
    in training mode.

    A path the model does not resolve (a traced name) counts as the model's own mode.
    """
    modules = dict(model.named_modules())
    return [path for path in batch_statistics(graph) if modules.get(path, model).training]


def check_sync_batchnorm(plan: Plan, device: torch.device) -> None:
    """``parallel.sync_batchnorm`` needs a device torch's SyncBatchNorm runs on: refused on the CPU,
    in one line."""
    if plan.parallel.sync_batchnorm and device.type == "cpu":
        raise ConfigError(
            "parallel.sync_batchnorm: torch.nn.SyncBatchNorm runs only on CUDA (or XPU) tensors,"
            " not on the CPU; run on GPUs, or set sync_batchnorm: false (per-rank batch statistics)"
        )


def init_mesh(plan: Plan, env: LaunchEnv, device: torch.device):
    """The default process group (if none yet) and the plan's DeviceMesh, axes in
    ``placement.order``."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        launch.init_process_group("nccl" if device.type == "cuda" else "gloo")
    shape = plan.mesh_shape()
    mesh = init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    # the mesh's groups too (Note [how long a collective may wait])
    if launch.current_timeout() is not None:
        launch.set_timeouts(launch.current_timeout())
    return mesh


def gradient_sharing(plan: Plan, mesh) -> tuple[Plan, Any]:
    """The plan as data parallelism sees it, and its mesh: dp x cp ranks sharing the weight
    gradients (Note [context parallelism], hyparallel.runtime.context), or the plan and its dp
    axis."""
    par = plan.parallel
    if par.cp == 1:
        return plan, mesh["dp"]
    shared = par.model_copy(update={"dp": par.dp * par.cp, "cp": 1})
    # torchtitan's dp_shard_cp: one group over both axes (``pmodel.data_mesh``)
    return plan.model_copy(update={"parallel": shared}), mesh["dp", "cp"]._flatten("dp_cp")


def materialize(
    model: nn.Module, device: torch.device, seed: int, only: set[str] | None = None
) -> None:
    """Allocate and initialise a meta model's tensors on ``device`` (``only``: just these names;
    else move it)."""
    state = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    if any(t.is_meta for name, t in state if only is None or name in only):
        materialize_(model, device, seed=seed, only=only)
    elif only is None:
        model.to(device)


def _pipeline(
    model: nn.Module,
    plan: Plan,
    mesh,
    example: Any,
    traced: ModelGraph | None,
    device: torch.device,
    seed: int,
    autocast: Autocast,
) -> PipelineRuntime:
    """Split this rank's stages out of ``model`` (cutting ``traced`` when given), materialise them,
    schedule them."""
    par, group = plan.parallel, mesh["pp"].get_group()
    with traced_with(model):  # Note [the router's auxiliary loss over dp]
        split = split_model(model, [stage.modules for stage in plan.stages], example, traced=traced)
    rank = mesh["pp"].get_local_rank()
    mine = [s for s in range(split.num_stages) if s % par.pp == rank]
    materialize(model, device, seed, only=split.state_names(mine))
    hook = micro_batch_hook(plan)
    return PipelineRuntime.for_plan(
        plan,
        split,
        {s: split.stage_module(s, device) for s in mine},
        group,
        stage_call=autocast.stage_call,
        before_backward=(lambda stage, last: hook(stage.body, last)) if hook is not None else None,
    )


class Autocast:
    """The plan's mixed precision around each forward: torch.autocast to ``dtype``, nothing for
    fp32."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype

    def __call__(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def stage_call(self, stage, inputs, received):
        """How the pipeline runs a stage's forward: under autocast."""
        with self():
            return stage(inputs, received)


class ParallelModel:
    """A model running under a plan in this process; build it with :func:`parallelize`."""

    def __init__(
        self,
        *,
        model: nn.Module,
        plan: Plan,
        env: LaunchEnv,
        device: torch.device,
        mesh,
        graph: ModelGraph,
        example: Any,
        modules: Sequence[nn.Module],
        tp_info: TensorParallelInfo | None,
        pipeline: PipelineRuntime | None,
        data_parallel: DataParallel,
        autocast: Autocast,
        vocab_parallel_loss: bool,
        experts: ExpertParallel | None = None,
        context: ContextParallel | None = None,
        data_mesh=None,
    ):
        from hyparallel.runtime.metrics import RunMetrics

        self.plan, self.env, self.device, self.module, self.mesh = plan, env, device, model, mesh
        self.tp_info, self.pipeline, self.data_parallel = tp_info, pipeline, data_parallel
        self.experts = experts  # Note [expert parallelism] (hyparallel.runtime.experts)
        self._grouped_experts = {
            layer.experts
            for layer in (experts.layers if experts else ())
            if layer.layout == "grouped"
        }
        self.dp_size, self.dp_rank = plan.parallel.dp, mesh["dp"].get_local_rank()
        # Note [context parallelism] (hyparallel.runtime.context): dp x cp ranks share the loss and
        # the gradients; the rows are dp's
        self.context = context
        self._data_size = plan.parallel.dp * plan.parallel.cp
        # the mesh flattened over dp x cp (kept: torch deprecates slicing it from the root mesh)
        self.data_mesh = data_mesh if data_mesh is not None else mesh["dp"]
        self._data_group = self.data_mesh.get_group()
        self._graph, self._modules, self._autocast = graph, list(modules), autocast
        self._dtype = autocast.dtype
        self._vocab_parallel_loss = vocab_parallel_loss
        self._split_heads = [
            m for m in model.modules() if isinstance(m, VocabParallelHead) and not m.gather_output
        ]
        self._ddp = data_parallel.ddp
        self._io = None
        self._started = False
        # fp16: dynamic loss scaling (Note [fp16 loss scaling]); its state goes into checkpoints
        self.scaler = LossScaler() if plan.training.dtype == "fp16" else None
        # an inf or NaN since the last optimizer step: skip the next one
        self._skip_optimizer_step = False
        # whether steps scale gradients after backward (unknown before one)
        self._scaled_after: bool | None = None
        # optimizer steps seen (Note [what a measured step is])
        self._optimizer_steps, self._measured_at = 0, -1
        self._forwards = self._forward_pipelines() if pipeline is not None else None
        self._own_ids = {id(p) for p in self.parameters()}
        self._optimizer_hooks = hook_optimizer_steps(self)
        self.metrics = RunMetrics(
            plan,
            graph.flops / max(_token_count(example), 1),
            device,
            pp_rank=mesh["pp"].get_local_rank(),
            rank=env.rank,
        )
        if self.experts is not None:  # the online fit and the run's record read the imbalance
            experts = self.experts
            # the last collective reading (pmodel.expert_imbalance), else this rank's own
            self.metrics.read_imbalance = lambda: (
                experts.loads.measured or experts.local_imbalance()
            )

    # ---- training --------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (its stages' tensor-parallel slices, sharded under ZeRO >= 1), for
        any optimizer."""
        seen: set[int] = set()
        for module in self._modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` under the original model's names, each parameter once."""
        seen: set[int] = set()
        for module in self._modules:
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def local_modules(self) -> list[nn.Module]:
        """The modules this rank runs: the model (pp = 1) or its pipeline stages' graphs, under
        original names."""
        return list(self._modules)

    def io_group(self):
        """A gloo group of every rank for background work (asynchronous checkpoints), made on first
        use.

        Every rank must call it at the same point, as for any new group.
        """
        if self._io is None:
            self._io = launch.background_group()
        return self._io

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors under the original model's names (local slices and shards as they
        are)."""
        state: dict[str, torch.Tensor] = {}
        for module in self._modules:
            state.update(module.state_dict())
        return state

    def shard(self, batch: Any) -> Any:
        """This data-parallel rank's rows of a global batch (dim 0 split into dp equal parts)."""

        def cut(value):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                return value
            if value.size(0) % self.dp_size:
                raise ConfigError(
                    f"a batch of {value.size(0)} rows does not split over dp = {self.dp_size}"
                    f" ranks; pass a multiple of {self.dp_size}"
                )
            return value.chunk(self.dp_size)[self.dp_rank]

        return torch.utils._pytree.tree_map(cut, batch)

    def sampler(
        self,
        dataset,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        train: bool = True,
    ):
        """This data-parallel rank's rows of each global batch of ``dataset``, for
        ``DataLoader(dataset, batch_size=sampler.share, sampler=sampler)``: the one way to feed a
        dataset (``shard`` cuts a batch already in memory to the same rows).

        The global batches are the same under any plan (Note [global batches, whatever the plan] in
        hyparallel/runtime/data.py). A training sampler (``train=True``) becomes
        ``pmodel.data_sampler``: train_step counts each batch it consumed, checkpoints save the
        position and ``hp.checkpoint.load`` resumes it, also when the sampler is made after the
        load. ``train=False`` is an evaluation sampler (pass ``shuffle=False``): it always starts at
        the first batch and is never counted or saved.
        """
        made = DataSampler(
            dataset,
            self.plan.training.global_batch,
            self.dp_size,
            self.dp_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            train=train,
        )
        if train:
            restored = getattr(self, "_restored_data_position", None)
            # hp.checkpoint.load ran first: resume where the checkpoint was
            if restored is not None:
                made.resume(restored)
                self._restored_data_position = None
            self._data_sampler = made
        return made

    def train_step(
        self, inputs: Any, targets: Any, loss_fn: LossFn | None = None, *, accumulate: int = 1
    ) -> torch.Tensor:
        """Forward and backward of this rank's batch; returns the global batch's loss, the same on
        every rank.

        ``inputs`` and ``targets`` are this data-parallel rank's rows (a ``pmodel.sampler``
        DataLoader's batch, or ``pmodel.shard`` of a global batch in memory); they split into the
        plan's micro-batches. Gradients are synchronised over data parallelism and completed over
        tensor parallelism: call the optimizer next. The loss is the single device's (Note [the loss
        a user reads], hyparallel.runtime.loss): by default token cross-entropy over every counted
        target of the global batch; a ``loss_fn(output, targets)`` returns a micro-batch's mean, or
        ``(total, count)`` for the exact mean of a loss whose rows weigh differently (padding, label
        smoothing). train_step runs the backward itself; the loss it returns has none left to run.
        Gradients add up over calls;
        ``accumulate=k`` divides this call's by k, so that k calls before the optimizer step train
        on the mean of the k batches' losses. fp16 plans scale the loss dynamically (Note [fp16 loss
        scaling]); the gradients left after train_step are unscaled, and an optimizer step after an
        inf or NaN is skipped.

        Args:
            inputs: this data-parallel rank's rows: a tensor, a tuple of args or a dict of kwargs.
            targets: their targets (token ids, -100 for targets not counted, under the default
                loss).
            loss_fn: ``loss_fn(output, targets)`` -> a micro-batch's mean, or ``(total, count)``;
                default token cross-entropy.
            accumulate: batches per optimizer step (this call's gradients are divided by it).

        Returns:
            The global batch's loss, a scalar with no backward left to run, equal on every rank and
            to one device's.

        Raises:
            ConfigError: rows that do not split into the plan's micro-batches, or a bad
                ``accumulate``.

        Example::

            loss = pmodel.train_step(inputs, targets)
            optimizer.step(); optimizer.zero_grad()
        """
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(
                f"train_step(accumulate={accumulate!r}): the number of batches per optimizer step,"
                " >= 1"
            )
        self._check_rows(inputs)
        self._open_measured_step(inputs)  # Note [what a measured step is]
        inputs, targets = _to(inputs, self.device), _to(targets, self.device)
        if not self._started:
            # once: a forgotten sampler feeds every dp rank the same rows
            self._warn_if_same_rows(inputs)
        if self.context is not None:  # this rank's chunks of every sequence
            inputs, targets, _ = self.context.cut(inputs, targets)
        rule = self._loss_rule(
            loss_fn, targets, self.plan.num_microbatches, sliced=self._vocab_parallel_loss
        )
        rule.backward_factor = (self.scaler.scale if self.scaler is not None else 1.0) / accumulate
        # Note [a step's own gradients]
        aside = self._set_aside_grads() if self._scaled_after is not False else {}
        before = (
            [self.tp_info.partial_grads(m) for m in self._modules]
            if self.tp_info is not None
            else []
        )
        with self._one_cast_per_step():
            if self.pipeline is not None:
                # the rule's reports: summed below
                self.pipeline.train_step(inputs, targets, rule, broadcast=False)
            else:
                self._accumulate(inputs, targets, rule)
        self.data_parallel.finish_step(
            self.named_parameters(),
            self.pipeline.shared_parameters() if self.pipeline is not None else (),
        )
        if self.experts is not None:  # over the ranks holding the same experts
            self.experts.reduce_grads(self.module)
        for module, since in zip(self._modules, before):
            self.tp_info.reduce_grads(module, since)
        loss, count, pair = global_loss(rule, self.device, self._loss_groups)
        self._finish_gradients(rule, count, pair, aside)
        if self.data_sampler is not None:
            self.data_sampler.step_consumed()
        # Note [how long a collective may wait]: started, from now on bounded tightly
        if not self._started:
            self._started = True
            launch.set_timeouts(
                launch.collective_timeout("nccl" if self.device.type == "cuda" else "gloo")
            )
            launch.set_phase("training")
        return detached_loss(loss)

    def _finish_gradients(
        self, rule: MicroBatchLoss, count: torch.Tensor, pair: bool, aside: dict
    ) -> None:
        """Scale the step's own gradients by what was known only after its backward, check them
        under fp16, and add back those of earlier calls (Note [a step's own gradients],
        hyparallel.runtime.loss)."""
        factor = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        count_after = pair and rule.global_count is None
        # a (total, count) loss: its sum's gradient over the global count (dp: averaged ranks)
        if count_after:
            factor *= self._data_size / max(float(count), 1.0)
        self._scaled_after = self.scaler is not None or count_after
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        inf = scale_step_gradients(
            grads, factor, check_finite=self.scaler is not None, device=self.device
        )
        if self.scaler is not None:  # Note [fp16 loss scaling] (hyparallel.runtime.loss)
            self.scaler.update(inf)
            self._skip_optimizer_step = self._skip_optimizer_step or inf
        for param, old in aside.items():
            param.grad = old if param.grad is None else param.grad.add_(old)

    def _set_aside_grads(self) -> dict[nn.Parameter, torch.Tensor]:
        """The gradients earlier calls left, taken off their parameters until the step's own are
        final."""
        aside = {p: p.grad for p in self.parameters() if p.grad is not None}
        for param in aside:
            param.grad = None
        return aside

    def _open_measured_step(self, inputs: Any) -> None:
        """A measured step runs from one optimizer step's first train_step to the next's (calls that
        accumulate are one step); before any optimizer step is seen (one hyparallel cannot hook),
        each call is one."""
        tokens = _token_count(inputs) * self.dp_size
        if self._optimizer_steps == 0 or self._optimizer_steps != self._measured_at:
            self.metrics.step_started(tokens)
            self._measured_at = self._optimizer_steps
        else:
            self.metrics.add_tokens(tokens)

    @torch.no_grad()
    def eval_step(
        self, inputs: Any, targets: Any = None, loss_fn: LossFn | None = None
    ) -> torch.Tensor:
        """The global batch's loss without gradients (validation), by train_step's rule, the same
        under any plan.

        ``inputs`` are any inputs the model's forward takes (a tensor, a tuple, or a dict with an
        attention mask or Hugging Face ``labels``), of any batch size that splits over dp: a
        pipeline traces its stages again for inputs it was not traced with (Note [a forward under
        any plan]). ``targets`` may be None with a ``loss_fn`` that reads the output alone (``lambda
        out, _: out.loss``). A ``loss_fn`` of your own sees the whole logits under a vocab-parallel
        plan too (gathered for it).
        """
        inputs, targets = _to(inputs, self.device), _to(targets, self.device)
        if self.context is not None:
            inputs, targets, _ = self.context.cut(inputs, targets)
        # the user's loss reads whole logits
        whole = loss_fn is not None and self._vocab_parallel_loss
        with self._whole_logits() if whole else nullcontext(), self._forward_only():
            if self.pipeline is None:
                rule = self._loss_rule(
                    loss_fn, targets, 1, sliced=self._vocab_parallel_loss and not whole
                )
                with self._attending() as attention:
                    with self._autocast(), self._whole_sequences_unless_divides(inputs):
                        output = call_with(self._ddp or self.module, inputs)
                    attention.checked()
                    rule(output, targets)
            else:
                runtime, m, gathered = self._forwards.select(
                    inputs, self._whole_logits, gather=whole
                )
                rule = self._loss_rule(
                    loss_fn, targets, m, sliced=self._vocab_parallel_loss and not gathered
                )
                with self._forwards.running(runtime):
                    runtime.eval_step(inputs, targets, rule, m, broadcast=False)
        return global_loss(rule, self.device, self._loss_groups)[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward under any plan: the single device's outputs (whole logits) on every
        rank.

        Under a pipeline every rank passes the same inputs (this data-parallel rank's rows); the
        last stage's outputs are broadcast to the others (``forward(..., broadcast=False)`` leaves
        them on the last stage).
        """
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, broadcast: bool = True, **kwargs: Any) -> Any:
        """:meth:`__call__`; with ``broadcast=False`` a pipeline's ranks other than the last stage's
        get None."""
        with self._whole_logits(), self._forward_only():
            bound = _bound_inputs(self.module, args, kwargs) if self.context is not None else None
            if self.context is not None and not self.context.cutter.splits(bound):
                # a length that does not cut into 2 cp chunks (generate's, one token at a time):
                # the whole sequence on every rank, as on one device
                inputs, _, _ = self.context.cut(bound, whole=True)
                sequences = self._whole_sequences_unless_divides(inputs)
                with self.context.attending(whole=True) as attention, self._autocast(), sequences:
                    output = (self._ddp or self.module)(**inputs)
                    attention.checked()
                return output
            if self.context is not None:  # each rank its chunks, the outputs gathered whole
                inputs, _, length = self.context.cut(bound)
                sequences = self._whole_sequences_unless_divides(inputs)
                with self._attending() as attention, self._autocast(), sequences:
                    output = (self._ddp or self.module)(**inputs)
                    attention.checked()
                return self.context.gather(output, length)
            if self.pipeline is None:
                with self._autocast(), self._whole_sequences_unless_divides((args, kwargs)):
                    return (self._ddp or self.module)(*args, **kwargs)
            return self._forwards.forward(
                _bound_inputs(self.module, args, kwargs), self._whole_logits, broadcast
            )

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
    ) -> torch.Tensor:
        """Greedy decoding under any plan: the tokens one device's argmax decoding gives, ``(B, T +
        new)``.

        Each new token runs the model over the whole sequence (no key/value cache: quadratic in the
        length, meant for checks and evaluation, not serving); under a pipeline traced by
        torch.export the stages are traced once with the length symbolic where the model allows
        (Note [one export for every length], hyparallel.graph.tracer), else once per length. Rows
        that produced ``eos_token_id`` continue with it.
        """
        tokens = input_ids.to(self.device)
        finished = torch.zeros(tokens.size(0), dtype=torch.bool, device=self.device)
        varying = self._forwards.lengths_vary() if self._forwards is not None else nullcontext()
        with varying:
            return self._generate(tokens, finished, max_new_tokens, eos_token_id)

    def _generate(
        self,
        tokens: torch.Tensor,
        finished: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        for _ in range(max_new_tokens):
            following = _logits(self(tokens))[:, -1, :].argmax(-1)
            if eos_token_id is not None:
                following = torch.where(
                    finished, torch.full_like(following, eos_token_id), following
                )
                finished |= following == eos_token_id
            tokens = torch.cat([tokens, following[:, None].to(tokens.dtype)], dim=1)
            if eos_token_id is not None and bool(finished.all()):
                break
        return tokens

    def train(self, mode: bool = True) -> ParallelModel:
        """Set training mode (dropout, batch statistics) on every module this rank runs, its stages
        included."""
        for module in (
            self.module,
            *self._modules,
            *([self._ddp] if self._ddp is not None else []),
        ):
            module.train(mode)
        return self

    def eval(self) -> ParallelModel:
        """Evaluation mode on every module this rank runs: ``train(False)``."""
        return self.train(False)

    @property
    def found_inf(self) -> bool:
        """fp16: whether a train_step since the last optimizer step found an inf or NaN (that step
        is skipped)."""
        return self._skip_optimizer_step

    @property
    def training(self) -> bool:
        """Whether the model is in training mode."""
        return self.module.training

    @property
    def _sequence_multiple(self) -> int:
        """What a sequence's length must divide by to run split over the tp ranks (tp under sequence
        parallelism)."""
        return self.tp_info.tp if self.tp_info is not None and self.tp_info.sequence_parallel else 1

    def _whole_sequences_unless_divides(self, inputs: Any):
        """Sequence parallelism off for a forward whose length does not divide by tp (Note [whole
        sequences for a forward], hyparallel.tensor.layers)."""
        return (
            nullcontext()
            if sequence_divides(inputs, self._sequence_multiple)
            else whole_sequences()
        )

    @contextmanager
    def _forward_only(self):
        """Around a forward without train_step's backward: FSDP2's gathered weights are freed after
        it."""
        try:
            yield
        finally:
            self.data_parallel.reshard(self._modules)

    @contextmanager
    def _whole_logits(self):
        """Under a vocab-parallel loss the head keeps its slice of the logits; a call of the model
        gathers them."""
        heads = self._split_heads if self._vocab_parallel_loss else []
        if not heads:
            yield
            return
        # nested: the outer block's setting comes back
        before = [head.gather_output for head in heads]
        for head in heads:
            head.gather_output = True
        try:
            yield
        finally:
            for head, was in zip(heads, before):
                head.gather_output = was

    def _accumulate(self, inputs: Any, targets: Any, loss_fn: LossFn) -> None:
        m = self.plan.num_microbatches
        pieces, goals = chunk_tree(inputs, m), chunk_tree(targets, m)
        runner = self._ddp or self.module
        for index, (piece, goal) in enumerate(zip(pieces, goals)):
            with self.data_parallel.micro_batch(self.module, last=index == m - 1):
                with self._attending() as attention:
                    with self._autocast():
                        output = call_with(runner, piece)
                    attention.checked()
                    loss = loss_fn(output, goal)
                    (loss / m).backward()  # a recomputed block splits its attention again

    @contextmanager
    def _attending(self):
        """Around a forward (and its backward): attention split over the cp group (Note [context
        parallelism], hyparallel.runtime.context); without cp, nothing to check."""
        if self.context is None:
            yield _NOTHING_SPLIT
            return
        with self.context.attending() as attention:
            yield attention

    def _loss_rule(
        self, loss_fn: LossFn | None, targets: Any, m: int, sliced: bool
    ) -> MicroBatchLoss:
        """The step's loss rule (Note [the loss a user reads], hyparallel.runtime.loss); ``sliced``:
        the head's logits are each tp rank's slice of the vocabulary."""
        if loss_fn is not None:
            if self.context is not None:
                loss_fn = self.context.pair_loss(loss_fn)
            return user_loss(loss_fn, m, self._data_size, sliced)
        return default_loss(
            targets, m, self._data_size, self._data_group, self.tp_info if sliced else None
        )

    @property
    def _loss_groups(self) -> list:
        """Where micro-batch loss reports are summed: the pipeline (the last stage has them), then
        data parallelism."""
        groups = [self.mesh["pp"].get_group()] if self.plan.parallel.pp > 1 else []
        return groups + ([self._data_group] if self._data_size > 1 else [])

    def _forward_pipelines(self) -> ForwardPipelines:
        """A pipeline's forwards on any inputs (Note [a forward under any plan],
        hyparallel.pipeline.forward)."""
        par = self.plan.parallel
        refusal = None
        if self.data_parallel.sharded:
            refusal = (
                "a pipelined forward or eval_step with inputs {inputs} that the stages were not"
                f" traced with, under ZeRO {par.zero}: FSDP2 holds the weights as shards it gathers"
                " only inside the training stages, so new stages cannot be traced for them; pass"
                " such inputs as parallelize's example_inputs (they are then the traced ones), or"
                " plan with zero: 0"
            )
        group = self.mesh["pp"].get_group()
        return ForwardPipelines(
            self.module,
            self.pipeline,
            [stage.modules for stage in self.plan.stages],
            self.device,
            micro_batch=self.plan.training.micro_batch,
            sequence_multiple=self._sequence_multiple,
            sliced_head=self._vocab_parallel_loss,
            traced_in=lambda: traced_with(self.module),
            make_runtime=lambda split, stages: PipelineRuntime(
                split,
                stages,
                group,
                schedule_kind="gpipe" if par.virtual_stages == 1 else par.schedule,
                num_microbatches=self.pipeline.num_microbatches,
                virtual_stages=par.virtual_stages,
                stage_call=self._autocast.stage_call,
            ),
            refusal=refusal,
        )

    def expert_imbalance(self) -> float | None:
        """Since the last call: the busiest expert-parallel rank's routed (token, expert) pairs over
        the mean, summed over every call of stacked experts (transformers' MoEs) and every ep group;
        None under ep 1 or before any is routed. What ``hyparallel plan --expert-imbalance``
        takes. A collective: call it on every rank at the same point (after a step, say)."""
        return self.experts.imbalance(self.device) if self.experts is not None else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so that the model's global 2-norm is at most ``max_norm``; returns
        the norm before.

        The norm is the single-device model's: each element counted once over tensor slices,
        pipeline stages and data-parallel shards (replicated copies, tied weights and shared
        key/value heads once), the same on every rank. torch's clip_grad_norm_ on ``parameters()``
        would see only this rank's share.
        """
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, param in self.named_parameters():
            if param.grad is not None:
                squares += self._own_square_sum(name, param.grad)
        dist.all_reduce(squares)  # every element was counted on exactly one rank
        norm = squares.sqrt().float()
        factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for param in self.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)
        return norm

    def _own_square_sum(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Sum of squares of the gradient elements this rank counts for the global norm."""
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        expert = self.experts is not None and name in self.experts.names
        groups = self.experts.groups_of(name) if expert else None
        # replicated over dp (DDP): dp rank 0 counts; an expert's over its replicas: the first
        if not hasattr(grad, "to_local") and (groups.replica if expert else self.dp_rank):
            return torch.zeros((), dtype=torch.float64, device=self.device)
        if groups is not None and groups.tp > 1:  # tp folded in: its replicas span tp too
            return local.double().pow(2).sum()
        # tied across stages: counted once
        if self.pipeline is not None and not self.pipeline.first_holder(name):
            return torch.zeros((), dtype=torch.float64, device=self.device)
        owner = self.module.get_submodule(name.rpartition(".")[0]) if "." in name else self.module
        split = (
            self.tp_info is not None
            and not (expert and name.rpartition(".")[0] in self._grouped_experts)
            and callable(getattr(owner, "shard_layout", None))
            and owner.shard_layout(name.rpartition(".")[2]) is not None
        )
        # replicated over tp: tp rank 0 counts
        if self.tp_info is not None and not split and self.tp_info.rank != 0:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        shared = self.tp_info.shared_rows.get(name) if self.tp_info is not None else None
        # key/value heads several tp ranks hold: the lowest counts
        if shared and not hasattr(grad, "to_local"):
            keep, offset = torch.zeros(local.size(0), dtype=torch.bool, device=local.device), 0
            for start, stop in shared[self.tp_info.rank]:
                first = min(r for r, rows in enumerate(shared) if (start, stop) in rows)
                keep[offset : offset + stop - start] = first == self.tp_info.rank
                offset += stop - start
            local = local[keep]
        return local.double().pow(2).sum()

    def _check_rows(self, inputs: Any) -> None:
        tensors = [
            v
            for v in torch.utils._pytree.tree_leaves(inputs)
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        share = self.plan.training.global_batch // self.dp_size
        if tensors and tensors[0].size(0) != share:
            raise ConfigError(
                f"train_step got {tensors[0].size(0)} rows but this data-parallel rank's share is"
                f" {share} (global_batch {self.plan.training.global_batch} / dp {self.dp_size});"
                " pass pmodel.shard(batch) of the global batch"
            )

    @contextmanager
    def _one_cast_per_step(self):
        """Note [one 16-bit copy of the weights per step]."""
        if (
            self._dtype == torch.float32
            or self.plan.parallel.zero == 3
            or self.plan.parallel.recompute != "none"
        ):
            yield
            return
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()

    # ---- the data position (hyparallel/runtime/data.py)
    # ----------------------------------------------------------------------------

    @property
    def data_sampler(self) -> DataSampler | None:
        """The training sampler ``sampler()`` made (None before): train_step counts each batch it
        consumed."""
        return getattr(self, "_data_sampler", None)

    def data_position(self) -> DataPosition | None:
        """Where training is in its data, as checkpoints save it: the training sampler's, or a
        restored position no sampler has taken yet (None: neither)."""
        sampler = self.data_sampler
        return (
            sampler.position()
            if sampler is not None
            else getattr(self, "_restored_data_position", None)
        )

    def restore_data_position(self, position: DataPosition | None) -> None:
        """Resume the data at ``position`` (``hp.checkpoint.load`` calls it): now, or when
        ``sampler()`` makes one."""
        if position is None:
            return
        if self.data_sampler is not None:
            self.data_sampler.resume(position)
        else:
            self._restored_data_position = position

    def _warn_if_same_rows(self, inputs: Any) -> bool:
        """Once (the first train_step), with dp > 1: whether every data-parallel rank got the same
        inputs, a forgotten ``shard`` or ``sampler``; rank 0 warns. One all-gather of an 8-byte
        checksum over dp."""
        if self.dp_size == 1 or getattr(self, "_rows_checked", False):
            return False
        self._rows_checked = True
        leaves = [
            v
            for v in torch.utils._pytree.tree_leaves(inputs)
            if isinstance(v, torch.Tensor) and v.numel()
        ]
        digest = hashlib.sha256()
        for leaf in leaves:
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            digest.update(
                leaf.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
            )
        mine = torch.tensor(
            [int.from_bytes(digest.digest()[:8], "little", signed=True)], device=self.device
        )
        every = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(every, mine, group=self.mesh["dp"].get_group())
        same = bool(leaves) and all(torch.equal(other, mine) for other in every)
        if same and self.env.rank == 0:
            warnings.warn(
                f"train_step's first batch is the same on all {self.dp_size} data-parallel ranks,"
                " so each replica trains on the same rows; give each rank its own:"
                " pmodel.sampler(dataset) with a DataLoader, or pmodel.shard(global_batch)",
                UserWarning,
                stacklevel=3,
            )
        return same


# Note [one 16-bit copy of the weights per step]
#     Autocast casts each fp32 weight to bf16/fp16 when a forward first uses it and caches the copy
#     until the outermost autocast region exits; a Linear saves that copy for its backward. With one
#     region per micro-batch, every micro-batch in flight (p of them on a 1F1B pipeline's first
#     stage) would hold its own copy: 2 bytes per parameter each. train_step therefore holds the
#     autocast nesting open for the whole step (torch.autocast's own counter), so micro-batches
#     share one copy, freed when the step ends: 2 bytes per parameter, as the planner counts. The
#     weights do not change within a step, so the copy is exact. Under ZeRO 3 a step-long copy of
#     every weight would undo the sharding, so each micro-batch casts anew. So does recomputation:
#     checkpointing matches the ops a recompute runs against those the forward ran, and a cast the
#     forward recorded (cache miss) would be a cache hit in the recompute; and on CUDA the recompute
#     runs on autograd's thread, whose autocast exit would clear the shared cache anyway.

# Note [which device a rank uses]
#     parallelize(device=...) wins. Otherwise a plan for a gloo cluster (the cpu preset, a CPU
#     calibration) runs on the CPU, GPUs present or not: gloo ranks sharing one GPU through NCCL
#     would fail, and the plan's figures are the CPU's. Any other plan takes cuda:LOCAL_RANK when
#     torch sees a GPU, and a node launched with more processes than GPUs is refused before the
#     first collective (NCCL cannot put two ranks on one GPU).


class _NothingSplit:
    def checked(self) -> None:
        pass


_NOTHING_SPLIT = _NothingSplit()


def _bound_inputs(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """A call's arguments as the pipeline takes inputs: one tensor, a tuple of arguments, or a dict
    by name."""
    if not kwargs:
        return args[0] if len(args) == 1 else tuple(args)
    if not args:
        return dict(kwargs)
    return dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)


def rank_device(device: torch.device | str, local_rank: int) -> torch.device:
    """``device`` as given to parallelize; an accelerator without an index ("cuda") is this rank's
    own one,
    ``cuda:LOCAL_RANK``, as default_device picks it (torch.cuda.set_device refuses an index-less
    device)."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        return torch.device(device.type, local_rank)
    return device


def default_device(env: LaunchEnv, plan: Plan) -> torch.device:
    """Where this rank computes when ``parallelize`` is not told: see Note [which device a rank
    uses]."""
    if (
        plan.cluster is not None and plan.cluster.backend == "gloo"
    ) or not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env.local_rank + 1))
    if local_world > gpus:
        raise ConfigError(
            f"{local_world} processes on this node (LOCAL_WORLD_SIZE) but {gpus} CUDA device(s):"
            f" NCCL needs one GPU per process; launch --nproc_per_node {gpus}, or pass device='cpu'"
            " to parallelize (gloo)"
        )
    return torch.device("cuda", env.local_rank)


def _token_count(inputs: Any) -> int:
    """Tokens in a batch.

    The size of its first integer tensor (token ids), else batch x sequence of its first tensor.
    """
    leaves = [
        leaf for leaf in torch.utils._pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)
    ]
    for leaf in leaves:  # token ids; a boolean mask may be (B, 1, T, T)
        if not leaf.is_floating_point() and not leaf.is_complex() and leaf.dtype != torch.bool:
            return leaf.numel()
    return math.prod(leaves[0].shape[:2]) if leaves else 0


def _to(value: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value
    )
