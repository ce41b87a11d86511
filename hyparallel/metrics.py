"""Run-time figures of a ParallelModel: step time, tokens/s, TFLOP/s per device, MFU and peak memory,
next to what the plan predicted for them.

Note [what a measured step is]
    A step is the wall time from one ``train_step`` call to the next, so it covers what a training loop
    really spends per step: forward, backward, gradient sync, the optimizer, clipping and the data loading of
    the next batch. On CUDA the boundaries are CUDA events on the current stream (no synchronisation is
    added; they are read once complete), on the CPU ``time.perf_counter``. The last step closes when
    :meth:`RunMetrics.summary` (or ``close``) is called. The first ``warmup`` steps (allocator growth,
    Triton autotuning, NCCL communicator set-up) are left out of the summary. Model FLOPs are the planner's:
    3 x the traced forward FLOPs per token x tokens (no recomputation counted), so measured and predicted
    TFLOP/s and MFU mean the same thing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from hyparallel.schema import Plan


@dataclass(frozen=True)
class StepFigures:
    """One step, or the median of several: what was measured and, where the plan has them, the predictions."""

    steps: int
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float | None  # None: the plan names no cluster, so no peak to divide by
    peak_memory_gib: float | None  # this rank's CUDA peak (allocated); None on the CPU
    predicted_step_time_s: float | None = None
    predicted_tokens_per_s: float | None = None
    predicted_mfu: float | None = None
    predicted_memory_gib: float | None = None  # this rank's stage, without the preset's reserve: as allocated

    def line(self) -> str:
        """One log line: measured figures, with the prediction where there is one."""
        parts = [
            f"{self.step_time_s * 1e3:,.1f} ms/step" + _vs(self.step_time_s, self.predicted_step_time_s),
            f"{self.tokens_per_s:,.0f} tokens/s",
            f"{self.tflops_per_gpu:,.3g} TFLOP/s per device",
        ]
        if self.mfu is not None:
            parts.append(
                f"MFU {self.mfu:.1%}" + (f" (predicted {self.predicted_mfu:.1%})" if self.predicted_mfu else "")
            )
        if self.peak_memory_gib is not None:
            parts.append(
                f"peak {self.peak_memory_gib:.2f} GiB"
                + (f" (predicted {self.predicted_memory_gib:.2f})" if self.predicted_memory_gib else "")
            )
        return ", ".join(parts)


def _vs(measured: float, predicted: float | None) -> str:
    return f" (predicted {predicted * 1e3:,.1f}, x{measured / predicted:.2f})" if predicted else ""


class RunMetrics:
    """Records every ``train_step`` of a ParallelModel; see Note [what a measured step is]."""

    def __init__(self, plan: Plan, flops_per_token: float, device: torch.device, pp_rank: int, warmup: int = 1):
        self.plan, self.flops_per_token, self.device, self.pp_rank, self.warmup = (
            plan,
            flops_per_token,
            device,
            pp_rank,
            warmup,
        )
        self._open: tuple[object, int] | None = None  # the step in progress: its start mark and global tokens
        self._pending: list[tuple[object, object, int]] = []  # closed CUDA steps whose end events may not be done
        self._steps: list[tuple[float, int]] = []  # closed steps: seconds and global tokens

    def step_started(self, tokens: int) -> None:
        """Called by train_step on entry: closes the previous step, opens this one with ``tokens`` global tokens."""
        mark = self._mark()
        if self._open is not None:
            self._pending.append((self._open[0], mark, self._open[1]))
        self._open = (mark, tokens)

    def close(self) -> None:
        """Ends the step in progress and waits for the device; the next train_step opens a new one."""
        if self._open is not None:
            self._pending.append((self._open[0], self._mark(), self._open[1]))
            self._open = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def steps(self) -> list[tuple[float, int]]:
        """(seconds, global tokens) of each closed step, in order (on CUDA, those whose events have completed)."""
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
        """The median of the last ``count`` closed steps (warm-up included), or None before the first closes."""
        steps = self.steps()[-count:]
        return self._figures(steps) if steps else None

    def summary(self) -> StepFigures | None:
        """Closes the step in progress and gives the median over the steps after warm-up (all if that is none)."""
        self.close()
        steps = self.steps()
        return self._figures(steps[self.warmup :] if len(steps) > self.warmup else steps) if steps else None

    def _figures(self, steps: list[tuple[float, int]]) -> StepFigures:
        step_s = statistics.median(seconds for seconds, _ in steps)
        tokens_per_s = statistics.median(tokens / seconds for seconds, tokens in steps)
        tflops = 3 * self.flops_per_token * tokens_per_s / self.plan.world_size / 1e12
        cluster, predicted = self.plan.cluster, self.plan.predicted
        peak = getattr(cluster.device.peak_flops, self.plan.training.dtype) if cluster else None
        memory = None
        if self.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.device) / 2**30
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
            predicted_memory_gib=(
                predicted.memory_gib[self.pp_rank] - cluster.device.reserved_bytes / 2**30
                if predicted and cluster
                else None
            ),
        )

    def _mark(self) -> object:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
