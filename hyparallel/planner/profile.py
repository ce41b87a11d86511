"""Per-segment costs of a traced model under a tensor-parallel degree: the planner's raw material.

A ``ModelProfile`` reads a ModelGraph once, per sequence (its figures divided by the rows it was
traced with), and answers, for any (tp, sequence_parallel, micro_batch, recompute), each segment's
forward and backward seconds, its tensor-parallel communication, the parameters a rank holds and the
activation bytes it keeps for the backward pass. Identical repeated blocks are costed once.
Formulas: docs/cost-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache, cached_property

import networkx as nx

from hyparallel.graph import ModelGraph, Op
from hyparallel.graph.context import context_refusal, kv_elements
from hyparallel.graph.structure import TPAnalysis
from hyparallel.planner import costs
from hyparallel.spec.cluster import ClusterSpec, LinkSpec
from hyparallel.spec.schema import Dtype

# View-kind ops that may copy (a reshape of a transposed tensor does): their outputs count as new
# tensors.
_COPYING_VIEWS = {"clone", "contiguous", "reshape", "flatten"}
# Elementwise ops whose backward needs none of their inputs or outputs.
_SAVES_NOTHING = {
    "add",
    "sub",
    "neg",
    "cat",
    "stack",
    "to",
    "type",
    "float",
    "arange",
    "expand",
    "where",
    "masked_fill",
    "zeros",
    "ones",
    "full",
    "new_ones",
    "new_zeros",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "__and__",
    "__or__",
    "and_",
    "or_",
    "cumsum",
    "diff",
    "index",
    "_assert_tensor_metadata",
    "floordiv",
    "size",
    "getattr",
}
# Elementwise ops whose backward needs their output (d softmax, d exp, d tanh, d sigmoid).
_SAVES_OUTPUT = {"softmax", "log_softmax", "_softmax", "exp", "tanh", "sigmoid"}
# Backward FLOPs over forward FLOPs: 2 for matrix products (input and weight gradients); 2.5 for
# fused attention, whose backward recomputes the attention scores (Dao 2023, FlashAttention-2, Sec.
# 3.1).
_BACKWARD_RATIO = {"attention": 2.5}
_MATMUL_KINDS = {"linear", "matmul", "attention"}


@dataclass(frozen=True)
class _OpCost:
    """One op for one sequence in the plan's dtype."""

    kind: str
    flops: float
    in_bytes: float
    out_bytes: float
    weight_bytes: float
    style: str  # column | row | vocab | replicate | split (inside a column->row region) | full
    # its output has two sequence-length dims (attention scores): selective recomputation redoes it
    quadratic: bool
    # A product's shape for one sequence, unsplit: (batch, M, N, K) of batch x (M x K) @ (K x N)
    # (Note [GEMM shapes]); () when it is not a product or its shape cannot be read (then its
    # efficiency is the plateau).
    gemm: tuple[float, float, float, float] = ()
    # a Linear: a micro-batch's sequences multiply M (its tokens), else the batch
    tokens_in_m: bool = False
    # an activation's function name (Op.function): Note [activations a CPU computes]
    function: str = ""
    out_elements: float = 0.0  # elements of its output, one sequence
    # an attention's keys and values as it reads them, one sequence: what context parallelism moves
    kv_bytes: float = 0.0


@dataclass(frozen=True)
class SegmentCost:
    """One segment under one configuration, per micro-batch of ``micro_batch`` sequences."""

    forward_s: float
    backward_s: float  # including recomputation
    tp_comm_s: float  # forward + backward, on the critical path
    params: float  # parameters one tensor-parallel rank holds
    activation_bytes: float  # kept for the backward pass, per micro-batch in flight
    working_bytes: float  # transient, once per stage (a recomputed block's activations)
    tensors: int = 0  # parameter tensors (each one the optimizer and ZeRO's FSDP handle apart)
    ep_comm_s: float = 0.0  # expert parallelism's all-to-alls, forward + backward (critical path)
    # of ``params``, the expert weights (their gradients are reduced over dp / ep ranks)
    expert_params: float = 0.0
    # of those, stacked experts with tp folded in (reduced over dp tp / ep ranks)
    folded_expert_params: float = 0.0
    # context parallelism's key/value traffic left on the critical path, forward + backward (Note
    # [context parallelism's costs] in costs.py)
    cp_comm_s: float = 0.0


def _under(module: str, path: str) -> bool:
    return module == path or module.startswith(path + ".")


def _layer_of(op, layers) -> list:
    """The MoE layer whose experts ``op`` runs in or reads (one, or none)."""
    module = op.module or ""
    for layer in layers:
        inside = module == layer.experts or module.startswith(layer.experts + ".")
        if inside or (op.params and all(p.startswith(layer.experts + ".") for p in op.params)):
            return [layer]
    return []


@dataclass(frozen=True)
class _SegmentExperts:
    """A segment's mixture-of-experts work (Note [expert parallelism's costs] in costs.py)."""

    ops: tuple[int, ...]  # positions of its expert ops in the segment's ops
    params: float  # every expert weight of the segment, whole
    token_bytes: float  # per sequence: tokens x top-k x hidden, over its MoE layers, plan's dtype
    stacked: frozenset[int] = frozenset()  # of ``ops``, those of stacked experts
    stacked_params: float = 0.0  # of ``params``, the stacked experts'
    stacked_token_bytes: float = 0.0  # of ``token_bytes``, the stacked experts' layers'
    stacked_row_bytes: float = 0.0  # per sequence: tokens x hidden of those layers (tp's gathers)
    listed_experts: int = 0  # the experts of its ModuleList layers (an exchange each)


@dataclass(frozen=True)
class GradientWork:
    """What PowerSGD does with some gradients on one rank per step (Note [PowerSGD's wire] in
    costs.py)."""

    # elements all-reduced: r (n + m) per compressed matrix, all of every other tensor
    elements: float = 0.0
    # kernel seconds: products, orthogonalisations, error feedback, copies of what is sent whole
    work_s: float = 0.0
    ops: float = 0.0  # ops dispatched, besides those of each bucket (costs.POWERSGD_OPS_PER_BUCKET)

    def __add__(self, other: GradientWork) -> GradientWork:
        return GradientWork(
            self.elements + other.elements, self.work_s + other.work_s, self.ops + other.ops
        )


@dataclass(frozen=True)
class _SegmentRaw:
    ops: tuple[_OpCost, ...]
    signature: tuple
    params_by_tp: Callable[[int], float]
    saved_split: float
    saved_full: float
    # Note [what sequence parallelism shards]: column Linears' gathered inputs, and how much of it
    # other ops save too
    saved_gathered: tuple[float, float]
    saved_quadratic: tuple[float, float]  # (split by tp, whole) bytes of seq x seq tensors
    block_input_bytes: float
    is_block: bool
    comm_fwd: tuple[float, ...]
    comm_bwd: tuple[float, ...]
    # The all-reduces sequence parallelism turns into a reduce-scatter and an all-gather (row
    # outputs forward, column inputs backward; Note [sequence parallelism on gloo]); the
    # vocab-parallel ones stay all-reduces.
    comm_sequence: tuple[float, ...] = ()
    # Note [the loss's memory]: the loss's saved fp32 tensor, its transients gathered and
    # vocab-parallel (whole)
    loss_saved: float = 0.0
    loss_working: float = 0.0
    loss_working_vocab: float = 0.0
    # the vocab-parallel loss's all-reduces (forward), in the head's segment
    comm_loss: tuple[float, ...] = ()
    # the head's logits, whole: what gathering them for the loss all-gathers
    comm_gather: float = 0.0
    # the head's logits in the plan's dtype, whole (Note [gloo's late frees])
    logits_bytes: float = 0.0
    # per sequence: the largest op's output and input gradients (Note [backward's own])
    backward_working: float = 0.0
    # ops with parameters: their weight gradients' transient (Note [backward's own])
    weight_ops: tuple[Op, ...] = ()
    tensors: int = 0  # parameter tensors its ops read


class ModelProfile:
    """Everything the search needs from a ModelGraph, for one dtype and one cluster."""

    def __init__(
        self,
        graph: ModelGraph,
        cluster: ClusterSpec,
        dtype: Dtype,
        seq_len: int,
        traced_rows: int = 1,
        vocab_parallel_loss: bool = True,
        expert_imbalance: float = costs.EXPERT_IMBALANCE,
        router_loss_gathered: bool = True,
        takes_positions: bool = False,
        attention_interface: bool = False,
    ):
        """``traced_rows``: the sequences ``graph`` was traced with (Note [example inputs] in
        api.py);
        ``router_loss_gathered``: a router loss outside the MoE layers (``router_logit_elements``)
        gathers every dp rank's scores; False: it all-reduces 2 E + 1 sums (transformers': Note
        [the router's auxiliary loss over dp] in hyparallel/runtime/router_loss.py);
        ``expert_imbalance``: the busiest expert-parallel rank's (token, expert) pairs over the
        mean (Note [expert parallelism's costs] in costs.py);
        ``vocab_parallel_loss``: the loss runs on each tp rank's slice of the logits wherever tp
        splits the head (parallel.vocab_parallel_loss), else they are gathered for it;
        ``takes_positions``: the model's forward takes ``position_ids`` (context parallelism needs
        them: hyparallel.graph.context; False when the planner has only a graph);
        ``attention_interface``: context parallelism receives its attention through transformers'
        attention interface, grouped-query keys and values before the model repeats them (Note
        [grouped-query keys as they travel] in hyparallel/graph/context.py)."""
        self.graph, self.cluster, self.dtype, self.seq_len = graph, cluster, dtype, seq_len
        self.vocab_parallel_loss = vocab_parallel_loss
        self.expert_imbalance = expert_imbalance
        self.router_loss_gathered = router_loss_gathered
        # why cp cannot split this model (None: it can), as parallelize would refuse it
        self.cp_refusal = context_refusal(graph, takes_positions)
        self.kv_as_made = attention_interface
        self.traced_rows = traced_rows
        self.tp_analysis: TPAnalysis = graph.structure
        self.segments = graph.segments()
        self.segments_last_op = self.segments[-1].ops[-1]
        self.quadratic = self._quadratic_ops()
        element = graph.param_bytes / graph.num_params if graph.num_params else 4
        self.scale = costs.DTYPE_BYTES[dtype] / element  # traced bytes -> plan-dtype bytes
        # traced bytes -> plan-dtype bytes of one sequence
        self.per_sequence = self.scale / traced_rows
        self.dtype_bytes = costs.DTYPE_BYTES[dtype]
        self.raw = [self._raw(segment) for segment in self.segments]
        # Each segment's first twin (the first segment of the same signature): hashing the
        # signatures once here, not per configuration costed, where it was most of segment_costs'
        # time.
        first_of: dict[tuple, int] = {}
        self._twin = [first_of.setdefault(raw.signature, i) for i, raw in enumerate(self.raw)]
        self.cut_bytes = max((cut.bytes for cut in graph.cut_points), default=0) * self.per_sequence
        self.forward_flops = graph.flops / traced_rows  # per sequence
        self.num_blocks = len(graph.blocks)
        self.has_quadratic = any(sum(raw.saved_quadratic) for raw in self.raw)
        self._cache: dict[tuple, tuple[SegmentCost, ...]] = {}
        self._totals: dict[tuple, tuple[float, float, float]] = {}
        self._tied: dict[int, list[tuple[int, tuple[int, ...], float]]] = {}
        self._powersgd: dict[tuple[int, int, int], tuple[GradientWork, ...]] = {}

    # ---- per configuration ------------------------------------------------------------------

    def head_split(self, tp: int) -> bool:
        """Whether ``tp`` ranks split the output head by vocabulary (each computes its slice of the
        logits)."""
        head = self.tp_analysis.vocab_head
        return tp > 1 and head is not None and self.tp_analysis.styles.get(head) == "vocab"

    def vocab_split(self, tp: int) -> bool:
        """Whether the loss runs on each of ``tp`` ranks' slice of the logits
        (parallel.vocab_parallel_loss)."""
        return self.vocab_parallel_loss and self.head_split(tp)

    def tp_forward_comm_s(
        self, raw: _SegmentRaw, tp: int, sp: bool, b: int, link: LinkSpec
    ) -> float:
        """Seconds of one segment's tensor-parallel collectives in the forward, at micro-batch
        ``b``."""
        seconds = sum(costs.ring_allreduce_s(x * b, tp, link) for x in raw.comm_fwd)
        # Note [sequence parallelism on gloo]: a reduce-scatter is an
        if sp and self.cluster.backend == "gloo":
            # all-reduce there
            seconds += sum(costs.ring_allgather_s(x * b, tp, link) for x in raw.comm_sequence)
        if raw.comm_loss and self.head_split(tp):
            # vocab-parallel cross-entropy: max, sum of exponentials, target logit
            if self.vocab_split(tp):
                seconds += sum(costs.ring_allreduce_s(x * b, tp, link) for x in raw.comm_loss)
            else:  # the head's logits all-gathered for the loss
                seconds += costs.ring_allgather_s(raw.comm_gather * b, tp, link)
        return float(seconds)

    def segment_costs(
        self,
        tp: int,
        sequence_parallel: bool,
        micro_batch: int,
        recompute: str,
        tp_link: LinkSpec,
        ep: int = 1,
        ep_links: tuple[LinkSpec, LinkSpec] | None = None,
        cp: int = 1,
        cp_link: LinkSpec | None = None,
        cp_attention: str = "gather",
    ) -> tuple[SegmentCost, ...]:
        """The cost of every segment under one configuration (cached); ``ep`` > 1: its experts
        split over ep ranks, their all-to-alls over ``ep_links`` (a ModuleList's experts', stacked
        experts': search.ep_links; Note [expert parallelism's costs] in costs.py); ``cp`` > 1:
        ``micro_batch`` is one cp rank's share of a micro-batch (sequences / cp), and each
        attention's keys and values cross the cp group over ``cp_link`` by ``cp_attention`` (Note
        [context parallelism's costs] in costs.py)."""
        key = (tp, sequence_parallel, micro_batch, recompute, tp_link, ep, ep_links)
        if cp > 1:
            whole = (*key, cp, cp_link, cp_attention)
            if whole not in self._cache:
                base, by_twin = self.segment_costs(*key), {}
                for index, (i, raw) in enumerate(zip(self._twin, self.raw)):
                    if i not in by_twin:  # a repeated block's twins cost alike
                        by_twin[i] = self._context_parallel(
                            base[index],
                            raw,
                            tp,
                            sequence_parallel,
                            micro_batch,
                            recompute,
                            cp,
                            cp_link,
                            cp_attention,
                        )
                self._cache[whole] = tuple(by_twin[i] for i in self._twin)
            return self._cache[whole]
        if ep > 1 and key not in self._cache:
            sp, b = sequence_parallel, micro_batch
            self._cache[key] = tuple(
                self._expert_parallel(
                    self._cost(raw, tp, sp, b, recompute, tp_link, ep),
                    raw,
                    moe,
                    tp,
                    sp,
                    b,
                    ep,
                    ep_links,
                    tp_link,
                )
                for raw, moe in zip(self.raw, self.experts)
            )
        if key not in self._cache:
            by_twin: dict[int, SegmentCost] = {}
            for i, raw in zip(self._twin, self.raw):
                if i not in by_twin:
                    by_twin[i] = self._cost(
                        raw, tp, sequence_parallel, micro_batch, recompute, tp_link
                    )
            self._cache[key] = tuple(by_twin[i] for i in self._twin)
        return self._cache[key]

    def tied_segments(self, tp: int) -> list[tuple[int, tuple[int, ...], float]]:
        """Weights read in several segments (tied embedding and head): (owner, readers, parameters
        per tp rank)."""
        if tp not in self._tied:
            self._tied[tp] = [
                (owner, readers, self.tp_analysis.params_per_rank(op, tp))
                for owner, readers, op in self._tied_weights
            ]
        return self._tied[tp]

    def tied_powersgd_work(
        self, tp: int, rank: int
    ) -> list[tuple[int, tuple[int, ...], GradientWork]]:
        """``tied_segments``' weights, each with what PowerSGD does with its owner's gradients on
        one tp rank."""
        return [
            (owner, readers, self._op_powersgd(op, tp, rank))
            for owner, readers, op in self._tied_weights
        ]

    @cached_property
    def _tied_weights(self) -> list[tuple[int, tuple[int, ...], Op]]:
        """(owner segment, the other segments reading its weight, the owning op) of each weight read
        in several."""
        segment_of = {name: i for i, segment in enumerate(self.segments) for name in segment.ops}
        owners = {p: op for op in self.graph.compute_ops() if op.param_count for p in op.params}
        readers: dict[str, set[int]] = {}
        for op in self.graph.compute_ops():
            for p in op.params:
                if op.name in segment_of and owners.get(p) is not op:
                    readers.setdefault(p, set()).add(segment_of[op.name])
        return [
            (segment_of[owners[p].name], tuple(sorted(r - {segment_of[owners[p].name]})), owners[p])
            for p, r in readers.items()
            if p in owners and r - {segment_of[owners[p].name]}
        ]

    def powersgd_work(self, tp: int, rank: int, ep: int = 1) -> tuple[GradientWork, ...]:
        """What PowerSGD at ``rank`` does per step with each segment's gradients on one tp rank
        (cached); ``ep`` > 1: the expert weights' left out (their own group reduces them, never
        compressed: ExpertParallel.reduce_grads)."""
        if (tp, rank, ep) not in self._powersgd:
            experts = self.graph.moe.expert_params if ep > 1 else set()
            self._powersgd[tp, rank, ep] = tuple(
                sum(
                    (
                        self._op_powersgd(op, tp, rank)
                        for op in map(self.graph.op, segment.ops)
                        if not (experts and op.params and set(op.params) <= experts)
                    ),
                    GradientWork(),
                )
                for segment in self.segments
            )
        return self._powersgd[tp, rank, ep]

    def _op_powersgd(self, op: Op, tp: int, rank: int) -> GradientWork:
        """PowerSGD's work on the gradients of the parameters ``op`` owns, as one tp rank holds
        them."""
        device = self.cluster.device
        elements = work_s = ops = total = whole = 0.0
        for shape in self.local_param_shapes(op, tp):
            rows, cols = costs.powersgd_matrix(shape)
            r = costs.powersgd_factor_rank(rows, cols, rank)
            elements += costs.powersgd_wire_elements(shape, rank)
            total += rows * cols
            if r:
                work_s += costs.powersgd_matrix_s(rows, cols, r, device)
                ops += costs.powersgd_matrix_ops(r)
            else:
                whole += rows * cols
                ops += 1  # its copy back from the flat buffer of uncompressed tensors
        if not total:
            return GradientWork()
        return GradientWork(
            elements, work_s + costs.powersgd_elementwise_s(total, whole, device), ops
        )

    def local_param_shapes(self, op: Op, tp: int) -> tuple[tuple[float, ...], ...]:
        """The shapes of the parameters ``op`` owns as one tensor-parallel rank holds them.

        As the runtime splits them (and ``TPAnalysis.params_per_rank`` counts them): a column or
        vocab split divides dim 0 of every parameter (a column Linear's weight and bias by tp, or by
        the key/value head groups when they are fewer; the vocabulary padded to a multiple of tp); a
        row split divides the weight's input dim, its bias stays whole. A split Linear holds its
        weight as (out, in) even where the model stores (in, out) (transformers' Conv1D;
        hyparallel.tensor.layers). Replicated parameters stay whole.
        """
        shapes = op.param_shapes
        style = self.tp_analysis.styles.get(op.name, "replicate") if tp > 1 else "replicate"
        if style == "replicate" or not shapes:
            return shapes
        analysis = self.tp_analysis
        if style == "column":
            groups = analysis.head_groups.get(op.name)
            share = max(1 / tp, 1 / groups) if groups else 1 / tp
        else:
            rows = analysis.vocab_size or 1
            share = math.ceil(rows / tp) / rows
        features = (
            (op.input_shapes[0][-1], op.output_shapes[0][-1])
            if op.kind == "linear" and op.input_shapes and op.output_shapes
            else None
        )
        result = []
        for shape in shapes:
            if (
                features is not None
                and len(shape) == 2
                and tuple(shape) == features
                and features[0] != features[1]
            ):
                shape = (shape[1], shape[0])  # stored (in, out): split as (out, in)
            if style == "row":
                result.append((*shape[:-1], shape[-1] / tp) if len(shape) >= 2 else tuple(shape))
            else:
                result.append((shape[0] * share, *shape[1:]) if shape else tuple(shape))
        return tuple(result)

    def totals(
        self,
        tp: int,
        sequence_parallel: bool,
        micro_batch: int,
        recompute: str,
        tp_link: LinkSpec,
        ep: int = 1,
        ep_links: tuple[LinkSpec, LinkSpec] | None = None,
        cp: int = 1,
        cp_link: LinkSpec | None = None,
        cp_attention: str = "gather",
    ) -> tuple[float, float, float]:
        """(seconds per micro-batch, parameters per rank, activation bytes) summed over all segments
        (cached)."""
        key = (tp, sequence_parallel, micro_batch, recompute, tp_link, ep, ep_links)
        key += (cp, cp_link, cp_attention) if cp > 1 else ()
        if key not in self._totals:
            segments = self.segment_costs(*key)
            self._totals[key] = (
                sum(
                    s.forward_s + s.backward_s + s.tp_comm_s + s.ep_comm_s + s.cp_comm_s
                    for s in segments
                ),
                sum(s.params for s in segments),
                sum(s.activation_bytes for s in segments),
            )
        return self._totals[key]

    def _cost(
        self,
        raw: _SegmentRaw,
        tp: int,
        sp: bool,
        b: int,
        recompute: str,
        link: LinkSpec,
        ep: int = 1,
    ) -> SegmentCost:
        device = self.cluster.device
        peak = getattr(device.peak_flops, self.dtype)
        # gloo clusters are CPU processes: Note [op overhead] in costs.py
        serial = self.cluster.backend == "gloo"
        forward = backward = quadratic_forward = 0.0
        for op in raw.ops:
            t, t_backward = _op_times(op, tp, sp, b, peak, device, serial)
            forward += t
            backward += t_backward
            quadratic_forward += t if op.quadratic else 0.0
        comm_fwd = self.tp_forward_comm_s(raw, tp, sp, b, link)
        comm_bwd = sum(costs.ring_allreduce_s(x * b, tp, link) for x in raw.comm_bwd)
        # Note [what sequence parallelism shards]
        #     parallelize splits the sequence from the first block's input to the last block's
        #     output: inside blocks, what is replicated across tp ranks without SP is a 1/tp slice
        #     of the sequence with it; a column Linear's input is all-gathered first
        #     (enter_tp_region), and autograd saves the gathered, whole tensor for the weight's
        #     gradient (Megatron gathers it again in the backward instead; parallelize does not).
        #     Outside the blocks nothing is sharded: the embedding's output is scattered by the
        #     first block's pre-hook, the last block's output gathered, so the final norm, the head
        #     and the loss hold the whole sequence. Measured: gpt-mini tp 2 SP on the CPU peaked in
        #     the loss's backward 12% over the prediction that divided all of these by tp.
        seq = tp if sp and raw.is_block else 1
        # without SP, the gathered copy is the replicated tensor itself
        gathered, also_full = raw.saved_gathered
        saved = (
            raw.saved_split / tp
            + raw.saved_full / seq
            + gathered
            - (also_full if seq == 1 else 0.0)
        )
        if self.vocab_split(tp):
            saved += raw.loss_saved / tp
            working = raw.loss_working_vocab / tp
        else:
            saved += raw.loss_saved
            working = raw.loss_working
            if tp > 1:
                # Note [the gathered logits]
                #     Gathered for the loss, the logits are whole on every rank, and the caller
                #     (train_step, a user's loop) holds them until the loss's backward is done;
                #     the head's output the graph counts is the column's 1/tp of them. Measured:
                #     gpt-tiny tp 2 on the CPU peaked in log_softmax's backward with the whole
                #     logits alive, half the logits over the prediction without this (and the
                #     late frees below).
                working += raw.logits_bytes * (1 - 1 / tp)
        if serial and tp > 1 and not self.vocab_split(tp):
            # Note [gloo's late frees]
            #     gloo's worker thread drops a collective's work object, and with it the tensors it
            #     staged, after the caller has gone on; on busy cores that can be well into the
            #     loss's backward. Measured on the CPU (hyparallel.runtime.peak_memory, which sees
            #     those frees): tp 2 ranks of gpt-tiny peaked at 0.95-1.06x the prediction from run
            #     to run, the spread the logits' all-gather's input and output (1 + 1/tp of the
            #     whole logits). The largest tensor-parallel collective's: counted beside the loss.
            working += raw.logits_bytes * (1 + 1 / tp)
        # an expert op's weights: over ep (Note [expert parallelism's costs] in costs.py)
        experts = self.graph.moe.expert_params if ep > 1 else set()
        weight_grads = max(
            (
                self.tp_analysis.params_per_rank(op, tp)
                / (ep if experts and set(op.params) <= experts else 1)
                for op in raw.weight_ops
            ),
            default=0.0,
        )
        weight_bytes = self.dtype_bytes + 4 if self.dtype != "fp32" else 4
        # an op's activation gradients counted whole (Note [backward's own]): a column's input
        # gradient is the gathered sequence's under SP, before its reduce-scatter
        working = max(working, raw.backward_working + weight_grads * weight_bytes / b)
        if raw.is_block and recompute == "full":
            backward += forward  # the block's forward runs again before its backward
            comm_bwd += comm_fwd
            working, saved = saved + working, raw.block_input_bytes / seq
        elif raw.is_block and recompute == "selective":
            # re-run the ops producing the seq^2 tensors (Korthikanti et al. 2022)
            backward += quadratic_forward
            quadratic_split, quadratic_full = raw.saved_quadratic
            saved -= quadratic_split / tp + quadratic_full / seq
        return SegmentCost(
            forward_s=forward,
            backward_s=backward,
            tp_comm_s=comm_fwd + comm_bwd,
            params=raw.params_by_tp(tp),
            activation_bytes=saved * b,
            working_bytes=working * b,
            tensors=raw.tensors,
        )

    def _context_parallel(
        self,
        cost: SegmentCost,
        raw: _SegmentRaw,
        tp: int,
        sp: bool,
        share: float,
        recompute: str,
        cp: int,
        link: LinkSpec | None,
        kind: str,
    ) -> SegmentCost:
        """``cost`` (already of one cp rank's ``share`` of a micro-batch) with each attention's
        keys and values crossing the cp group (Note [context parallelism's costs] in costs.py)."""
        attentions = [op for op in raw.ops if op.kv_bytes]
        if not attentions:
            return cost
        link = link or self.cluster.inter_node
        device = self.cluster.device
        peak = getattr(device.peak_flops, self.dtype)
        serial = self.cluster.backend == "gloo"
        recomputed = raw.is_block and recompute == "full"
        comm = held = extra_working = 0.0
        for op in attentions:
            # this rank's keys and values: its share of the tokens, its tp ranks' heads
            local = op.kv_bytes * share / (tp if op.style == "split" else 1)
            if kind == "gather":
                # all-gathered forward (again when recomputed), reduce-scattered backward
                comm += (2 + recomputed) * costs.ring_allgather_s(local * cp, cp, link)
                held += local * (cp - 1)  # the others' keys and values, saved for the backward
            else:
                forward, backward = _op_times(op, tp, sp, share, peak, device, serial)
                send, both = costs.p2p_s(local, link), costs.p2p_s(2 * local, link)
                # Note [context parallelism's costs]: each step's send beside its block's compute
                # (NCCL: what does not fit, plus contention); gloo sends first
                ring_forward = (cp - 1) * float(costs.overlapped_s(send, forward / cp, serial))
                comm += (1 + recomputed) * ring_forward
                comm += (cp - 1) * float(costs.overlapped_s(both, backward / cp, serial)) + both
                extra_working = max(extra_working, 4 * local)  # the blocks in flight
        working = cost.working_bytes + max(held, extra_working)
        return replace(
            cost,
            cp_comm_s=cost.cp_comm_s + comm,
            activation_bytes=cost.activation_bytes + (0.0 if recomputed else held),
            working_bytes=working,
        )

    def _expert_parallel(
        self,
        cost: SegmentCost,
        raw: _SegmentRaw,
        moe: _SegmentExperts | None,
        tp: int,
        sp: bool,
        b: int,
        ep: int,
        links: tuple[LinkSpec, LinkSpec] | None,
        tp_link: LinkSpec,
    ) -> SegmentCost:
        """``cost`` with the segment's experts split over ``ep`` ranks (Note [expert parallelism's
        costs] in costs.py)."""
        if moe is None:
            return cost
        device = self.cluster.device
        peak = getattr(device.peak_flops, self.dtype)
        serial = self.cluster.backend == "gloo"
        listed_link, stacked_link = links or (self.cluster.inter_node,) * 2
        # stacked experts: on 1/tp of the tokens (tp folded in), the busiest rank's share of as
        # many (token, expert) pairs as before; a ModuleList's: as tp splits them, one expert at a
        # time across the ep group (each call an exchange the others wait in), so the group's
        # pairs one after another: ep times a rank's own
        extra_forward = extra_backward = 0.0
        for i in moe.ops:
            forward, backward = _op_times(raw.ops[i], tp, sp, b, peak, device, serial)[:2]
            factor = self.expert_imbalance / tp if i in moe.stacked else ep
            extra_forward += forward * (factor - 1)
            extra_backward += backward * (factor - 1)
        held = sum(
            self.tp_analysis.params_per_rank(self.graph.op(self._segment_op(raw, i)), tp)
            for i in moe.ops
        )
        # a ModuleList's: one exchange of its rows per expert (and a header all-gather before the
        # forward's, priced as one more)
        listed_bytes = (moe.token_bytes - moe.stacked_token_bytes) * b
        calls = max(moe.listed_experts, 1)
        listed = calls * costs.all_to_all_s(listed_bytes / calls, ep, listed_link)
        exchange = listed + costs.all_to_all_s(moe.stacked_token_bytes * b / tp, ep, stacked_link)
        headers = moe.listed_experts * costs.ring_allgather_s(24.0 * ep, ep, listed_link)
        # tp folded in: the outputs all-gathered over tp forward, the inputs' gradients backward
        gathers = (
            2 * costs.ring_allgather_s(moe.stacked_row_bytes * b, tp, tp_link) if tp > 1 else 0
        )
        folded = moe.stacked_params / ep if tp > 1 else 0.0
        return replace(
            cost,
            forward_s=cost.forward_s + extra_forward,
            backward_s=cost.backward_s + extra_backward,
            tp_comm_s=cost.tp_comm_s + gathers,
            params=cost.params - held + held / ep,
            expert_params=held / ep,
            folded_expert_params=folded,
            ep_comm_s=costs.EXCHANGES_PER_MOE_LAYER * exchange + headers,
        )

    def _segment_op(self, raw: _SegmentRaw, position: int) -> str:
        return self._op_names[id(raw)][position]

    @cached_property
    def _op_names(self) -> dict[int, tuple[str, ...]]:
        return {id(raw): tuple(seg.ops) for raw, seg in zip(self.raw, self.segments)}

    @cached_property
    def router_logit_elements(self) -> float:
        """Per sequence, the router scores that leave their MoE layer (to an auxiliary
        load-balancing loss the model computes outside it), over every layer: what the runtime
        all-gathers over dp for a loss it does not reduce to its sums (Note [the router's auxiliary
        loss over dp] in hyparallel/runtime/router_loss.py; Note [expert parallelism's costs] in
        costs.py)."""
        graph, elements = self.graph, 0.0
        # each router's ops, by name -> its MoE layer
        layer_of = {
            op.name: layer
            for layer in graph.moe.layers
            for op in graph.ops
            if _under(op.module or "", layer.router)
        }
        for value in graph.values:
            layer = layer_of.get(value.producer)
            if layer is None or not value.shape or value.shape[-1] != layer.num_experts:
                continue
            readers = (graph.op(c).module for c in value.consumers)
            if any(not _under(m or "", layer.path) for m in readers):
                elements += math.prod(value.shape)
        return elements / self.traced_rows

    @cached_property
    def expert_counts(self) -> tuple[int, ...]:
        """The expert count of each MoE layer graph.moe found (none: no expert parallelism)."""
        return tuple(layer.num_experts for layer in self.graph.moe.layers)

    @cached_property
    def experts(self) -> tuple[_SegmentExperts | None, ...]:
        """Each segment's mixture-of-experts work (None: it has none), from graph.moe."""
        moe = self.graph.moe
        names = moe.expert_params
        layouts = {layer.path: layer.layout for layer in moe.layers}
        by_path = {layer.path: layer for layer in moe.layers}
        widths = {}
        for layer in moe.layers:
            router = next(
                (op for op in self.graph.ops if op.module == layer.router and op.input_shapes),
                None,
            )
            if router is not None:  # hidden width, top-k, tokens per sequence
                rows = math.prod(router.input_shapes[0][:-1]) / self.traced_rows
                widths[layer.path] = (router.input_shapes[0][-1], layer.top_k, rows)
        found = []
        for segment in self.segments:
            ops = [self.graph.op(name) for name in segment.ops]
            # an expert op: one reading expert weights only, or one run inside the experts (a
            # grouped matmul reads the weights through a transpose; the dispatch's gathers)
            owner = {
                i: layer
                for i, op in enumerate(ops)
                if (op.params and set(op.params) <= names) or op.module
                for layer in _layer_of(op, moe.layers)
            }
            positions = tuple(sorted(owner))
            if not positions:
                found.append(None)
                continue
            params = sum(ops[i].param_count for i in positions)
            layers = {owner[i].path for i in positions}
            stacked_layers = {p for p in layers if layouts[p] == "grouped"}
            stacked = frozenset(i for i in positions if owner[i].layout == "grouped")

            def bytes_of(paths, choices: bool = True) -> float:
                return sum(
                    (math.prod(widths[p]) if choices else widths[p][0] * widths[p][2])
                    * self.dtype_bytes
                    for p in paths
                    if p in widths
                )

            found.append(
                _SegmentExperts(
                    positions,
                    float(params),
                    float(bytes_of(layers)),
                    stacked=stacked,
                    stacked_params=float(sum(ops[i].param_count for i in stacked)),
                    stacked_token_bytes=float(bytes_of(stacked_layers)),
                    stacked_row_bytes=float(bytes_of(stacked_layers, choices=False)),
                    listed_experts=sum(by_path[p].num_experts for p in layers - stacked_layers),
                )
            )
        return tuple(found)

    # ---- once per model ---------------------------------------------------------------------

    def _raw(self, segment) -> _SegmentRaw:
        graph, analysis, scale = self.graph, self.tp_analysis, self.scale
        ops = [graph.op(name) for name in segment.ops]
        op_costs = tuple(self._op_cost(op) for op in ops)
        saved_split, saved_full, saved_gathered, quadratic = self._saved(ops, segment.is_block)
        loss_saved = loss_working = loss_working_vocab = logits_bytes = 0.0
        if ops[-1].name == self.segments_last_op:
            # Note [the loss's memory]
            # The loss (token cross-entropy in fp32, as parallelize's default computes it:
            # log_softmax then nll_loss) keeps its fp32 log-probabilities for the backward: 4 bytes
            # per logit saved. Its forward holds the model's logits (the plan's dtype) and their
            # fp32 copy beside them: 2 + 4 bytes per logit in bf16/fp16 (4 in fp32, where the copy
            # is the tensor itself). Its backward holds more: nll_loss's gradient (fp32, dense, 4
            # bytes per logit) and log_softmax's (4 more) beside the saved log-probabilities, before
            # the gradient is cast back to the logits' dtype. The transient is the larger of the
            # two, LOSS_BACKWARD_BYTES_PER_LOGIT = 8 in every dtype.
            outputs = [graph.op(p) for p in graph.graph.predecessors(graph.ops[-1].name)]
            numel = sum(_numel(s) for op in outputs for s in op.output_shapes)
            #     The vocab-parallel loss (parallel.vocab_parallel_loss; Note [the vocab-parallel
            #     loss's memory] in hyparallel/tensor/layers.py) saves one fp32 tensor of the local
            #     logits, 4 bytes per logit over tp, and holds the logits themselves beside it (the
            #     plan's dtype) while it makes it, and the gradient cast back to that dtype in its
            #     backward: dtype bytes per logit over tp. Gathered, each rank holds the whole: 4
            #     saved, the transient above.
            forward_transient = self.dtype_bytes + (4 if self.dtype != "fp32" else 0)
            loss_saved = numel * 4 / scale
            loss_working = (
                numel * max(forward_transient, costs.LOSS_BACKWARD_BYTES_PER_LOGIT) / scale
            )
            loss_working_vocab = numel * self.dtype_bytes / scale
            logits_bytes = numel * self.dtype_bytes / scale
        comm_fwd, comm_bwd, comm_sequence, (comm_loss, comm_gather) = self._tp_comm(ops)
        entering = self._entering_bytes(ops) if segment.is_block else 0.0
        # Note [backward's own]
        #     While an op's backward runs, the gradient of its output and those of its inputs are
        #     alive beside every saved activation, each in its value's dtype; a Linear's weight
        #     gradient is made in the dtype it computed in (autocast's 16 bits) and cast to the fp32
        #     parameter's before it is accumulated: 2 + 4 bytes per parameter at once (4 in fp32).
        #     The planner adds the largest op's to the stage's transient (each activation gradient
        #     counted whole across tp ranks: an upper bound). Measured: gpt-tiny pp 2 in bf16 on the
        #     CPU peaked in a backward, 3.5% over the prediction without it
        #     (tests/test_planner_memory.py).
        g = graph.graph
        backward_working = max(
            (
                (
                    cost.out_bytes * self._widening(op.name)
                    + sum(
                        g.nodes[p]["output_bytes"]
                        * self._widening(p)
                        * self.scale
                        / self.traced_rows
                        for p in g.predecessors(op.name)
                        if g.nodes[p]["kind"] != "input" and p not in self.weight_values
                    )
                )
                for op, cost in zip(ops, op_costs)
                if cost.kind != "view" and op.name not in self.weight_values
            ),
            default=0.0,
        )
        weight_ops = tuple(op for op in ops if op.param_count)

        @cache
        def params_by_tp(tp: int) -> float:
            return sum(analysis.params_per_rank(op, tp) for op in ops)

        signature = (
            tuple(op_costs),
            saved_split,
            saved_full,
            saved_gathered,
            quadratic,
            comm_fwd,
            comm_bwd,
            comm_sequence,
            entering,
            loss_saved,
            loss_working,
            loss_working_vocab,
            comm_loss,
            comm_gather,
            logits_bytes,
            backward_working,
            segment.is_block,
            tuple((analysis.styles.get(op.name), op.param_count) for op in ops),
        )
        # traced bytes (the graph's rows, its dtype) -> one sequence's in the plan's dtype
        one = self.per_sequence
        return _SegmentRaw(
            ops=op_costs,
            signature=signature,
            params_by_tp=params_by_tp,
            saved_split=saved_split * one,
            saved_full=saved_full * one,
            saved_gathered=(saved_gathered[0] * one, saved_gathered[1] * one),
            saved_quadratic=(quadratic[0] * one, quadratic[1] * one),
            block_input_bytes=entering * one,
            is_block=segment.is_block,
            comm_fwd=tuple(x * one for x in comm_fwd),
            comm_bwd=tuple(x * one for x in comm_bwd),
            comm_sequence=tuple(x * one for x in comm_sequence),
            loss_saved=loss_saved * one,
            loss_working=loss_working * one,
            loss_working_vocab=loss_working_vocab * one,
            comm_loss=tuple(x * one for x in comm_loss),
            comm_gather=comm_gather * one,
            logits_bytes=logits_bytes * one,
            backward_working=backward_working,
            weight_ops=weight_ops,
            tensors=len({name for op in weight_ops for name in op.params}),
        )

    def _op_cost(self, op: Op) -> _OpCost:
        analysis, rows = self.tp_analysis, self.traced_rows
        style = analysis.styles.get(op.name) or (
            "split" if op.name in analysis.split_ops else "full"
        )
        in_bytes = sum(_numel(s) for s in op.input_shapes) * self.dtype_bytes / rows
        out_bytes = op.output_bytes * self.per_sequence
        weight = (
            op.input_shapes[0][-1] * op.output_shapes[0][-1] * self.dtype_bytes
            if op.kind == "linear" and op.params
            else 0
        )
        # other views alias: free
        kind = "copy" if op.kind == "view" and op.target in _COPYING_VIEWS else op.kind
        gemm = _gemm_shape(op, rows) if kind in _MATMUL_KINDS else ()
        return _OpCost(
            kind=kind,
            flops=op.flops / rows,
            in_bytes=in_bytes,
            out_bytes=out_bytes,
            weight_bytes=weight,
            style=style,
            quadratic=op.name in self.quadratic,
            gemm=gemm,
            tokens_in_m=kind == "linear" and bool(gemm),
            function=op.function if kind == "activation" else "",
            out_elements=sum(_numel(shape) for shape in op.output_shapes) / rows,
            kv_bytes=(
                kv_elements(self.graph, op, self.kv_as_made) * self.dtype_bytes / rows
                if op.kind == "attention" and len(op.input_shapes) >= 3
                else 0.0
            ),
        )

    def _quadratic_ops(self) -> set[str]:
        """Ops producing seq x seq tensors (attention scores and what is computed from them before
        the next product).

        Found from dataflow: a product of two activations whose output ends in (seq, seq), and the
        elementwise ops after it (scale, mask, softmax, dropout) while their outputs keep that
        shape. A shape test alone would mistake a (batch, seq, hidden) tensor for scores whenever
        hidden == seq.
        """
        g, found = self.graph.graph, set()

        def scores(name: str) -> bool:
            shapes = g.nodes[name]["output_shapes"]
            return (
                bool(shapes)
                and len(shapes[0]) >= 2
                and shapes[0][-1] == shapes[0][-2] == self.seq_len
            )

        for op in self.graph.compute_ops():
            from_scores = any(p in found for p in g.predecessors(op.name))
            # queries x keys makes scores; scores x values does not (whatever its shape)
            if op.kind == "matmul":
                if not op.params and scores(op.name) and not from_scores:
                    found.add(op.name)
            elif (
                op.kind in ("elementwise", "activation", "dropout", "view", "copy")
                and scores(op.name)
                and from_scores
            ):
                found.add(op.name)
        return found

    def _base(self, name: str) -> str:
        """The op whose output storage a value aliases (views resolved to what they view)."""
        g = self.graph.graph
        while g.nodes[name]["kind"] == "view" and g.nodes[name]["target"] not in _COPYING_VIEWS:
            preds = [p for p in g.predecessors(name) if g.nodes[p]["kind"] != "input"]
            if len(preds) != 1:
                break
            name = preds[0]
        return name

    def _saved(
        self, ops: list[Op], in_block: bool
    ) -> tuple[float, float, tuple[float, float], tuple[float, float]]:
        """Bytes (traced dtype and rows) the segment keeps for backward: split by tp, replicated,
        the gathered inputs of column Linears and how much of them other ops save too (Note [what
        sequence parallelism shards]; only in blocks), seq^2-sized (split, replicated)."""
        g, split_ops = self.graph.graph, self.tp_analysis.split_ops
        styles = self.tp_analysis.styles
        saved: dict[str, float] = {}
        gathered: set[str] = set()  # read by a column Linear: saved as the gathered copy under SP
        # read and saved by another op: that op keeps the (sharded) tensor itself
        elsewhere: set[str] = set()
        for op in ops:
            sources: list[str] = []
            name = op.target
            if op.kind in ("linear", "matmul", "attention", "norm", "activation", "loss") or (
                op.kind == "elementwise"
                and name not in _SAVES_NOTHING
                and name not in _SAVES_OUTPUT
            ):
                sources = [
                    self._base(p)
                    for p in g.predecessors(op.name)
                    if g.nodes[p]["kind"] != "input" and p not in self.weight_values
                ]
            column = in_block and styles.get(op.name) == "column"
            for source in sources:
                (gathered if column else elsewhere).add(source)
            if op.kind == "attention" or name in _SAVES_OUTPUT:
                sources.append(op.name)
                elsewhere.add(op.name)
            for source in sources:
                if (
                    op.kind in _SIXTEEN_BIT_KINDS
                    and source != op.name
                    and source in self.fp32_values
                ):
                    # autocast casts an fp32 input to the plan's dtype first and the op saves that
                    # cast
                    saved[f"{source}:cast"] = g.nodes[source]["output_bytes"]
                    (gathered if column else elsewhere).add(f"{source}:cast")
                else:
                    saved[source] = g.nodes[source]["output_bytes"] * self._widening(source)
            if op.kind == "attention":  # log-sum-exp per (head, query) in fp32
                saved[f"{op.name}:lse"] = (
                    _numel(op.output_shapes[0]) / op.input_shapes[0][-1] * 4 / self.scale
                )
            # mean and reciprocal std (or rms) per row in fp32
            if op.kind == "norm" and op.output_shapes:
                rows = _numel(op.output_shapes[0]) / max(op.output_shapes[0][-1], 1)
                saved[f"{op.name}:stats"] = rows * 2 * 4 / self.scale
            if op.kind == "dropout":  # a one-byte mask per element
                saved[f"{op.name}:mask"] = sum(_numel(s) for s in op.output_shapes) / self.scale
        split = full = whole = both = quadratic_split = quadratic_full = 0.0
        for source, num_bytes in saved.items():
            base = source.split(":")[0]
            # Split by tp: what column Linears produce and what is computed from it, and the
            # vocab-parallel head's logits; the vocab-parallel embedding's output is all-reduced, so
            # whole.
            is_split = (
                base in split_ops
                or styles.get(base) == "column"
                or base == self.tp_analysis.vocab_head
            )
            if is_split:
                split += num_bytes
            elif source in gathered:
                whole += num_bytes  # the gathered copy (without SP: the tensor itself, replicated)
                if source in elsewhere:  # and the sharded one another op saves
                    full += num_bytes
                    both += num_bytes
            else:
                full += num_bytes
            if ":" not in source and base in self.quadratic:
                quadratic_split += num_bytes if is_split else 0.0
                quadratic_full += 0.0 if is_split else num_bytes
        return split, full, (whole, both), (quadratic_split, quadratic_full)

    def _tp_comm(
        self, ops: list[Op]
    ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], tuple]:
        """Bytes (traced dtype and rows) of each all-reduce forward and backward in these ops, of
        those among them that sequence parallelism turns into a reduce-scatter and an all-gather
        (the row and column ones), and (the vocab-parallel loss's three all-reduces, the head's
        whole logits) where the head is among them."""
        analysis, g = self.tp_analysis, self.graph.graph
        names = {op.name for op in ops}
        forward = [self.graph.op(r).output_bytes for r in analysis.row_ops if r in names]
        backward = [
            sum(g.nodes[p]["output_bytes"] for p in inputs)
            for inputs in analysis.column_inputs
            if any(
                c in names
                for p in inputs
                for c in g.successors(p)
                if analysis.styles.get(c) == "column"
            )
        ]
        sequence = (*forward, *backward)
        if analysis.vocab_embedding in names:
            forward.append(self.graph.op(analysis.vocab_embedding).output_bytes)
        loss, gathered = [], 0.0
        if analysis.vocab_head in names:
            head = self.graph.op(analysis.vocab_head)
            backward.append(
                sum(_numel(s) for s in head.input_shapes) * self.dtype_bytes / self.scale
            )
            tokens = _numel(head.output_shapes[0]) / head.output_shapes[0][-1]
            # vocab-parallel cross-entropy: max, sum of exp, target logit
            loss = [tokens * 4 / self.scale] * 3
            gathered = _numel(head.output_shapes[0]) * self.dtype_bytes / self.scale
        return tuple(forward), tuple(backward), sequence, (tuple(loss), gathered)

    def _entering_bytes(self, ops: list[Op]) -> float:
        """Bytes of the tensors that flow into these ops from outside (a block's inputs)."""
        g, names = self.graph.graph, {op.name for op in ops}
        sources = {
            p
            for op in ops
            for p in g.predecessors(op.name)
            if p not in names and g.nodes[p]["kind"] != "input"
        }
        return sum(g.nodes[p]["output_bytes"] * self._widening(p) for p in sources)

    @cached_property
    def boundary_bytes(self) -> float:
        """Bytes per sequence of the largest tensor set crossing a cut point, in the dtypes the
        runtime holds them (Note [fp32 under autocast]): what a pipeline stage keeps of each
        micro-batch it has sent (Note [a pipeline stage's boundary tensors] in search.py)."""
        g = self.graph.graph
        return (
            max(
                (
                    sum(
                        g.nodes[t]["output_bytes"] * self._widening(t)
                        for t in cut.tensors
                        if t in g
                    )
                    for cut in self.graph.cut_points
                ),
                default=0.0,
            )
            * self.per_sequence
        )

    def _widening(self, name: str) -> float:
        """How much wider than the plan's dtype the value ``name`` is when the runtime computes it
        (Note [fp32 under autocast]): 4 / 2 for a value autocast leaves in fp32 in a bf16/fp16 plan,
        else 1."""
        return 4 / self.dtype_bytes if name in self.fp32_values else 1.0

    @cached_property
    def weight_values(self) -> frozenset[str]:
        """Values computed from parameters alone (a stacked expert weight transposed for
        grouped_mm): the weights' own, held once whatever the batch, never a micro-batch's
        activations (Note [values computed from the weights])."""
        g = self.graph.graph
        data: set[str] = set()
        for name in g.nodes:
            if g.nodes[name]["kind"] == "input":
                data |= nx.descendants(g, name) | {name}
        reading = {op.name for op in self.graph.ops if op.params}
        found: set[str] = set()
        for name in nx.topological_sort(g):
            if name in data or g.nodes[name]["kind"] in ("input", "output"):
                continue
            if name in reading or any(p in found for p in g.predecessors(name)):
                found.add(name)
        return frozenset(found)

    @cached_property
    def fp32_values(self) -> frozenset[str]:
        """The values a bf16/fp16 plan's runtime holds in fp32 (Note [fp32 under autocast]); none in
        fp32 plans."""
        return autocast_fp32_values(self.graph) if self.dtype != "fp32" else frozenset()


# Note [values computed from the weights]
#     A value no graph input reaches but a parameter does (transformers' grouped_mm experts
#     transpose their stacked [E, out, in] weights before the product) is the weights' own: a
#     view or a weight-sized copy, made once per forward whatever the micro-batch. Counted as a
#     saved activation it was charged per sequence and per micro-batch in flight (DeepSeek-V3 at
#     seq 4096: 24 GiB "saved" per MoE layer, the transposed gate_up_proj), and its gradient as an
#     activation's (the weight gradient's transient is counted apart, Note [backward's own]). Both
#     leave it out.


# Note [sequence parallelism on gloo]
#     Sequence parallelism replaces a row Linear's all-reduce by a reduce-scatter and the next
#     column Linear's copy by an all-gather (and mirrors them backward): a ring reduce-scatter and
#     all-gather cost one all-reduce together (Korthikanti et al. 2022, Sec. 4.2.2). Gloo has no
#     reduce-scatter of its own, so the runtime all-reduces the whole tensor and keeps its chunk
#     (hyparallel.tensor.collectives._reduce_scatter): on a gloo cluster each such pair costs an
#     all-reduce plus an all-gather. Measured with gpt-mini tp 2 SP, 2 processes on this project's
#     2-core machine (torch.profiler, 2026-12-02): a reduce-scatter of a 1 MiB row output took 3.9
#     ms, an all-gather to 1 MiB 1.8 ms (the step's collectives also wait for the other rank, which
#     this does not price).


# Note [fp32 under autocast]
#     parallelize runs a bf16/fp16 plan under torch.autocast over fp32 weights, and autocast casts
#     only the inputs of its lower-precision ops (matrix products, attention: torch's autocast op
#     lists, "CUDA Ops that can autocast to float16", and their CPU counterparts). Everything else
#     computes in the dtype its inputs have: embeddings look up the fp32 table, norms, softmax and
#     the loss run in fp32 (autocast's fp32 list), and an elementwise op with one fp32 input
#     promotes to fp32. So a GPT's residual stream (embedding + positions, then each block's
#     residual adds) stays fp32: the norms save it at 4 bytes per element, and full recomputation
#     keeps each block's input at 4, where the plan's dtype says 2. The planner follows the dtypes
#     through the traced graph the same way: a value is 16-bit when a matrix product or attention
#     makes it, or when every value it is computed from is; fp32 when a norm, softmax, embedding,
#     loss or explicit `float` makes it, or when any value it is computed from is fp32 (type
#     promotion). Measured: gpt-1.3b on an H200 (benchmarks/RESULTS.md, Note [the H200 rows] in
#     tests/test_planner_memory.py).
_SIXTEEN_BIT_KINDS = {"linear", "matmul", "attention"}
_FP32_KINDS = {"norm", "embedding", "loss"}
_FP32_TARGETS = _SAVES_OUTPUT | {
    "float",
    "softmax",
    "log_softmax",
    "cross_entropy",
    "layer_norm",
    "rms_norm",
}


def autocast_fp32_values(graph: ModelGraph) -> frozenset[str]:
    """The ops whose outputs a bf16/fp16 autocast region leaves in fp32 (Note [fp32 under
    autocast])."""
    g, fp32 = graph.graph, set()
    for name in nx.topological_sort(g):
        kind, target = g.nodes[name]["kind"], g.nodes[name].get("target")
        if kind in ("input", "output"):
            continue
        if kind in _SIXTEEN_BIT_KINDS:
            continue
        if kind in _FP32_KINDS or target in _FP32_TARGETS:
            fp32.add(name)
        elif any(p in fp32 for p in g.predecessors(name)):
            fp32.add(name)
    return frozenset(fp32)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def dispatched_ops(graph: ModelGraph) -> list[Op]:
    """The ops whose dispatch the cost model charges (Note [op overhead]): all but views that alias
    their input."""
    return [op for op in graph.compute_ops() if op.kind != "view" or op.target in _COPYING_VIEWS]


# Note [GEMM shapes]
#     A product's efficiency depends on its shape (Note [matmul curve] in cluster.py), read from the
#     traced op: a Linear of input (..., K) and output (..., N) is one GEMM with M = its tokens
#     (every leading dim: a micro-batch of b sequences has b times the tokens of one); a matmul of
#     (..., M, K) @ (..., K, N) is a batch of GEMMs, the leading dims (b times one sequence's) the
#     batch; fused attention of q (..., Tq, D) and k (..., Tk, D) has Tq x D outputs per batch and
#     head, reduced over the Tk keys. Each tensor-parallel rank runs its share: a column or vocab
#     split divides N, a row split K, a split inside a column->row region (heads) the batch;
#     sequence parallelism shards the ops between them, not the products' shapes. The backward of C
#     = A @ B runs two products, each costed by its own shape (costs.gemm_backward_efficiencies): dA
#     = dC @ B^T (M x K outputs over N) and dB = A^T @ dC (K x N over M, a Linear's weight gradient
#     reduced over the tokens).


def _gemm_shape(op: Op, rows: int) -> tuple[float, float, float, float]:
    """(batch, M, N, K) of one sequence's product (Note [GEMM shapes]); () when the shapes do not
    read as one."""
    inputs, outputs = op.input_shapes, op.output_shapes
    if not inputs or not outputs or not inputs[0] or not outputs[0]:
        return ()
    if op.kind == "linear":
        k, n = inputs[0][-1], outputs[0][-1]
        return (1.0, _numel(inputs[0]) / k / rows, float(n), float(k)) if k and n else ()
    if op.kind == "attention":
        if len(inputs) < 2 or len(inputs[0]) < 2 or len(inputs[1]) < 2:
            return ()
        query_rows, head_dim, keys = inputs[0][-2], inputs[0][-1], inputs[1][-2]
        batch = _numel(inputs[0][:-2]) / rows
        return (batch, float(query_rows), float(head_dim), float(keys))
    # a matrix-vector product: the plateau
    if len(inputs) < 2 or len(inputs[0]) < 2 or len(inputs[1]) < 2:
        return ()
    m, k, n = inputs[0][-2], inputs[0][-1], inputs[1][-1]
    return (_numel(outputs[0][:-2]) / rows, float(m), float(n), float(k))


def _rank_gemm(op: _OpCost, tp: int, b: int) -> tuple[float, float, float, float]:
    """(batch, M, N, K) of a micro-batch of ``b`` sequences on one tensor-parallel rank (Note [GEMM
    shapes])."""
    batch, m, n, k = op.gemm
    if op.tokens_in_m:
        m *= b
    else:
        batch *= b
    if op.style in ("column", "vocab"):
        n /= tp
    elif op.style == "row":
        k /= tp
    elif op.style == "split":
        batch /= tp
    return batch, m, n, k


def _op_times(
    op: _OpCost, tp: int, sp: bool, b: int, peak: float, device, serial: bool
) -> tuple[float, float]:
    """(forward, backward) seconds of one op for a micro-batch of ``b`` on one tensor-parallel rank
    (``serial``: a CPU), dispatch included (Note [op overhead] in costs.py)."""
    if op.kind == "view":  # aliases its input: no kernel runs
        return 0.0, 0.0
    flops, weight = op.flops * b, op.weight_bytes
    in_bytes, out_bytes = op.in_bytes * b, op.out_bytes * b
    if op.style == "column" or op.style == "vocab":
        flops, weight, out_bytes = flops / tp, weight / tp, out_bytes / tp
    elif op.style == "row":
        flops, weight, in_bytes = flops / tp, weight / tp, in_bytes / tp
    elif op.style == "split":
        flops, in_bytes, out_bytes = flops / tp, in_bytes / tp, out_bytes / tp
    # sequence parallelism shards norms, dropout and residuals along the sequence
    elif sp and op.style == "full":
        in_bytes, out_bytes = in_bytes / tp, out_bytes / tp
    bandwidth, memory_efficiency = device.memory_bandwidth_bytes_per_s, device.memory_efficiency
    overhead, floor = device.op_overhead_s, device.kernel_floor_s

    def kernel(kernel_flops: float, num_bytes: float, efficiency: float) -> float:
        work_s = costs.roofline_s(
            kernel_flops, num_bytes, peak, efficiency, bandwidth, memory_efficiency
        )
        return costs.dispatched_s(costs.kernel_s(work_s, floor), overhead, serial)

    ratio = _BACKWARD_RATIO.get(op.kind, 2.0)
    computed = device.activation_costs.get(op.function) if op.function else None
    # Note [activations a CPU computes] in cluster.py: the larger of compute and bytes
    if computed is not None:
        # this rank's share, as above
        elements = op.out_elements * out_bytes / op.out_bytes if op.out_bytes else 0.0
        moved = costs.roofline_s(0.0, in_bytes + out_bytes, peak, 1.0, bandwidth, memory_efficiency)
        forward = costs.dispatched_s(
            costs.kernel_s(max(moved, elements * computed.forward_s), floor), overhead, serial
        )
        # its ops dispatched as the others' are
        backward_each = max(moved, elements * computed.backward_s / ratio)
        return forward, ratio * costs.dispatched_s(
            costs.kernel_s(backward_each, floor), overhead, serial
        )
    if op.kind not in _MATMUL_KINDS:
        forward = kernel(0.0, in_bytes + out_bytes, 1.0)
        return forward, forward * ratio
    num_bytes = in_bytes + out_bytes + weight
    shape = _rank_gemm(op, tp, b) if op.gemm else None
    if op.kind == "attention":
        efficiency = device.attention_efficiency
        if shape is not None:
            batch, query_rows, head_dim, keys = shape
            efficiency *= costs.curve_factor(
                device.attention_curve, batch * query_rows * head_dim, keys
            )
        forward = kernel(flops, num_bytes, efficiency)
        return forward, forward * ratio
    if shape is None:
        forward = kernel(flops, num_bytes, device.matmul_efficiency)
        return forward, forward * ratio
    plateau, curve = device.matmul_efficiency, device.matmul_curve
    forward = kernel(flops, num_bytes, costs.gemm_efficiency(plateau, curve, *shape))
    input_grad, weight_grad = costs.gemm_backward_efficiencies(plateau, curve, *shape)
    return forward, kernel(flops, num_bytes, input_grad) + kernel(flops, num_bytes, weight_grad)
