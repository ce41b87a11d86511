"""The peak bytes of torch tensors one process holds, on the CPU as on CUDA: ``PeakMemory``.

Note [measuring a CPU peak]
    CUDA's caching allocator counts its own bytes (``torch.cuda.max_memory_allocated``). torch's CPU
    allocator keeps no statistics, and tracemalloc sees only Python's allocator, not tensors'
    storages. What does see every CPU storage is torch's memory profiler: with ``profile_memory``
    on, c10's CPU allocator reports each allocation and free (``ProfiledCPUMemoryReporter``: every
    storage, kernels' temporaries included) as a ``[memory]`` event with its signed size.
    ``torch.profiler.profile`` would also record every op, which slows a CPU step several-fold; this
    module enables the same profiler with only the user scope's callbacks
    (``_enable_profiler(config, {CPU}, {RecordScope.USER_SCOPE})``, torch's own entry point under
    ``torch.autograd.profiler.profile``), so only the memory events are recorded and a step runs at
    its speed. Events pile up while the profiler runs, so ``mark`` (called once a step) stops it,
    starts it again at once and folds the events into a running total: the allocator's table of
    sizes is global, so a storage allocated before a restart and freed after it is still reported.
    Caveats: a storage that existed before ``start`` is not known, and its free is not reported
    (torch logs one warning line), so start before the model is materialised; kineto logs each start
    and stop unless KINETO_LOG_LEVEL says otherwise, so ``start`` sets it to 6 (silent) when unset,
    before kineto first runs. Threads the profiler does not follow (gloo's workers: autograd's it
    does) report no events, and c10 skips their frees in its table too, unless its global flag
    ``caffe2_report_cpu_memory_usage`` is on: gloo's workers release a collective's tensors when its
    work object goes, so without the flag each all-gather's output stays counted (measured: +8 MB
    per all-gather of 8 MB, 2 processes). ``start`` so turns the flag on (a c10 global, set through
    ctypes; nothing in torch's Python API reaches it): every thread's allocations and frees then
    update c10's table and its running total, and each event the profiler records carries that
    process-wide total (``total_allocated``), which is what this module counts. The count is exact
    at every event on the threads the profiler follows; a peak reached and left entirely inside a
    gloo worker between two of them is not seen (a collective's temporaries: small next to the
    tensors the step holds). Where the flag cannot be set (a libc10 without the symbol), the count
    falls back to summing the followed threads' signed sizes, which can only over-state a peak
    (``exact`` is then False).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import glob
import os

import torch
from torch._C._profiler import _ExtraFields_Allocation as _Allocation

__all__ = ["PeakMemory"]


@functools.cache
def _report_every_thread() -> bool:
    """Turn on c10's ``caffe2_report_cpu_memory_usage`` (Note [measuring a CPU peak]) once per
    process; whether it could be. c10's total counts from then on."""
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*c10.*"))):
        try:
            ctypes.c_bool.in_dll(
                ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage"
            ).value = True
            return True
        except (OSError, ValueError):
            continue
    return False


class PeakMemory:
    """This process's tensor bytes on ``device`` (CUDA: the caching allocator's own counters; CPU:
    Note [measuring a CPU peak]): the peak since ``start`` or the last ``reset_peak``, and each
    interval's between ``mark`` calls."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.current_bytes = 0  # CPU: bytes allocated since start and not yet freed
        self.peak_bytes = 0
        self.exact = True  # CPU: False where c10's every-thread reporting could not be turned on
        # CPU: c10's process-wide total at start (what was allocated before)
        self._base: int | None = None
        self._running = False

    def start(self) -> PeakMemory:
        """Start counting (on the CPU, every allocation from now on); returns self."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            first = _report_every_thread.cache_info().currsize == 0
            self.exact = _report_every_thread()
            # the first tracker counts from zero; a later one from c10's total at its first event
            self._base = 0 if first else None
            self._enable()
            atexit.register(self.stop)  # a profiler left running crashes the interpreter's exit
        self._running = True
        return self

    def mark(self) -> int:
        """Close an interval: its peak in bytes (CUDA: the peak since the last mark); the next one
        starts now."""
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

        # (state, record_shapes, profile_memory, with_stack, with_flops, with_modules, experimental
        # config)
        config = ProfilerConfig(
            ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig()
        )
        _prepare_profiler(config, {ProfilerActivity.CPU})
        _enable_profiler(config, {ProfilerActivity.CPU}, {RecordScope.USER_SCOPE})

    def _fold(self, result) -> int:
        """Fold a profiler session's CPU memory events into the running count; the session's
        peak."""
        events = sorted(_allocations(result.experimental_event_tree()))
        peak = self.current_bytes
        for _, nbytes, total in events:
            if self.exact:
                # c10's total: every thread's storages since the flag went on (a later tracker's
                # base: before it)
                if self._base is None:
                    self._base = total - nbytes
                self.current_bytes = total - self._base
            else:
                self.current_bytes += nbytes
            peak = max(peak, self.current_bytes)
        self.peak_bytes = max(self.peak_bytes, peak)
        return peak


def _allocations(nodes) -> list[tuple[int, int, int]]:
    """(start ns, signed bytes, c10's process-wide total after it) of every CPU allocation event
    under ``nodes``."""
    found, stack = [], list(nodes)
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if isinstance(fields, _Allocation) and fields.device.type == "cpu":
            found.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
        stack.extend(node.children)
    return found


def for_plan(plan) -> PeakMemory:
    """A PeakMemory on the device ``parallelize`` gives this rank by default (Note [which device a
    rank uses] in parallel.py), made before it so that a CPU count starts before the model is
    materialised."""
    from hyparallel.runtime.parallel import LaunchEnv, default_device

    return PeakMemory(default_device(LaunchEnv.from_environ(), plan))


def report(pmodel, tracker: PeakMemory) -> list[dict] | None:
    """Every rank's measured peak against its stage's prediction, gathered on rank 0 (None on the
    others).

    Each row: rank, mesh coordinates, ``peak_bytes`` (``tracker``'s, since its last ``reset_peak``)
    and ``predicted_bytes`` (the plan's stage memory without the preset's reserve: what the
    allocator counts).
    Collective: every rank calls it.
    """
    import torch.distributed as dist

    plan, rank = pmodel.plan, pmodel.env.rank
    coords = plan.coords(rank)
    predicted = None
    if plan.predicted is not None and plan.cluster is not None:
        predicted = (
            plan.predicted.memory_gib[coords["pp"]] * 2**30 - plan.cluster.device.reserved_bytes
        )
    mine = {
        "rank": rank,
        "coords": coords,
        "peak_bytes": tracker.stop(),
        "predicted_bytes": predicted,
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every if rank == 0 else None
