"""Pure cost functions: seconds and bytes from sizes, group sizes and links.

Every function is a small pure function of its arguments, with units in the names. The
formulas and the source of every constant are written up in docs/cost-model.md.
"""

from __future__ import annotations

import math

import numpy as np

from hyparallel.spec.cluster import DeviceSpec, LinkSpec, MatmulCurve
from hyparallel.spec.schema import Dtype, GradCompression

# A figure (bytes, seconds, counts) for one configuration, or an array of them, one per candidate
# the search costs at once.
Figure = float | np.ndarray

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}

# Mixed-precision Adam (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1, with Megatron-LM's fp32 main
# gradients): 16-bit weights, fp32 gradients (accumulated and reduced in fp32), fp32 master weights
# + Adam m + v.
GRAD_BYTES_PER_PARAM = 4
# fp32 training needs no master copy
OPTIMIZER_BYTES_PER_PARAM: dict[str, int] = {"bf16": 12, "fp16": 12, "fp32": 8}

# The weights parallelize holds (autocast casts them to the training dtype as each op runs): fp32
# master copies.
MASTER_BYTES_PER_PARAM = 4

# Communication overlapped with computation is not free: NCCL kernels take SMs and memory bandwidth
# from the GEMMs they run beside, which slow by roughly 10-30% while both run (e.g. Wang et al.
# 2023, "Overlap Communication with Dependent Computation via Decomposition", Sec. 2; Zhao et al.
# 2023, "PyTorch FSDP", Sec. 7.2). We charge this fraction of the hidden communication time to the
# step.
OVERLAP_CONTENTION = 0.2
# Note [the loss's memory] in profile.py: the cross-entropy's backward holds nll_loss's and
# log_softmax's fp32 gradients (4 + 4 bytes per logit) beside the saved fp32 log-probabilities
# (aten's cross_entropy is log_softmax then nll_loss; both gradients are dense).
LOSS_BACKWARD_BYTES_PER_LOGIT = 8

# DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25): the
# last bucket is reduced after the last backward op, so at least its reduction is never hidden.
DP_BUCKET_BYTES = 25 * 2**20


# The collective costs take a byte count or a numpy array of them (the stage search costs every
# candidate stage at once); nothing to send costs nothing.


def _ring_s(num_bytes: Figure, steps: int, group_size: int, link: LinkSpec) -> Figure:
    # one byte count: the same float64 arithmetic, without numpy's overhead
    if isinstance(num_bytes, (int, float)):
        if not num_bytes > 0:
            return 0.0
        return float(
            steps * link.step_latency_s
            + steps / group_size * float(num_bytes) / link.bandwidth_bytes_per_s
        )
    seconds = (
        steps * link.step_latency_s
        + steps / group_size * np.asarray(num_bytes, dtype=float) / link.bandwidth_bytes_per_s
    )
    result = np.where(np.asarray(num_bytes) > 0, seconds, 0.0)
    return float(result) if np.ndim(result) == 0 else result


def ring_allreduce_s(num_bytes: Figure, group_size: int, link: LinkSpec) -> Figure:
    """Ring all-reduce of ``num_bytes`` per rank: 2(n-1) steps of bytes/n each (Patarasuk & Yuan
    2009)."""
    return (
        _ring_s(num_bytes, 2 * (group_size - 1), group_size, link)
        if group_size > 1
        else 0.0 * np.asarray(num_bytes)
    )


def ring_allgather_s(gathered_bytes: Figure, group_size: int, link: LinkSpec) -> Figure:
    """Ring all-gather producing ``gathered_bytes`` on every rank: (n-1) steps of bytes/n."""
    return (
        _ring_s(gathered_bytes, group_size - 1, group_size, link)
        if group_size > 1
        else 0.0 * np.asarray(gathered_bytes)
    )


def ring_reduce_scatter_s(input_bytes: Figure, group_size: int, link: LinkSpec) -> Figure:
    """Ring reduce-scatter of ``input_bytes`` per rank: the mirror of all-gather, same cost."""
    return ring_allgather_s(input_bytes, group_size, link)


def all_to_all_s(num_bytes: Figure, group_size: int, link: LinkSpec) -> Figure:
    """All-to-all of ``num_bytes`` per rank, an equal share to each: (n-1)/n of it leaves, one step
    per peer (pairwise exchange)."""
    return (
        _ring_s(num_bytes, group_size - 1, group_size, link)
        if group_size > 1
        else 0.0 * np.asarray(num_bytes)
    )


# Note [expert parallelism's costs]
#     Under ep > 1 (hyparallel.runtime.experts) a segment's expert ops (those reading only
#     expert weights, and every op run inside the experts: a grouped matmul, the dispatch's gathers
#     and casts) cost, per micro-batch:
#     * compute: each rank runs its E/ep experts on every rank's tokens routed there, which on
#       average is as many (token, expert) pairs as its own tokens make: a ModuleList's experts as
#       tp splits them (column/row), stacked experts on 1/tp of the tokens (tp folded into their
#       ranks: Note [tp folded into the experts' ranks] in hyparallel/runtime/experts.py), times
#       the imbalance: the busiest rank's pairs over the mean, which the step waits for.
#       EXPERT_IMBALANCE (1.2) is what Megatron-Core's dropless MoE with a load-balancing loss is
#       commonly reported to keep its most loaded expert under early in training; a run measures
#       its own (``pmodel.expert_imbalance``) and the planner takes it (``--expert-imbalance``).
#     * the exchange: EXCHANGES_PER_MOE_LAYER all-to-alls of tokens x top-k x hidden in the plan's
#       dtype per MoE layer (dispatch and combine, forward and backward), over the link the ep group
#       spans (search.ep_links: ep consecutive dp ranks with tp inside them for a ModuleList's
#       experts, ep consecutive ranks of the (dp, tp) block for stacked ones, whose tp ranks each
#       send 1/tp of the tokens), never overlapped with compute. A ModuleList's experts exchange
#       their rows one expert at a time, after a header all-gather each: E exchanges of 1/E of the
#       bytes, each paying the link's latency. Stacked experts under tp add two all-gathers of
#       tokens x hidden over tp (the outputs forward, the inputs' gradients backward).
#     * memory: the expert weights a tp rank holds, over ep (and their optimizer state over ZeRO's
#       dp / ep replicas, dp tp / ep for stacked experts under tp), everything else as before.
#     * their gradients: averaged over those replicas, not dp (Note [an expert's gradient is a
#       mean over dp] in hyparallel/runtime/experts.py): under ZeRO 0 an fp32 all-reduce after
#       the last backward, never compressed (DDP's bucketed, compressed all-reduce takes the other
#       weights); under ZeRO 1-3 an FSDP unit of their own over the replicas, gathered and
#       scattered as the stage's other units are, each unit's optimizer step on 1/replicas of
#       them. With ep = dp (one replica) they are not reduced at all.
#     * the router's auxiliary loss (Note [the router's auxiliary loss over dp] in
#       hyparallel/runtime/router_loss.py), for a model whose router scores leave their MoE layer
#       (ModelProfile.router_logit_elements: tokens x E per layer, read by the loss the model
#       computes), each micro-batch, on the stage computing the loss, over the dp link:
#       transformers' function all-reduces its 2 E + 1 fp32 sums forward and backward (as
#       Megatron-Core's global auxiliary loss, a latency); any other (ModelProfile's
#       router_loss_gathered, also when the planner has only a graph) has every dp rank's scores
#       all-gathered forward and their gradients reduce-scattered backward, in the plan's dtype.
EXPERT_IMBALANCE = 1.2
EXCHANGES_PER_MOE_LAYER = 4

# Note [context parallelism's costs]
#     Under cp > 1 (hyparallel.runtime.context) a cp rank runs 1/cp of every sequence of its dp
#     rank's micro-batch, and the search costs it as a data-parallel rank of dp x cp with 1/cp of a
#     micro-batch's sequences (search.Config.costed):
#     * compute and memory: every op on 1/cp of the tokens; attention's (query, key) pairs too,
#       since the load-balanced chunks (i and 2 cp - 1 - i) give every rank the same number under a
#       causal mask (the FLOPs a graph counts, 4 b heads T^2 d, are then split evenly);
#     * weight gradients: shared by the dp x cp ranks (one group, the link it spans), ZeRO's shards
#       over them too;
#     * each attention's keys and values as the split receives them (Note [grouped-query keys as
#       they travel] in hyparallel/graph/context.py: a model that repeats grouped-query heads before
#       calling scaled_dot_product_attention moves the repeated ones, a transformers model the few
#       it makes), of this rank's tokens and tp's heads:
#       - `gather`: all-gathered over cp forward and reduce-scattered backward, never overlapped
#         (once more when the block is recomputed); the other ranks' keys and values are saved for
#         the backward, so a layer holds the whole sequence's, which grows with the sequence as
#         nothing else per rank does;
#       - `ring`: cp - 1 steps each sending one block (forward: keys and values; backward: with
#         their gradients, one more hop home), each step's send beside the step's share of the
#         attention's compute on NCCL (batch_isend_irecv in flight while the block is computed:
#         overlapped_s, what does not fit plus OVERLAP_CONTENTION of what does), exposed whole on
#         gloo, whose sends the CPU runs before the compute; a few blocks in flight, nothing saved
#         beyond this rank's own.
#     The planner writes the faster of the two; `hyparallel plan --top K` compares them.


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
    """A kernel's time: the larger of its compute time and its memory-traffic time (Williams et al.
    2009)."""
    compute_s = flops / (peak_flops * flop_efficiency) if flops else 0.0
    memory_s = num_bytes / (memory_bandwidth_bytes_per_s * memory_efficiency) if num_bytes else 0.0
    return max(compute_s, memory_s)


def curve_factor(curve: MatmulCurve | None, output_elements: float, k: float) -> float:
    """A product's efficiency relative to the plateau by its shape (Note [matmul curve] in
    cluster.py); 1 without a curve."""
    return 1.0 if curve is None else curve.factor(output_elements, k)


def gemm_efficiency(
    plateau: float, curve: MatmulCurve | None, batch: float, m: float, n: float, k: float
) -> float:
    """The fraction of peak a ``batch`` x (``m`` x ``k``) @ (``k`` x ``n``) product reaches: the
    plateau times the curve's factor for its ``batch * m * n`` outputs reduced over ``k``."""
    return plateau * curve_factor(curve, batch * m * n, k)


def gemm_backward_efficiencies(
    plateau: float, curve: MatmulCurve | None, batch: float, m: float, n: float, k: float
) -> tuple[float, float]:
    """Efficiencies of the two backward products of C = A @ B (A: m x k, B: k x n), each by its own
    shape: dA = dC @ B^T (m x k outputs reduced over n) and dB = A^T @ dC (k x n outputs reduced
    over m)."""
    return (
        gemm_efficiency(plateau, curve, batch, m, k, n),
        gemm_efficiency(plateau, curve, batch, k, n, m),
    )


def kernel_s(work_s: float, kernel_floor_s: float) -> float:
    """One kernel's device time: its roofline, at least the device's per-kernel floor (launch and
    teardown)."""
    return max(work_s, kernel_floor_s)


# Note [op overhead]
#     Every op the traced graph runs costs host time before any kernel runs: Python, the framework's
#     dispatch and autograd bookkeeping, the kernel launch (DeviceSpec.op_overhead_s; `hyparallel
#     calibrate` measures it with a small F.linear whose weight requires grad). A GPU runs kernels
#     asynchronously, so the host's dispatch hides behind kernels longer than it, and an op costs
#     max(kernel, overhead): small ops are launch-bound. A CPU computes in the thread that
#     dispatches, so the two add. The backward of an op dispatches about as many kernels again per
#     forward one as its time ratio says (two matmuls for a Linear), so the backward's overhead
#     scales with the same ratio as its work.


def dispatched_s(work_s: float, op_overhead_s: float, serial: bool) -> float:
    """One op's time with the host's dispatch overhead: added on a CPU, a floor on a GPU (Note [op
    overhead])."""
    return work_s + op_overhead_s if serial else max(work_s, op_overhead_s)


# Note [gradient compression]
#     How each parallel.grad_compression reduces the data-parallel gradients, as
#     hyparallel.runtime.compression runs them (torch's DDP communication hooks; the pipeline's
#     all-reduce after the schedule runs the same hooks), and what the planner charges each.
#     ``none`` keeps its price (a ring all-reduce of the fp32 gradients, its latency charged once
#     for all buckets, plus the last bucket's); the others are priced relative to it:
#       bf16/fp16: torch.distributed.algorithms.ddp_comm_hooks.default_hooks._compress_hook casts
#       each bucket to 16
#         bits, divides it by the group size, all-reduces it and casts it back: half the bytes on
#         the wire, the same one collective per bucket, and three kernels per bucket that fp32 does
#         not run (DDP without a hook divides while it copies each gradient into its bucket): read 4
#         write 2, read 2 write 2, read 2 write 4 bytes per element. Under ZeRO 1-3 (FSDP2) the
#         reduce-scatter runs in 16 bits and, in 16-bit training, the weights are gathered in 16
#         bits (2 bytes each, ``gathered_bytes_per_param``); FSDP2 casts in the copies into its
#         collective buffers that it makes anyway, so nothing else is charged.
#       powersgd: torch's powerSGD_hook (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient
#       Compression for
#         Distributed Optimization", Algorithm 1 with error feedback and warm start; Note
#         [PowerSGD's wire]) runs three all-reduces per bucket, one after the other: the
#         uncompressed tensors, then the P factors, then the Q factors: two collectives per bucket
#         more than ``none``, each a ring latency of its own. Its kernels (``powersgd_matrix_s``,
#         ``powersgd_elementwise_s``) and their dispatch are charged too. It compresses from
#         powersgd_start_step on; the planner prices the steady state after it.
#     Compression's kernels are never hidden: on a GPU they run on the device beside the backward's;
#     on a CPU (gloo) compute and communication share the cores, and hyparallel waits for each
#     PowerSGD bucket's chain of collectives before the next (Note [compression hooks on gloo] in
#     runtime/compression.py). Each hook op pays the host's dispatch (Note [op overhead]): added to
#     the work on a CPU; on a GPU the host dispatches while the device works, so the hook costs the
#     larger of the two.
#
# Note [PowerSGD's wire]
#     powerSGD_hook views each gradient as a matrix (shape[0], -1) of n rows and m columns and
#     compresses it at rank r = min(n, m, powersgd_rank) when (n + m) r x MIN_COMPRESSION_RATE < n m
#     (torch's _should_compress): it then sends P (n x r) and Q (m x r), r (n + m) elements; every
#     other tensor (vectors, small matrices) is sent whole, in fp32. Per compressed matrix M it
#     runs: Q orthogonalised (warm start), P = M Q, P all-reduced and orthogonalised, Q = M^T P, Q
#     all-reduced, M = P Q^T: three batched products of 2 n m r FLOPs each and two
#     orthogonalisations (QR for r > 2, Gram-Schmidt otherwise, about 2 k r^2 FLOPs for a k x r
#     factor; Golub & Van Loan, "Matrix Computations", Sec. 5.2). Per bucket it adds the residual of
#     the last step to the gradients, clones them, and stores the new residual (the gradients minus
#     their approximation): error feedback, read 4 + 4 write 4, read 4 write 4, read 4 + 4 write 4
#     bytes per element, an fp32 residual per element kept between steps; it copies the uncompressed
#     tensors into one buffer, divides and copies them back. The planner reads the shapes of the
#     gradients each rank holds from the trace (Op.param_shapes, split by tensor parallelism as the
#     runtime splits them: ModelProfile.powersgd_work).

GRAD_COMPRESSIONS: tuple[GradCompression, ...] = ("none", "bf16", "fp16", "powersgd")
SIXTEEN_BIT: tuple[GradCompression, ...] = ("bf16", "fp16")
# torch's default min_compression_rate, which hyparallel.runtime.compression.MIN_COMPRESSION_RATE
# passes to PowerSGDState (the planner does not import the runtime: tests/test_planner_costs.py
# checks the two agree).
MIN_COMPRESSION_RATE = 2
# PowerSGD's error feedback keeps one fp32 residual per gradient element between steps
# (PowerSGDState.error_dict).
ERROR_FEEDBACK_BYTES_PER_PARAM = 4
# bf16/fp16 hook kernels per element (Note [gradient compression]): cast down, divide in 16 bits,
# cast back.
SIXTEEN_BIT_HOOK_BYTES_PER_ELEMENT = (4 + 2) + (2 + 2) + (2 + 4)
SIXTEEN_BIT_HOOK_OPS_PER_BUCKET = 3
# PowerSGD per gradient element: the residual added (read 8 write 4), the clone (read 4 write 4),
# the new residual (read 8 write 4); per uncompressed element: the copy into one buffer, its
# division, the copy back (read 4 write 4 each). Per bucket: add_, clone, cat, the two divisions
# (uncompressed tensors, Q) and the residual's subtraction.
POWERSGD_BYTES_PER_ELEMENT = 12 + 8 + 12
POWERSGD_BYTES_PER_UNCOMPRESSED_ELEMENT = 3 * 8
POWERSGD_OPS_PER_BUCKET = 6


def powersgd_factor_rank(rows: float, cols: float, rank: int) -> int:
    """The rank PowerSGD compresses a ``rows`` x ``cols`` gradient at, 0 when it sends it whole
    (torch's _should_compress with MIN_COMPRESSION_RATE; Note [PowerSGD's wire])."""
    r = int(min(rows, cols, rank))
    return r if (rows + cols) * r * MIN_COMPRESSION_RATE < rows * cols else 0


def powersgd_matrix(shape: tuple[float, ...]) -> tuple[float, float]:
    """(rows, cols) of the matrix PowerSGD views a gradient of ``shape`` as: (shape[0], -1); a
    scalar is 1 x 1."""
    rows = shape[0] if shape else 1
    return rows, math.prod(shape) / rows if rows else 0.0


def powersgd_wire_elements(shape: tuple[float, ...], rank: int) -> float:
    """Elements PowerSGD all-reduces for one gradient of ``shape``: r (n + m) when compressed, else
    all of them."""
    rows, cols = powersgd_matrix(shape)
    r = powersgd_factor_rank(rows, cols, rank)
    return r * (rows + cols) if r else rows * cols


def powersgd_matrix_s(rows: float, cols: float, r: int, device: DeviceSpec) -> float:
    """Kernel seconds PowerSGD spends on one compressed ``rows`` x ``cols`` fp32 gradient at rank
    ``r``: three products of 2 n m r FLOPs (reading or writing the matrix and both factors) and the
    two factors' orthogonalisations, ~2 k r^2 FLOPs over a k x r factor read and written (Note
    [PowerSGD's wire]); dispatch not included."""
    peak, bandwidth = device.peak_flops.fp32, device.memory_bandwidth_bytes_per_s
    product = roofline_s(
        2 * rows * cols * r,
        4 * (rows * cols + (rows + cols) * r),
        peak,
        device.matmul_efficiency,
        bandwidth,
        device.memory_efficiency,
    )
    orthogonalise = sum(
        roofline_s(
            2 * k * r * r,
            8 * k * r,
            peak,
            device.matmul_efficiency,
            bandwidth,
            device.memory_efficiency,
        )
        for k in (rows, cols)
    )
    return 3 * product + orthogonalise


def powersgd_matrix_ops(r: int) -> int:
    """Ops PowerSGD dispatches per compressed matrix: three products and two orthogonalisations,
    each a QR and the empty R it writes (r > 2), or Gram-Schmidt's 6 per column but the last's 2
    (torch's _orthogonalize)."""
    orthogonalise = 2 if r > 2 else 6 * r - 4
    return 3 + 2 * orthogonalise


def powersgd_elementwise_s(elements: float, uncompressed: float, device: DeviceSpec) -> float:
    """Seconds of PowerSGD's memory-bound work on ``elements`` gradient elements, ``uncompressed``
    of them sent whole: error feedback on all, the copies and division of the uncompressed ones
    (Note [PowerSGD's wire])."""
    traffic = (
        POWERSGD_BYTES_PER_ELEMENT * elements
        + POWERSGD_BYTES_PER_UNCOMPRESSED_ELEMENT * uncompressed
    )
    return traffic / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)


def dp_buckets(grad_bytes: Figure) -> Figure:
    """Gradient buckets of ``grad_bytes`` of fp32 gradients (DP_BUCKET_BYTES each, the last one
    partial)."""
    return np.ceil(np.asarray(grad_bytes, dtype=float) / DP_BUCKET_BYTES)


def collectives_per_bucket(grad_compression: GradCompression) -> int:
    """All-reduces a data-parallel hook runs per bucket: PowerSGD's three (uncompressed tensors, P,
    Q), else one."""
    return 3 if grad_compression == "powersgd" else 1


def grad_wire_bytes(
    grad_compression: GradCompression,
    params: Figure,
    powersgd_elements: Figure,
    serial: bool = False,
) -> Figure:
    """Bytes per rank a ZeRO-0 gradient all-reduce sends for ``params`` gradients: fp32 (``none``),
    16-bit, or PowerSGD's fp32 factors and uncompressed tensors (``powersgd_elements`` of them: Note
    [PowerSGD's wire]); on gloo (``serial``) a 16-bit sum's fp32-equivalent bytes (Note [16-bit sums
    on gloo])."""
    if grad_compression == "powersgd":
        return np.asarray(powersgd_elements, dtype=float) * GRAD_BYTES_PER_PARAM
    return np.asarray(params, dtype=float) * reduction_bytes_per_element(grad_compression, serial)


def dp_allreduce_s(
    grad_compression: GradCompression,
    grad_bytes: Figure,
    wire_bytes: Figure,
    group_size: int,
    link: LinkSpec,
) -> tuple[Figure, Figure]:
    """(all buckets, the last bucket) seconds of the ZeRO-0 gradient all-reduce: ``grad_bytes`` of
    fp32 gradients in DP_BUCKET_BYTES buckets, ``wire_bytes`` of them on the wire.

    Ring all-reduces of the wire bytes; PowerSGD's extra collectives add a ring latency each, per
    bucket (Note [gradient compression]). The last bucket carries its share of the wire bytes.
    """
    grad = np.asarray(grad_bytes, dtype=float)
    wire = np.asarray(wire_bytes, dtype=float)
    share = np.divide(wire, grad, out=np.zeros_like(wire * grad), where=grad > 0)
    last_wire = np.minimum(grad, DP_BUCKET_BYTES) * share
    latency = 2 * (group_size - 1) * link.step_latency_s  # one ring all-reduce's steps
    extra = (collectives_per_bucket(grad_compression) - 1) * latency
    buckets = dp_buckets(grad)
    whole = ring_allreduce_s(wire, group_size, link) + extra * buckets
    last = ring_allreduce_s(last_wire, group_size, link) + extra * np.minimum(buckets, 1)
    return whole, last


def compression_compute_s(
    grad_compression: GradCompression,
    params: Figure,
    powersgd_work_s: Figure,
    powersgd_ops: Figure,
    device: DeviceSpec,
    serial: bool,
) -> Figure:
    """Seconds a ZeRO-0 compression hook adds to the step for ``params`` gradients, with dispatch
    (Note [gradient compression]); PowerSGD's per-matrix kernel seconds and ops come from
    ``ModelProfile.powersgd_work``."""
    params = np.asarray(params, dtype=float)
    buckets = dp_buckets(params * GRAD_BYTES_PER_PARAM)
    if grad_compression in SIXTEEN_BIT:
        work = (
            params
            * SIXTEEN_BIT_HOOK_BYTES_PER_ELEMENT
            / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
        )
        ops = buckets * SIXTEEN_BIT_HOOK_OPS_PER_BUCKET
    elif grad_compression == "powersgd":
        work = np.asarray(powersgd_work_s, dtype=float)
        ops = np.asarray(powersgd_ops, dtype=float) + buckets * POWERSGD_OPS_PER_BUCKET
    else:
        return 0.0 * params
    dispatch = ops * device.op_overhead_s
    if not serial:
        return np.maximum(work, dispatch)
    return (work + dispatch) * (GLOO_POWERSGD_IN_STEP if grad_compression == "powersgd" else 1.0)


def powersgd_buffer_bytes(grad_bytes: Figure, powersgd_elements: Figure) -> Figure:
    """Bytes PowerSGD holds beyond its residuals (in ``state_bytes_per_param``): the P and Q
    factors, kept between steps for the warm start, and the flat copy of the uncompressed tensors (4
    bytes per element sent), and the clone of one bucket while it is reduced."""
    return np.asarray(powersgd_elements, dtype=float) * 4 + np.minimum(grad_bytes, DP_BUCKET_BYTES)


def bubble_fraction(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time over ideal compute time.

    (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) interleaved (Narayanan et al. 2021).
    """
    return (pp - 1) / (virtual_stages * num_microbatches)


def gathered_bytes_per_param(dtype: Dtype, grad_compression: GradCompression = "none") -> int:
    """Bytes per parameter ZeRO 1-3 all-gather: the fp32 master copies, or the training dtype's 16
    bits when the plan compresses gradients to bf16/fp16 and trains in 16 bits (FSDP2's
    MixedPrecisionPolicy param_dtype, as hyparallel.runtime.compression.fsdp_policy sets it; Note
    [ZeRO stages on FSDP2] in data_parallel.py)."""
    if grad_compression in SIXTEEN_BIT and dtype != "fp32":
        return DTYPE_BYTES[dtype]
    return MASTER_BYTES_PER_PARAM


def reduced_bytes_per_param(grad_compression: GradCompression, serial: bool = False) -> float:
    """Bytes per gradient element ZeRO 1-3 reduce-scatter: 2 under bf16/fp16 (FSDP2's reduce_dtype),
    else fp32; on gloo (``serial``) a 16-bit reduction costs what its fp32-equivalent bytes say
    (Note [16-bit sums on gloo])."""
    return reduction_bytes_per_element(grad_compression, serial)


# Note [16-bit sums on gloo]
#     NCCL sums bf16 and fp16 natively, so a 16-bit all-reduce or reduce-scatter takes half the fp32
#     time. Gloo sums them on the CPU element by element through float, on the cores the backward
#     runs on, so halving the bytes saves little: on this project's 2-core machine an all-reduce of
#     3.45M elements alone took 0.71 (bf16) and 0.90 (fp16) of the fp32 time with 2 processes, 0.82
#     and 0.92 with 4; inside a DDP training step (benchmarks/dp_compression.py: the step's time
#     minus a no_sync step's, less the casts' predicted time) the 16-bit reduction cost 1.02 and
#     1.03 of fp32's with 2 processes, 0.95 and 1.12 with 4: nothing saved. The planner charges
#     gloo's 16-bit reductions the in-step figure as a share of the fp32 bytes
#     (GLOO_SIXTEEN_BIT_SUM); all-gathers only copy, and move their 2 bytes.
GLOO_SIXTEEN_BIT_SUM: dict[str, float] = {"bf16": 1.0, "fp16": 1.1}
# Note [PowerSGD inside a gloo step]
#     PowerSGD's work alone (one process, gpt-tiny 4 x 256's 3.45M gradients) took 15.4 ms against
#     13.3 ms predicted with this machine calibrated. Inside a DDP step on gloo
#     (benchmarks/dp_compression.py, measured dp seconds less the predicted wire time) it took 2.8x
#     the prediction with 2 processes and 2.7-4x with 4: the backward's activations have pushed the
#     gradients out of cache before the hook reads them three times, and each bucket waits out three
#     collectives in turn. The cause is not isolated further; the planner charges PowerSGD's work on
#     gloo GLOO_POWERSGD_IN_STEP times the kernel and dispatch model, so it does not pick PowerSGD
#     where it measures slower. NCCL clusters are charged the model as it is.
GLOO_POWERSGD_IN_STEP = 3.0


def reduction_bytes_per_element(grad_compression: GradCompression, serial: bool = False) -> float:
    """What one gradient element costs a reduction (all-reduce, reduce-scatter) in wire bytes under
    a 16-bit mode or fp32 (Note [16-bit sums on gloo] for ``serial``, gloo, clusters); PowerSGD's
    factors are fp32."""
    if grad_compression not in SIXTEEN_BIT:
        return GRAD_BYTES_PER_PARAM
    return GRAD_BYTES_PER_PARAM * GLOO_SIXTEEN_BIT_SUM[grad_compression] if serial else 2


def unsharded_bytes_per_param(
    dtype: Dtype, grad_compression: GradCompression = "none"
) -> tuple[int, int]:
    """(weight, gradient) bytes of one gathered (unsharded) parameter under ZeRO 1-3.

    The weight as gathered plus autocast's 16-bit copy of it when it is gathered in fp32; gathered
    in 16 bits (FSDP2's param_dtype) it already is what autocast computes with. Its gradient has the
    weight's dtype (FSDP2 accumulates it in param_dtype between micro-batches, and casts the reduced
    shard back to fp32).
    """
    gathered = gathered_bytes_per_param(dtype, grad_compression)
    copy = DTYPE_BYTES[dtype] if gathered == MASTER_BYTES_PER_PARAM and dtype != "fp32" else 0
    return gathered + copy, gathered


def state_bytes_per_param(
    dtype: Dtype, zero: int, dp: int, grad_compression: GradCompression = "none"
) -> float:
    """Bytes per parameter one rank holds through a step for weights, gradients and AdamW state
    under ZeRO ``zero``.

    As parallelize runs it (Note [ZeRO stages on FSDP2] in data_parallel.py): fp32 master weights,
    plus a 16-bit copy under bf16/fp16 autocast, fp32 gradients and AdamW's m and v. ZeRO 1 shards
    the master weights and m, v but keeps the weights gathered and the gradients whole through the
    step; ZeRO 2 shards the gradients too; ZeRO 3 holds only shards (the units gathered at a time
    are added by the search). With dp = 1 nothing shards.
    ``grad_compression`` bf16/fp16 under ZeRO 1/2 with 16-bit training: the gathered weights and
    their gradients in 16 bits (``unsharded_bytes_per_param``); ``powersgd``: an fp32 residual per
    gradient element (its error feedback; its factors are the search's, Note [PowerSGD's wire]).
    """
    master, grad, adam = (
        MASTER_BYTES_PER_PARAM,
        GRAD_BYTES_PER_PARAM,
        OPTIMIZER_BYTES_PER_PARAM["fp32"],
    )
    if zero == 0 or dp == 1:
        copy = 0 if dtype == "fp32" else DTYPE_BYTES[dtype]
        residual = (
            ERROR_FEEDBACK_BYTES_PER_PARAM if grad_compression == "powersgd" and dp > 1 else 0
        )
        buckets = DDP_BUCKET_BYTES_PER_PARAM if dp > 1 else 0
        return master + copy + grad + adam + residual + buckets
    weight, unsharded_grad = unsharded_bytes_per_param(dtype, grad_compression)
    if zero == 1:
        return master / dp + weight + unsharded_grad + adam / dp
    if zero == 2:  # gradients reduce-scattered after every micro-batch: only their fp32 shards stay
        return master / dp + weight + (grad + adam) / dp
    return (master + grad + adam) / dp


# Note [memory after the backward]
#     Between train_step and the next one, the runtime and a training loop allocate transients the
#     step's own peak does not see. Activations are freed by then, and so is autocast's 16-bit copy
#     of the weights (held for the step, Note [one 16-bit copy of the weights per step] in
#     parallel.py), but weights, gradients and AdamW state are all alive:
#       * torch.optim.AdamW's default on CUDA is its foreach implementation (torch/optim/adam.py,
#         _multi_tensor_adam): `torch._foreach_sqrt(exp_avg_sqs)` makes a new fp32 tensor for every
#         parameter the optimizer steps, 4 bytes per parameter at once
#         (OPTIMIZER_STEP_TRANSIENT_BYTES_PER_PARAM). The single-tensor implementation (CPU's
#         default) makes `exp_avg_sq.sqrt() / bias_correction2_sqrt`, two fp32 temporaries of one
#         parameter at a time; the fused one (fused=True) none;
#       * ParallelModel.clip_grad_norm_ squares each gradient in float64 (`grad.double().pow(2)`):
#         two 8-byte copies of one gradient at a time, CLIP_TRANSIENT_BYTES_PER_ELEMENT = 16 per
#         element of the largest.
#     The planner takes the larger of the two over a stage's state, bounding a stage's largest
#     tensor by its largest segment's parameters.
# Note [syncing a weight several stages hold]
#     After the schedule, a weight two pipeline ranks hold (a tied embedding and head) has its
#     step's gradient summed over them (PipelineRuntime._sync_tied_grads): the gradient before the
#     step (cloned when one existed), the step's part (a clone or a difference), the other holder's
#     part received, and the total: 4 fp32 tensors of the weight's size beside its gradient, 16
#     bytes per element, while the step's state (autocast's copy included) is alive and the
#     activations are freed. Measured: gpt-tiny pp 2 in bf16 on the CPU peaked there, 3.5% over the
#     prediction without it (tests/test_planner_memory.py).
TIED_SYNC_BYTES_PER_PARAM = 16
# DistributedDataParallel (ZeRO 0, dp > 1) allocates its gradient buckets when it is built: a flat
# fp32 copy of every gradient, kept for the run (torch's default gradient_as_bucket_view=False,
# which parallelize keeps). Measured: gpt-tiny dp 2 in bf16 on the CPU peaked 12% over the
# prediction without it (tests/test_planner_memory.py). With a pipeline the runtime reduces in flat
# buckets of its own instead (one 25 MiB bucket at a time): counted the same.
DDP_BUCKET_BYTES_PER_PARAM = 4
OPTIMIZER_STEP_TRANSIENT_BYTES_PER_PARAM = 4
CLIP_TRANSIENT_BYTES_PER_ELEMENT = 16


def after_backward_bytes(
    params: Figure,
    largest: Figure,
    dtype: Dtype,
    zero: int,
    dp: int,
    grad_compression: GradCompression = "none",
) -> Figure:
    """A stage's memory in the optimizer step and gradient clipping (Note [memory after the
    backward]).

    ``params``: the parameters a rank holds; ``largest``: the most any one of its segments holds (a
    bound on its largest tensor). State as ``state_bytes_per_param`` counts it, less autocast's copy
    at ZeRO 0 (freed with the step; ZeRO 1-3 keep their gathered buffers in the count); the
    optimizer's transient over the parameters it steps (a 1/dp shard at ZeRO >= 1), or the clip's
    over the largest gradient, whichever is larger.
    """
    state = state_bytes_per_param(dtype, zero, dp, grad_compression)
    if (zero == 0 or dp == 1) and dtype != "fp32":
        state -= DTYPE_BYTES[dtype]
    stepped = params / dp if zero >= 1 and dp > 1 else params
    transient = np.maximum(
        stepped * OPTIMIZER_STEP_TRANSIENT_BYTES_PER_PARAM,
        largest * CLIP_TRANSIENT_BYTES_PER_ELEMENT,
    )
    return params * state + transient


def recompute_copies_bytes_per_param(
    dtype: Dtype, recompute: str, zero: int, inflight: float
) -> float:
    """Bytes per parameter of the 16-bit weight copies selective recomputation keeps beyond the
    step's one.

    Note [16-bit copies under recomputation]: with recomputation parallelize casts the weights once
    per micro-batch (not once per step). Full recomputation saves nothing of a recomputed region, so
    each copy is freed when its micro-batch's autocast region ends and the recompute casts one
    region's weights again: the step's one copy in ``state_bytes_per_param`` bounds it. Selective
    recomputation saves every op it does not recompute, the casts among them, so each micro-batch in
    flight holds a copy of the stage's weights until its backward: ``inflight - 1`` more than
    counted. Nothing in fp32 training, or under ZeRO 3 (copies of the gathered units only).
    """
    if dtype == "fp32" or recompute != "selective" or zero == 3:
        return 0.0
    return DTYPE_BYTES[dtype] * max(inflight - 1.0, 0.0)


# Note [what FSDP and the optimizer dispatch on a CPU]
#     On a CPU backend (gloo) nothing hides the host's work per parameter tensor behind kernels:
#     torch's AdamW (its for-loop path, the CPU default) dispatches a handful of ops per tensor, six
#     times as costly on FSDP2's DTensors; and FSDP2 splits each all-gather's output into, and packs
#     each reduce-scatter's input from, its unit's parameters, with DTensor bookkeeping per
#     parameter. Counted in units of the device's op overhead (DeviceSpec.op_overhead_s, which
#     `hyparallel calibrate` measures), per parameter tensor. Measured on an Intel Xeon (2 cores, op
#     overhead 13.9 us): AdamW 22 us per plain tensor and 130 us per DTensor (a 1-process mesh, 200
#     tensors); gpt-mini (52 tensors, 5 FSDP units) at dp 2: ZeRO 1 steps 41.5 ms slower than ZeRO 0
#     (train_step +33.5, optimizer +6.3), ZeRO 3 23 ms slower than ZeRO 1 in train_step (its 5 extra
#     all-gathers): 22 op overheads per tensor per FSDP collective from the first (its all-gather
#     and reduce-scatter, less the optimizer and gloo's slower reduce-scatter), 32 from the second;
#     26 taken. The planner priced none of it, and picked ZeRO 1 there (measured 38% slower than
#     ZeRO 0). GPUs launch this work asynchronously, behind the kernels: not added.
ADAM_OPS_PER_TENSOR = 1.6
ADAM_DTENSOR_OPS_PER_TENSOR = 9.4
FSDP_OPS_PER_TENSOR = 26.0


def adam_step_bytes_per_param(dtype: Dtype) -> int:
    """Memory traffic of one fused Adam step per parameter: read grad, master, m, v; write master,
    m, v, weight."""
    reads = GRAD_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM[dtype] + (0 if dtype != "fp32" else 4)
    writes = OPTIMIZER_BYTES_PER_PARAM[dtype] + (DTYPE_BYTES[dtype] if dtype != "fp32" else 4)
    return reads + writes


def korthikanti_activation_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
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
    """Model FLOPs of one step: forward + backward = 3x forward, no recomputation counted
    (Korthikanti et al. 2022)."""
    return 3 * forward_flops_per_sequence * global_batch


def overlapped_s(comm_s: Figure, compute_s: Figure, serial: bool = False) -> Figure:
    """Time communication adds when it runs beside ``compute_s`` of computation: what does not fit,
    plus contention.

    ``serial``: a CPU cluster (backend gloo), whose collectives run on the cores that compute:
    nothing hides.
    """
    if serial:
        # the shape of an array argument, as the overlapped case returns
        return comm_s + 0.0 * compute_s
    hidden = np.minimum(comm_s, compute_s)
    return np.maximum(comm_s - compute_s, 0.0) + OVERLAP_CONTENTION * hidden
