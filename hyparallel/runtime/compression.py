"""Gradient compression on the data-parallel axis (``parallel.grad_compression``), with torch's own
hooks.

    compressor = Compressor(mode, dp_group, names, rank=4, start_step=1000)
    # DDP (pp = 1, ZeRO 0): each bucket as DDP hands it over
    ddp.register_comm_hook(None, compressor.hook)
    # pp > 1, ZeRO 0: the buckets of the all-reduce after the schedule
    compressor.reduce(named_grads)
    # ZeRO 1-3: FSDP2's MixedPrecisionPolicy (None: fp32 throughout)
    fsdp_policy(plan)

``bf16``/``fp16`` are torch's ``default_hooks.bf16_compress_hook``/``fp16_compress_hook`` (cast,
divide by the group size, all-reduce in 16 bits, cast back); ``powersgd`` is
``powerSGD_hook.powerSGD_hook`` with error feedback and warm start (Vogels et al. 2019). Both paths
of ZeRO 0 run the same hook, so DDP and a pipeline compress alike. PowerSGD's state (each rank's
residuals, the warm-start factors, the step count) is saved by checkpoints per rank
(``state_dict``/``load_state_dict``).

Note [compression hooks on gloo]
    bf16: DDP's register_comm_hook refuses a hook *named* bf16_compress_hook unless CUDA and NCCL >=
    2.10 are there, though gloo all-reduces bf16 tensors (torch 2.13); ``Compressor.hook`` calls
    that hook from under its own name, so the cast runs on either backend.
    PowerSGD chains three all-reduces per bucket (the uncompressed vectors, then P, then Q) through
    future callbacks. NCCL's futures complete when the collective is enqueued, so each callback runs
    at once in the calling thread and every rank issues its collectives bucket after bucket. Gloo's
    complete on a gloo thread: bucket k's callback issuing its P all-reduce races the autograd
    thread issuing bucket k+1's first one, ranks disagree on the order, and gloo aborts ("Received
    data size doesn't match expected size. Is there a distributed collective mismatch") or hangs.
    Measured: 8 Linear(64, 64) in 0.02 MB buckets, 2 gloo ranks, SIGABRT at the first compressed
    step. So off NCCL the hook waits for its bucket's chain before returning: one bucket's
    collectives end before the next bucket's begin. Nothing is lost on a CPU, where communication
    and the backward share the cores anyway (the planner prices gloo serially). torch's
    batched_powerSGD_hook is not offered: it compresses a whole bucket as one matrix, which the plan
    key does not ask for. PowerSGD's decompression calls torch.cuda.synchronize(device) whenever
    CUDA is available, which raises for a CPU bucket on a machine that has a GPU; a CPU bucket runs
    a copy of the hook that sees no CUDA.

Note [error feedback that outlives a bucket layout]
    PowerSGDState keys each bucket's residual (``error_dict``) and warm-start Q factors
    (``q_memory_dict``) by the bucket's index. DDP rebuilds its buckets, in gradient-ready order,
    after the first step of every DDP it builds (torch therefore starts PowerSGD at step 2 at the
    earliest), so a resumed run's first step has other buckets than the uninterrupted run's same
    step, and the residuals saved by index would be added to other gradients. But a residual is one
    entry per gradient element, and a Q factor belongs to one compressed matrix: the Compressor
    records each bucket's parameters, and when an index turns up holding other parameters (DDP
    rebuilt its buckets) or after a load, it moves every bucket's residual and Q into per-parameter
    pieces and assembles each bucket's from them as the bucket comes. Checkpoints save the pieces,
    so they load under any bucket layout; a resumed run then compresses exactly as the uninterrupted
    one does (tests/test_grad_compression.py).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from hyparallel.spec.schema import Plan

# DDP's default bucket size; the all-reduce after a pipeline schedule uses it too
BUCKET_BYTES = 25 * 2**20
# PowerSGD compresses a matrix only when (rows + cols) x rank x this < rows x cols (torch's default,
# _should_compress); hyparallel.planner.costs.powersgd_elements prices the same rule.
MIN_COMPRESSION_RATE = 2
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _without_cuda(hook):
    """``hook`` run with a ``torch`` whose CUDA is unavailable (Note [compression hooks on gloo],
    the last part)."""
    view = types.ModuleType("torch")
    view.__dict__.update(torch.__dict__)
    view.cuda = types.SimpleNamespace(is_available=lambda: False)
    return types.FunctionType(
        hook.__code__, {**hook.__globals__, "torch": view}, hook.__name__, hook.__defaults__
    )


_CPU_POWERSGD = _without_cuda(powersgd.powerSGD_hook)


@dataclass(frozen=True)
class _Layout:
    """One bucket's gradients: parameter names, shapes and offsets into the bucket's flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    length: int


class _Bucket:
    """A bucket of the all-reduce after a pipeline schedule, shaped as DDP's GradBucket for torch's
    hooks."""

    def __init__(
        self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor], names: list[str]
    ):
        self._index, self._buffer, self._gradients, self.names = index, buffer, gradients, names

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    # DDP reduces bucket 0 last; the pipeline's buckets are numbered the same way
    def is_last(self) -> bool:
        return self._index == 0

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


class Compressor:
    """One plan's gradient compression over one data-parallel group (module docstring)."""

    def __init__(
        self, mode: str, group: Any, names: Mapping[int, str], rank: int = 4, start_step: int = 1000
    ) -> None:
        """``names``: ``id(parameter) -> name`` of every parameter whose gradient the hook may
        see."""
        if mode not in _DTYPES and mode != "powersgd":
            raise ValueError(f"no compression hook for grad_compression {mode!r}")
        self.mode, self.group, self.names = mode, group, dict(names)
        # Note [compression hooks on gloo]
        self.wait = mode == "powersgd" and dist.get_backend(group) != "nccl"
        self.state = None
        if mode == "powersgd":
            self.state = powersgd.PowerSGDState(
                group,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=start_step,
                min_compression_rate=MIN_COMPRESSION_RATE,
                use_error_feedback=True,
                warm_start=True,
                random_seed=0,
                compression_stats_logging_frequency=2**62,  # no log line every 10,000 steps
            )
        self.layouts: dict[int, _Layout] = {}  # bucket index -> what it held when last seen
        # parameter -> {"error", "q"} not in a bucket now
        self.pieces: dict[str, dict[str, torch.Tensor]] = {}

    # ---- the hook --------------------------------------------------------------------------------

    # unannotated: DDP compares annotations with dist.GradBucket, and these are strings
    def hook(self, state, bucket):
        """Reduce one bucket (a dist.GradBucket) averaged over the group the plan's way; returns a
        Future of it.

        DDP's comm-hook signature; ``state`` is unused (the Compressor is the state).
        """
        if self.state is None:
            compress = (
                default_hooks.bf16_compress_hook
                if self.mode == "bf16"
                else default_hooks.fp16_compress_hook
            )
            return compress(self.group, bucket)
        self._settle(bucket)
        run = _CPU_POWERSGD if bucket.buffer().device.type == "cpu" else powersgd.powerSGD_hook
        future = run(self.state, bucket)
        if self.wait:
            future.wait()
        return future

    def reduce(
        self, named_grads: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        """Average gradients over the group in place, in flat buckets of about ``bucket_bytes``,
        through ``hook``."""
        buckets: list[list[tuple[str, torch.Tensor]]] = []
        filled = bucket_bytes  # a new bucket first
        for name, grad in named_grads:
            if filled >= bucket_bytes:
                buckets.append([])
                filled = 0
            buckets[-1].append((name, grad))
            filled += grad.numel() * grad.element_size()
        for position, members in enumerate(buckets):
            flat = torch.cat([g.reshape(-1) for _, g in members])
            views, offset = [], 0
            for _, g in members:
                views.append(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket = _Bucket(
                len(buckets) - 1 - position, flat, views, [name for name, _ in members]
            )
            # every hook leaves the averaged gradients in the bucket's buffer
            self.hook(None, bucket).wait()
            for (_, g), view in zip(members, views):
                g.copy_(view)

    # ---- Note [error feedback that outlives a bucket layout] -------------------------------------

    def _layout(self, bucket: Any) -> _Layout:
        buffer, grads = bucket.buffer(), bucket.gradients()
        names = getattr(bucket, "names", None) or [self.names[id(p)] for p in bucket.parameters()]
        size = buffer.element_size()
        offsets = tuple((g.data_ptr() - buffer.data_ptr()) // size for g in grads)
        return _Layout(tuple(names), tuple(g.shape for g in grads), offsets, buffer.numel())

    def _settle(self, bucket: Any) -> None:
        """Before PowerSGD reduces ``bucket``: its residual and Qs are this layout's, assembled from
        pieces if new."""
        index, layout = bucket.index(), self._layout(bucket)
        if self.layouts.get(index) == layout:
            return
        held = {name for known in self.layouts.values() for name in known.names}
        # parameters moved between buckets: DDP rebuilt them
        if index in self.layouts or held & set(layout.names):
            self._to_pieces()
        self.layouts[index] = layout
        self._from_pieces(index, layout, bucket.buffer())

    def _compressed(self, layout: _Layout) -> list[tuple[int, int, int]]:
        """(position in the bucket, P elements, Q elements) of each matrix PowerSGD compresses, in
        its Q order."""
        by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for position, shape in enumerate(layout.shapes):
            n = shape[0] if len(shape) else 1
            m = max(1, shape.numel() // max(n, 1))  # the hook's tensor.view(tensor.shape[0], -1)
            r = min(n, m, self.state.matrix_approximation_rank)
            if powersgd._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append((position, n * r, m * r))
        # grouped by shape, as powerSGD_hook does
        return [entry for group in by_shape.values() for entry in group]

    def _to_pieces(self) -> None:
        """Every bucket's residual and Qs as per-parameter pieces; the state then holds no
        bucket."""
        self.pieces.update(self._split_all(clone=False))
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self.layouts.clear()

    def _split_all(self, clone: bool) -> dict[str, dict[str, torch.Tensor]]:
        pieces: dict[str, dict[str, torch.Tensor]] = {}
        for index, layout in self.layouts.items():
            error, q = self.state.error_dict.get(index), self.state.q_memory_dict.get(index)
            for position, name in enumerate(layout.names):
                numel = layout.shapes[position].numel()
                if error is not None:
                    start = layout.offsets[position]
                    piece = error[start : start + numel]
                    pieces.setdefault(name, {})["error"] = piece.clone() if clone else piece
            if q is not None:
                start = 0
                for position, _, count in self._compressed(layout):
                    piece = q[start : start + count]
                    pieces.setdefault(layout.names[position], {})["q"] = (
                        piece.clone() if clone else piece
                    )
                    start += count
        return pieces

    def _from_pieces(self, index: int, layout: _Layout, buffer: torch.Tensor) -> None:
        if not self.pieces:
            return
        have = [self.pieces.get(name, {}) for name in layout.names]
        sizes = [shape.numel() for shape in layout.shapes]
        if all(
            "error" in piece and piece["error"].numel() == size for piece, size in zip(have, sizes)
        ):
            error = torch.zeros(layout.length, dtype=buffer.dtype, device=buffer.device)
            for piece, start, size in zip(have, layout.offsets, sizes):
                error[start : start + size].copy_(piece["error"])
            self.state.error_dict[index] = error
        compressed = self._compressed(layout)
        if compressed and all(
            "q" in have[p] and have[p]["q"].numel() == count for p, _, count in compressed
        ):
            self.state.q_memory_dict[index] = torch.cat(
                [have[p]["q"].to(buffer.device) for p, _, _ in compressed]
            )
            rows = sum(count for _, count, _ in compressed)
            self.state.p_memory_dict[index] = torch.empty(
                rows, dtype=buffer.dtype, device=buffer.device
            )
        unfit = [
            name
            for name, piece, size in zip(layout.names, have, sizes)
            if piece and ("error" in piece and piece["error"].numel() != size)
        ]
        if unfit:
            warnings.warn(
                f"PowerSGD's saved residual for {unfit[0]} has another size than its gradient (the"
                " checkpoint's plan split it differently): error feedback starts afresh for its"
                " bucket",
                stacklevel=2,
            )
        for name in layout.names:
            self.pieces.pop(name, None)

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's PowerSGD state, per parameter (any bucket layout loads it); None for the
        16-bit modes."""
        if self.state is None:
            return None
        pieces = {name: dict(piece) for name, piece in self.pieces.items()}
        for name, piece in self._split_all(clone=True).items():
            pieces.setdefault(name, {}).update(piece)
        return {
            "mode": self.mode,
            "rank": self.state.matrix_approximation_rank,
            "iter": self.state.iter,
            "rng": self.state.rng.get_state(),
            "pieces": {
                name: {k: v.detach().cpu() for k, v in piece.items()}
                for name, piece in pieces.items()
            },
        }

    def load_state_dict(self, saved: dict[str, Any] | None, iteration: int | None = None) -> None:
        """Resume from ``state_dict()``'s ``saved`` (this rank's); with only ``iteration``, restart
        error feedback."""
        if self.state is None:
            return
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self.layouts.clear()
        self.pieces = {}
        same = saved is not None and saved.get("mode") == self.mode
        if same and saved.get("rank") == self.state.matrix_approximation_rank:
            self.state.iter = saved["iter"]
            self.state.rng.set_state(saved["rng"])
            known = set(self.names.values())
            self.pieces = {
                name: dict(piece) for name, piece in saved["pieces"].items() if name in known
            }
        elif iteration is not None:
            self.state.iter = iteration


def compressor_for(plan: Plan, group: Any, modules: Iterable[nn.Module]) -> Compressor | None:
    """The plan's compressor for ZeRO 0 over ``group`` (None: gradients reduced in fp32, or dp =
    1)."""
    par = plan.parallel
    if par.dp == 1 or par.zero > 0 or par.grad_compression == "none":
        return None
    names = {id(p): name for module in modules for name, p in module.named_parameters()}
    return Compressor(
        par.grad_compression, group, names, par.powersgd_rank, par.powersgd_start_step
    )


def fsdp_policy(plan: Plan):
    """FSDP2's MixedPrecisionPolicy for ZeRO 1-3 under the plan's compression (None: fp32 gathers
    and reductions).

    bf16/fp16 reduce-scatter the gradients in that dtype and, when training.dtype is 16-bit, gather
    the weights in it (autocast would cast them to it anyway); PowerSGD under ZeRO is refused by the
    plan's validation.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mode, dtype = plan.parallel.grad_compression, plan.training.dtype
    if mode not in _DTYPES:
        return None
    return MixedPrecisionPolicy(param_dtype=_DTYPES.get(dtype), reduce_dtype=_DTYPES[mode])
