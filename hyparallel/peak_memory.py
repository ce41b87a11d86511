"""The peak bytes of torch tensors one process holds, on the CPU as on CUDA: ``PeakMemory``.

Note [measuring a CPU peak]
    CUDA's caching allocator counts its own bytes (``torch.cuda.max_memory_allocated``). torch's CPU allocator keeps
    no statistics, and tracemalloc sees only Python's allocator, not tensors' storages. What does see every CPU
    storage is torch's memory profiler: with ``profile_memory`` on, c10's CPU allocator reports each allocation and
    free (``ProfiledCPUMemoryReporter``: every storage, kernels' temporaries included) as a ``[memory]`` event with
    its signed size. ``torch.profiler.profile`` would also record every op, which slows a CPU step several-fold; this
    module enables the same profiler with only the user scope's callbacks (``_enable_profiler(config, {CPU},
    {RecordScope.USER_SCOPE})``, torch's own entry point under ``torch.autograd.profiler.profile``), so only the
    memory events are recorded and a step runs at its speed. Events pile up while the profiler runs, so ``mark``
    (called once a step) stops it, starts it again at once and folds the events into a running total: the
    allocator's table of sizes is global, so a storage allocated before a restart and freed after it is still
    reported. Caveats: a storage that existed before ``start`` is not known, and its free is not reported (torch logs
    one warning line), so start before the model is materialised; kineto logs each start and stop unless
    KINETO_LOG_LEVEL says otherwise, so ``start`` sets it to 6 (silent) when unset, before kineto first runs.
    Threads the profiler does not follow (not autograd's, which it does) are not counted, and neither are frees
    made on them: gloo's worker threads release a collective's output when its work object goes, so each
    all-gather's output stays counted (measured: +8 MB of count per all-gather of 8 MB, 2 processes; an all-reduce
    of a contiguous tensor, which works in place, drifts by nothing). The count can so only over-state a peak,
    never under-state it; plans with many collectives' outputs (tensor parallelism, FSDP) read high.
"""

from __future__ import annotations

import atexit
import os

import torch

__all__ = ["PeakMemory"]


class PeakMemory:
    """This process's tensor bytes on ``device`` (CUDA: the caching allocator's own counters; CPU: Note [measuring a
    CPU peak]): the peak since ``start`` or the last ``reset_peak``, and each interval's between ``mark`` calls."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.current_bytes = 0  # CPU: bytes allocated since start and not yet freed
        self.peak_bytes = 0
        self._running = False

    def start(self) -> PeakMemory:
        """Start counting (on the CPU, every allocation from now on); returns self."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            self._enable()
            atexit.register(self.stop)  # a profiler left running crashes the interpreter's exit
        self._running = True
        return self

    def mark(self) -> int:
        """Close an interval: its peak in bytes (CUDA: the peak since the last mark); the next one starts now."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_bytes = max(self.peak_bytes, peak)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        from torch._C._autograd import _disable_profiler

        result = _disable_profiler()
        self._enable()
        return self._fold(result)

    def stop(self) -> int:
        """Stop counting; returns the peak since start (or the last reset_peak)."""
        if self._running and self.device.type != "cuda":
            from torch._C._autograd import _disable_profiler

            self._fold(_disable_profiler())
        elif self._running:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device))
        self._running = False
        return self.peak_bytes

    def reset_peak(self) -> None:
        """Count the peak from now on (what is allocated now is in it)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.peak_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.mark()
            self.peak_bytes = self.current_bytes

    def _enable(self) -> None:
        from torch._C._autograd import _enable_profiler, _prepare_profiler
        from torch._C._profiler import (
            ProfilerActivity,
            ProfilerConfig,
            ProfilerState,
            RecordScope,
            _ExperimentalConfig,
        )

        # (state, record_shapes, profile_memory, with_stack, with_flops, with_modules, experimental config)
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        _prepare_profiler(config, {ProfilerActivity.CPU})
        _enable_profiler(config, {ProfilerActivity.CPU}, {RecordScope.USER_SCOPE})

    def _fold(self, result) -> int:
        """Add a profiler session's CPU memory events to the running total; the session's peak."""
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in result.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
        peak = self.current_bytes
        for _, nbytes in events:
            self.current_bytes += nbytes
            peak = max(peak, self.current_bytes)
        self.peak_bytes = max(self.peak_bytes, peak)
        return peak


def for_plan(plan) -> PeakMemory:
    """A PeakMemory on the device ``parallelize`` gives this rank by default (Note [which device a rank uses] in
    parallel.py), made before it so that a CPU count starts before the model is materialised."""
    from hyparallel.parallel import LaunchEnv, default_device

    return PeakMemory(default_device(LaunchEnv.from_environ(), plan))


def report(pmodel, tracker: PeakMemory) -> list[dict] | None:
    """Every rank's measured peak against its stage's prediction, gathered on rank 0 (None on the others).

    Each row: rank, mesh coordinates, ``peak_bytes`` (``tracker``'s, since its last ``reset_peak``) and
    ``predicted_bytes`` (the plan's stage memory without the preset's reserve: what the allocator counts).
    Collective: every rank calls it.
    """
    import torch.distributed as dist

    plan, rank = pmodel.plan, pmodel.env.rank
    coords = plan.coords(rank)
    predicted = None
    if plan.predicted is not None and plan.cluster is not None:
        predicted = plan.predicted.memory_gib[coords["pp"]] * 2**30 - plan.cluster.device.reserved_bytes
    mine = {"rank": rank, "coords": coords, "peak_bytes": tracker.stop(), "predicted_bytes": predicted}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every if rank == 0 else None
