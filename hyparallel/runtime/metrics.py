"""Run-time figures of a ParallelModel: step time, tokens/s, TFLOP/s per device, MFU and peak
memory, next to what the plan predicted for them.

Note [what a measured step is]
    A step is the wall time from one optimizer step's first ``train_step`` call to the next one's
    (calls that accumulate gradients between two optimizer steps are one step, their tokens added
    up; before any optimizer step is seen, each call is one), so it covers what a training loop
    really spends per step: forward, backward, gradient sync, the optimizer, clipping and the data
    loading of the next batch. On CUDA the boundaries are CUDA events on the current stream (no
    synchronisation is added; they are read once complete), on the CPU ``time.perf_counter``. The
    last step closes when :meth:`RunMetrics.summary` (or ``close``) is called. The first ``warmup``
    steps (allocator growth, Triton autotuning, NCCL communicator set-up) are left out of the
    summary. Model FLOPs are the planner's: 3 x the traced forward FLOPs per token x tokens (no
    recomputation counted), so measured and predicted TFLOP/s and MFU mean the same thing.

Note [peak memory on the CPU]
    :func:`measured_peak_bytes` is the one place a rank's peak is measured. On CUDA it is
    ``torch.cuda.max_memory_allocated``, which the planner's memory figures (without the preset's
    reserve) describe. The CPU has no allocator counter; a stand-in until an honest CPU measurement
    replaces this function: the process's peak resident set (``VmHWM``, which never goes down) less
    the cluster's ``reserved_bytes``, which the cpu preset sets to what a torch + gloo process holds
    before any model. It counts what the interpreter and the allocator's caches hold beyond that
    too, so it reads high, not low.

Note [online calibration]
    ``calibrate_online`` arms the fit of hyparallel.planner.online: after ``warmup`` steps, the
    median of the next ``steps`` is compared with the plan's prediction on every rank
    (``RunMetrics.comparison``); when they differ by more than ``threshold``, rank 0 alone fits the
    cluster (Note [what the fit changes] in hyparallel/planner/online.py), writes it, re-plans and
    logs one line. That happens once, inside the train_step call that follows the last measured
    step, after that step is closed and before the new one opens (so no measured step contains it)
    and before any collective of the new step: the other ranks wait for rank 0 at their first
    collective of that step, as long as the fit and re-plan take (measured on this project's CPU
    machine: 0.1 s for gpt-tiny, 1.1 s for gpt-mini on 8 processes, about 25 s for GPT-3 175B,
    mostly its trace; it must stay within the collective timeout, HYPARALLEL_TIMEOUT), and no
    collective is added, skipped or reordered. The
    running plan is never changed. A failure of the fit (the model spec does not load, nothing
    reproduces the step) is logged as one line and training goes on.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hyparallel.spec.cluster import ClusterSpec
from hyparallel.spec.errors import HyparallelError
from hyparallel.spec.schema import Plan


@dataclass(frozen=True)
class StepFigures:
    """One step, or the median of several: what was measured and, where the plan has them, the
    predictions."""

    steps: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float | None  # None: the plan names no cluster, so no peak to divide by
    # this rank's peak (measured_peak_bytes); None on the CPU without a cluster
    peak_memory_gib: float | None
    predicted_step_time_s: float | None = None
    predicted_tokens_per_s: float | None = None
    predicted_mfu: float | None = None
    # this rank's stage, without the preset's reserve: as allocated
    predicted_memory_gib: float | None = None

    def line(self) -> str:
        """One log line: measured figures, with the prediction where there is one."""
        parts = [
            f"{self.step_time_s * 1e3:,.1f} ms/step"
            + _vs(self.step_time_s, self.predicted_step_time_s),
            f"{self.tokens_per_s:,.0f} tokens/s",
            f"{self.tflops_per_gpu:,.3g} TFLOP/s per device",
        ]
        if self.mfu is not None:
            parts.append(
                f"MFU {self.mfu:.1%}"
                + (f" (predicted {self.predicted_mfu:.1%})" if self.predicted_mfu else "")
            )
        if self.peak_memory_gib is not None:
            parts.append(
                f"peak {self.peak_memory_gib:.2f} GiB"
                + (
                    f" (predicted {self.predicted_memory_gib:.2f})"
                    if self.predicted_memory_gib
                    else ""
                )
            )
        return ", ".join(parts)


def _vs(measured: float, predicted: float | None) -> str:
    return f" (predicted {predicted * 1e3:,.1f}, x{measured / predicted:.2f})" if predicted else ""


def measured_peak_bytes(device: torch.device, cluster: ClusterSpec | None) -> int | None:
    """This process's peak memory as the planner's figures without the reserve count it (Note [peak
    memory on the CPU]): CUDA's max_memory_allocated; on the CPU the peak resident set less
    ``cluster``'s reserve (a stand-in)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if cluster is None:
        return None
    peak = _peak_rss_bytes()
    return None if peak is None else max(peak - cluster.device.reserved_bytes, 0)


def _peak_rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass(frozen=True)
class OnlineSettings:
    """What ``calibrate_online`` armed (Note [online calibration])."""

    out: str | None
    model: str | None
    warmup: int
    steps: int
    threshold: float
    switch_gain: float
    log: Callable[[str], None]


@dataclass(frozen=True)
class Comparison:
    """One rank's measured step and peak against the plan's prediction, after the warm-up."""

    measured_step_s: float
    predicted_step_s: float
    measured_memory_gib: float | None
    predicted_memory_gib: float | None

    @property
    def step_error(self) -> float:
        """measured / predicted - 1 (0.3: 30% slower than predicted)."""
        return self.measured_step_s / self.predicted_step_s - 1

    @property
    def memory_under(self) -> bool:
        """Whether the measured peak is above the prediction (an under-prediction)."""
        return (
            self.measured_memory_gib is not None
            and self.predicted_memory_gib is not None
            and self.measured_memory_gib > self.predicted_memory_gib
        )


class RunMetrics:
    """Records every ``train_step`` of a ParallelModel; see Note [what a measured step is]."""

    def __init__(
        self,
        plan: Plan,
        flops_per_token: float,
        device: torch.device,
        pp_rank: int,
        warmup: int = 1,
        rank: int = 0,
    ):
        self.plan, self.flops_per_token, self.device, self.pp_rank, self.warmup = (
            plan,
            flops_per_token,
            device,
            pp_rank,
            warmup,
        )
        self.rank = rank
        # the step in progress: its start mark and global tokens
        self._open: tuple[object, int] | None = None
        # closed CUDA steps whose end events may not be done
        self._pending: list[tuple[object, object, int]] = []
        self._steps: list[tuple[float, int]] = []  # closed steps: seconds and global tokens
        self._online: OnlineSettings | None = None
        # set once the online warm-up and measured steps are done
        self.comparison: Comparison | None = None
        self.calibration = None  # rank 0: the hyparallel.planner.online.Calibration, once fitted
        # ep > 1 (ParallelModel sets it): the experts' load imbalance this rank saw, read alone (no
        # collective: ranks reach the comparison at different times on CUDA)
        self.read_imbalance: Callable[[], float | None] = lambda: None

    def calibrate_online(
        self,
        out: str | Path | None = None,
        *,
        model: str | None = None,
        warmup: int | None = None,
        steps: int | None = None,
        threshold: float | None = None,
        switch_gain: float | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        """Arm online calibration (Note [online calibration]); call it on every rank, before
        training.

        ``out``: where rank 0 writes the corrected cluster (default ``<cluster>-corrected.yaml`` in
        the working folder; an existing file is never replaced: a free ``-2``, ``-3``... name beside
        it is used). ``model``: the spec ``hyparallel plan --model`` takes (default the plan's model
        name). ``warmup`` steps are left out, the median of the next ``steps`` is the measurement, a
        fit follows when it is off the prediction by more than ``threshold``, and another plan is
        suggested when it is predicted more than ``switch_gain`` faster (defaults:
        hyparallel.planner.online's DEFAULT_*). ``log`` takes rank 0's line (default: printed).
        """
        from hyparallel.planner import online

        values = {
            "warmup": online.DEFAULT_WARMUP_STEPS if warmup is None else warmup,
            "steps": online.DEFAULT_MEASURED_STEPS if steps is None else steps,
            "threshold": online.DEFAULT_THRESHOLD if threshold is None else threshold,
            "switch_gain": online.DEFAULT_SWITCH_GAIN if switch_gain is None else switch_gain,
        }
        for name, value in values.items():
            low = 1 if name == "steps" else 0
            if not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
            ):
                raise HyparallelError(
                    f"calibrate_online: {name}={value!r}; give a number of at least {low}"
                )
        self._online = OnlineSettings(
            out=None if out is None else str(out),
            model=model,
            log=log or (lambda line: print(line, flush=True)),
            **values,
        )

    def step_started(self, tokens: int) -> None:
        """Called by train_step on entry: closes the previous step, opens this one with ``tokens``
        global tokens."""
        mark = self._mark()
        if self._open is not None:
            self._pending.append((self._open[0], mark, self._open[1]))
            if self._online is not None and self.comparison is None:
                if self._check_online():
                    mark = self._mark()  # the fit's time is in no measured step
        self._open = (mark, tokens)

    def add_tokens(self, tokens: int) -> None:
        """Called by a train_step that accumulates into the step in progress (no optimizer step
        since the last)."""
        if self._open is not None:
            self._open = (self._open[0], self._open[1] + tokens)

    def _check_online(self) -> bool:
        """Compare after the warm-up; on rank 0, fit and re-plan when off by more than the
        threshold.

        Returns whether anything was done (the comparison is made once).
        """
        settings, predicted = self._online, self.plan.predicted
        measured = self._measured_step(settings)
        if measured is None:
            return False
        if predicted is None:
            self.comparison = Comparison(measured, float("nan"), None, None)
            if self.rank == 0:
                settings.log(
                    "online calibration: the plan has no prediction to compare the measured steps"
                    " with"
                )
            return True
        memory = measured_peak_bytes(self.device, self.plan.cluster)
        self.comparison = Comparison(
            measured,
            predicted.step_time_s,
            None if memory is None else memory / 2**30,
            self._predicted_memory_gib(),
        )
        if self.rank != 0:
            return False
        if (
            abs(self.comparison.step_error) <= settings.threshold
            and not self.comparison.memory_under
        ):
            settings.log(
                f"online calibration: step {measured * 1e3:,.4g} ms measured vs"
                f" {predicted.step_time_s * 1e3:,.4g} predicted, within {settings.threshold:.0%}:"
                " the cluster file stands"
            )
            return True
        # the experts' imbalance rank 0 saw, which the fit costs them with
        self._fit(settings, measured, memory, self.read_imbalance())
        return True

    def _measured_step(self, settings: OnlineSettings) -> float | None:
        from hyparallel.planner import online

        return online.measured_step(
            [seconds for seconds, _ in self.steps()], settings.warmup, settings.steps
        )

    def _fit(
        self,
        settings: OnlineSettings,
        measured: float,
        memory: int | None,
        imbalance: float | None = None,
    ) -> None:
        from hyparallel.planner import online

        try:
            out = settings.out or f"{self.plan.cluster.name}-corrected.yaml"
            self.calibration = online.calibrate(
                self.plan,
                measured,
                model=settings.model,
                measured_memory_bytes=memory,
                out=online.free_path(out),
                expert_imbalance=imbalance,
            )
        except HyparallelError as error:
            settings.log(
                f"online calibration: step {measured * 1e3:,.4g} ms measured; no fit: {error}"
            )
            return
        # a bug in the fit must not end a training run that does not need it
        except Exception as error:
            settings.log(
                "online calibration failed (a bug: please report it with this line):"
                f" {type(error).__name__}: {error}; training goes on with its plan"
            )
            return
        settings.log(self.calibration.line(settings.switch_gain))

    def record(self, model: str | None = None) -> dict | None:
        """What ``hyparallel calibrate --from-run`` reads (hyparallel.planner.online.run_record):
        the summary, every step's seconds and the plan; None before a step closed."""
        from hyparallel.planner import online

        summary = self.summary()
        if summary is None:
            return None
        steps = [seconds for seconds, _ in self.steps()]
        return online.run_record(
            summary,
            self.plan,
            model or self._model_spec(),
            steps,
            self.calibration,
            self.read_imbalance(),
        )

    def _model_spec(self) -> str | None:
        return self._online.model if self._online and self._online.model else None

    def close(self) -> None:
        """Ends the step in progress and waits for the device; the next train_step opens a new
        one."""
        if self._open is not None:
            self._pending.append((self._open[0], self._mark(), self._open[1]))
            self._open = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def steps(self) -> list[tuple[float, int]]:
        """(seconds, global tokens) of each closed step, in order (on CUDA, those whose events have
        completed)."""
        while self._pending:
            start, end, tokens = self._pending[0]
            if isinstance(start, float):
                seconds = end - start
            elif end.query():
                seconds = start.elapsed_time(end) / 1e3
            else:
                break
            self._steps.append((seconds, tokens))
            self._pending.pop(0)
        return list(self._steps)

    def last(self, count: int = 1) -> StepFigures | None:
        """The median of the last ``count`` closed steps (warm-up included), or None before the
        first closes."""
        steps = self.steps()[-count:]
        return self._figures(steps) if steps else None

    def summary(self) -> StepFigures | None:
        """Closes the step in progress and gives the median over the steps after warm-up (all if
        that is none)."""
        self.close()
        steps = self.steps()
        return (
            self._figures(steps[self.warmup :] if len(steps) > self.warmup else steps)
            if steps
            else None
        )

    def _figures(self, steps: list[tuple[float, int]]) -> StepFigures:
        step_s = statistics.median(seconds for seconds, _ in steps)
        tokens_per_s = statistics.median(tokens / seconds for seconds, tokens in steps)
        tflops = 3 * self.flops_per_token * tokens_per_s / self.plan.world_size / 1e12
        cluster, predicted = self.plan.cluster, self.plan.predicted
        peak = getattr(cluster.device.peak_flops, self.plan.training.dtype) if cluster else None
        peak_bytes = measured_peak_bytes(self.device, cluster)
        memory = None if peak_bytes is None else peak_bytes / 2**30
        return StepFigures(
            steps=len(steps),
            step_time_s=step_s,
            tokens_per_s=tokens_per_s,
            tflops_per_gpu=tflops,
            mfu=tflops * 1e12 / peak if peak else None,
            peak_memory_gib=memory,
            predicted_step_time_s=predicted.step_time_s if predicted else None,
            predicted_tokens_per_s=predicted.tokens_per_s if predicted else None,
            predicted_mfu=predicted.mfu if predicted else None,
            predicted_memory_gib=self._predicted_memory_gib(),
        )

    def _predicted_memory_gib(self) -> float | None:
        """This rank's stage's predicted peak without the preset's reserve: as allocated."""
        cluster, predicted = self.plan.cluster, self.plan.predicted
        if predicted is None or cluster is None:
            return None
        return predicted.memory_gib[self.pp_rank] - cluster.device.reserved_bytes / 2**30

    def _mark(self) -> object:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
