"""`hyparallel calibrate`: measure this machine and write a ClusterSpec the planner can use.

Every figure is per process, i.e. per device the planner sees (one GPU, or one process sharing a
CPU).

* **Matmul throughput** by dtype and shape: ``torch.mm`` of (M, K) @ (K, N) into a preallocated
  output, 2*M*K*N FLOPs a call. fp32 runs with ``torch.set_float32_matmul_precision("highest")``,
  tf32 with ``"high"`` (CUDA only: a CPU has no TF32, so its tf32 figure is the fp32 one). The
  shapes run from small to the device's plateau, skinny ones among them (a short K, few rows); the
  efficiency curve is fitted to them and each dtype's plateau is its rate under that curve (Note
  [fitting the curve]); every (dtype, shape) rate is reported.
* **Attention**: causal ``F.scaled_dot_product_attention`` forward (bf16 on CUDA, fp32 on a CPU),
  counted as the planner counts it (Note [attention FLOPs]).
* **Memory bandwidth**: ``dst.copy_(src)`` of a large fp32 buffer, bytes read plus bytes written per
  second.
* **Collectives** (2 or more processes): all-reduce bus bandwidth of a large fp32 tensor,
  2(n-1)/n * bytes / time (nccl-tests' definition, the one the planner's ring cost uses), median of
  several runs; and point-to-point latency, half the round trip of a 4-byte send/recv ping-pong,
  with the ranks paired (0, 1), (2, 3), ... all at once, as in training where every process is busy.
* **Reserved memory** after the run, benchmark tensors freed: on CUDA the device memory in use (CUDA
  context, cuBLAS workspaces, NCCL buffers, and anything else on that GPU); on a CPU the resident
  set of the process (Python, torch, gloo).

Timing: on CUDA, back-to-back launches between CUDA events after a warm-up, the median of 5 batches,
sustained for a window (Note [sustained clocks]). On a CPU, see Note [sharing a CPU].

Processes: ``calibrate(nproc=N)`` spawns N local processes (``torch.multiprocessing``, rendezvous on
a TCPStore this process holds on a free port; all are killed if one fails) with backend nccl (one
GPU each) or gloo; inside a torchrun launch (WORLD_SIZE set) it uses that world instead. Each
process measures at the same time as the others and the figures are their means. One process
measures in place and has no links to measure: they come from the base preset (or the preset with
the same device name).

Output: with a base preset (``base="h200"``) the spec keeps the preset's datasheet peak FLOP/s,
memory and bandwidth and sets the efficiencies to measured / datasheet (matmul: bf16's plateau;
attention: the rate over the preset's attention curve at the measured shape; clipped to (0, 1]),
keeps the preset's attention curve and kernel floor; the intra-node link is measured, the inter-node
link kept (one machine cannot measure it). Without a base the peaks are the measured matmul plateaus
with matmul efficiency 1 (raised to the attention plateau when attention measured faster: Note
[attention above the matmul plateau]), memory is the device's (a CPU: RAM / N), and the inter-node
link repeats the intra-node one. Either way the fitted matmul curve is written (none when too few
shapes are compute-bound).

Note [sharing a CPU]: N processes share the cores as they do in training (``torchrun
--nproc_per_node N``): each gets max(1, cores // N) threads, all measure at once after a barrier,
and each runs its kernel back to back for a fixed window; its rate is its own work over that window,
so the figure is its share of the machine. Timing calls one by one and keeping the fastest would
catch moments when a process had a core to itself (a 256^3 matmul fits in one scheduler slice) and
overstate the share by up to N / cores.

Note [sustained clocks]: a GPU runs short bursts faster than it can sustain. On an H200 an 8192^3
bf16 matmul reaches about 800 TFLOP/s in a burst of ten (14 ms, SM clock 1980 MHz), then settles
near 670-700 TFLOP/s within 50 ms as the power limit pulls the clock to about 1500 MHz. Training
runs matmuls for hours, so each rate here is timed over a 0.25 s window (0.05 s with ``quick``),
after one batch of warm-up: the sustained figure, which is what the planner should predict with.

Note [attention FLOPs]: the planner's graph counts attention with ``torch.utils.flop_counter``,
which charges the full T x T score matrix, 4*B*H*T*T*D forward, even for causal attention whose
kernels skip the masked half. The efficiency the planner needs is that count over time over peak, so
we measure the causal kernel the models call and count it the same way (clipped at 1).
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hyparallel.spec import files, limits
from hyparallel.spec.cluster import (
    ClusterSpec,
    DeviceSpec,
    ElementCost,
    LinkSpec,
    MatmulCurve,
    PeakFlops,
)
from hyparallel.spec.errors import ConfigError, HyparallelError

DTYPES = ("fp32", "tf32", "bf16", "fp16")
DeviceKind = Literal["cuda", "cpu"]
BACKEND: dict[DeviceKind, Literal["nccl", "gloo"]] = {"cuda": "nccl", "cpu": "gloo"}

# A spawned run that has not finished by then is hung (a full 8-process CPU run takes about a
# minute).
SPAWN_TIMEOUT_S = 900
COLLECTIVE_TIMEOUT_S = 300
# Reserved memory is rounded up to this: the planner must not count on the last few MiB.
RESERVED_ROUNDING_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Settings:
    """What to measure and for how long: chosen by device kind and ``quick``."""

    matmul_shapes: tuple[tuple[int, int, int], ...]  # (M, K, N): (M, K) @ (K, N)
    window_s: float  # time given to each rate measurement
    attention_shape: tuple[int, int, int, int]  # (B, n_heads, T, head_dim)
    # More attention shapes on a CPU, for its attention curve (Note [a CPU's attention curve]); none
    # on a GPU.
    attention_curve_shapes: tuple[tuple[int, int, int, int], ...]
    copy_bytes: int
    allreduce_bytes: int
    allreduce_repeats: int
    pingpong_iters: int
    # CPU threads per process; 0 keeps the launcher's setting (torchrun's OMP_NUM_THREADS)
    threads: int


def settings_for(kind: DeviceKind, quick: bool, threads: int) -> Settings:
    """Shapes from small to the device's plateau, skinny ones among them, for the efficiency curve
    (Note [fitting the curve]); ``quick`` trades accuracy for a few seconds."""
    if kind == "cuda":
        squares = (512, 2048, 8192) if quick else (256, 512, 1024, 2048, 4096, 8192)
        # Skinny: a short reduction (K = 128) and few rows (M = 256) under a large output or
        # reduction.
        skinny = ((8192, 128, 8192), (256, 8192, 8192))
        # Transformer MLP projections: llama-70b (8192 -> 28672) and llama-8b (4096 -> 14336),
        # 8192/16384 tokens.
        mlp = () if quick else ((8192, 8192, 28672), (16384, 4096, 14336))
        return Settings(
            matmul_shapes=tuple((s, s, s) for s in squares) + skinny + mlp,
            window_s=0.05 if quick else 0.25,
            attention_shape=(4, 32, 4096, 128),
            attention_curve_shapes=(),
            copy_bytes=2**28 if quick else 2**30,
            allreduce_bytes=2**27 if quick else 2**30,
            allreduce_repeats=3 if quick else 5,
            pingpong_iters=30 if quick else 100,
            threads=0,
        )
    # Three squares at or above 256: a CPU whose cores outrun its memory (an Intel Xeon here: 150
    # GFLOP/s fp32 per process, 13 GB/s copy) reads 64^3 and the skinny shapes as memory-bound, and
    # the curve needs three others.
    squares = (64, 256, 384, 512) if quick else (32, 64, 128, 256, 384, 512, 1024)
    skinny = ((512, 16, 512), (16, 512, 512)) if quick else ((1024, 16, 1024), (16, 1024, 1024))
    # A small transformer's products: 1,024 tokens through a 128 -> 512 projection, and the weight
    # gradient's (128 x 1,024) @ (1,024 x 512). Compute-bound on both CPUs measured (the squares
    # alone left the curve's K term free: the AMD EPYC's 512^3 ran at 62-69 GFLOP/s, gpt-mini's
    # products at 52).
    model = ((1024, 128, 512), (128, 1024, 512))
    mlp = () if quick else ((1024, 1024, 4096),)
    return Settings(
        matmul_shapes=tuple((s, s, s) for s in squares) + skinny + model + mlp,
        window_s=0.1 if quick else 0.5,
        attention_shape=(1, 4, 256, 64) if quick else (1, 8, 512, 64),
        attention_curve_shapes=(
            ((8, 8, 128, 16), (2, 8, 128, 32), (1, 8, 512, 32))
            if quick
            else ((8, 8, 128, 16), (4, 8, 256, 32), (1, 8, 1024, 64), (1, 16, 512, 128))
        ),
        copy_bytes=2**25 if quick else 2**27,
        allreduce_bytes=2**22 if quick else 2**26,
        allreduce_repeats=3 if quick else 5,
        pingpong_iters=50 if quick else 200,
        threads=threads,
    )


@dataclass(frozen=True)
class Measurements:
    """The raw figures of one calibration, per process (mean over the processes)."""

    device_kind: DeviceKind
    device_name: str  # torch.cuda.get_device_name, or the CPU model
    nproc: int
    # this process's rank: under torchrun every rank returns the figures, rank 0 writes them
    rank: int
    backend: Literal["nccl", "gloo"]
    cores: int
    threads: float  # CPU threads per process (mean)
    hostname: str
    torch_version: str
    date: str
    quick: bool
    matmul_flops: dict[str, dict[str, float]]  # dtype -> "MxKxN" -> FLOP/s; no "tf32" on a CPU
    attention_flops: float  # FLOP/s as Note [attention FLOPs] counts them
    attention_dtype: Literal["bf16", "fp32"]
    attention_shape: tuple[int, int, int, int]
    memory_bandwidth_bytes_per_s: float  # copy_: read + written
    copy_bytes: int
    memory_bytes: int  # device memory, or RAM / nproc on a CPU
    reserved_bytes: int
    allreduce_bus_bytes_per_s: float | None  # None with one process
    allreduce_bytes: int
    latency_s: float | None  # None with one process
    # host time per dispatched op: Note [op overhead] in hyparallel/planner/costs.py
    op_overhead_s: float
    # A CPU's activations: name -> (forward, backward) seconds per fp32 element (Note [activations a
    # CPU computes] in cluster.py); empty on a GPU.
    activation_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    # A CPU's further attention shapes: "BxHxTxD" -> FLOP/s (Note [a CPU's attention curve]); empty
    # on a GPU.
    attention_curve_flops: dict[str, float] = field(default_factory=dict)
    # A ring collective's step latency where it is not the ping-pong's (Note [a collective's
    # latency]); None: latency_s. And the two all-reduces' seconds it was solved from
    # (1/ALLREDUCE_SMALL_FRACTION of allreduce_bytes, allreduce_bytes); None with one process.
    collective_latency_s: float | None = None
    allreduce_s: tuple[float, float] | None = None

    def achievable_flops(self, dtype: str) -> float:
        """The fastest shape's rate for ``dtype`` (a CPU's tf32 is its fp32)."""
        return max((self.matmul_flops.get(dtype) or self.matmul_flops["fp32"]).values())


def calibrate(
    nproc: int | None = None,
    *,
    base: str | ClusterSpec | None = None,
    quick: bool = False,
    name: str | None = None,
    log: Callable[[str], None] | None = None,
    device: DeviceKind | None = None,
) -> tuple[ClusterSpec, Measurements]:
    """Measure this machine with ``nproc`` processes and return (ClusterSpec, raw measurements).

    ``nproc`` defaults to the GPU count on CUDA, else 8 (as the cpu preset); inside a torchrun
    launch the launched world is used. ``base`` is a preset name, YAML path or ClusterSpec whose
    datasheet figures to keep (see the module docstring). ``device`` ("cpu" or "cuda") defaults to
    CUDA when torch sees a GPU.
    """
    base_spec = ClusterSpec.resolve(base) if isinstance(base, str) else base
    kind = device or _device_kind()
    nproc = _resolve_nproc(kind, nproc)
    if nproc == 1 and base_spec is None and _preset_named_for(_local_device_name(kind)) is None:
        raise ConfigError(
            "one process has no links to measure; pass --base PRESET to take them from "
            f"(one of: {', '.join(ClusterSpec.presets())}) or --nproc 2 or more"
        )
    if log and _launched_rank() == 0:
        where = "one per GPU" if kind == "cuda" else f"sharing {_cores()} CPU cores"
        log(
            f"calibrating with {nproc} {BACKEND[kind]} process(es),"
            f" {where}{' (quick)' if quick else ''}: a few seconds to a minute"
        )
    measurements = measure(nproc, quick, kind)
    return to_cluster_spec(measurements, base_spec, name), measurements


def measure(
    nproc: int | None = None, quick: bool = False, device: DeviceKind | None = None
) -> Measurements:
    """Run the measurements with ``nproc`` local processes (spawned, in place, or the torchrun
    world) on ``device``."""
    import torch

    kind = device or _device_kind()
    nproc = _resolve_nproc(kind, nproc)
    launched = _launched_world()
    cores = _cores()
    settings = settings_for(kind, quick, 0 if launched else max(1, cores // nproc))
    if launched and launched > 1:
        figures, info = _measure_in_launched_world(kind, settings)
    elif nproc == 1:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if kind == "cuda"
            else torch.device("cpu")
        )
        figures, info = (
            _measure_rank(settings, kind, device, 0, 1, lambda: None),
            _device_info(kind, device, 1),
        )
    # the parent never touches the GPUs: a CUDA context here would count as reserved memory on GPU 0
    else:
        figures, info = _spawn_and_measure(kind, nproc, settings)
    matmul: dict[str, dict[str, float]] = {dtype: {} for dtype in DTYPES}
    for key, value in figures.items():
        if key.startswith("matmul/"):
            _, dtype, shape = key.split("/")
            matmul[dtype][shape] = value

    def by_size(item: tuple[str, float]) -> tuple[int, ...]:
        return tuple(int(size) for size in item[0].split("x"))

    matmul = {
        dtype: dict(sorted(rates.items(), key=by_size)) for dtype, rates in matmul.items() if rates
    }
    link = (
        collective_link(
            nproc,
            settings.allreduce_bytes,
            figures["allreduce_s"],
            settings.allreduce_bytes // ALLREDUCE_SMALL_FRACTION,
            figures["allreduce_small_s"],
        )
        if "allreduce_s" in figures
        else None
    )
    return Measurements(
        device_kind=kind,
        device_name=info["device_name"],
        nproc=nproc,
        rank=_launched_rank(),
        backend=BACKEND[kind],
        cores=cores,
        threads=figures["threads"],
        hostname=socket.gethostname(),
        torch_version=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        quick=quick,
        matmul_flops=matmul,
        attention_flops=figures["attention"],
        attention_curve_flops={
            k.split("/")[1]: v for k, v in figures.items() if k.startswith("attention/")
        },
        attention_dtype="bf16" if kind == "cuda" else "fp32",
        attention_shape=settings.attention_shape,
        memory_bandwidth_bytes_per_s=figures["copy"],
        copy_bytes=settings.copy_bytes,
        memory_bytes=info["memory_bytes"],
        reserved_bytes=int(figures["reserved"]),
        allreduce_bus_bytes_per_s=link[0] if link else None,
        allreduce_bytes=settings.allreduce_bytes,
        latency_s=figures.get("latency"),
        op_overhead_s=figures["op_overhead"],
        activation_s={
            key.split("/")[1]: (value, figures[key.replace("/forward", "/backward")])
            for key, value in figures.items()
            if key.startswith("activation/") and key.endswith("/forward")
        },
        collective_latency_s=link[1] if link else None,
        allreduce_s=(figures["allreduce_small_s"], figures["allreduce_s"]) if link else None,
    )


# Note [fitting the curve]
#     The matmul rates by shape give the device's efficiency curve (Note [matmul curve] in
#     cluster.py): the reference dtype's (bf16 on CUDA, the one GPUs train in; fp32 on a CPU) rates
#     are fitted, in log space, to plateau x output / (output + half_output) x K / (K + half_k) over
#     a grid of the two halves (0, and 1 to 1e10 output elements, 0.1 to 1e6 for K, log-spaced), the
#     plateau in closed form for each (the mean log residual). Shapes whose operands and result take
#     at least half their measured time to move at the measured copy bandwidth are memory-bound: the
#     roofline prices them already, so they are left out. The fit may not put the plateau beyond
#     what the shapes show: the largest measured shape must reach at least MIN_LARGEST_FACTOR of it.
#     Every other dtype gets its own plateau under the same curve (peaks per dtype differ, the shape
#     effect is the kernels' tiling). Fewer than three compute-bound shapes fit nothing: no curve,
#     the fastest rate the plateau.
MIN_LARGEST_FACTOR = 0.8
_REFERENCE_DTYPE: dict[DeviceKind, str] = {"cuda": "bf16", "cpu": "fp32"}
_ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def _shapes(rates: dict[str, float]) -> list[tuple[int, int, int]]:
    return [tuple(int(size) for size in shape.split("x")) for shape in rates]  # type: ignore[misc]


def _compute_bound(
    rates: dict[str, float], dtype: str, bandwidth_bytes_per_s: float
) -> dict[str, float]:
    """The shapes of ``rates`` (MxKxN -> FLOP/s) that memory traffic does not explain (Note [fitting
    the curve])."""
    kept = {}
    for (m, k, n), (shape, rate) in zip(_shapes(rates), rates.items()):
        seconds = 2 * m * k * n / rate
        moved = (m * k + k * n + m * n) * _ELEMENT_BYTES[dtype]
        if moved / bandwidth_bytes_per_s < 0.5 * seconds:
            kept[shape] = rate
    return kept


def fit_matmul_curve(
    rates: dict[str, float], dtype: str, bandwidth_bytes_per_s: float
) -> MatmulCurve | None:
    """The efficiency curve that fits ``rates`` (torch.mm FLOP/s by "MxKxN") best (Note [fitting the
    curve])."""
    import numpy as np

    kept = _compute_bound(rates, dtype, bandwidth_bytes_per_s)
    if len(kept) < 3:
        return None
    shapes = np.array(_shapes(kept), dtype=float)
    return _fit_halves(shapes[:, 0] * shapes[:, 2], shapes[:, 1], list(kept.values()))


def _fit_halves(output, k, rates: list[float]) -> MatmulCurve:
    """The two halves of Hockney's form that fit ``rates`` at (``output``, ``k``) best, in log
    space, the largest shape at least MIN_LARGEST_FACTOR of the plateau (Note [fitting the
    curve])."""
    import numpy as np

    log_rate = np.log(np.array(rates))
    largest = int(np.argmax(output * k))
    halves_output = np.concatenate([[0.0], np.geomspace(1.0, 1e10, 201)])[:, None, None]
    halves_k = np.concatenate([[0.0], np.geomspace(0.1, 1e6, 141)])[None, :, None]
    # (output, k, shape)
    log_factor = np.log(output / (output + halves_output)) + np.log(k / (k + halves_k))
    log_plateau = (log_rate - log_factor).mean(axis=2, keepdims=True)
    error = ((log_rate - log_factor - log_plateau) ** 2).sum(axis=2)
    error[log_factor[:, :, largest] < math.log(MIN_LARGEST_FACTOR)] = np.inf
    i, j = np.unravel_index(np.argmin(error), error.shape)
    return MatmulCurve(
        half_output_elements=_four_digits(float(halves_output[i, 0, 0])),
        half_k=_four_digits(float(halves_k[0, j, 0])),
    )


# Note [a CPU's attention curve]
#     A CPU's fused attention (torch's flash kernel for the CPU: blocks of BLAS products and an exp
#     per score) slows with small heads far more than a GPU's: on the AMD EPYC gpt-mini's (8
#     sequences x 8 heads, T 128, head_dim 16) ran at about half the rate of the calibrated (1, 4,
#     256, 64). So on a CPU calibrate times more shapes, head_dim 16 to 64 (128 in the full run),
#     and fits the attention curve to them as the matmul curve is fitted (Note [fitting the curve];
#     output = B x H x T x head_dim, k = T: Note [matmul curve] in cluster.py), its plateau the
#     attention efficiency. A GPU keeps its preset's curve, and its one shape gives the plateau.
def fit_attention_curve(measured: Measurements) -> tuple[MatmulCurve | None, float]:
    """(curve, plateau FLOP/s) of a CPU's attention shapes; (None, the one rate) with fewer than
    three."""
    import numpy as np

    rates = {
        "x".join(map(str, measured.attention_shape)): measured.attention_flops,
        **measured.attention_curve_flops,
    }
    if len(rates) < 3:
        return None, measured.attention_flops
    shapes = np.array([[int(x) for x in shape.split("x")] for shape in rates], dtype=float)
    output, k = shapes.prod(axis=1), shapes[:, 2]
    curve = _fit_halves(output, k, list(rates.values()))
    logs = [math.log(rate / curve.factor(o, kk)) for o, kk, rate in zip(output, k, rates.values())]
    return curve, max(math.exp(statistics.fmean(logs)), max(rates.values()))


def matmul_plateau(
    rates: dict[str, float], dtype: str, bandwidth: float, curve: MatmulCurve | None
) -> float:
    """The plateau FLOP/s of ``rates`` under ``curve``: the geometric mean of each compute-bound
    shape's rate over its factor (the fastest rate without a curve, or with no compute-bound
    shape)."""
    kept = _compute_bound(rates, dtype, bandwidth) if curve is not None else {}
    if not kept:
        return max(rates.values())
    logs = [
        math.log(rate / curve.factor(m * n, k))
        for (m, k, n), rate in zip(_shapes(kept), kept.values())
    ]
    return max(math.exp(statistics.fmean(logs)), max(kept.values()))


def to_cluster_spec(
    measured: Measurements, base: ClusterSpec | None = None, name: str | None = None
) -> ClusterSpec:
    """The ClusterSpec for ``measured``: datasheet figures from ``base`` when given (module
    docstring), the matmul efficiency curve fitted (Note [fitting the curve])."""
    bandwidth = measured.memory_bandwidth_bytes_per_s
    reference = _REFERENCE_DTYPE[measured.device_kind]
    curve = fit_matmul_curve(measured.matmul_flops[reference], reference, bandwidth)
    rates = {
        dtype: _four_digits(
            matmul_plateau(
                measured.matmul_flops.get(dtype) or measured.matmul_flops["fp32"],
                dtype,
                bandwidth,
                curve,
            )
        )
        for dtype in DTYPES
    }
    attention_curve, attention_plateau = fit_attention_curve(measured)
    reserved = -(-measured.reserved_bytes // RESERVED_ROUNDING_BYTES) * RESERVED_ROUNDING_BYTES
    device_name = measured.device_name
    if measured.device_kind == "cpu":
        device_name = (
            f"{measured.device_name} ({measured.cores} cores / {measured.nproc} processes)"
        )
    if base is not None:
        peaks = base.device.peak_flops
        device = DeviceSpec(
            name=device_name,
            peak_flops=peaks,
            memory_bytes=base.device.memory_bytes,
            memory_bandwidth_bytes_per_s=base.device.memory_bandwidth_bytes_per_s,
            matmul_efficiency=_efficiency_of(rates["bf16"], peaks.bf16),
            matmul_curve=curve,
            attention_efficiency=_efficiency_of(
                (
                    attention_plateau
                    if attention_curve is not None
                    else measured.attention_flops
                    / _attention_factor(measured, base.device.attention_curve)
                ),
                getattr(peaks, measured.attention_dtype),
            ),
            attention_curve=attention_curve or base.device.attention_curve,
            kernel_floor_s=base.device.kernel_floor_s,
            memory_efficiency=_efficiency_of(
                measured.memory_bandwidth_bytes_per_s, base.device.memory_bandwidth_bytes_per_s
            ),
            reserved_bytes=max(base.device.reserved_bytes, reserved),
            op_overhead_s=_four_digits(measured.op_overhead_s),
            activation_costs=_activation_specs(measured),
        )
    else:
        # Note [attention above the matmul plateau]
        #     Without a datasheet the peak is the measured matmul plateau, and each efficiency a
        #     fraction of it, at most 1. A CPU's fused attention can measure above that plateau (its
        #     rate drifts between the matmul shapes and the attention ones, Note [a CPU's rates
        #     drift]: a CI run read the attention plateau 1.22x the matmul one), and clamping its
        #     efficiency to 1 would predict every attention ~1.6x slower than measured. So the peaks
        #     rise to the attention plateau and the matmul efficiency falls to match: both rates
        #     stay the measured ones (online.scaled does the same).
        up = max(1.0, attention_plateau / rates[measured.attention_dtype])
        device = DeviceSpec(
            name=device_name,
            peak_flops=PeakFlops(
                **{dtype: _four_digits(rate * up) for dtype, rate in rates.items()}
            ),
            memory_bytes=measured.memory_bytes,
            memory_bandwidth_bytes_per_s=_four_digits(measured.memory_bandwidth_bytes_per_s),
            matmul_efficiency=_efficiency_of(1.0, up),
            matmul_curve=curve,
            attention_efficiency=_efficiency_of(
                attention_plateau, rates[measured.attention_dtype] * up
            ),
            attention_curve=attention_curve,
            memory_efficiency=1.0,
            reserved_bytes=reserved,
            op_overhead_s=_four_digits(measured.op_overhead_s),
            activation_costs=_activation_specs(measured),
        )
    intra_node, inter_node, links_from = _links(measured, base)
    figures_from = (
        f"datasheet peaks, memory and bandwidth from preset {base.name}, efficiencies measured"
        if base
        else "peaks are measured rates"
    )
    return ClusterSpec(
        name=name or f"calibrated-{measured.hostname}",
        description=(
            f"`hyparallel calibrate` on {measured.hostname}, {measured.date}: {measured.nproc}"
            f" {measured.backend} process(es) on {measured.device_name}; {figures_from};"
            f" {links_from}"
        ),
        num_nodes=1,
        gpus_per_node=measured.nproc,
        backend=measured.backend,
        device=device,
        intra_node=intra_node,
        inter_node=inter_node,
    )


def _activation_specs(measured: Measurements) -> dict[str, ElementCost]:
    """The measured activations as the cluster file carries them."""
    return {
        name: ElementCost(forward_s=_four_digits(forward), backward_s=_four_digits(backward))
        for name, (forward, backward) in measured.activation_s.items()
    }


def _attention_factor(measured: Measurements, curve: MatmulCurve | None) -> float:
    """The base's attention curve at the measured attention shape: the measured rate over it is the
    plateau."""
    batch, heads, seq, head_dim = measured.attention_shape
    return 1.0 if curve is None else curve.factor(batch * heads * seq * head_dim, seq)


def _links(measured: Measurements, base: ClusterSpec | None) -> tuple[LinkSpec, LinkSpec, str]:
    """(intra-node link, inter-node link, where they came from)."""
    source = base or _preset_named_for(measured.device_name)
    if measured.allreduce_bus_bytes_per_s is None or measured.latency_s is None:
        if source is None:
            raise ConfigError(
                "one process has no links to measure and no base preset was given to take them from"
            )
        return (
            source.intra_node,
            source.inter_node,
            f"links from preset {source.name} (one process: none measured)",
        )
    intra = LinkSpec(
        name=f"{measured.backend} between {measured.nproc} local processes (measured)",
        bandwidth_bytes_per_s=_four_digits(measured.allreduce_bus_bytes_per_s),
        latency_s=_four_digits(measured.latency_s),
        collective_latency_s=(
            None
            if measured.collective_latency_s is None
            else _four_digits(min(measured.collective_latency_s, limits.MAX_LATENCY_S))
        ),
    )
    if source is not None:
        return (
            intra,
            source.inter_node,
            f"intra-node link measured, inter-node from preset {source.name}",
        )
    inter = LinkSpec(
        name=f"{intra.name}; inter-node not measured (one machine): same as intra-node",
        bandwidth_bytes_per_s=intra.bandwidth_bytes_per_s,
        latency_s=intra.latency_s,
        collective_latency_s=intra.collective_latency_s,
    )
    return intra, inter, "intra-node link measured, inter-node not measurable here (same figures)"


def _four_digits(value: float) -> float:
    """``value`` to 4 significant digits: measurements are not better than that."""
    return float(f"{value:.4g}")


def _efficiency_of(measured: float, peak: float) -> float:
    """measured / peak as an efficiency in (0, 1], 3 decimals."""
    return min(1.0, max(0.001, round(measured / peak, 3)))


def _preset_named_for(device_name: str) -> ClusterSpec | None:
    """The preset whose device has this name (e.g. "NVIDIA H200"), if any."""
    for preset in ClusterSpec.presets():
        spec = ClusterSpec.preset(preset)
        if spec.device.name == device_name:
            return spec
    return None


def cluster_yaml(spec: ClusterSpec, measured: Measurements) -> str:
    """``spec`` as YAML under a comment header listing every raw measurement (loads with
    ClusterSpec.load)."""
    lines = [
        (
            f"Written by `hyparallel calibrate`{' --quick' if measured.quick else ''} on"
            f" {measured.hostname}, {measured.date}, torch {measured.torch_version}."
        ),
        f"Device: {measured.device_name}; {measured.nproc} {measured.backend} process(es)"
        + (
            f", {measured.threads:g} thread(s) each on {measured.cores} cores"
            if measured.device_kind == "cpu"
            else ""
        )
        + (
            "; all measured at once, figures per process (mean over processes)."
            if measured.nproc > 1
            else "."
        ),
        (
            "Matmul FLOP/s, torch.mm (M, K) @ (K, N) by MxKxN; the plateau under the fitted curve"
            " is the rate:"
        ),
    ]
    for dtype, rates in measured.matmul_flops.items():
        lines.append(
            f"  {dtype}: " + ", ".join(f"{shape} {rate:.3g}" for shape, rate in rates.items())
        )
    if "tf32" not in measured.matmul_flops:
        lines.append("  tf32: none on a CPU; the fp32 figure is used")
    lines.append(_curve_line(spec.device.matmul_curve, measured))
    bandwidth, curve = measured.memory_bandwidth_bytes_per_s, spec.device.matmul_curve
    fractions = {
        dtype: (
            matmul_plateau(
                measured.matmul_flops.get(dtype) or measured.matmul_flops["fp32"],
                dtype,
                bandwidth,
                curve,
            )
            / getattr(spec.device.peak_flops, dtype)
        )
        for dtype in DTYPES
    }
    if any(
        abs(fraction - 1) > 1e-3 for fraction in fractions.values()
    ):  # datasheet peaks (a base), not the measured rates
        lines.append(
            "  fraction of peak_flops below: "
            + ", ".join(f"{d} {f:.3f}" for d, f in fractions.items())
            + " (matmul_efficiency takes bf16's"
            + (", clipped to 1)" if fractions["bf16"] > 1 else ")")
        )
    b, h, t, d = measured.attention_shape
    lines += [
        f"Attention: causal SDPA forward, {measured.attention_dtype}, B={b} H={h} T={t} D={d}:"
        f" {measured.attention_flops:.3g} FLOP/s counting 4*B*H*T*T*D (torch.utils.flop_counter's"
        " count)"
        + (
            "; for the curve, BxHxTxD "
            + ", ".join(
                f"{shape} {rate:.3g}" for shape, rate in measured.attention_curve_flops.items()
            )
            + "."
            if measured.attention_curve_flops
            else "."
        ),
        f"Memory: copy_ of {measured.copy_bytes / 2**20:.0f} MiB: "
        f"{measured.memory_bandwidth_bytes_per_s:.3g} B/s read + written; "
        f"reserved {measured.reserved_bytes / 2**20:.0f} MiB measured "
        + (
            "(device memory in use after the run)."
            if measured.device_kind == "cuda"
            else "(resident set of a torch + gloo process)."
        ),
        (
            f"Op overhead: {measured.op_overhead_s:.3g} s per op "
            "(a tiny GPT's forward + backward over 3 x its traced ops)."
        ),
    ]
    if measured.activation_s:
        lines.append(
            f"Activations, fp32, {ACTIVATION_ELEMENTS:,} elements, seconds per element forward /"
            " backward: "
            + ", ".join(
                f"{name} {f:.3g} / {b:.3g}" for name, (f, b) in measured.activation_s.items()
            )
        )
    if measured.allreduce_bus_bytes_per_s is None:
        lines.append(
            "Links: one process, nothing to measure; taken from the preset named in the"
            " description."
        )
    else:
        lines.append(
            f"All-reduce of {measured.allreduce_bytes / 2**20:.0f} MiB fp32 across"
            f" {measured.nproc}: {measured.allreduce_bus_bytes_per_s:.3g} B/s bus bandwidth"
            + (
                f", {measured.allreduce_s[1]:.3g} s, and of 1/{ALLREDUCE_SMALL_FRACTION} of it "
                f"{measured.allreduce_s[0]:.3g} s: solved for the bandwidth and "
                + (
                    f"{measured.collective_latency_s:.3g} s per ring step (Note [a collective's"
                    " latency])"
                    if measured.collective_latency_s is not None
                    else "no step latency of their own (the small one no faster per byte)"
                )
                if measured.allreduce_s
                else ""
            )
            + f"; send/recv of 4 bytes: {measured.latency_s:.3g} s one way (ping-pong, all pairs at"
            " once)."
        )
    if measured.device_kind == "cpu":
        lines.append(
            f'A "GPU" is one of {measured.nproc} processes sharing this machine: plan with'
            f" --gpus-per-node {measured.nproc} and launch torchrun --nproc_per_node"
            f" {measured.nproc}."
        )
    else:
        lines.append(
            f"gpus_per_node is the {measured.nproc} GPU(s) measured; "
            "`hyparallel plan --gpus-per-node G` plans nodes of G."
        )
    return "".join(f"# {line}\n" for line in lines) + spec.to_yaml()


def _curve_line(curve: MatmulCurve | None, measured: Measurements) -> str:
    reference = _REFERENCE_DTYPE[measured.device_kind]
    if curve is None:
        return (
            f"  curve: not fitted (fewer than 3 compute-bound {reference} shapes); every matmul at"
            " the plateau"
        )
    return (
        f"  curve fitted on {reference} (Note [fitting the curve] in"
        " hyparallel/tools/calibrate.py): efficiency x output / (output +"
        f" {curve.half_output_elements:.4g}) x K / (K + {curve.half_k:.4g})"
    )


def write(spec: ClusterSpec, measured: Measurements, path: str | Path) -> None:
    """Write :func:`cluster_yaml` to ``path`` (replaced only once complete); an OS error is a
    one-line ConfigError."""
    text = cluster_yaml(spec, measured)
    with files.atomic_output(path) as tmp:
        tmp.write_text(text)


def measurements_table(measured: Measurements):
    """A rich Table of every measurement."""
    from rich.table import Table

    table = Table(
        title=(
            f"calibration of {measured.device_name}: {measured.nproc} {measured.backend}"
            " process(es), per process"
        )
    )
    for column in ("measurement", "size", "per process"):
        table.add_column(column, justify="right" if column == "per process" else "left")
    for dtype, rates in measured.matmul_flops.items():
        best = max(rates.values())
        for shape, rate in rates.items():
            table.add_row(
                f"matmul {dtype}", shape, _si(rate, "FLOP/s") + (" (best)" if rate == best else "")
            )
    reference = _REFERENCE_DTYPE[measured.device_kind]
    curve = fit_matmul_curve(
        measured.matmul_flops[reference], reference, measured.memory_bandwidth_bytes_per_s
    )
    table.add_row(
        f"matmul curve ({reference} fit)",
        "output, K halves",
        (
            "none (too few shapes)"
            if curve is None
            else f"{curve.half_output_elements:.4g}, {curve.half_k:.4g} (plateau "
            + _si(
                matmul_plateau(
                    measured.matmul_flops[reference],
                    reference,
                    measured.memory_bandwidth_bytes_per_s,
                    curve,
                ),
                "FLOP/s",
            )
            + ")"
        ),
    )
    table.add_row(
        f"attention {measured.attention_dtype}",
        "BxHxTxD " + "x".join(map(str, measured.attention_shape)),
        _si(measured.attention_flops, "FLOP/s"),
    )
    table.add_row(
        "memory copy_",
        f"{measured.copy_bytes / 2**20:.0f} MiB",
        _si(measured.memory_bandwidth_bytes_per_s, "B/s"),
    )
    table.add_row(
        "op dispatch overhead", "tiny GPT step / 3 x ops", f"{measured.op_overhead_s * 1e6:,.1f} us"
    )
    if measured.allreduce_bus_bytes_per_s is not None and measured.latency_s is not None:
        table.add_row(
            f"all-reduce bus bandwidth ({measured.nproc} processes)",
            f"{measured.allreduce_bytes / 2**20:.0f} MiB",
            _si(measured.allreduce_bus_bytes_per_s, "B/s"),
        )
        table.add_row("send/recv latency", "4 B", f"{measured.latency_s * 1e6:,.1f} us")
        if measured.collective_latency_s is not None:
            table.add_row(
                "all-reduce step latency",
                "two sizes",
                f"{measured.collective_latency_s * 1e6:,.1f} us",
            )
    else:
        table.add_row("collectives", "-", "not measured (one process)")
    table.add_row("memory", "", f"{measured.memory_bytes / 2**30:,.1f} GiB")
    table.add_row(
        "reserved (in use after the run)", "", f"{measured.reserved_bytes / 2**20:,.0f} MiB"
    )
    return table


def _si(value: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:,.1f} {prefix}{unit}"
    return f"{value:.3g} {unit}"


# ---- the machine ---------------------------------------------------------------------------------


def _device_kind() -> DeviceKind:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _launched_world() -> int | None:
    """The torchrun world size when launched by torchrun (WORLD_SIZE set), else None."""
    if "WORLD_SIZE" not in os.environ:
        return None
    text = os.environ["WORLD_SIZE"]
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"WORLD_SIZE={text[:40]!r} is not a positive integer; launch with torchrun or unset it"
        )
    return int(text)


def _launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _resolve_nproc(kind: DeviceKind, nproc: int | None) -> int:
    """The process count to measure with, checked against the launch and the GPUs."""
    import torch

    launched = _launched_world()
    if launched is not None:
        if nproc is not None and nproc != launched:
            raise ConfigError(
                f"--nproc {nproc} but torchrun launched WORLD_SIZE={launched}; drop --nproc under"
                " torchrun"
            )
        if int(os.environ.get("LOCAL_WORLD_SIZE", launched)) != launched:
            raise ConfigError(
                f"calibrate measures one machine, but WORLD_SIZE={launched} spans nodes; launch"
                " with --nnodes 1"
            )
        return launched
    gpus = torch.cuda.device_count() if kind == "cuda" else 0
    nproc = nproc if nproc is not None else (gpus if kind == "cuda" else 8)
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if kind == "cuda" and nproc > gpus:
        raise ConfigError(
            f"--nproc {nproc} but this machine has {gpus} CUDA device(s); calibrate runs one"
            " process per GPU"
        )
    return nproc


def _device_info(kind: DeviceKind, device, nproc: int) -> dict:
    """The measured device's name and memory per process, read in a process that uses it."""
    import torch

    if kind == "cuda":
        return {
            "device_name": torch.cuda.get_device_name(device),
            "memory_bytes": torch.cuda.get_device_properties(device).total_memory,
        }
    return {"device_name": _cpu_name(), "memory_bytes": _ram_bytes() // nproc}


def _local_device_name(kind: DeviceKind) -> str:
    """This process's device name (initialises CUDA here: only for a run that measures in place)."""
    import torch

    return torch.cuda.get_device_name() if kind == "cuda" else _cpu_name()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _ram_bytes() -> int:
    """This machine's RAM, or its cgroup's limit when lower."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        # cgroup v2: a number or "max"
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        ram = min(ram, int(limit)) if limit.isdigit() else ram
    except OSError:
        pass
    return ram


def _rss_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
        return peak if sys.platform == "darwin" else peak * 1024


# ---- processes -----------------------------------------------------------------------------------


def _spawn_and_measure(
    kind: DeviceKind, nproc: int, settings: Settings
) -> tuple[dict[str, float], dict]:
    """Spawn ``nproc`` processes that measure together; (means over ranks, device info) come back in
    a file."""
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    # The parent holds the rendezvous store on a port the OS picks: no race for a "free" port.
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="hyparallel-calibrate-") as folder:
        result = Path(folder) / "figures.json"
        context = mp.start_processes(
            _spawned_worker,
            args=(nproc, store.port, kind, settings, str(result)),
            nprocs=nproc,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise HyparallelError(
                        f"calibration processes did not finish within {SPAWN_TIMEOUT_S} s; "
                        "is another job holding the device?"
                    )
        except mp.ProcessExitedException:
            # gloo can abort while processes tear their groups down under load ("terminate called
            # ..."), after rank 0 wrote every figure; anything earlier is a real failure.
            if not result.exists():
                raise
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        written = json.loads(result.read_text())
        return written["figures"], written["device"]


def _spawned_worker(
    rank: int, world: int, port: int, kind: DeviceKind, settings: Settings, result: str
) -> None:
    """One spawned process: join the group through the parent's store, measure, rank 0 writes the
    means."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
    device = _bind_device(kind, rank)
    dist.init_process_group(
        BACKEND[kind], store=store, rank=rank, world_size=world, timeout=timeout
    )
    try:
        figures = _mean_over_ranks(
            _measure_rank(settings, kind, device, rank, world, _barrier(kind, device)),
            device,
            world,
        )
        if rank == 0:
            partial = Path(result).with_suffix(".partial")
            partial.write_text(
                json.dumps({"figures": figures, "device": _device_info(kind, device, world)})
            )
            partial.replace(result)
        dist.barrier(**_barrier_args(kind, device))
    finally:
        dist.destroy_process_group()


def _measure_in_launched_world(
    kind: DeviceKind, settings: Settings
) -> tuple[dict[str, float], dict]:
    """Measure in the torchrun world this process belongs to; every rank returns the means."""
    import torch.distributed as dist

    device = _bind_device(kind, int(os.environ.get("LOCAL_RANK", "0")))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(
            BACKEND[kind], timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        figures = _measure_rank(settings, kind, device, rank, world, _barrier(kind, device))
        return _mean_over_ranks(figures, device, world), _device_info(kind, device, world)
    finally:
        if created:
            dist.destroy_process_group()


def _bind_device(kind: DeviceKind, local_rank: int):
    import torch

    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _barrier_args(kind: DeviceKind, device) -> dict:
    return {"device_ids": [device.index]} if kind == "cuda" else {}


def _barrier(kind: DeviceKind, device) -> Callable[[], None]:
    import torch.distributed as dist

    return functools.partial(dist.barrier, **_barrier_args(kind, device))


def _mean_over_ranks(figures: dict[str, float], device, world: int) -> dict[str, float]:
    """Each figure's mean over the ranks (NaN, a rank that did not measure it, left out)."""
    import torch
    import torch.distributed as dist

    keys = sorted(figures)
    values = torch.tensor([figures[key] for key in keys], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(gathered, values)
    return dict(zip(keys, torch.stack(gathered).nanmean(dim=0).tolist()))


# ---- measurements --------------------------------------------------------------------------------


def _measure_rank(
    settings: Settings, kind: DeviceKind, device, rank: int, world: int, sync: Callable[[], None]
) -> dict[str, float]:
    """This process's figures; ``sync`` is a barrier across the processes (a no-op alone)."""
    import torch

    threads = torch.get_num_threads()
    if kind == "cpu" and settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        rate = functools.partial(_rate, kind=kind, window_s=settings.window_s, sync=sync)
        figures = _matmul_rates(settings, kind, device, rate)
        figures["attention"] = _attention_rate(settings.attention_shape, kind, device, rate)
        for shape in settings.attention_curve_shapes:
            figures["attention/" + "x".join(map(str, shape))] = _attention_rate(
                shape, kind, device, rate
            )
        figures["copy"] = _copy_rate(settings, device, rate)
        figures["op_overhead"] = _op_overhead_s(device, rate)
        if kind == "cpu":  # a GPU's activations are memory-bound: their bytes price them
            figures.update(_activation_costs(device, rate, settings.window_s))
        if world > 1:
            figures.update(_collective_figures(settings, kind, device, rank, world, sync))
        figures["reserved"] = float(_reserved_bytes(kind, device))
        figures["threads"] = float(torch.get_num_threads())
    finally:
        torch.set_num_threads(threads)
    return figures


def _rate(
    fn: Callable[[], object],
    work: float,
    *,
    kind: DeviceKind,
    window_s: float,
    sync: Callable[[], None],
) -> float:
    """Work units per second of ``fn()``: CUDA events on a GPU, Note [sharing a CPU] on a CPU."""
    fn()  # warm-up: first-call allocation, cuBLAS heuristics, oneDNN primitive creation
    sync()
    if kind == "cuda":
        return _cuda_rate(fn, work, window_s)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window_s:
            return work * calls / elapsed


def _cuda_rate(fn: Callable[[], object], work: float, window_s: float, batches: int = 5) -> float:
    """Work per second of back-to-back launches timed by CUDA events: median of ``batches``
    batches."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one_s = max(start.elapsed_time(end) / 1e3, 1e-6)
    per_batch = max(1, round(window_s / batches / one_s))
    # one batch's worth of warm-up, so clocks settle at their loaded value
    for _ in range(per_batch):
        fn()
    seconds = []
    for _ in range(batches):
        start.record()
        for _ in range(per_batch):
            fn()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3 / per_batch)
    return work / statistics.median(seconds)


# Note [a CPU's rates drift]
#     A shared or virtual CPU's speed moves over seconds: on the AMD EPYC (2 cores) 512^3 fp32 ran
#     at 62-69 GFLOP/s in one minute and 38-43 in another, and one quick calibration read its 256^3
#     at 43 GFLOP/s while the next read 68. Measured one after another, the shapes would each catch
#     a different moment and the fitted curve would fit the drift (one such fit put both halves at
#     0, every product at the plateau). So on a CPU every shape is measured in CPU_ROUNDS rounds of
#     window / rounds, the shapes taking turns, and the median round is its rate: a slow moment
#     lowers all shapes alike instead of one. A CPU's BLAS also runs one shape at different speeds
#     by operand layout: on that EPYC (1,024 x 128) @ (128 x 512) read 39 GFLOP/s as nn.Linear's
#     forward runs it (the weight transposed), 56 with both operands as stored, 52 with the first
#     transposed (a weight gradient's). Training runs each layout about as often (a Linear's
#     forward, its input's gradient, its weight's), so on a CPU each shape's round times the three
#     in turn and its rate is their mean (_cpu_products). And in training a product's operands come
#     from memory, not from a cache the last call warmed: the same shape read 56-66 GFLOP/s timed on
#     one set of operands and 40-49 taking turns over sets of 32 MiB in all (gpt-mini's products ran
#     at 51 in its step). So each call takes the next of enough operand sets to fill
#     CPU_OPERAND_BYTES. A GPU's kernels run every layout at one speed from HBM: it times A @ B on
#     one set.
CPU_ROUNDS = 3
CPU_OPERAND_BYTES = 32 * 2**20


def _cpu_products(shape: tuple[int, int, int], device, dtype) -> Callable[[], object]:
    """One (M, K) @ (K, N) product in each layout training runs it: A @ B^T, A @ B, A^T @ B (three
    products), each call on the next of the operand sets that fill CPU_OPERAND_BYTES (Note [a CPU's
    rates drift])."""
    import torch

    m, k, n = shape
    element = torch.empty((), dtype=dtype).element_size()
    count = max(1, min(64, CPU_OPERAND_BYTES // ((2 * m * k + 2 * k * n + m * n) * element)))
    sets = [
        (
            torch.randn(m, k, device=device, dtype=dtype),
            torch.randn(k, m, device=device, dtype=dtype).t(),
            torch.randn(k, n, device=device, dtype=dtype),
            torch.randn(n, k, device=device, dtype=dtype).t(),
            torch.empty(m, n, device=device, dtype=dtype),
        )
        for _ in range(count)
    ]
    turn = itertools.cycle(sets)

    def products() -> None:
        a, a_t, b, b_t, out = next(turn)
        torch.mm(a, b_t, out=out)
        torch.mm(a, b, out=out)
        torch.mm(a_t, b, out=out)

    return products


def _mm_operands(shape: tuple[int, int, int], device, dtype) -> Callable[[], object]:
    """``torch.mm`` of an (M, K) and a (K, N) random operand into a preallocated result, ready to
    time."""
    import torch

    m, k, n = shape
    a, b = (
        torch.randn(m, k, device=device, dtype=dtype),
        torch.randn(k, n, device=device, dtype=dtype),
    )
    return functools.partial(torch.mm, a, b, out=torch.empty(m, n, device=device, dtype=dtype))


def _matmul_rates(
    settings: Settings, kind: DeviceKind, device, rate: Callable[..., float]
) -> dict[str, float]:
    """FLOP/s of torch.mm for every dtype and shape, keyed "matmul/<dtype>/<M>x<K>x<N>"."""
    import torch

    dtypes = {
        "fp32": torch.float32,
        "tf32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }
    figures = {}
    precision = torch.get_float32_matmul_precision()
    try:
        for name, dtype in dtypes.items():
            if name == "tf32" and kind == "cpu":
                continue  # no TF32 on a CPU
            torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
            if kind == "cpu":  # Note [a CPU's rates drift]
                operands = [_cpu_products(shape, device, dtype) for shape in settings.matmul_shapes]
                rounds: list[list[float]] = [[] for _ in operands]
                for _ in range(CPU_ROUNDS):
                    for (m, k, n), call, rates in zip(settings.matmul_shapes, operands, rounds):
                        rates.append(
                            rate(call, 3 * 2 * m * k * n, window_s=settings.window_s / CPU_ROUNDS)
                        )
                for (m, k, n), rates in zip(settings.matmul_shapes, rounds):
                    figures[f"matmul/{name}/{m}x{k}x{n}"] = statistics.median(rates)
                del operands
                continue
            for m, k, n in settings.matmul_shapes:
                call = _mm_operands((m, k, n), device, dtype)
                figures[f"matmul/{name}/{m}x{k}x{n}"] = rate(call, 2 * m * k * n)
                del call  # before the next shape's operands
    finally:
        torch.set_float32_matmul_precision(precision)
    return figures


def _attention_rate(
    shape: tuple[int, int, int, int], kind: DeviceKind, device, rate: Callable[..., float]
) -> float:
    """FLOP/s of causal SDPA forward of (B, heads, T, head_dim), counted as Note [attention FLOPs]
    says."""
    import torch
    import torch.nn.functional as F

    batch, heads, seq, head_dim = shape
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype) for _ in range(3)
    )
    return rate(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        4 * batch * heads * seq * seq * head_dim,
    )


# Elements each activation is timed on: 8 MiB of fp32, past a core's L2 as a small model's
# activations are.
ACTIVATION_ELEMENTS = 2**21


def _activation_costs(device, rate: Callable[..., float], window_s: float) -> dict[str, float]:
    """Seconds per element of common activations' forward and backward in fp32, keyed
    "activation/<name>/<pass>" (Note [activations a CPU computes] in cluster.py)."""
    import torch
    import torch.nn.functional as F

    functions = {
        "gelu": F.gelu,
        "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
        "silu": F.silu,
        "relu": F.relu,
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
    }
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(ACTIVATION_ELEMENTS, device=device, generator=generator).requires_grad_()
    grad = torch.randn(ACTIVATION_ELEMENTS, device=device, generator=generator)
    calls = {}
    for name, fn in functions.items():
        calls[f"activation/{name}/forward"] = functools.partial(_no_grad, fn, x)
        calls[f"activation/{name}/backward"] = functools.partial(
            torch.autograd.grad, fn(x), x, grad, retain_graph=True
        )
    seconds: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(CPU_ROUNDS):  # taking turns, as the matmuls do: Note [a CPU's rates drift]
        for key, call in calls.items():
            seconds[key].append(
                1.0 / rate(call, ACTIVATION_ELEMENTS, window_s=window_s / CPU_ROUNDS)
            )
    return {key: statistics.median(values) for key, values in seconds.items()}


def _no_grad(fn: Callable, x):
    import torch

    with torch.no_grad():
        return fn(x)


# A transformer too small for its kernels' work to matter: its step time is all dispatch.
_OVERHEAD_MODEL = [
    "gpt-tiny",
    "num_layers=2",
    "hidden_size=32",
    "num_heads=2",
    "vocab_size=64",
    "max_seq_len=16",
]


def _op_overhead_s(device, rate: Callable[..., float]) -> float:
    """Seconds per op as the cost model counts ops (Note [op overhead] in planner/costs.py).

    A forward and backward of a tiny zoo GPT, whose kernels do next to no work, divided by 3 x the
    ops the planner charges in its traced graph (the backward dispatches about twice the forward's):
    module calls, autograd's bookkeeping and the backward's own kernels are in the figure, as they
    are in training.
    """
    import torch

    from hyparallel import models
    from hyparallel.graph import trace
    from hyparallel.planner.profile import dispatched_ops
    from hyparallel.runtime.parallel import token_cross_entropy
    from hyparallel.tensor.init import materialize_

    model = models.load(_OVERHEAD_MODEL).module
    tokens = torch.randint(
        0, 64, (2, 17), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    ops = len(dispatched_ops(trace(model, tokens[:, :-1].to("meta"))))
    materialize_(model, device, seed=0)

    def step() -> None:
        token_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()

    return 1.0 / rate(step, 1.0) / (3 * ops)


def _copy_rate(settings: Settings, device, rate: Callable[..., float]) -> float:
    """Bytes read plus written per second by ``copy_`` of a large fp32 buffer."""
    import torch

    # ones, not empty: pages touched before timing
    source = torch.ones(settings.copy_bytes // 4, device=device)
    target = torch.zeros_like(source)
    return rate(lambda: target.copy_(source), 2 * settings.copy_bytes)


# Note [a collective's latency]
#     A ring all-reduce of B bytes over n ranks takes 2(n-1) steps of latency and 2(n-1)/n x B at
#     the bus bandwidth (costs.ring_allreduce_s). On NCCL a step's latency is about a message's;
#     gloo's all-reduce on a CPU pays far more per step than its send/recv: on the AMD EPYC (2
#     processes) 64 KiB took 2.9 ms, 1 MiB 5.0 and 4 MiB 6.8, against a 0.13-0.55 ms ping-pong;
#     priced from the ping-pong and the 4 MiB rate, a tensor-parallel step's 1 MiB all-reduces read
#     2.8 ms each and ran 4.9 (gpt-mini tp 2: 88 of 348 ms). So calibrate times the all-reduce at
#     two sizes (allreduce_bytes and 1/ALLREDUCE_SMALL_FRACTION of it) and solves the two for the
#     step latency (the link's collective_latency_s) and the bandwidth; send/recv keep the
#     ping-pong's latency_s. A pair that does not solve (the small one no faster per byte) keeps the
#     large one's rate as the bandwidth and no collective latency of its own.
ALLREDUCE_SMALL_FRACTION = 64


def collective_link(
    world: int, large_bytes: float, large_s: float, small_bytes: float, small_s: float
) -> tuple[float, float | None]:
    """(bus bandwidth, step latency or None) solving t = 2(n-1) a + 2(n-1)/n B / b at two sizes
    (Note [a collective's latency])."""
    steps, share = 2 * (world - 1), 2 * (world - 1) / world
    if large_s > small_s and large_bytes > small_bytes:
        bandwidth = share * (large_bytes - small_bytes) / (large_s - small_s)
        latency = (small_s - share * small_bytes / bandwidth) / steps
        if latency > 0:
            return bandwidth, latency
    return share * large_bytes / large_s, None


def _collective_figures(
    settings: Settings, kind: DeviceKind, device, rank: int, world: int, sync: Callable[[], None]
) -> dict[str, float]:
    """All-reduce bus bandwidth (every rank) and send/recv latency (paired ranks; NaN on an odd one
    out)."""
    import torch
    import torch.distributed as dist

    def synchronize() -> None:
        if kind == "cuda":
            torch.cuda.synchronize(device)

    def allreduce_s(num_bytes: int, repeats: int) -> float:
        tensor = torch.ones(num_bytes // 4, device=device)
        dist.all_reduce(tensor)  # warm-up: connections and buffers
        seconds = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            synchronize()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    small = settings.allreduce_bytes // ALLREDUCE_SMALL_FRACTION
    figures = {
        "allreduce_s": allreduce_s(settings.allreduce_bytes, settings.allreduce_repeats),
        "allreduce_small_s": allreduce_s(small, 3 * settings.allreduce_repeats),
        "latency": math.nan,
    }
    peer = rank ^ 1  # pairs (0, 1), (2, 3), ...
    token = torch.zeros(1, device=device)

    def pingpong(iters: int) -> None:
        for _ in range(iters):
            if rank % 2 == 0:
                dist.send(token, peer)
                dist.recv(token, peer)
            else:
                dist.recv(token, peer)
                dist.send(token, peer)
        synchronize()

    if peer < world:
        pingpong(10)  # warm-up: NCCL creates the pair's communicator here
    sync()
    if peer < world:
        start = time.perf_counter()
        pingpong(settings.pingpong_iters)
        figures["latency"] = (time.perf_counter() - start) / (2 * settings.pingpong_iters)
    return figures


def _reserved_bytes(kind: DeviceKind, device) -> int:
    """Memory this process holds that a model could not use (module docstring)."""
    import torch

    if kind == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return _rss_bytes()
