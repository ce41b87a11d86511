"""Training figures to TensorBoard and Weights & Biases, from rank 0: ``hp.tracking.Tracker``.

    # every rank
    tracker = hp.tracking.Tracker(pmodel, tensorboard_dir="runs/gpt", wandb_project="gpt")
    for step in range(steps):
        loss = pmodel.train_step(inputs, targets)
        opt.step(); opt.zero_grad()
        tracker.log(step, loss=loss, lr=scheduler.get_last_lr()[0])
    tracker.close()

Each ``log`` writes the loss, the caller's scalars under their own names, and the figures of the
step
``pmodel.metrics`` closed last under ``perf/`` (step time, tokens/s, TFLOP/s per device, MFU, this
rank's peak memory; Note [what a measured step is] in hyparallel/runtime/metrics.py: a measured step
closes when the next one's first ``train_step`` starts, so at ``log(step)`` they describe the step
before). ``train_step``'s loss is the global mean on every rank, so rank 0 alone writes, and the
other ranks' trackers do nothing (no collective). TensorBoard needs the ``tensorboard`` package
(``pip install "hyparallel[track]"``), W&B the ``wandb`` package; each is imported only when asked
for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyparallel.spec.errors import ConfigError

__all__ = ["Tracker"]

# StepFigures field -> the name it is logged under (None values, e.g. MFU without a cluster, are
# left out).
FIGURES = {
    "step_time_s": "perf/step_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops_per_gpu": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "peak_memory_gib": "perf/peak_memory_gib",
}


class Tracker:
    """Logs the loss, the caller's scalars and each step's measured figures to TensorBoard and/or
    W&B on rank 0.

    ``tensorboard_dir``: a folder for TensorBoard's event files; ``wandb_project``: a W&B project
    (``run_name`` names the run there; the W&B run's config is the plan's ``training`` and
    ``parallel`` sections plus ``config``; ``WANDB_MODE=offline`` keeps it local). Neither given:
    nothing is written. Every rank may make one; on other ranks it does nothing.
    """

    def __init__(
        self,
        pmodel,
        *,
        tensorboard_dir: str | Path | None = None,
        wandb_project: str | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.pmodel = pmodel
        self.active = pmodel.env.rank == 0
        self._tensorboard = self._wandb = None
        if not self.active:
            return
        if tensorboard_dir is not None:
            self._tensorboard = _summary_writer(Path(tensorboard_dir))
        if wandb_project is not None:
            wandb = _import_wandb()
            plan = pmodel.plan
            self._wandb = wandb.init(
                project=wandb_project,
                name=run_name,
                config={
                    "training": plan.training.model_dump(),
                    "parallel": plan.parallel.model_dump(),
                    "world_size": plan.world_size,
                    **(config or {}),
                },
            )

    def log(self, step: int, loss: Any = None, **scalars: Any) -> None:
        """Write ``loss`` (a number or a one-element tensor), ``scalars`` by name and the last
        closed step's figures (``perf/...``) for ``step``; rank 0 only."""
        if not self.active or (self._tensorboard is None and self._wandb is None):
            return
        values = {name: _number(value, name) for name, value in scalars.items()}
        if loss is not None:
            values["loss"] = _number(loss, "loss")
        figures = self.pmodel.metrics.last()
        if figures is not None:
            for field, name in FIGURES.items():
                value = getattr(figures, field)
                if value is not None:
                    values[name] = float(value)
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        """Flush and close the writers (the W&B run finishes); every rank may call it."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary_writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            f"tensorboard_dir={str(folder)!r}: TensorBoard logging needs the tensorboard package;"
            ' pip install "hyparallel[track]" (or pip install tensorboard), or leave'
            " tensorboard_dir out"
        ) from None
    return SummaryWriter(log_dir=str(folder))


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "wandb_project: Weights & Biases logging needs the wandb package; pip install wandb, or"
            " leave wandb_project out"
        ) from None
    return wandb


def _number(value: Any, name: str) -> float:
    """A scalar to log: a number, or a tensor of one element (read on rank 0 only)."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(
        f"Tracker.log: {name}={value!r} is not a number; log scalars (a float, or a 1-element"
        " tensor)"
    )
