"""The loss a user reads, the same under every plan, and fp16's dynamic loss scaling.

Note [the loss a user reads]
    ``train_step`` and ``eval_step`` return the loss of the *global* batch as one device computes
    it, whatever the plan cuts it into (micro-batches, data-parallel ranks, pipeline stages), and
    train on its gradient:

    - the default loss (token cross-entropy): the sum over every target token of the global batch
      that is not ``ignore_index`` (-100, padding), divided by their count;
    - a ``loss_fn(output, targets)`` returning a scalar: taken as the micro-batch's *mean* over
      equally weighted rows. The global loss is the mean over micro-batches and data-parallel ranks,
      which is one device's ``loss_fn(global batch)`` for such a loss (mean-reduced MSE,
      cross-entropy with nothing ignored): every micro-batch and rank share has the same number of
      rows. A mean whose rows weigh differently (ignored padding, per-sample weights) is then a mean
      of means, which depends on the plan: return a pair instead;
    - a ``loss_fn`` returning a pair ``(total, count)``: the sum of the loss over what it counts and
      that count (``F.cross_entropy(..., reduction="sum", label_smoothing=0.1)`` and ``(targets !=
      -100).sum()``). The global loss is the global total over the global count: the single device's
      mean for any such loss, as Megatron-Core's per-token loss. Its gradient is scaled once the
      step's count is known (Note [a step's own gradients]).

    Each micro-batch reports a (numerator, denominator) pair: (its mean, 1), (total, count), or the
    default loss's (token sum, token count). The pairs are summed on the last pipeline stage and
    over the pipeline and data-parallel ranks; the loss is their quotient, the same float on every
    rank.

Note [a step's own gradients]
    Two factors are known only after a step's backward: fp16's ``1 / loss scale`` (unscaling, which
    must precede a look at the gradients) and a ``(total, count)`` loss's ``dp / global count``.
    They apply to what this step added, not to what earlier calls accumulated: gradients already
    there are set aside before the step (the parameters' ``.grad`` set to None), the step's own are
    scaled, and the earlier ones are added back. So after every ``train_step`` the gradients are
    plain, unscaled ones, ready for clipping or inspection. Setting aside costs nothing in the usual
    loop (``zero_grad()`` leaves None) and one more copy of the gradients while accumulating over
    calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyparallel.graph.kinds import logits_of
from hyparallel.spec.errors import ConfigError

IGNORE_INDEX = -100  # targets with this value (padding) are not counted, as in F.cross_entropy

__all__ = [
    "IGNORE_INDEX",
    "LossScaler",
    "MicroBatchLoss",
    "StepLoss",
    "default_loss",
    "global_loss",
    "scale_grad",
    "token_cross_entropy",
    "user_loss",
]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(value: torch.Tensor, factor: float) -> torch.Tensor:
    """``value`` unchanged, its gradient multiplied by ``factor`` on the way back (loss scaling,
    accumulation)."""
    return value if factor == 1.0 else _ScaleGrad.apply(value, factor)


@dataclass
class MicroBatchLoss:
    """The loss rule of one step (Note [the loss a user reads]): a ``loss_fn`` for the runtime, and
    its reports.

    ``fn`` is the user's ``loss_fn`` or the default loss as ``(token sum, token count)``;
    ``runtime_mean`` is how the runtime weighs micro-batches (it divides each one's value by ``m``,
    and DDP/FSDP average ``dp`` ranks);
    ``backward_factor`` multiplies every gradient on its way back (the fp16 loss scale, 1 /
    accumulate);
    ``global_count``, when known before the step (the default loss), scales a pair loss's value for
    the backward so that no factor is left for after it.
    """

    fn: Any
    m: int
    dp: int
    backward_factor: float = 1.0
    global_count: torch.Tensor | None = None
    # per micro-batch: (numerator, denominator)
    reports: list[torch.Tensor] = field(default_factory=list)
    pair: bool | None = None  # whether fn returned (total, count); None until its first call

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        value = self.fn(output, targets)
        pair = isinstance(value, (tuple, list))
        if self.pair is not None and pair != self.pair:
            raise TypeError(
                "loss_fn returned a scalar for one micro-batch and a (total, count) pair for"
                " another"
            )
        self.pair = pair
        if not pair:
            loss = _scalar(value, "loss_fn")
            self.reports.append(
                torch.stack([loss.detach().float(), torch.ones((), device=loss.device)])
            )
            return scale_grad(loss, self.backward_factor)
        if len(value) != 2:
            raise TypeError(
                f"loss_fn returned a tuple of {len(value)}; return a scalar mean or (total, count)"
            )
        total = _scalar(value[0], "loss_fn's total")
        count = torch.as_tensor(value[1], device=total.device).detach().float().reshape(())
        self.reports.append(torch.stack([total.detach().float(), count]))
        # The runtime divides by m and data parallelism averages dp ranks: undone here, so the
        # gradient is the sum's, divided by the global count (now, when known; else after the step:
        # Note [a step's own gradients]).
        weight = self.m * self.dp / self.global_count if self.global_count is not None else self.m
        return scale_grad(total * weight, self.backward_factor)

    def needs_count_after(self) -> bool:
        """Whether the step's gradients still wait for the global count (a pair loss, its count
        unknown before)."""
        return bool(self.pair) and self.global_count is None

    def local_report(self, device: torch.device) -> torch.Tensor:
        """(numerator, denominator, is pair) summed over this rank's micro-batches; zeros where no
        loss ran."""
        summed = torch.stack(self.reports).sum(0) if self.reports else torch.zeros(2, device=device)
        return torch.cat([summed.to(device), torch.tensor([float(bool(self.pair))], device=device)])


def _scalar(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
        raise TypeError(
            f"{what} must be a scalar tensor (a micro-batch's mean loss, or a (total, count) pair),"
            f" got {type(value).__name__}{shape}"
        )
    return value


class LossScaler:
    """Dynamic loss scaling for fp16 plans, with ``torch.amp.GradScaler``'s semantics and defaults.

    The loss's gradient is multiplied by ``scale`` on its way back, so that small fp16 gradients do
    not flush to zero; the step's gradients are divided by it again before anyone sees them (Note [a
    step's own gradients]). A step whose gradients hold an inf or NaN on any rank (``found_inf``,
    agreed over every rank of every axis) is skipped by the optimizer and halves the scale;
    ``growth_interval`` clean steps in a row double it.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if not (
            growth_factor > 1.0
            and 0.0 < backoff_factor < 1.0
            and growth_interval >= 1
            and init_scale > 0
        ):
            raise ConfigError(
                f"loss scaler: init_scale {init_scale}, growth_factor {growth_factor},"
                f" backoff_factor {backoff_factor}, growth_interval {growth_interval}; need"
                " init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval"
                " >= 1"
            )
        self.scale, self.growth_factor, self.backoff_factor = (
            float(init_scale),
            growth_factor,
            backoff_factor,
        )
        self.growth_interval, self.growth_tracker = growth_interval, 0
        self.skipped_steps = 0  # optimizer steps skipped for an inf or NaN, over the run

    def update(self, found_inf: bool) -> None:
        """After a step's gradients are checked: back off on an inf/NaN, grow after enough clean
        steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint keeps (GradScaler's keys)."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "growth_tracker": self.growth_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Resume from :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))


def token_cross_entropy(
    output: Any, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of next-token logits ``(B, T, V)`` (or an output with ``.logits``) against
    ``(B, T)``.

    Targets equal to ``IGNORE_INDEX`` (-100, padding) count for nothing.
    """
    logits = logits_or_output(output)
    return F.cross_entropy(
        logits.flatten(0, -2).float(),
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def logits_or_output(output: Any) -> torch.Tensor:
    """What the default loss reads (``logits_of``), or the whole output."""
    logits = logits_of(output)
    return output if logits is None else logits


def user_loss(loss_fn: Callable, m: int, dp: int, sliced_logits: bool) -> MicroBatchLoss:
    """The rule of a ``loss_fn`` of the user's (a scalar mean or a (total, count) pair), refused on
    sliced logits."""
    if sliced_logits:
        raise ConfigError(
            "this plan computes the loss on each tp rank's slice of the logits"
            " (parallel.vocab_parallel_loss: true), so a loss_fn of your own would see a slice in"
            " training; use train_step's default loss, or set vocab_parallel_loss: false in the"
            " plan (`hyparallel plan --no-vocab-parallel-loss`, hp.plan(...,"
            " vocab_parallel_loss=False)) to gather them"
        )
    return MicroBatchLoss(loss_fn, m, dp)


def default_loss(targets: Any, m: int, dp: int, dp_group, tp_info: Any = None) -> MicroBatchLoss:
    """Token cross-entropy as (token sum, token count), its global count all-reduced over
    ``dp_group`` first: a micro-batch's tokens weigh as in one big batch, padding (``IGNORE_INDEX``)
    nowhere. With ``tp_info`` (a vocab-parallel head's TensorParallelInfo) it is computed on each
    rank's slice of the logits."""
    if not isinstance(targets, torch.Tensor):
        raise ConfigError(
            "the default loss (token cross-entropy) needs targets: a (batch, sequence) tensor of"
            " token ids; pass targets, or a loss_fn that reads the output (lambda output, _:"
            " output.loss)"
        )
    count = (targets != IGNORE_INDEX).sum().float()
    if dp > 1:
        dist.all_reduce(count, group=dp_group)

    def default(output: Any, goal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counted = (goal != IGNORE_INDEX).sum()
        if tp_info is None:
            return token_cross_entropy(output, goal, reduction="sum"), counted
        from hyparallel.tensor import vocab_parallel_cross_entropy

        logits = logits_or_output(output)
        mean = vocab_parallel_cross_entropy(
            logits, goal, tp_info.group, tp_info.vocab_start, tp_info.vocab_size
        )
        return mean * counted, counted

    return MicroBatchLoss(default, m, dp, global_count=count)


def global_loss(
    rule: MicroBatchLoss, device: torch.device, groups: list
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(loss, global denominator, whether the loss was a pair): this rank's micro-batch reports
    summed over
    ``groups`` (the pipeline's, where only the last stage has any, and the data-parallel one; Note
    [the loss a user reads])."""
    report = rule.local_report(device).double()
    for group in groups:
        dist.all_reduce(report, group=group)
    pair = bool(report[2] > 0)
    numerator, denominator = report[0], report[1]
    loss = (numerator / denominator.clamp_min(1.0) if pair else numerator / denominator).float()
    return loss, denominator, pair


def scale_step_gradients(
    grads: list[torch.Tensor], factor: float, check_finite: bool, device: torch.device
) -> bool:
    """Multiply a step's own gradients by ``factor``; with ``check_finite`` (fp16) in torch's fused
    unscale-and-check, the inf/NaN flag agreed over every rank (all-reduce max on the default
    group). Returns whether any was found."""
    # FSDP2's DTensors: their shards
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not check_finite:
        if factor != 1.0 and local:
            torch._foreach_mul_(local, factor)
        return False
    found = torch.zeros(1, device=device)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in local:
        by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for tensors in by_kind.values():
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, found, torch.full((1,), factor, device=device)
        )
    # every rank of every axis agrees (Note [fp16 loss scaling])
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


# Note [fp16 loss scaling]
#     fp16 has 5 exponent bits: gradients below 6e-8 flush to zero in its backward, and training
#     degrades without an error. An fp16 plan therefore scales the loss as torch.amp.GradScaler does
#     (hyparallel.runtime.loss.LossScaler, its defaults): the loss's gradient is multiplied by the
#     scale (2^16 at first), and after the backward the step's own gradients are divided by it and
#     checked for inf and NaN in one pass (torch's fused
#     _amp_foreach_non_finite_check_and_unscale_). The flag is all-reduced (max) over every rank, so
#     the tp, pp and dp ranks agree. On an inf the scale halves and the next optimizer step is
#     skipped: a hook every torch.optim.Optimizer runs before its step
#     (register_optimizer_step_pre_hook) takes this model's gradients off the parameters of an
#     optimizer holding them, and torch's optimizers leave a parameter without a gradient untouched
#     (no update, no weight decay, no moment or step count change). growth_interval clean steps
#     double it. So the loop stays `loss = pmodel.train_step(...); opt.step(); opt.zero_grad()`, and
#     clipping (pmodel.clip_grad_norm_, or torch's) sees unscaled gradients. ``pmodel.scaler`` holds
#     the state; checkpoints save and restore it. bf16 has fp32's exponent range and needs none.


def hook_optimizer_steps(pmodel: Any) -> list[Any]:
    """Hooks around every torch optimizer's step, acting on those holding ``pmodel``'s parameters:
    skip a step after an fp16 inf (Note [fp16 loss scaling]) and count optimizer steps (Note [what a
    measured step is])."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model = weakref.ref(pmodel)

    def owned(optimizer) -> list[torch.nn.Parameter]:
        live = model()
        if live is None:
            return []
        return [
            p for group in optimizer.param_groups for p in group["params"] if id(p) in live._own_ids
        ]

    def before(optimizer, args, kwargs) -> None:
        live = model()
        if live is not None and live._skip_optimizer_step:
            for param in owned(optimizer):
                param.grad = None
            if live.scaler is not None:
                live.scaler.skipped_steps += 1

    def after(optimizer, args, kwargs) -> None:
        live = model()
        if live is not None and owned(optimizer):
            live._optimizer_steps += 1
            live._skip_optimizer_step = False

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    weakref.finalize(pmodel, lambda: [handle.remove() for handle in handles])
    return handles


class StepLoss(torch.Tensor):
    """The loss train_step returns: a detached scalar (adding it up builds no graph) whose
    ``backward()`` says that train_step ran the backward already; any operation on it gives a plain
    tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self.as_subclass(torch.Tensor))

    def __format__(self, spec: str) -> str:
        return format(self.as_subclass(torch.Tensor), spec)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "train_step already ran the backward of its loss (and synchronised the gradients): do"
            " not call loss.backward() on what it returns; call optimizer.step() next"
        )


def detached_loss(loss: torch.Tensor) -> StepLoss:
    """``loss`` as train_step returns it: detached, a :class:`StepLoss`."""
    return torch.Tensor._make_subclass(StepLoss, loss.detach())
