"""``parallelize(model, plan) -> ParallelModel``: data x tensor x pipeline parallelism under torchrun.

    pmodel = hp.parallelize(model, plan)            # in every process of `torchrun --nproc_per_node N`
    opt = torch.optim.AdamW(pmodel.parameters(), lr=3e-4)
    loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets), loss_fn)
    opt.step(); opt.zero_grad()

Order of construction (Note [what parallelize does]): check the whole plan against the launch and the
model before any collective; complete a hand-written plan (stages, tensor_parallel) with the planner,
its choices fixed; build the DeviceMesh in the plan's placement order; swap in tensor-parallel modules
on the meta model; split this rank's pipeline stages and materialise only their slices; recompute and
mixed precision around each forward; finally data parallelism on the dp axis (DDP for ZeRO 0, FSDP2
for ZeRO 1-3).
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyparallel.errors import ConfigError, HyparallelError
from hyparallel.schema import LossFn, Plan

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IGNORE_INDEX = -100  # targets with this value (padding) are not counted, as in F.cross_entropy

# Note [what parallelize does]
# 1. Checks, with no process group touched: WORLD_SIZE = dp * tp * pp (the arithmetic and the fix in the
#    message), the model is the one planned (parameter names and shapes, by fingerprint), the plan's
#    dimensions divide the model's (the planner's own tensor-parallel check).
# 2. A plan written by hand with only `training` and `parallel` gets its stages and tensor_parallel map
#    from the planner with every degree and strategy it states fixed (the planner decides nothing else).
# 3. init_device_mesh(device, shape, mesh_dim_names=placement.order): tp innermost by default. The
#    sub-meshes (`pmodel.mesh["dp"]`, ...) work with any torch API that takes a DeviceMesh.
# 4. Tensor parallelism swaps modules on the (meta) model; pipeline stages are traced from the swapped
#    model (its collectives trace as one custom op) and each rank materialises only its stages' slices,
#    from the same per-parameter random streams a single device would use (`seed`): any plan of the same
#    model starts from the same weights.
# 5. Data parallelism: ZeRO 0 is DDP (pp = 1) or one bucketed all-reduce of the accumulated gradients
#    after the pipeline schedule (pp > 1: DDP's reducer expects one backward per forward); ZeRO 1 and 2
#    are FSDP2 without resharding after forward (gradients and optimizer state sharded: ZeRO 2, which
#    contains ZeRO 1's saving at the same traffic), ZeRO 3 FSDP2 resharding after forward.


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK; one process without them)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        """Read the launch from the environment (torchrun sets it), or from an initialised process group."""
        if dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
        return cls(
            int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
        )


def parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    example_inputs: Any = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    vocab_parallel_loss: bool = False,
) -> ParallelModel:
    """Run ``model`` as ``plan`` says, in every process of a torchrun launch; see Note [what parallelize does].

    ``model`` is best built on the meta device (``hp.models.build(name)``): then no rank allocates more
    than its share, initialised deterministically from ``seed``. ``example_inputs`` is one micro-batch
    for tracing (default: token ids of the plan's ``micro_batch x seq_len``). ``device`` defaults to the
    CPU for a gloo cluster's plan, else cuda:LOCAL_RANK when there is a GPU (Note [which device a rank
    uses]). With
    ``vocab_parallel_loss`` the vocab-parallel head keeps its slice of the logits and ``train_step``'s
    default loss is token cross-entropy computed without ever gathering them; otherwise the logits are
    gathered and any ``loss_fn`` works.
    """
    from hyparallel.models import fingerprint

    env = LaunchEnv.from_environ()
    par = plan.parallel
    if env.world_size != plan.world_size:
        raise ConfigError(
            f"dp({par.dp}) * tp({par.tp}) * pp({par.pp}) = {plan.world_size} != WORLD_SIZE({env.world_size}); "
            f"launch {plan.world_size} processes (torchrun --nproc_per_node {plan.world_size}) or re-plan "
            f"with `hyparallel plan --gpus {env.world_size}`"
        )
    if plan.model is not None and plan.model.fingerprint and plan.model.fingerprint != fingerprint(model):
        count = sum(p.numel() for p in model.parameters())
        raise ConfigError(
            f"the plan was made for model '{plan.model.name}' ({plan.model.num_params:,} parameters), not this "
            f"{type(model).__name__} ({count:,} parameters, other names or shapes); "
            "plan this model with `hyparallel plan` or hp.plan"
        )
    if plan.training.dtype == "fp16":
        warnings.warn(
            "fp16 plans run under autocast without loss scaling, so small gradients can underflow; "
            "prefer bf16, or scale the loss inside loss_fn",
            stacklevel=2,
        )
    device = torch.device(device) if device is not None else _default_device(env, plan)
    example = example_inputs if example_inputs is not None else _token_ids(plan)
    plan = complete_plan(model, plan, example_inputs=example_inputs)
    import hyparallel as hp
    from hyparallel.planner.tp import analyze

    graph = hp.trace(model, example)  # before any swap: blocks, and the dataflow tensor parallelism splits by
    if par.tp > 1:
        analysis = analyze(graph)
        if reason := analysis.check(par.tp, graph):
            raise ConfigError(
                f"tp = {par.tp} does not fit {type(model).__name__}: {reason}; choose a tp that divides it"
            )
        if par.zero > 0 and _shares_heads(analysis, graph, par.tp):
            raise ConfigError(
                f"tp ({par.tp}) is more than the model's key/value heads, so ranks share heads, and zero "
                f"{par.zero} shards their gradients: not supported together yet; use zero: 0 or a tp up to "
                "the key/value head count"
            )
    return ParallelModel(model, plan, env, device, (graph, example), seed, vocab_parallel_loss)


def complete_plan(model: nn.Module, plan: Plan, *, example_inputs: Any = None) -> Plan:
    """``plan`` with its missing ``stages`` / ``tensor_parallel`` planned, every stated choice fixed.

    ``example_inputs`` (one micro-batch, as ``parallelize`` takes them) are what the planner traces with, if given.

    A plan without predictions gets the planner's for its configuration when its stages are the planner's
    (what ``pmodel.metrics`` compares with); one the planner would refuse (e.g. over its memory estimate)
    runs without them.
    """
    from hyparallel.pipeline.split import listed_stages
    from hyparallel.planner import plan as make_plan
    from hyparallel.tensor.apply import expand_styles

    if plan.stages is not None:  # a hand-written map names this model's modules, or is refused here, not mid-launch
        listed_stages(model, [stage.modules for stage in plan.stages])
    if plan.tensor_parallel is not None:
        expand_styles(model, plan.tensor_parallel)
    par, tr = plan.parallel, plan.training
    needs_stages = par.pp > 1 and plan.stages is None
    needs_tp = par.tp > 1 and plan.tensor_parallel is None
    if plan.cluster is None and (needs_stages or needs_tp):
        raise ConfigError(
            f"the plan has pp = {par.pp}, tp = {par.tp} but no cluster, so its stages and tensor-parallel "
            "map cannot be planned; add `cluster: PRESET` (e.g. cpu, h100-sxm; `hyparallel clusters`) or "
            "list `stages` and `tensor_parallel` yourself"
        )
    if not (needs_stages or needs_tp or plan.predicted is None) or plan.cluster is None:
        return plan
    cluster = plan.cluster
    if cluster.num_gpus != plan.world_size:  # a preset named without a size: the launch is the cluster
        per_node = cluster.gpus_per_node if plan.world_size % cluster.gpus_per_node == 0 else plan.world_size
        cluster = cluster.resized(num_nodes=plan.world_size // per_node, gpus_per_node=per_node)
    try:
        fixed = make_plan(
            model,
            cluster,
            tr.global_batch,
            tr.seq_len,
            tr.dtype,
            tp=par.tp,
            pp=par.pp,
            dp=par.dp,
            micro_batch=tr.micro_batch,
            schedule=par.schedule,
            virtual_stages=par.virtual_stages,
            recompute=par.recompute,
            zero=par.zero,
            sequence_parallel=par.sequence_parallel,
            order=plan.placement.order,
            example_inputs=example_inputs,
        )
    except HyparallelError:  # e.g. a model that traces only with the caller's example_inputs
        if needs_stages or needs_tp:
            raise
        return plan  # it runs; only the predictions are missing
    data, planned = plan.to_dict(), fixed.to_dict()
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


class ParallelModel:
    """A model running under a plan in this process; build it with :func:`parallelize`."""

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        env: LaunchEnv,
        device: torch.device,
        traced: tuple[Any, Any],
        seed: int,
        vocab_parallel_loss: bool,
    ):
        from torch.distributed.device_mesh import init_device_mesh

        self.plan, self.env, self.device, self.module = plan, env, device, model
        self._io = None
        par = plan.parallel
        if not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            _init_process_group("nccl" if device.type == "cuda" else "gloo", env)
        shape = plan.mesh_shape()
        self.mesh = init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        self.dp_size, self.dp_rank = par.dp, self.mesh["dp"].get_local_rank()
        self._dtype = _DTYPES[plan.training.dtype]
        self._vocab_parallel_loss = vocab_parallel_loss and par.tp > 1
        self._graph, example = traced  # the model's ModelGraph and the micro-batch it was traced with
        self.tp_info = self._tensor_parallel()
        self.pipeline = None
        if par.pp > 1:
            from hyparallel.pipeline import PipelineRuntime

            self.pipeline = PipelineRuntime.from_plan(
                model,
                plan,
                self.mesh["pp"].get_group(),
                example_inputs=example,
                device=device,
                seed=seed,
                stage_call=self._stage_call(),
                before_backward=self._before_backward,
            )
            self._modules = [stage.body for stage in self.pipeline.stages.values()]
            self._recompute_stages()
        else:
            self._materialize(seed)
            self._recompute_blocks()
            self._modules = [model]
        self._data_parallel()
        from hyparallel.metrics import RunMetrics

        self.metrics = RunMetrics(
            plan, self._graph.flops / max(_token_count(example), 1), device, pp_rank=self.mesh["pp"].get_local_rank()
        )

    # ---- construction ----------------------------------------------------------------------------

    def _tensor_parallel(self):
        par = self.plan.parallel
        if par.tp == 1:
            return None
        from hyparallel.tensor import apply_tensor_parallel

        info = apply_tensor_parallel(
            self.module,
            self.plan.tensor_parallel or {},
            self.mesh["tp"].get_group(),
            self._graph,
            sequence_parallel=par.sequence_parallel,
            gather_logits=not self._vocab_parallel_loss,
            fused_kernels=par.fused_kernels,
        )
        return info

    def _materialize(self, seed: int) -> None:
        from hyparallel.tensor.init import materialize_

        if any(t.is_meta for t in (*self.module.parameters(), *self.module.buffers())):
            materialize_(self.module, self.device, seed=seed)
        else:
            self.module.to(self.device)

    def _recompute_blocks(self) -> None:
        """pp = 1: recompute each repeated block (full) or its seq x seq ops (selective), names unchanged."""
        recompute = self.plan.parallel.recompute
        if recompute == "none":
            return
        blocks = [b.path for b in self._graph.blocks]
        if not blocks:
            raise ConfigError(f"recompute: {recompute} needs repeated blocks (transformer layers) to recompute")
        context = _selective_context(self.plan.training.seq_len) if recompute == "selective" else None
        for path in blocks:
            # The block's forward, not its __call__: hooks (sequence-parallel scatter, FSDP) run once, outside.
            block = self.module.get_submodule(path)
            block.forward = partial(
                torch.utils.checkpoint.checkpoint,
                block.forward,
                use_reentrant=False,
                **({"context_fn": context} if context else {}),
            )

    def _stage_call(self) -> Callable:
        def call(stage, inputs, received):
            with self._autocast():
                return stage(inputs, received)

        return call

    def _recompute_stages(self) -> None:
        """pp > 1: recompute each stage from its inputs (full), or only its seq x seq ops (selective).

        The stage graph's forward is wrapped, not its __call__, so FSDP's gathers run outside the region.
        """
        recompute = self.plan.parallel.recompute
        if recompute == "none":
            return
        context = _selective_context(self.plan.training.seq_len) if recompute == "selective" else None
        for stage in self.pipeline.stages.values():
            stage.body.forward = partial(
                torch.utils.checkpoint.checkpoint,
                stage.body.forward,
                use_reentrant=False,
                **({"context_fn": context} if context else {}),
            )

    def _data_parallel(self) -> None:
        par = self.plan.parallel
        self._ddp = None
        if par.dp == 1:
            return
        dp_mesh = self.mesh["dp"]
        if par.zero == 0:
            if self.pipeline is None:
                from torch.nn.parallel import DistributedDataParallel

                ids = [self.device.index] if self.device.type == "cuda" else None
                # Buffers (rotary tables) are computed alike on every rank: no broadcast before each forward.
                quiet = (
                    "forward_sync_buffers"
                    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                    else "broadcast_buffers"
                )  # renamed in newer torch
                self._ddp = DistributedDataParallel(
                    self.module, device_ids=ids, process_group=dp_mesh.get_group(), **{quiet: False}
                )
            return  # pp > 1: _all_reduce_grads after the schedule
        from torch.distributed.fsdp import fully_shard

        reshard = par.zero == 3
        if self.pipeline is None:  # each block its own unit (gathers overlap compute), then the rest
            for block in self._graph.blocks:
                fully_shard(self.module.get_submodule(block.path), mesh=dp_mesh, reshard_after_forward=reshard)
        for module in self._modules:
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard)

    def _before_backward(self, stage, last: bool) -> None:
        if self.plan.parallel.dp > 1 and self.plan.parallel.zero > 0:
            self._fsdp_micro_batch(stage.body, last)

    def _fsdp_micro_batch(self, module, last: bool) -> None:
        """Note [ZeRO stages on FSDP2]: what one micro-batch's backward does with weights and gradients."""
        zero = self.plan.parallel.zero
        module.set_requires_gradient_sync(last or zero >= 2)
        if zero < 3:
            module.set_reshard_after_backward(last)

    # ---- training --------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (its stages' tensor-parallel slices, sharded under ZeRO >= 1), for any optimizer."""
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
        """The modules this rank runs: the model (pp = 1) or its pipeline stages' graphs, under original names."""
        return list(self._modules)

    def io_group(self):
        """A gloo group of every rank for background work (asynchronous checkpoints), made on first use.

        Every rank must call it at the same point, as for any new group.
        """
        if self._io is None:
            self._io = dist.new_group(backend="gloo")
        return self._io

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors under the original model's names (local slices and shards as they are)."""
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
                    f"a batch of {value.size(0)} rows does not split over dp = {self.dp_size} ranks; "
                    f"pass a multiple of {self.dp_size}"
                )
            return value.chunk(self.dp_size)[self.dp_rank]

        return torch.utils._pytree.tree_map(cut, batch)

    def sampler(self, dataset, shuffle: bool = True, seed: int = 0):
        """A DistributedSampler giving this data-parallel rank its share of ``dataset``."""
        from torch.utils.data import DistributedSampler

        return DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle, seed=seed)

    def train_step(self, inputs: Any, targets: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
        """Forward and backward of this rank's batch (``shard`` cuts it); returns the global mean loss on every rank.

        The batch splits into the plan's micro-batches; gradients are synchronised over data parallelism and
        completed over tensor parallelism: call the optimizer next (or accumulate: gradients add up over calls).
        The default loss is token cross-entropy averaged over every target token of the global batch that is
        not ``ignore_index`` (-100), however they fall into micro-batches and ranks. A ``loss_fn(output,
        targets)`` of your own returns a micro-batch's mean; micro-batches and ranks then weigh equally.
        """
        self._check_rows(inputs)
        self.metrics.step_started(_token_count(inputs) * self.dp_size)  # Note [what a measured step is]
        inputs, targets = _to(inputs, self.device), _to(targets, self.device)
        loss_fn = self._loss(loss_fn, targets)
        before = [self.tp_info.partial_grads(m) for m in self._modules] if self.tp_info is not None else []
        with self._one_cast_per_step():
            if self.pipeline is not None:
                loss = self.pipeline.train_step(inputs, targets, loss_fn)
            else:
                loss = self._accumulate(inputs, targets, loss_fn)
        if self.pipeline is not None and self.plan.parallel.dp > 1 and self.plan.parallel.zero == 0:
            self._all_reduce_grads()
        for module, since in zip(self._modules, before):
            self.tp_info.reduce_grads(module, since)
        return self._dp_mean(loss)

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
        """The global mean loss of a batch, without gradients (validation)."""
        inputs, targets = _to(inputs, self.device), _to(targets, self.device)
        loss_fn = self._loss(loss_fn, targets)
        if self.pipeline is not None:
            return self._dp_mean(self.pipeline.eval_step(inputs, targets, loss_fn))
        with self._autocast():
            whole = loss_fn(_call(self._ddp or self.module, inputs), targets).detach().float()
        return self._dp_mean(whole / self.plan.num_microbatches)  # the loss was scaled for one micro-batch of m

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on this rank (pp = 1 only; a pipeline runs through train_step and eval_step)."""
        if self.pipeline is not None:
            raise RuntimeError("a pipelined model has no single forward on one rank; use train_step or eval_step")
        with self._autocast():
            return (self._ddp or self.module)(*args, **kwargs)

    def _accumulate(self, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        from hyparallel.pipeline.runtime import _chunk_tree

        m = self.plan.num_microbatches
        pieces, goals = _chunk_tree(inputs, m), _chunk_tree(targets, m)
        runner = self._ddp or self.module
        total = torch.zeros((), device=self.device)
        for index, (piece, goal) in enumerate(zip(pieces, goals)):
            last = index == m - 1
            sync = nullcontext()
            if self._ddp is not None and not last:
                sync = self._ddp.no_sync()
            elif hasattr(self.module, "set_requires_gradient_sync"):
                self._fsdp_micro_batch(self.module, last)
            with sync:
                with self._autocast():
                    loss = loss_fn(_call(runner, piece), goal)
                (loss / m).backward()
            total += loss.detach().float()
        return total / m

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so that the model's global 2-norm is at most ``max_norm``; returns the norm before.

        The norm is the single-device model's: each element counted once over tensor slices, pipeline stages
        and data-parallel shards (replicated copies, tied weights and shared key/value heads once), the same on
        every rank. torch's clip_grad_norm_ on ``parameters()`` would see only this rank's share.
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
        if not hasattr(grad, "to_local") and self.dp_rank != 0:  # replicated over dp (DDP): dp rank 0 counts
            return torch.zeros((), dtype=torch.float64, device=self.device)
        if self.pipeline is not None and not self.pipeline.first_holder(name):  # tied across stages: counted once
            return torch.zeros((), dtype=torch.float64, device=self.device)
        owner = self.module.get_submodule(name.rpartition(".")[0]) if "." in name else self.module
        split = (
            self.tp_info is not None
            and callable(getattr(owner, "shard_layout", None))
            and owner.shard_layout(name.rpartition(".")[2]) is not None
        )
        if self.tp_info is not None and not split and self.tp_info.rank != 0:  # replicated over tp: tp rank 0 counts
            return torch.zeros((), dtype=torch.float64, device=self.device)
        shared = self.tp_info.shared_rows.get(name) if self.tp_info is not None else None
        if shared and not hasattr(grad, "to_local"):  # key/value heads several tp ranks hold: the lowest counts
            keep, offset = torch.zeros(local.size(0), dtype=torch.bool, device=local.device), 0
            for start, stop in shared[self.tp_info.rank]:
                first = min(r for r, rows in enumerate(shared) if (start, stop) in rows)
                keep[offset : offset + stop - start] = first == self.tp_info.rank
                offset += stop - start
            local = local[keep]
        return local.double().pow(2).sum()

    def _all_reduce_grads(self) -> None:
        """Sum the accumulated gradients over dp, averaged, in flat buckets of about 25 MB (DDP's default)."""
        group, size = self.mesh["dp"].get_group(), self.plan.parallel.dp
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        bucket: list[torch.Tensor] = []
        for grad in grads + [None]:
            if grad is not None:
                bucket.append(grad)
            if bucket and (grad is None or sum(g.numel() * g.element_size() for g in bucket) >= 25 * 2**20):
                flat = torch.cat([g.flatten() for g in bucket])
                dist.all_reduce(flat, group=group)
                flat /= size
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                bucket = []

    def _dp_mean(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.detach().float().reshape(())
        if self.plan.parallel.dp > 1:
            loss = loss.clone()
            dist.all_reduce(loss, group=self.mesh["dp"].get_group())
            loss /= self.plan.parallel.dp
        return loss

    def _check_rows(self, inputs: Any) -> None:
        tensors = [v for v in torch.utils._pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor) and v.dim() > 0]
        share = self.plan.training.global_batch // self.dp_size
        if tensors and tensors[0].size(0) != share:
            raise ConfigError(
                f"train_step got {tensors[0].size(0)} rows but this data-parallel rank's share is {share} "
                f"(global_batch {self.plan.training.global_batch} / dp {self.dp_size}); pass "
                "pmodel.shard(batch) of the global batch"
            )

    def _loss(self, loss_fn: LossFn | None, targets: Any) -> LossFn:
        if loss_fn is not None:
            if self._vocab_parallel_loss:
                raise ConfigError(
                    "parallelize(..., vocab_parallel_loss=True) keeps each rank's slice of the logits; "
                    "use train_step's default loss, or vocab_parallel_loss=False to gather them for yours"
                )
            return loss_fn
        # Sum over tokens, divided by the global count of real targets: micro-batches, ranks and padding
        # (ignore_index) weigh as in one big batch. The runtime averages micro-batches and DDP/FSDP average
        # ranks, hence the factor m * dp.
        count = (targets != IGNORE_INDEX).sum().float().reshape(1)
        if self.dp_size > 1:
            dist.all_reduce(count, group=self.mesh["dp"].get_group())
        scale = self.plan.num_microbatches * self.dp_size / count.clamp_min(1.0)
        if self._vocab_parallel_loss:
            from hyparallel.tensor import vocab_parallel_cross_entropy

            info = self.tp_info
            return lambda output, goal: (
                vocab_parallel_cross_entropy(_logits(output), goal, info.group, info.vocab_start, info.vocab_size)
                * (goal != IGNORE_INDEX).sum()
                * scale
            )[0]
        return lambda output, goal: (token_cross_entropy(output, goal, reduction="sum") * scale)[0]

    def _autocast(self):
        if self._dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self._dtype)

    @contextmanager
    def _one_cast_per_step(self):
        """Note [one 16-bit copy of the weights per step]."""
        if self._dtype == torch.float32 or self.plan.parallel.zero == 3 or self.plan.parallel.recompute != "none":
            yield
            return
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()


# Note [ZeRO stages on FSDP2]
#     ZeRO 1-3 run on FSDP2 (fully_shard: each block a unit when pp = 1, each stage when pp > 1), configured per
#     micro-batch to do what the planner costs (docs/data-parallel.md):
#       ZeRO 1: weights gathered once per step (no resharding until the last micro-batch's backward), gradients
#               kept whole and reduce-scattered once, after the last micro-batch; optimizer state sharded.
#       ZeRO 2: as ZeRO 1, but gradients reduce-scattered after every micro-batch (only shards accumulate).
#       ZeRO 3: weights gathered for every forward and backward and resharded after each; gradients
#               reduce-scattered after every micro-batch.
#     The gathered weights are the fp32 master copies (no FSDP mixed-precision policy: autocast casts them).


# Note [one 16-bit copy of the weights per step]
#     Autocast casts each fp32 weight to bf16/fp16 when a forward first uses it and caches the copy until the
#     outermost autocast region exits; a Linear saves that copy for its backward. With one region per
#     micro-batch, every micro-batch in flight (p of them on a 1F1B pipeline's first stage) would hold its own
#     copy: 2 bytes per parameter each. train_step therefore holds the autocast nesting open for the whole
#     step (torch.autocast's own counter), so micro-batches share one copy, freed when the step ends: 2 bytes
#     per parameter, as the planner counts. The weights do not change within a step, so the copy is exact.
#     Under ZeRO 3 a step-long copy of every weight would undo the sharding, so each micro-batch casts anew. So
#     does recomputation: checkpointing matches the ops a recompute runs against those the forward ran, and a
#     cast the forward recorded (cache miss) would be a cache hit in the recompute; and on CUDA the recompute
#     runs on autograd's thread, whose autocast exit would clear the shared cache anyway.

# Note [which device a rank uses]
#     parallelize(device=...) wins. Otherwise a plan for a gloo cluster (the cpu preset, a CPU calibration) runs on
#     the CPU, GPUs present or not: gloo ranks sharing one GPU through NCCL would fail, and the plan's figures are
#     the CPU's. Any other plan takes cuda:LOCAL_RANK when torch sees a GPU, and a node launched with more
#     processes than GPUs is refused before the first collective (NCCL cannot put two ranks on one GPU).


def token_cross_entropy(output: Any, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of next-token logits ``(B, T, V)`` (or an output with ``.logits``) against ``(B, T)``.

    Targets equal to ``IGNORE_INDEX`` (-100, padding) count for nothing.
    """
    logits = _logits(output)
    return F.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


# Note [what selective recomputation saves]
#     The policy below is asked about every op of a recomputed region as the forward runs it; what it saves,
#     the recompute takes back from a cache instead of running the op again. It recomputes:
#       1. ops whose output is seq x seq (attention scores, their scale, mask, softmax and dropout): what the
#          planner costs as selective recomputation;
#       2. ops that write into a tensor (in-place ops, e.g. CPU dropout's `empty_like(x).bernoulli_(1 - p)`
#          then `div_(1 - p)`, or `masked_fill_`), and the allocations they fill (`empty_like`, `new_*`,
#          factories without tensor inputs). A saved result is handed back as the tensor it was when saved:
#          torch refuses one written to since ("Tensor cached during selective activation checkpoint has
#          been mutated": what dropout did to the saved `empty_like` before this rule), and replaying the
#          write on a saved tensor would apply it twice;
#       3. every random op (dropout's draw). Checkpointing restores the RNG state at the start of the
#          region's recompute, so the recompute draws the forward's numbers only if it makes every draw the
#          forward made, in the same order; one saved (skipped) draw would shift the ones after it, and the
#          backward would use other dropout masks than the forward did.
#     Everything else is saved. In transformer blocks rules 2 and 3 add elementwise work only (dropout's
#     draws, masks built in place), which the planner does not count. A model that writes in place into the
#     result of some other op (say `relu_` on a matmul's output) still stops with torch's error in its first
#     backward: loud, never wrong.


def _selective_context(seq_len: int):
    """Selective recomputation as the planner costs it; see Note [what selective recomputation saves]."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, func, *args, **kwargs):
        redo = _writes_or_draws(func, args) or _is_seq_by_seq(func, args, seq_len)
        return CheckpointPolicy.PREFER_RECOMPUTE if redo else CheckpointPolicy.MUST_SAVE

    return partial(create_selective_checkpoint_contexts, policy)


def _writes_or_draws(func, args) -> bool:
    """Rules 2 and 3 of Note [what selective recomputation saves]: writes into a tensor, allocates one, or draws."""
    schema = getattr(func, "_schema", None)
    if schema is None:  # not an ATen op (a higher-order op): leave it to the shape rule
        return False
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        return True
    name = schema.name.split("::")[-1]
    return name.endswith("_like") or name.startswith("new_") or not any(isinstance(a, torch.Tensor) for a in args)


def _is_seq_by_seq(func, args, seq_len: int) -> bool:
    """Rule 1: the op's result ends in (seq_len, seq_len) (a matmul's from its operands, others' from the first)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return False
    name = str(func)
    if any(k in name for k in ("bmm", "matmul", ".mm", "baddbmm")) and len(tensors) >= 2:
        shape = (*tensors[-2].shape[:-1], tensors[-1].shape[-1])
    else:
        shape = tuple(tensors[0].shape)
    return len(shape) >= 2 and shape[-1] == shape[-2] == seq_len


def _shares_heads(analysis, graph, tp: int) -> bool:
    """Whether some attention projection has fewer heads than tp (grouped-query key/value heads get replicated)."""
    for name, groups in analysis.head_groups.items():
        width = graph.op(name).output_shapes[0][-1]
        head_dim = width // groups
        if any(part // head_dim < tp for part in analysis.parts.get(name, [width])):
            return True
    return False


def _init_process_group(backend: str, env: LaunchEnv) -> None:
    """The default process group for this launch: env:// under torchrun, an in-memory store for one process.

    Restarts under torchrun need each rendezvous round to get its own store, or the new gloo/NCCL groups
    can read the dead workers' addresses (pytorch/pytorch#167288): launch torchrun with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 when it may restart workers (README, examples/train_gpt.py).
    """
    if env.world_size == 1:  # a world of one needs no rendezvous, whatever MASTER_ADDR a shell exported
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)


def _default_device(env: LaunchEnv, plan: Plan) -> torch.device:
    """Where this rank computes when ``parallelize`` is not told: see Note [which device a rank uses]."""
    if (plan.cluster is not None and plan.cluster.backend == "gloo") or not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env.local_rank + 1))
    if local_world > gpus:
        raise ConfigError(
            f"{local_world} processes on this node (LOCAL_WORLD_SIZE) but {gpus} CUDA device(s): NCCL "
            f"needs one GPU per process; launch --nproc_per_node {gpus}, or pass device='cpu' to "
            "parallelize (gloo)"
        )
    return torch.device("cuda", env.local_rank)


def _token_ids(plan: Plan) -> torch.Tensor:
    return torch.zeros(plan.training.micro_batch, plan.training.seq_len, dtype=torch.long, device="meta")


def _token_count(inputs: Any) -> int:
    """Tokens in a batch: the size of its first integer tensor (token ids), else batch x sequence of its first tensor."""
    leaves = [leaf for leaf in torch.utils._pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]
    for leaf in leaves:  # token ids; a boolean mask may be (B, 1, T, T)
        if not leaf.is_floating_point() and not leaf.is_complex() and leaf.dtype != torch.bool:
            return leaf.numel()
    return math.prod(leaves[0].shape[:2]) if leaves else 0


def _call(module: Any, inputs: Any) -> Any:
    """``module`` on inputs given as the pipeline takes them: a tensor, a tuple of args or a dict of kwargs."""
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(*inputs) if isinstance(inputs, (tuple, list)) else module(inputs)


def _to(value: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)
