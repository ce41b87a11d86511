"""Data parallelism on the mesh's dp axis: ``apply_data_parallel(...) -> DataParallel``.

    dp = apply_data_parallel(model_or_stages, plan, mesh["dp"], device, blocks=..., pipelined=...)
    # around each micro-batch's backward (no_sync / FSDP's per-micro-batch state)
    with dp.micro_batch(module, last):
        loss.backward()
    # after the last backward (pp > 1, ZeRO 0: the bucketed all-reduce)
    dp.finish_step(parameters)

ZeRO 0 is DDP (pp = 1) or one bucketed all-reduce of the accumulated gradients after the pipeline
schedule (pp > 1: DDP's reducer expects one backward per forward); ZeRO 1-3 are FSDP2 (Note [ZeRO
stages on FSDP2]). Every gradient reduction over dp goes through here, so a gradient hook
(compression) has one place to go.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hyparallel.runtime.compression import BUCKET_BYTES, Compressor, compressor_for, fsdp_policy
from hyparallel.runtime.experts import ExpertParallel
from hyparallel.spec.schema import Plan

# Note [ZeRO stages on FSDP2]
#     ZeRO 1-3 run on FSDP2 (fully_shard: each block a unit when pp = 1, each stage when pp > 1),
#     configured per micro-batch to do what the planner costs (docs/data-parallel.md):
#       ZeRO 1: weights gathered once per step (no resharding until the last micro-batch's
#       backward), gradients
#               kept whole and reduce-scattered once, after the last micro-batch; optimizer state
#               sharded.
#       ZeRO 2: as ZeRO 1, but gradients reduce-scattered after every micro-batch (only shards
#       accumulate). ZeRO 3: weights gathered for every forward and backward and resharded after
#       each; gradients
#               reduce-scattered after every micro-batch.
#     The gathered weights are the fp32 master copies (no FSDP mixed-precision policy: autocast
#     casts them), unless the plan compresses gradients to bf16/fp16: then FSDP2's
#     MixedPrecisionPolicy reduce-scatters in that dtype and, for a 16-bit training.dtype, gathers
#     the weights in it (hyparallel.runtime.compression.fsdp_policy).


# Note [a weight several stages hold]
#     A tied embedding and head on two pipeline ranks is two copies, whose gradients the pipeline
#     sums (so they are equal) before each copy's rank reduces it over its own dp group. The copies
#     stay equal only if both reductions compute the same thing: in a bucket of its own (an
#     all-reduce sums each element in an order that depends on its offset in the buffer, which
#     differs between the two ranks' buckets), and uncompressed: PowerSGD draws each bucket's random
#     Q from a stream the two ranks' bucket layouts consume differently, so it would approximate the
#     two copies' gradients differently and the copies would drift apart (measured: gpt-tiny, dp 2 x
#     pp 2, after 6 PowerSGD steps the last stage's head copy differed from the first stage's
#     embedding). So shared weights go first, each rank's in a bucket of their own, uncompressed.


@dataclass(frozen=True)
class DataParallel:
    """What ``apply_data_parallel`` did to the modules, and what each step asks of it."""

    dp: int
    zero: int
    mesh: DeviceMesh | None  # the dp sub-mesh (None: dp = 1)
    ddp: nn.Module | None = None  # DistributedDataParallel around the model (pp = 1, ZeRO 0)
    after_step_all_reduce: bool = False  # pp > 1, ZeRO 0: gradients all-reduced after the schedule
    # ZeRO 0 under grad_compression bf16/fp16/powersgd (DDP's hook, or the above)
    compressor: Compressor | None = None
    # parameters the above leaves to their own group (expert parallelism's experts), by name
    ignored: frozenset[str] = frozenset()

    @property
    def sharded(self) -> bool:
        """Whether the modules are FSDP2 units (ZeRO >= 1 over more than one rank)."""
        return self.dp > 1 and self.zero > 0

    @contextmanager
    def micro_batch(self, module: nn.Module, last: bool) -> Iterator[None]:
        """Around one micro-batch's backward of ``module``: DDP syncs only the last; FSDP as the
        ZeRO stage says."""
        if self.sharded:
            self.before_backward(module, last)
        with self.ddp.no_sync() if self.ddp is not None and not last else nullcontext():
            yield

    def before_backward(self, module: nn.Module, last: bool) -> None:
        """Note [ZeRO stages on FSDP2]: what one micro-batch's backward does with weights and
        gradients."""
        if self.sharded:
            fsdp_micro_batch(module, last, self.zero)

    def reshard(self, modules: Iterable[nn.Module]) -> None:
        """After a forward that no backward follows (eval_step, a call of the model): every FSDP2
        unit in ``modules`` frees the weights it gathered and its parameters are the shards again.

        Under ZeRO 1 and 2 a unit keeps its weights gathered after the forward
        (reshard_after_forward=False, for the step's backward), so without this an optimizer made
        next would hold the gathered copies (its updates lost) and a checkpoint would save them.
        Under grad mode a later backward gathers them again, as ZeRO 3's.
        """
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in modules:
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()

    def finish_step(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        shared: Iterable[nn.Parameter] = (),
    ):
        """After the step's last backward: the bucketed all-reduce a pipeline's ZeRO 0 needs
        (nothing otherwise).

        ``shared``: this rank's copies of weights other pipeline ranks hold too (Note [a weight
        several stages hold]).
        """
        if not self.after_step_all_reduce:
            return
        exact = {id(p) for p in shared}
        named = [
            (name, p.grad)
            for name, p in named_parameters
            if p.grad is not None and id(p) not in exact and name not in self.ignored
        ]
        group = self.mesh.get_group()
        all_reduce_mean([p.grad for p in shared if p.grad is not None], group, self.dp)
        if self.compressor is not None:
            self.compressor.reduce(named)
        else:
            all_reduce_mean([grad for _, grad in named], group, self.dp)

    @property
    def compression_step(self) -> int | None:
        """Gradient reductions PowerSGD has counted (its warm-up ends at powersgd_start_step); None
        without it."""
        state = self.compressor.state if self.compressor is not None else None
        return state.iter if state is not None else None

    def compression_state(self) -> dict[str, Any] | None:
        """This rank's gradient-compression state for a checkpoint (PowerSGD's; None for every other
        mode)."""
        return self.compressor.state_dict() if self.compressor is not None else None

    def load_compression_state(
        self, saved: dict[str, Any] | None, iteration: int | None = None
    ) -> None:
        """Restore ``compression_state()``'s ``saved``; with only ``iteration``, PowerSGD counts on
        from it afresh."""
        if self.compressor is not None:
            self.compressor.load_state_dict(saved, iteration)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a loss) averaged over the data-parallel ranks, as a float32 scalar."""
        value = value.detach().float().reshape(())
        if self.dp > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.mesh.get_group())
            value /= self.dp
        return value


def fsdp_micro_batch(module: nn.Module, last: bool, zero: int) -> None:
    """Note [ZeRO stages on FSDP2]: set an FSDP2 unit up for one micro-batch's backward (``last``:
    the step's last)."""
    module.set_requires_gradient_sync(last or zero >= 2)
    if zero < 3:
        module.set_reshard_after_backward(last)


def micro_batch_hook(plan: Plan) -> Callable[[nn.Module, bool], None] | None:
    """What each micro-batch's backward asks of a module under ``plan``'s data parallelism (None:
    nothing).

    A pipeline calls it before each stage's backward; it depends on the plan only, so the pipeline
    can be built before its stages are wrapped.
    """
    par = plan.parallel
    return partial(fsdp_micro_batch, zero=par.zero) if par.dp > 1 and par.zero > 0 else None


def apply_data_parallel(
    modules: Sequence[nn.Module],
    plan: Plan,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    blocks: Sequence[nn.Module] = (),
    pipelined: bool = False,
    unused: Sequence[str] = (),
    find_unused: bool = False,
    experts: ExpertParallel | None = None,
) -> DataParallel:
    """Wrap ``modules`` (the model, or this rank's pipeline stage graphs) for the plan's data
    parallelism.

    ``blocks`` (pp = 1) are the repeated blocks, each its own FSDP unit so that gathers overlap
    compute. Returns what training steps through: ``.ddp`` to call (pp = 1, ZeRO 0),
    ``micro_batch``/``finish_step``.
    ``unused``: parameters the traced forward never reads (a decoder's cross-attention without
    encoder states); DDP ignores them (their gradients stay None, as on one device) instead of
    waiting for them forever.
    ``find_unused``: some parameters get a gradient from one loss and not another (outputs the
    default loss does not read, ModelGraph.params_outside_logits): DDP finds each step's unused ones
    (``find_unused_parameters``).
    ``experts``: expert parallelism's split experts, which neither DDP nor FSDP2 reduces (their own
    group does: Note [expert parallelism], hyparallel.runtime.experts).
    """
    par = plan.parallel
    result = DataParallel(dp=par.dp, zero=par.zero, mesh=mesh if par.dp > 1 else None)
    if par.dp == 1:
        return result
    if par.zero == 0:
        compressor = compressor_for(plan, mesh.get_group(), modules)
        if pipelined:
            ignored = experts.names if experts is not None else frozenset()
            return replace(
                result, after_step_all_reduce=True, compressor=compressor, ignored=ignored
            )
        (model,) = modules
        ignored = [*unused, *sorted(experts.names)] if experts is not None else unused
        ddp = _ddp(model, mesh, device, ignored, find_unused)
        if compressor is not None:
            ddp.register_comm_hook(None, compressor.hook)
        return replace(result, ddp=ddp, compressor=compressor)
    from torch.distributed.fsdp import fully_shard

    reshard = par.zero == 3
    policy = {"mp_policy": policy} if (policy := fsdp_policy(plan)) is not None else {}
    if experts is not None:  # Note [experts under ZeRO] (hyparallel.runtime.experts)
        for module in modules:
            for unit, replicas in experts.units(module):
                fully_shard(unit, mesh=replicas, reshard_after_forward=reshard, **policy)
                # Note [an expert unit prefetches nothing] (hyparallel.runtime.experts): only
                # itself, which its own pre-backward has gathered already
                unit.set_modules_to_backward_prefetch([unit])
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **policy)
    for module in modules:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **policy)
    return result


def _ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    device: torch.device,
    unused: Sequence[str] = (),
    find_unused: bool = False,
) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    if unused:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(unused))

    ids = [device.index] if device.type == "cuda" else None
    # Buffers (rotary tables) are computed alike on every rank: no broadcast before each forward.
    quiet = (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else "broadcast_buffers"
    )  # renamed in newer torch
    return DistributedDataParallel(
        model,
        device_ids=ids,
        process_group=mesh.get_group(),
        find_unused_parameters=find_unused,
        **{quiet: False},
    )


def all_reduce_mean(
    grads: list[torch.Tensor], group: Any, size: int, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Average ``grads`` over ``group`` in place, in flat buckets of about ``bucket_bytes`` (DDP's
    default)."""
    bucket: list[torch.Tensor] = []
    for grad in [*grads, None]:
        if grad is not None:
            bucket.append(grad)
        if bucket and (
            grad is None or sum(g.numel() * g.element_size() for g in bucket) >= bucket_bytes
        ):
            flat = torch.cat([g.flatten() for g in bucket])
            dist.all_reduce(flat, group=group)
            flat /= size
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket = []
