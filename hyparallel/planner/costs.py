"""Pure cost functions: seconds and bytes from sizes, group sizes and links.

Every function is a small pure function of its arguments, with units in the names. The
formulas and the source of every constant are written up in docs/cost-model.md.
"""

from __future__ import annotations

import numpy as np

from hyparallel.cluster import LinkSpec
from hyparallel.schema import Dtype, Schedule

Bytes = float | np.ndarray

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}

# Mixed-precision Adam (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1, with Megatron-LM's fp32 main gradients):
# 16-bit weights, fp32 gradients (accumulated and reduced in fp32), fp32 master weights + Adam m + v.
GRAD_BYTES_PER_PARAM = 4
OPTIMIZER_BYTES_PER_PARAM: dict[str, int] = {"bf16": 12, "fp16": 12, "fp32": 8}  # fp32 training needs no master copy

# ZeRO's all-gathers move the weights as parallelize holds them: fp32 master copies, cast by autocast after the
# gather (FSDP2 without a mixed-precision policy; Note [ZeRO stages on FSDP2] in data_parallel.py).
GATHERED_BYTES_PER_PARAM = 4

# Communication overlapped with computation is not free: NCCL kernels take SMs and memory bandwidth from
# the GEMMs they run beside, which slow by roughly 10-30% while both run (e.g. Wang et al. 2023,
# "Overlap Communication with Dependent Computation via Decomposition", Sec. 2; Zhao et al. 2023,
# "PyTorch FSDP", Sec. 7.2). We charge this fraction of the hidden communication time to the step.
OVERLAP_CONTENTION = 0.2

# DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25): the last
# bucket is reduced after the last backward op, so at least its reduction is never hidden.
DP_BUCKET_BYTES = 25 * 2**20


# The collective costs take a byte count or a numpy array of them (the stage search costs every
# candidate stage at once); nothing to send costs nothing.


def _ring_s(num_bytes: Bytes, steps: int, group_size: int, link: LinkSpec) -> Bytes:
    seconds = (
        steps * link.latency_s + steps / group_size * np.asarray(num_bytes, dtype=float) / link.bandwidth_bytes_per_s
    )
    result = np.where(np.asarray(num_bytes) > 0, seconds, 0.0)
    return float(result) if np.ndim(result) == 0 else result


def ring_allreduce_s(num_bytes: Bytes, group_size: int, link: LinkSpec) -> Bytes:
    """Ring all-reduce of ``num_bytes`` per rank: 2(n-1) steps of bytes/n each (Patarasuk & Yuan 2009)."""
    return _ring_s(num_bytes, 2 * (group_size - 1), group_size, link) if group_size > 1 else 0.0 * np.asarray(num_bytes)


def ring_allgather_s(gathered_bytes: Bytes, group_size: int, link: LinkSpec) -> Bytes:
    """Ring all-gather producing ``gathered_bytes`` on every rank: (n-1) steps of bytes/n."""
    return (
        _ring_s(gathered_bytes, group_size - 1, group_size, link)
        if group_size > 1
        else 0.0 * np.asarray(gathered_bytes)
    )


def ring_reduce_scatter_s(input_bytes: Bytes, group_size: int, link: LinkSpec) -> Bytes:
    """Ring reduce-scatter of ``input_bytes`` per rank: the mirror of all-gather, same cost."""
    return ring_allgather_s(input_bytes, group_size, link)


def p2p_s(num_bytes: float, link: LinkSpec) -> float:
    """One point-to-point send of ``num_bytes``."""
    return link.latency_s + num_bytes / link.bandwidth_bytes_per_s if num_bytes > 0 else 0.0


def roofline_s(
    flops: float,
    num_bytes: float,
    peak_flops: float,
    flop_efficiency: float,
    memory_bandwidth_bytes_per_s: float,
    memory_efficiency: float,
) -> float:
    """A kernel's time: the larger of its compute time and its memory-traffic time (Williams et al. 2009)."""
    compute_s = flops / (peak_flops * flop_efficiency) if flops else 0.0
    memory_s = num_bytes / (memory_bandwidth_bytes_per_s * memory_efficiency) if num_bytes else 0.0
    return max(compute_s, memory_s)


# Note [op overhead]
#     Every op the traced graph runs costs host time before any kernel runs: Python, the framework's
#     dispatch and autograd bookkeeping, the kernel launch (DeviceSpec.op_overhead_s; `hyparallel calibrate`
#     measures it with a small F.linear whose weight requires grad). A GPU runs kernels asynchronously, so the
#     host's dispatch hides behind kernels longer than it, and an op costs max(kernel, overhead): small ops
#     are launch-bound. A CPU computes in the thread that dispatches, so the two add. The backward of an op
#     dispatches about as many kernels again per forward one as its time ratio says (two matmuls for a
#     Linear), so the backward's overhead scales with the same ratio as its work.


def dispatched_s(work_s: float, op_overhead_s: float, serial: bool) -> float:
    """One op's time with the host's dispatch overhead: added on a CPU, a floor on a GPU (Note [op overhead])."""
    return work_s + op_overhead_s if serial else max(work_s, op_overhead_s)


def bubble_fraction(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time over ideal compute time.

    (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) interleaved (Narayanan et al. 2021).
    """
    return (pp - 1) / (virtual_stages * num_microbatches)


def inflight_microbatches(
    schedule: Schedule, pp: int, num_microbatches: int, stage: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak, in units of the whole stage.

    GPipe runs every forward before any backward: m. 1F1B lets stage s run p - s forwards before its
    first backward (Narayanan et al. 2021, Sec. 2.2): min(p - s, m). Interleaved 1F1B warms up
    2(p - s - 1) + (v - 1)p chunk forwards, plus one in the steady state (Megatron-LM's
    get_num_warmup_microbatches), each chunk 1/v of the stage.
    """
    if schedule == "gpipe":
        return float(num_microbatches)
    if pp == 1:
        return 1.0
    if schedule == "1f1b":
        return float(min(pp - stage, num_microbatches))
    chunks = min(2 * (pp - stage - 1) + (virtual_stages - 1) * pp + 1, num_microbatches * virtual_stages)
    return chunks / virtual_stages


def state_bytes_per_param(dtype: Dtype, zero: int, dp: int) -> float:
    """Bytes per parameter one rank holds through a step for weights, gradients and AdamW state under ZeRO ``zero``.

    As parallelize runs it (Note [ZeRO stages on FSDP2] in data_parallel.py): fp32 master weights, plus a 16-bit copy
    under bf16/fp16 autocast, fp32 gradients and AdamW's m and v. ZeRO 1 shards the master weights and m, v but
    keeps the weights gathered (fp32) and the gradients whole through the step; ZeRO 2 shards the gradients too;
    ZeRO 3 holds only shards (the units gathered at a time are added by the search). With dp = 1 nothing shards.
    """
    master, grad, adam = GATHERED_BYTES_PER_PARAM, GRAD_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM["fp32"]
    copy = 0 if dtype == "fp32" else DTYPE_BYTES[dtype]
    if zero == 0 or dp == 1:
        return master + copy + grad + adam
    if zero == 1:
        return master / dp + master + copy + grad + adam / dp
    if zero == 2:
        return master / dp + master + copy + (grad + adam) / dp
    return (master + grad + adam) / dp


def adam_step_bytes_per_param(dtype: Dtype) -> int:
    """Memory traffic of one fused Adam step per parameter: read grad, master, m, v; write master, m, v, weight."""
    reads = GRAD_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM[dtype] + (0 if dtype != "fp32" else 4)
    writes = OPTIMIZER_BYTES_PER_PARAM[dtype] + (DTYPE_BYTES[dtype] if dtype != "fp32" else 4)
    return reads + writes


def korthikanti_activation_bytes(
    seq: int, batch: int, hidden: int, heads: int, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes of one GPT layer with 16-bit activations (Korthikanti et al. 2022, Table 2).

    The reference formula for a standard attention layer that stores its softmax; hyparallel's
    model computes saved tensors from the traced graph instead (docs/cost-model.md).
    """
    sbh = seq * batch * hidden
    attention = 5 * heads * seq / hidden
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if recompute == "selective":
        return sbh * (34 / tp if sequence_parallel else 10 + 24 / tp)
    if sequence_parallel:
        return sbh * (34 / tp + attention / tp)
    return sbh * (10 + 24 / tp + attention / tp)


def model_flops_per_step(forward_flops_per_sequence: float, global_batch: int) -> float:
    """Model FLOPs of one step: forward + backward = 3x forward, no recomputation counted (Korthikanti et al. 2022)."""
    return 3 * forward_flops_per_sequence * global_batch


def overlapped_s(comm_s: Bytes, compute_s: Bytes, serial: bool = False) -> Bytes:
    """Time communication adds when it runs beside ``compute_s`` of computation: what does not fit, plus contention.

    ``serial``: a CPU cluster (backend gloo), whose collectives run on the cores that compute: nothing hides.
    """
    if serial:
        return comm_s + 0.0 * compute_s  # the shape of an array argument, as the overlapped case returns
    hidden = np.minimum(comm_s, compute_s)
    return np.maximum(comm_s - compute_s, 0.0) + OVERLAP_CONTENTION * hidden
