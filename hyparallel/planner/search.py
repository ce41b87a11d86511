"""The exact search: every discrete choice enumerated, stage boundaries by dynamic programming.

Candidates are ordered by a lower bound on their step time and evaluated exactly in that order until
the bound passes the K-th best time found (branch and bound): the answer is the same as evaluating
every candidate, which ``tests/test_planner_search.py`` checks against brute force.

Note [step time]
    Each pipeline stage s spends t_s per micro-batch (forward, backward with recomputation, its
    tensor-parallel all-reduces and its point-to-point sends) and ends the step with a tail x_s
    (the data-parallel gradient reduction not hidden behind its last backward, with a compressing
    hook's kernels, ZeRO's parameter all-gather, the optimizer step). With m micro-batches and v
    virtual stages per device:

        T = max_s [ (m - 1/v) * t_s + x_s ] + sum_s t_s / v

    For v = 1 the pipeline part is (m - 1) * max t + sum t, the critical path of GPipe and 1F1B
    (Tarnawski et al. 2020; Alpa, Zheng et al. 2022, eq. 2); with balanced stages it is
    (m + (p - 1)/v) * t (Narayanan et al. 2021). sum_s t_s does not depend on where the stages are
    cut, so the boundaries minimise max_s [...] under each stage's memory limit: an exact min-max
    dynamic program over the segments.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from hyparallel.planner import costs
from hyparallel.planner.constraints import default
from hyparallel.planner.inflight import backward_sends_held, inflight_microbatches
from hyparallel.planner.profile import GradientWork, ModelProfile, SegmentCost
from hyparallel.spec.cluster import ClusterSpec, LinkSpec

log = logging.getLogger("hyparallel.planner")
# Called as progress(phase, done, total) while a search runs: phase "bounding" (every configuration
# gets a lower bound) then "costing" (candidates evaluated exactly in bound order; most are pruned,
# so it ends early).
Progress = Callable[[str, int, int], None]

ORDERS: tuple[tuple[str, str, str], ...] = (("pp", "dp", "tp"), ("dp", "pp", "tp"))
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Config:
    """One point of the search space."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    recompute: str
    zero: int
    sequence_parallel: bool
    order: tuple[str, str, str]
    grad_compression: str = "none"  # Note [gradient compression] in costs.py
    # the search's (a constraint, not searched); costed under grad_compression powersgd
    powersgd_rank: int = 4
    ep: int = 1  # Note [expert parallelism] (hyparallel.runtime.experts); ep divides dp
    # Note [context parallelism] (hyparallel.runtime.context): each sequence over cp ranks
    cp: int = 1
    cp_attention: str = "gather"
    # costed(): dp already dp x cp and micro_batch one cp rank's share
    costed_view: bool = False

    def costed(self) -> Config:
        """The configuration as the costs see one of its ranks (Note [context parallelism's costs]
        in costs.py): under cp, a data-parallel rank of dp x cp with 1/cp of a micro-batch's
        sequences; itself otherwise."""
        if self.cp == 1 or self.costed_view:
            return self
        return replace(
            self, dp=self.dp * self.cp, micro_batch=self.micro_batch / self.cp, costed_view=True
        )

    @property
    def data_parallel(self) -> int:
        """The ranks sharing the weight gradients: dp x cp."""
        return self.dp if self.costed_view else self.dp * self.cp

    def planned(self) -> Config:
        """The configuration as a plan states it (``costed``'s inverse)."""
        if not self.costed_view:
            return self
        return replace(
            self,
            dp=self.dp // self.cp,
            micro_batch=round(self.micro_batch * self.cp),
            costed_view=False,
        )

    def __str__(self) -> str:
        c = self.planned()
        schedule = c.schedule + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "")
        return (
            f"tp {c.tp} pp {c.pp} dp {c.dp}"
            + (f" cp {c.cp} ({c.cp_attention})" if c.cp > 1 else "")
            + (f" (ep {c.ep})" if c.ep > 1 else "")
            + f", micro-batch {c.micro_batch} x"
            f" {c.num_microbatches}, {schedule}, recompute {c.recompute}, ZeRO {c.zero},"
            f" SP {'on' if c.sequence_parallel else 'off'}, order {','.join(c.order)}"
            + (f", gradients {c.compression}" if c.compressed else "")
        )

    @property
    def compressed(self) -> bool:
        """Whether the data-parallel gradients are compressed (a mode other than none, with dp >
        1)."""
        return self.grad_compression != "none" and self.dp > 1

    @property
    def compression(self) -> str:
        """The gradient compression in a few words: ``bf16``, ``powersgd rank 4``."""
        rank = f" rank {self.powersgd_rank}" if self.grad_compression == "powersgd" else ""
        return self.grad_compression + rank


@dataclass
class Evaluation:
    """The predicted cost of one configuration with its best stage boundaries."""

    config: Config
    feasible: bool
    step_time_s: float = math.inf
    # segment ranges [start, end) per (virtual) stage
    stages: list[tuple[int, int]] = field(default_factory=list)
    stage_time_s: list[float] = field(default_factory=list)  # per device stage, per micro-batch
    stage_memory_bytes: list[float] = field(default_factory=list)  # per device stage
    stage_params: list[float] = field(default_factory=list)
    comm_s: dict[str, float] = field(default_factory=dict)
    bubble_fraction: float = 0.0
    reason: str = ""
    refused: bool = False  # fits, but its plan is one the runtime refuses (``reason`` says why)

    @property
    def peak_memory_bytes(self) -> float:
        """The most memory any device needs."""
        return max(self.stage_memory_bytes, default=math.inf)


@dataclass
class _Context:
    """What every candidate of one search shares."""

    profile: ModelProfile
    cluster: ClusterSpec
    global_batch: int
    dtype: str


def axis_link(
    order: tuple[str, ...], sizes: dict[str, int], axis: str, cluster: ClusterSpec
) -> LinkSpec:
    """The link groups along ``axis`` talk over: intra-node only if every such group lies inside one
    node.

    A group is ``size`` ranks ``stride`` apart, all within a window of ``stride * size`` ranks that
    starts at a multiple of it; ranks fill nodes in order, so every group stays inside a node
    exactly when that window divides the node.
    """
    stride = 1
    for name in reversed(order):
        if name == axis:
            break
        stride *= sizes[name]
    window = stride * sizes[axis]
    return (
        cluster.intra_node
        if sizes[axis] == 1 or cluster.gpus_per_node % window == 0
        else cluster.inter_node
    )


def config_links(c: Config, cluster: ClusterSpec) -> dict[str, LinkSpec]:
    """The link each axis's groups talk over (``c`` costed: its dp is the gradients' dp x cp, a cp
    axis right inside it, as hyparallel.spec.schema's mesh_shape lays it)."""
    sizes = {"tp": c.tp, "pp": c.pp, "dp": c.dp}
    links = {axis: axis_link(c.order, sizes, axis, cluster) for axis in ("tp", "pp", "dp")}
    links["ep"], links["ep_stacked"] = ep_links(c, cluster)
    if c.cp > 1:
        order = tuple(a for axis in c.order for a in ((axis, "cp") if axis == "dp" else (axis,)))
        shape = {**sizes, "dp": c.data_parallel // c.cp, "cp": c.cp}
        links["cp"] = axis_link(order, shape, "cp", cluster)
    return links


def profile_key(c: Config, links: dict[str, LinkSpec]) -> tuple:
    """What ModelProfile.segment_costs and totals take for ``c`` (costed: Config.costed)."""
    ep_pair = (links["ep"], links["ep_stacked"])
    key = (c.tp, c.sequence_parallel, c.micro_batch, c.recompute, links["tp"], c.ep, ep_pair)
    return key + ((c.cp, links["cp"], c.cp_attention) if c.cp > 1 else ())


def segment_costs_of(profile: ModelProfile, c: Config, cluster: ClusterSpec):
    """Every segment's cost under the plan's configuration ``c`` (costed as Config.costed)."""
    k = c.costed()
    return profile.segment_costs(*profile_key(k, config_links(k, cluster)))


def enumerate_configs(ctx: _Context, fixed: dict) -> list[Config]:
    """Every configuration the constraints allow and the model's dimensions admit."""
    configs = []
    rank = fixed.get("powersgd_rank", default("powersgd_rank"))
    # replicated attention: no sequence parallelism
    whole = ctx.profile.tp_analysis.whole_sequence(ctx.profile.graph)

    def uneven(tp: int) -> str | None:  # a sequence tp does not divide (a ViT's 257 positions)
        return ctx.profile.tp_analysis.uneven_sequence(ctx.profile.graph, tp)

    for tp, cp, pp, dp in _layouts(ctx, fixed):
        # each cp rank's tokens split over tp by sequence parallelism
        local = ctx.profile.seq_len // cp
        sequence_split = (
            tp > 1 and ctx.profile.num_blocks and not whole and not uneven(tp) and local % tp == 0
        )
        attentions = _cp_attentions(cp, fixed)
        for b in _divisors(ctx.global_batch // dp):
            m = ctx.global_batch // (dp * b)
            schedules = list(_schedules(pp, m, ctx.profile.num_blocks, fixed))
            options = itertools.product(
                schedules,
                # selective has nothing to recompute in the split attention (the runtime's rule)
                [r for r in _recomputes(ctx.profile, pp, fixed) if cp == 1 or r != "selective"],
                _zeros(pp, dp * cp, fixed),
                (False, True) if sequence_split else (False,),  # Note [what needs blocks]
                _orders(pp, dp, fixed),
            )
            configs.extend(
                Config(
                    tp,
                    pp,
                    dp,
                    b,
                    m,
                    schedule,
                    v,
                    recompute,
                    zero,
                    sp,
                    order,
                    mode,
                    rank,
                    ep,
                    cp,
                    attention,
                )
                for (schedule, v), recompute, zero, sp, order in options
                if fixed.get("micro_batch", b) == b and fixed.get("sequence_parallel", sp) == sp
                for mode in _compressions(dp * cp, zero, fixed)
                for ep in (_expert_degrees(ctx, dp, fixed) if cp == 1 else (1,))
                if ep == fixed.get("ep", ep)
                for attention in attentions
            )
    return configs


def _cp_attentions(cp: int, fixed: dict) -> tuple[str, ...]:
    """How attention crosses cp ranks: the one asked for, else both (costs.py's Note [context
    parallelism's costs] prices them)."""
    if cp == 1:
        return (fixed.get("cp_attention", "gather"),)
    return (fixed["cp_attention"],) if "cp_attention" in fixed else ("gather", "ring")


def _context_degrees(ctx: _Context, per_tp: int, fixed: dict) -> list[int]:
    """The context-parallel degrees of a layout: 1, and for a model context parallelism can split
    (hyparallel.graph.context) every cp dividing the GPUs left by tp whose 2 cp chunks divide the
    sequence (the runtime's rule); only the one asked for when fixed."""
    if fixed.get("cp", 1) > 1 and ctx.profile.cp_refusal:
        return []
    splittable = ctx.profile.cp_refusal is None and ctx.profile.seq_len
    degrees = [
        cp
        for cp in _divisors(per_tp)
        if cp == 1 or (splittable and ctx.profile.seq_len % (2 * cp) == 0)
    ]
    return [cp for cp in degrees if fixed.get("cp", cp) == cp]


def _expert_degrees(ctx: _Context, dp: int, fixed: dict) -> tuple[int, ...]:
    """The expert-parallel degrees of a layout: the one asked for when dp admits it; else, for a
    model with MoE layers, every ep dividing both dp and each layer's experts."""
    if "ep" in fixed:
        return (fixed["ep"],) if dp % fixed["ep"] == 0 else ()
    counts = ctx.profile.expert_counts
    if not counts:
        return (1,)
    return tuple(e for e in _divisors(dp) if all(n % e == 0 for n in counts))


def ep_link(c: Config, cluster: ClusterSpec, stacked: bool = False) -> LinkSpec:
    """The link an ep group talks over: ep consecutive dp ranks (``stacked`` experts under tp: ep
    consecutive ranks of the (dp, tp) block, Note [tp folded into the experts' ranks] in
    hyparallel/runtime/experts.py), each with what lies inside them between them."""
    folded = ("dp", "tp") if stacked else ("dp",)
    stride = 1
    for name in reversed(c.order):
        if name in folded:
            break
        stride *= {"tp": c.tp, "pp": c.pp, "dp": c.dp}[name]
    window = stride * c.ep
    inside = c.ep == 1 or cluster.gpus_per_node % window == 0
    return cluster.intra_node if inside else cluster.inter_node


def ep_links(c: Config, cluster: ClusterSpec) -> tuple[LinkSpec, LinkSpec]:
    """The links of a ModuleList's experts' ep groups and of stacked experts' (ep_link)."""
    return ep_link(c, cluster), ep_link(c, cluster, stacked=c.tp > 1)


def _compressions(dp: int, zero: int, fixed: dict) -> tuple[str, ...]:
    """The gradient compressions of a layout (Note [gradient compression is asked for] in
    constraints.py): the one asked for, or every one under ``any`` (in costs.GRAD_COMPRESSIONS
    order: the earlier wins a tie); only none with dp = 1, and powersgd only at ZeRO 0."""
    if dp == 1:
        return ("none",)
    asked = fixed.get("grad_compression", default("grad_compression"))
    modes = costs.GRAD_COMPRESSIONS if asked == "any" else (asked,)
    return tuple(mode for mode in modes if not (mode == "powersgd" and zero > 0))


def _layouts(ctx: _Context, fixed: dict):
    """(tp, cp, pp, dp): tp valid for the model and inside a node unless fixed; cp as
    _context_degrees allows, beside pp 1 only (the runtime's rule); dp divides the batch."""
    n = ctx.cluster.num_gpus
    for tp in _divisors(n):
        # tp leaves a node only when asked
        inside_node = tp <= ctx.cluster.gpus_per_node or "tp" in fixed
        if (
            fixed.get("tp", tp) != tp
            or not inside_node
            or ctx.profile.tp_analysis.check(tp, ctx.profile.graph)
        ):
            continue
        for cp in _context_degrees(ctx, n // tp, fixed):
            for pp in _divisors(n // (tp * cp)) if cp == 1 else (1,):
                dp = n // (tp * cp * pp)
                if (
                    fixed.get("pp", pp) == pp
                    and fixed.get("dp", dp) == dp
                    and pp <= len(ctx.profile.segments)
                    and ctx.global_batch % dp == 0
                ):
                    yield tp, cp, pp, dp


def _orders(pp: int, dp: int, fixed: dict) -> tuple[tuple[str, ...], ...]:
    if "order" in fixed:
        return (tuple(fixed["order"]),)
    return ORDERS if pp > 1 and dp > 1 else ORDERS[:1]


# Note [what needs blocks]
# Sequence parallelism shards the activations between a block's column/row pairs, and recomputation
# without a pipeline wraps each repeated block: both need repeated blocks
# (hyparallel.graph.checks.check_blocks refuses them otherwise), so a model without any gets no
# candidate with them; fixed by the caller, they leave nothing.


def _recomputes(profile: ModelProfile, pp: int, fixed: dict) -> list[str]:
    if "recompute" in fixed:
        return [fixed["recompute"]]
    if pp == 1 and not profile.num_blocks:  # Note [what needs blocks]
        return ["none"]
    # With nothing seq^2-sized kept (fused attention), selective recomputation is the same as none.
    return [r for r in RECOMPUTE if r != "selective" or profile.has_quadratic]


def _zeros(pp: int, dp: int, fixed: dict) -> list[int]:
    # ZeRO-2/3 with pipelining is unsupported (DeepSpeed's rule); sharding needs dp > 1.
    allowed = [z for z in (0, 1, 2, 3) if not (z >= 2 and pp > 1) and not (z and dp == 1)]
    return [z for z in allowed if fixed.get("zero", z) == z]


def _schedules(pp: int, m: int, num_blocks: int, fixed: dict):
    if pp == 1:
        if fixed.get("schedule", "1f1b") == "1f1b" and fixed.get("virtual_stages", 1) == 1:
            yield "1f1b", 1
        return
    for schedule in ("gpipe", "1f1b"):
        if fixed.get("schedule", schedule) == schedule and fixed.get("virtual_stages", 1) == 1:
            yield schedule, 1
    if fixed.get("schedule", "interleaved-1f1b") != "interleaved-1f1b" or m % pp or not num_blocks:
        return
    for v in range(2, num_blocks // pp + 1):
        # Megatron-LM's interleaving: every virtual stage holds the same number of blocks.
        if num_blocks % (pp * v) == 0 and fixed.get("virtual_stages", v) == v:
            yield "interleaved-1f1b", v


def transfer_s(profile: ModelProfile, c: Config, link: LinkSpec) -> float:
    """One pipeline boundary transfer of a micro-batch (its activations, or their gradient); 0
    without a pipeline."""
    return costs.p2p_s(profile.cut_bytes * c.micro_batch / c.tp, link) if c.pp > 1 else 0.0


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in sqrt(n) steps (a global batch may be 2^24)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class Search:
    """Searches the plans of one model on one cluster for one batch shape."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        global_batch: int,
        dtype: str,
        progress: Progress | None = None,
        admit: Callable[[Evaluation], str | None] | None = None,
    ):
        self.ctx = _Context(profile, cluster, global_batch, dtype)
        self.evaluated = 0
        self.considered = 0
        self.progress = progress
        # Note [the runtime's checks]: the plan of a candidate is checked as the runtime would check
        # it; a refusal (its one-line reason) makes the candidate infeasible, never a plan.
        self.admit = admit
        self.refused: list[Evaluation] = []

    def best(self, fixed: dict, top: int = 1) -> tuple[list[Evaluation], Evaluation | None]:
        """The ``top`` fastest feasible evaluations (fastest first), and the most frugal infeasible
        one seen.

        Note [one micro-batch through a pipeline]: a pipeline fed one micro-batch idles every stage
        but one (bubble (pp - 1) / 1 of the compute), so such configurations are ranked after every
        other that fits, and are only costed when fewer than ``top`` others fit.
        """
        configs = enumerate_configs(self.ctx, fixed)
        self.considered += len(configs)
        preferred = [c for c in configs if not lone_microbatch(c)]
        found, frugal = self._branch_and_bound(preferred, top)
        if len(found) < top:
            rest, rest_frugal = self._branch_and_bound(
                [c for c in configs if lone_microbatch(c)], top - len(found)
            )
            found += rest
            frugal = _more_frugal(frugal, rest_frugal)
        return found, frugal

    def _branch_and_bound(
        self, configs: list[Config], top: int
    ) -> tuple[list[Evaluation], Evaluation | None]:
        """The ``top`` fastest feasible evaluations of ``configs`` (see the module docstring), and
        the most frugal infeasible one seen; a candidate ``admit`` refuses counts as infeasible,
        with its reason."""
        bounds = []
        for i, c in enumerate(configs):
            if (bound := self._lower_bound(c)) is not None:
                bounds.append((bound, i))
            if self.progress and i % 256 == 255:
                self.progress("bounding", i + 1, len(configs))
        log.info(
            "%d configurations, %d may fit in memory; costing them in order of their lower bounds",
            len(configs),
            len(bounds),
        )
        heapq.heapify(bounds)
        found: list[Evaluation] = []
        frugal: Evaluation | None = None
        candidates = len(bounds)
        while bounds:
            bound, i = heapq.heappop(bounds)
            if len(found) >= top and bound >= found[top - 1].step_time_s:
                log.info(
                    "stopped: the next lower bound, %.4g s, cannot beat the top %d (the slowest of"
                    " them: %.4g s); %d left uncosted",
                    bound,
                    top,
                    found[top - 1].step_time_s,
                    len(bounds) + 1,
                )
                break
            evaluation = self._admitted(self.evaluate(configs[i]))
            log.debug(
                "%s: bound %.4g s, %s",
                configs[i],
                bound,
                f"{evaluation.step_time_s:.4g} s" if evaluation.feasible else evaluation.reason,
            )
            if evaluation.feasible:
                found.append(evaluation)
                found.sort(key=lambda e: e.step_time_s)
            else:
                frugal = _more_frugal(frugal, evaluation)
            if self.progress:
                self.progress("costing", candidates - len(bounds), candidates)
        return found[:top], frugal

    def _admitted(self, evaluation: Evaluation) -> Evaluation:
        """``evaluation``, made infeasible (``refused``, with the reason) when ``admit`` refuses its
        plan."""
        if evaluation.feasible and self.admit is not None and (reason := self.admit(evaluation)):
            evaluation.feasible, evaluation.refused = False, True
            evaluation.step_time_s, evaluation.reason = math.inf, reason
            self.refused.append(evaluation)
        return evaluation

    def least_memory_bytes(self, fixed: dict) -> float | None:
        """The smallest per-GPU memory lower bound over the configurations ``fixed`` allows (None:
        none exist)."""
        bounds = [self._memory_bound(c) for c in enumerate_configs(self.ctx, fixed)]
        return min(bounds, default=None)

    # ---- one configuration ------------------------------------------------------------------

    def _links(self, c: Config) -> dict[str, LinkSpec]:
        return config_links(c, self.ctx.cluster)

    @staticmethod
    def _profile_key(c: Config, links) -> tuple:
        """What ModelProfile.segment_costs and totals take for ``c`` (costed: Config.costed)."""
        return profile_key(c, links)

    def _segment_costs(self, c: Config, links) -> tuple[SegmentCost, ...]:
        return self.ctx.profile.segment_costs(*self._profile_key(c, links))

    def _tables(self, c: Config, links) -> _Tables:
        profile = self.ctx.profile
        gradients, tied_gradients = None, ()
        if c.grad_compression == "powersgd" and c.dp > 1:
            gradients = profile.powersgd_work(c.tp, c.powersgd_rank, c.ep)
            tied_gradients = profile.tied_powersgd_work(c.tp, c.powersgd_rank)
        segments = self._segment_costs(c, links)
        return _Tables(
            segments,
            profile.tied_segments(c.tp),
            gradients,
            tied_gradients,
            expert_state=self._expert_state(c, segments),
            loss_s=self._router_loss_s(c, links, len(segments)),
        )

    def _p2p_s(self, c: Config, links) -> float:
        """Point-to-point seconds per micro-batch on one device: activations forward, gradients
        back, per chunk."""
        return 2 * c.virtual_stages * transfer_s(self.ctx.profile, c, links["pp"])

    def _lower_bound(self, c: Config) -> float | None:
        """A step time no plan of this configuration beats (None when it cannot fit in memory at
        all).

        max_s [a_s + b_s] >= mean_s a_s + mean_s b_s, so the bound averages the stages: pipeline
        time and optimizer step (both sums over segments), with no communication tail. Gradient
        compression only adds to what it leaves out (the tail, ZeRO 2/3's per-micro-batch traffic),
        so one bound holds for every mode; the memory bound counts PowerSGD's residuals, not its
        buffers.
        """
        c = c.costed()
        if self._memory_bound(c) > self.ctx.cluster.device.usable_memory_bytes:
            return None
        links = self._links(c)
        total_t, params, _ = self.ctx.profile.totals(*self._profile_key(c, links))
        total_t += c.pp * self._p2p_s(c, links)
        device = self.ctx.cluster.device
        optimizer_params = params / c.dp if c.zero >= 1 else params
        optimizer_s = (
            optimizer_params
            * costs.adam_step_bytes_per_param(self.ctx.dtype)
            / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
        )
        v = c.virtual_stages
        return ((c.num_microbatches - 1 / v) * total_t + optimizer_s) / c.pp + total_t / v

    def _memory_bound(self, c: Config) -> float:
        """Per-GPU memory no stage boundaries go below: the stages' mean, with the fewest
        micro-batches in flight."""
        c = c.costed()
        links = self._links(c)
        _, params, act = self.ctx.profile.totals(*self._profile_key(c, links))
        state = costs.state_bytes_per_param(self.ctx.dtype, c.zero, c.dp, c.grad_compression)
        least_inflight = inflight_microbatches(
            c.schedule, c.pp, c.num_microbatches, c.pp - 1, c.virtual_stages
        )
        expert_state = sum(self._expert_state(c, self._segment_costs(c, links)))
        return (params * state + least_inflight * act + expert_state) / c.pp

    def _expert_state(self, c: Config, segments: Sequence[SegmentCost]) -> list[float]:
        """What each segment's expert weights' state costs beside ``params * state``: ZeRO shards
        it over the dp / ep ranks holding the same experts (dp tp / ep for stacked experts under
        tp: Note [tp folded into the experts' ranks]), not dp (Note [experts under ZeRO])."""
        if c.ep == 1:
            return [0.0] * len(segments)
        dtype, mode = self.ctx.dtype, c.grad_compression
        plain = costs.state_bytes_per_param(dtype, c.zero, c.dp, mode)
        held_extra, folded_extra = (
            costs.state_bytes_per_param(dtype, c.zero, replicas, mode) - plain
            for replicas in (c.dp // c.ep, c.dp * c.tp // c.ep)
        )
        return [
            (s.expert_params - s.folded_expert_params) * held_extra
            + s.folded_expert_params * folded_extra
            for s in segments
        ]

    def _router_loss_s(self, c: Config, links, n: int) -> list[float]:
        """Per micro-batch, each segment's seconds making an auxiliary load-balancing loss the whole
        dp batch's: the last segment's, where the loss is (Note [expert parallelism's costs] in
        costs.py). Its router scores gathered over dp (forward) and their gradients
        reduce-scattered (backward), or transformers' 2 E + 1 sums all-reduced both ways."""
        seconds = [0.0] * n
        profile = self.ctx.profile
        elements = profile.router_logit_elements
        if c.dp > 1 and elements and n:
            if profile.router_loss_gathered:
                gathered = elements * c.micro_batch * c.dp * costs.DTYPE_BYTES[self.ctx.dtype]
                seconds[-1] = 2 * costs.ring_allgather_s(gathered, c.dp, links["dp"])
            else:
                sums = (2 * max(profile.expert_counts) + 1) * 4  # fp32
                seconds[-1] = 2 * costs.ring_allreduce_s(sums, c.dp, links["dp"])
        return seconds

    def _expert_replicas(self, c: Config) -> tuple[int, int]:
        """How many ranks hold the same experts (their gradients averaged there): experts as tp
        splits them (a ModuleList's, or any under tp 1), and stacked experts with tp folded in
        (Note [tp folded into the experts' ranks] in hyparallel/runtime/experts.py)."""
        return max(c.dp // c.ep, 1), max(c.dp * c.tp // c.ep, 1)

    def evaluate(self, c: Config) -> Evaluation:
        """Step time, memory and the best stage boundaries of one configuration."""
        return _as_planned(self._evaluate(c.costed()))

    def _evaluate(self, c: Config) -> Evaluation:
        self.evaluated += 1
        links = self._links(c)
        tables = self._tables(c, links)
        segments = tables.segments
        if c.schedule == "interleaved-1f1b":
            chunks = _interleaved_chunks(len(segments), self.ctx.profile, c.pp * c.virtual_stages)
            return self._finish(c, links, tables, chunks, _devices(c, chunks))
        best = self._partition(c, links, tables)
        if best is None:
            return self._infeasible(c, links, tables)
        return self._finish(c, links, tables, best, [[r] for r in best])

    def evaluate_even(self, c: Config) -> Evaluation:
        """``c`` with Megatron-LM's layout whatever its schedule: equal blocks per (virtual) stage,
        what precedes and follows them with the first and the last (for comparing with runs that
        used it; the search balances stages by time under memory instead)."""
        c = c.costed()
        links = self._links(c)
        tables = self._tables(c, links)
        chunks = _interleaved_chunks(
            len(tables.segments), self.ctx.profile, c.pp * c.virtual_stages
        )
        return _as_planned(self._finish(c, links, tables, chunks, _devices(c, chunks)))

    def _stage_terms(
        self, c: Config, links, *quantities: np.ndarray, stage: int
    ) -> tuple[np.ndarray, ...]:
        """Per-micro-batch time, tail and memory of candidate stages at place ``stage`` of the
        pipeline;
        ``quantities`` are ``_Tables.range``'s (arrays of any shape), as ``_stage_time`` takes
        them."""
        t, tail, held = self._stage_time(c, links, *quantities)
        return t, tail, self._stage_memory(c, held, stage)

    def _stage_time(
        self,
        c: Config,
        links,
        t: np.ndarray,
        bwd: np.ndarray,
        params: np.ndarray,
        act: np.ndarray,
        wire: np.ndarray,
        hook_s: np.ndarray,
        hook_ops: np.ndarray,
        shared: np.ndarray,
        tensors: np.ndarray,
        expert_state: np.ndarray,
        experts: np.ndarray,
        folded: np.ndarray,
        work: np.ndarray,
        largest: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, tuple]:
        """Per-micro-batch time and tail of candidate stages, which do not depend on their place in
        the pipeline, and what their memory needs beside that place (``_stage_memory``): the
        partition computes these once, not per stage.

        ``wire``, ``hook_s``, ``hook_ops``: PowerSGD's elements sent, kernel seconds and ops
        (``GradientWork``) of the stages' gradients but the shared ones, under grad_compression
        powersgd (else ``wire`` is ``params``);
        ``shared``: the params of weights other stages hold too, which a compressing plan reduces
        apart in fp32; ``expert_state``: what the stages' expert weights' state costs beside
        ``params * state`` (``_expert_state``); ``experts``, ``folded``: of ``params``, the expert
        weights under ep, which their replicas reduce, not dp (Note [expert parallelism's costs]
        in costs.py).
        """
        dtype, cluster, mode = self.ctx.dtype, self.ctx.cluster, c.grad_compression
        t = t + self._p2p_s(c, links)
        serial = cluster.backend == "gloo"  # CPU processes: collectives and compute share the cores
        tail = np.zeros_like(t)
        extra_memory = 0.0
        dense = params - experts - folded
        replicas, folded_replicas = self._expert_replicas(c)
        if c.dp > 1 and c.zero == 0:
            tail, extra_memory = self._all_reduce_tail(
                c, links, dense, bwd, wire, hook_s, hook_ops, shared, serial
            )
            # the experts' gradients, averaged over their replicas after the last backward, in fp32
            # (ExpertParallel.reduce_grads)
            grad = costs.GRAD_BYTES_PER_PARAM
            tail = (
                tail
                + costs.ring_allreduce_s(experts * grad, replicas, links["dp"])
                + costs.ring_allreduce_s(folded * grad, folded_replicas, links["dp"])
            )
        # Note [ZeRO stages on FSDP2] in data_parallel.py: one collective per FSDP unit
        elif c.dp > 1:
            units = self.ctx.profile.num_blocks + 1 if c.pp == 1 else c.virtual_stages
            link = links["dp"]

            def per_unit(collective, num_bytes):
                return units * collective(num_bytes / units, c.dp, link)

            gathered = costs.gathered_bytes_per_param(dtype, mode)
            reduced = costs.reduced_bytes_per_param(mode, serial)
            scatter_bytes = dense * reduced
            gather = per_unit(costs.ring_allgather_s, dense * gathered)
            scatter = per_unit(costs.ring_reduce_scatter_s, scatter_bytes)
            # Note [experts under ZeRO]: the experts are units of their own over their replicas
            for held, n in ((experts, replicas), (folded, folded_replicas)):
                gather = gather + costs.ring_allgather_s(held * gathered, n, link)
                scatter = scatter + costs.ring_reduce_scatter_s(held * reduced, n, link)
            # Note [what FSDP and the optimizer dispatch on a CPU]: each collective's per-tensor
            # work, unhidden there
            per_tensor = (
                tensors * costs.FSDP_OPS_PER_TENSOR * cluster.device.op_overhead_s
                if serial
                else 0.0
            )
            # gradients reduce-scattered unit by unit in the last backward; weights gathered once
            if c.zero == 1:
                last = costs.ring_reduce_scatter_s(scatter_bytes / units, c.dp, link)
                tail = (
                    np.maximum(costs.overlapped_s(scatter - last, bwd, serial), 0)
                    + last
                    + gather
                    + 2 * per_tensor
                )
            elif c.zero == 2:  # gradients reduce-scattered after every micro-batch's backward
                t = t + costs.overlapped_s(scatter, bwd, serial) + per_tensor
                tail = gather + per_tensor
            # ZeRO-3: weights gathered for forward and backward, gradients scattered, every
            # micro-batch
            else:
                t = (
                    t
                    + costs.overlapped_s(gather, t - bwd, serial)
                    + costs.overlapped_s(gather + scatter, bwd, serial)
                )
                t = t + 3 * per_tensor
        # ZeRO 1-3: each rank steps its shard, the experts' over their replicas
        optimizer_params = (
            dense / c.dp + experts / replicas + folded / folded_replicas if c.zero >= 1 else params
        )
        device = cluster.device
        tail = tail + optimizer_params * costs.adam_step_bytes_per_param(dtype) / (
            device.memory_bandwidth_bytes_per_s * device.memory_efficiency
        )
        if serial:  # Note [what FSDP and the optimizer dispatch on a CPU]
            sharded = c.zero >= 1 and c.dp > 1  # FSDP2's parameters are DTensors
            ops = costs.ADAM_DTENSOR_OPS_PER_TENSOR if sharded else costs.ADAM_OPS_PER_TENSOR
            tail = tail + tensors * ops * device.op_overhead_s
        state = costs.state_bytes_per_param(dtype, c.zero, c.dp, mode)
        held = params * state + work + extra_memory + expert_state
        # the gathered unit (a block) and the next one prefetched, with their unsharded gradients
        if c.zero == 3:
            held = held + 2 * largest * sum(costs.unsharded_bytes_per_param(dtype, mode))
        floor = costs.after_backward_bytes(params, largest, dtype, c.zero, c.dp, mode)
        if c.pp > 1:  # Note [syncing a weight several stages hold] in costs.py
            floor = np.maximum(floor, params * state + shared * costs.TIED_SYNC_BYTES_PER_PARAM)
        return t, tail, (held, params, act, floor)

    def _stage_memory(self, c: Config, held: tuple, stage: int) -> np.ndarray:
        """The memory of candidate stages at place ``stage`` of the pipeline: what ``_stage_time``
        found held, and what depends on the micro-batches in flight there."""
        base, params, act, floor = held
        inflight = inflight_microbatches(
            c.schedule, c.pp, c.num_microbatches, stage, c.virtual_stages
        )
        memory = base + inflight * act
        memory = memory + params * costs.recompute_copies_bytes_per_param(
            self.ctx.dtype, c.recompute, c.zero, inflight
        )
        if c.pp > 1:  # Note [a pipeline stage's boundary tensors]
            boundary = (
                self.ctx.profile.boundary_bytes
                * c.micro_batch
                / (c.tp if c.sequence_parallel else 1)
            )
            sent_back = backward_sends_held(
                c.schedule, c.pp, c.num_microbatches, stage, c.virtual_stages
            )
            memory = memory + (inflight * c.virtual_stages + 1 + sent_back) * boundary
        return np.maximum(memory, floor)

    def _all_reduce_tail(
        self, c: Config, links, params, bwd, wire, hook_s, hook_ops, shared, serial: bool
    ) -> tuple[np.ndarray, np.ndarray | float]:
        """ZeRO 0's gradient all-reduce: the tail it adds, and the memory its compression holds
        (arrays of stages).

        DDP reduces gradients in buckets while the last micro-batch's backward runs; the last bucket
        waits for the end of the backward. With a pipeline the same bucketed all-reduce runs after
        the schedule, priced alike. A compressing hook's kernels are never hidden (Note [gradient
        compression] in costs.py). A weight several stages hold (a tied embedding and head) is
        all-reduced apart, in fp32, when the rest is compressed (Note [a weight several stages hold]
        in data_parallel.py); ``none`` reduces it with the rest.
        """
        mode, link = c.grad_compression, links["dp"]
        exact = shared if mode != "none" else 0.0 * shared
        compressed = params - exact
        grad_bytes = compressed * costs.GRAD_BYTES_PER_PARAM
        wire_bytes = costs.grad_wire_bytes(mode, compressed, wire, serial)
        reduce, last = costs.dp_allreduce_s(mode, grad_bytes, wire_bytes, c.dp, link)
        reduce = reduce + costs.ring_allreduce_s(exact * costs.GRAD_BYTES_PER_PARAM, c.dp, link)
        hook = costs.compression_compute_s(
            mode, compressed, hook_s, hook_ops, self.ctx.cluster.device, serial
        )
        tail = np.maximum(costs.overlapped_s(reduce - last, bwd, serial), 0) + last + hook
        return tail, costs.powersgd_buffer_bytes(grad_bytes, wire) if mode == "powersgd" else 0.0

    def _partition(self, c: Config, links, tables: _Tables) -> list[tuple[int, int]] | None:
        """Min-max dynamic program over contiguous stages under each stage's memory limit."""
        n, p = tables.n, c.pp
        if p > n:
            return None
        limit = self.ctx.cluster.device.usable_memory_bytes
        quantities = tables.ranges()
        weight = c.num_microbatches - 1 / c.virtual_stages
        # the same at every place in the pipeline
        step, tail, held = self._stage_time(c, links, *quantities)
        cost = weight * step + tail

        def stage_cost(stage: int) -> np.ndarray:
            return np.where(
                (self._stage_memory(c, held, stage) <= limit) & tables.valid, cost, np.inf
            )

        return _minmax_partition(stage_cost, n, p)

    def _finish(
        self, c: Config, links, tables: _Tables, chunks, devices, limit: float | None = None
    ) -> Evaluation:
        """Evaluate a fixed assignment of segment ranges to devices (``limit``: the memory a device
        may use; the device's when None)."""
        limit = self.ctx.cluster.device.usable_memory_bytes if limit is None else limit
        step_times, tails, memories, params_list = [], [], [], []
        for stage, ranges in enumerate(devices):
            parts = [tables.range(*r) for r in ranges]
            totals = [np.float64(sum(part[k] for part in parts)) for k in range(_Tables.ADDITIVE)]
            peaks = [
                np.float64(max(part[k] for part in parts))
                for k in range(_Tables.ADDITIVE, len(parts[0]))
            ]
            step, tail, memory = (
                float(x) for x in self._stage_terms(c, links, *totals, *peaks, stage=stage)
            )
            params = float(totals[2])
            step_times.append(step)
            tails.append(tail)
            memories.append(memory)
            params_list.append(params)
        v = c.virtual_stages
        weight = c.num_microbatches - 1 / v
        pipeline = max(weight * s + x for s, x in zip(step_times, tails)) + sum(step_times) / v
        fits = max(memories) <= limit
        dp_tail = max(tails)
        tp_comm = sum(seg.tp_comm_s for seg in tables.segments) * c.num_microbatches / c.pp
        ep_comm = sum(seg.ep_comm_s for seg in tables.segments) * c.num_microbatches / c.pp
        cp_comm = sum(seg.cp_comm_s for seg in tables.segments) * c.num_microbatches / c.pp
        evaluation = Evaluation(
            config=c,
            feasible=fits,
            step_time_s=pipeline if fits else math.inf,
            stages=list(chunks),
            stage_time_s=step_times,
            stage_memory_bytes=memories,
            stage_params=params_list,
            comm_s={
                "tp": tp_comm,
                "dp": dp_tail,
                "pp": self._p2p_s(c, links) * (c.num_microbatches + c.pp - 1),
                **({"ep": ep_comm} if c.ep > 1 else {}),
                **({"cp": cp_comm} if c.cp > 1 else {}),
            },
            bubble_fraction=costs.bubble_fraction(c.pp, c.num_microbatches, v),
        )
        if not fits:
            evaluation.reason = _oom_reason(memories, limit)
        return evaluation

    def _infeasible(self, c: Config, links, tables: _Tables) -> Evaluation:
        """No boundaries fit: report the memory of the partition that needs the least."""
        state = costs.state_bytes_per_param(self.ctx.dtype, c.zero, c.dp, c.grad_compression)
        chunks = _memory_frugal_partition(tables, c.pp, state)
        evaluation = self._finish(c, links, tables, chunks, [[r] for r in chunks])
        evaluation.feasible, evaluation.step_time_s = False, math.inf
        evaluation.reason = _oom_reason(
            evaluation.stage_memory_bytes, self.ctx.cluster.device.usable_memory_bytes
        )
        return evaluation

    def uncompressed(self, evaluation: Evaluation) -> Evaluation:
        """``evaluation``'s configuration and stages with grad_compression none: what compression
        saved.

        Timed whatever its memory (it may need more than the device has: 16-bit ZeRO gathers save
        some), so its ``step_time_s`` is the step the same plan would take uncompressed.
        """
        c = replace(evaluation.config, grad_compression="none").costed()
        links = self._links(c)
        return _as_planned(
            self._finish(
                c,
                links,
                self._tables(c, links),
                evaluation.stages,
                _devices(c, evaluation.stages),
                limit=math.inf,
            )
        )


# Note [a pipeline stage's boundary tensors]
#     A pipeline stage keeps the output it sent for each micro-batch in flight (the root its
#     backward starts from when the gradient arrives) and receives that gradient into a tensor of
#     the same size; neither is saved by an op of the stage, so the activations do not count them.
#     The planner adds (in flight x v + 1) x the largest cut's tensors per micro-batch
#     (profile.boundary_bytes, in the dtypes the runtime holds: the residual stream is fp32 under
#     autocast) on every pipeline stage; 1/t of them with sequence parallelism. Measured: gpt-tiny
#     pp 2 on this project's CPU (benchmarks/prediction.py's memory table) was 7% over the
#     prediction on stage 0 without it. And the gradients a stage sends back stay referenced by
#     their isend's work until it is waited for: at most inflight.backward_sends_held of them (Note
#     [gradients sent back] in pipeline/executor.py; they were all held until the schedule's end, m
#     per virtual stage past a device's first: 100 GiB per GPU for a 1T GPT at pp 64 with 512
#     micro-batches). Measured: gpt-mini pp 2, 1F1B with 16 micro-batches of 1, stage 1 at 1.04 x
#     the prediction without them (benchmarks/prediction.py).


def _as_planned(evaluation: Evaluation) -> Evaluation:
    """``evaluation`` of a costed configuration, stating it as the plan does (Config.planned)."""
    evaluation.config = evaluation.config.planned()
    return evaluation


def _devices(c: Config, chunks: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Each pipeline device's segment ranges: virtual stage d + k p for k < v on device d
    (interleaved), else one."""
    return [[chunks[d + k * c.pp] for k in range(c.virtual_stages)] for d in range(c.pp)]


def lone_microbatch(c: Config) -> bool:
    """A pipeline fed a single micro-batch (Note [one micro-batch through a pipeline])."""
    return c.pp > 1 and c.num_microbatches == 1


def _more_frugal(a: Evaluation | None, b: Evaluation | None) -> Evaluation | None:
    """Of two infeasible evaluations, the one out of memory by less (a refused one only when neither
    is short of
    memory: the message then says why the runtime refuses it)."""
    if a is None or b is None:
        return a or b
    return min((a, b), key=lambda e: (e.refused, e.peak_memory_bytes))


def _oom_reason(memories: list[float], limit: float) -> str:
    worst = max(range(len(memories)), key=memories.__getitem__)
    return f"out of memory by {(memories[worst] - limit) / 2**30:.1f} GiB on stage {worst}"


class _Tables:
    """Prefix sums over segments, so any contiguous range's totals are two lookups."""

    # Quantities summed over a range (t, backward, params, activations, the elements its gradients'
    # data-parallel reduction sends (PowerSGD's, or the params but the experts'), PowerSGD's kernel
    # seconds and ops, the shared weights' params, parameter tensors, the expert weights' extra
    # state bytes, under ep the expert params (those of stacked experts with tp folded in apart)
    # and those); then two taken as the range's largest (working bytes, a segment's params).
    ADDITIVE = 12

    def __init__(
        self,
        segments: tuple[SegmentCost, ...],
        tied: list[tuple[int, tuple[int, ...], float]] = (),
        gradients: tuple[GradientWork, ...] | None = None,
        tied_gradients: list[tuple[int, tuple[int, ...], GradientWork]] = (),
        expert_state: Sequence[float] | None = None,
        loss_s: Sequence[float] | None = None,
    ):
        """``gradients``: PowerSGD's work on each segment's gradients (None: not compressed by
        PowerSGD; then the elements a range sends are its params but the experts');
        ``tied_gradients``: the same for ``tied``'s weights, in its order; ``expert_state``: each
        segment's expert weights' extra state bytes (Planner._expert_state; None: none);
        ``loss_s``: each segment's seconds per micro-batch beside its ops'
        (Planner._router_loss_s; None: none)."""
        self.segments = segments
        self.n = len(segments)
        # A weight read by several segments (tied embedding and head) is held by every stage that
        # reads it: (owner segment, reader segments, parameters per rank) -> extra parameters of a
        # range without its owner. Held by several stages, it is shared, and reduced apart,
        # uncompressed (Note [a weight several stages hold] in data_parallel.py): a range's shared
        # params, and PowerSGD's work on its owner taken out.
        self.tied = tied
        self.powersgd = gradients is not None
        self.tied_gradients = [g for _, _, g in tied_gradients] or [GradientWork()] * len(tied)

        def prefix(values):
            return np.concatenate(([0.0], np.cumsum(values)))

        loss_s = loss_s if loss_s is not None else [0.0] * self.n
        self.t = prefix(
            [
                s.forward_s + s.backward_s + s.tp_comm_s + s.ep_comm_s + s.cp_comm_s + extra
                for s, extra in zip(segments, loss_s)
            ]
        )
        self.bwd = prefix([s.backward_s for s in segments])
        self.params = prefix([s.params for s in segments])
        self.act = prefix([s.activation_bytes for s in segments])
        gradients = gradients or [GradientWork()] * self.n
        self.wire = prefix([g.elements for g in gradients])
        self.hook_s = prefix([g.work_s for g in gradients])
        self.hook_ops = prefix([g.ops for g in gradients])
        self.tensors = prefix([s.tensors for s in segments])
        self.expert_state = prefix(expert_state if expert_state is not None else [0.0] * self.n)
        self.experts = prefix([s.expert_params - s.folded_expert_params for s in segments])
        self.folded = prefix([s.folded_expert_params for s in segments])
        self.work = np.array([s.working_bytes for s in segments])
        self.largest = np.array([s.params for s in segments])
        index = np.arange(self.n + 1)
        self.valid = index[:, None] < index[None, :]

    def range(self, start: int, end: int) -> tuple[float, ...]:
        """(t, backward, params, activations, elements reduced over dp, PowerSGD's seconds and ops,
        shared params, parameter tensors, expert state, the unfolded and the folded experts'
        params, working, largest segment's params) of segments [start, end)."""
        peak = lambda values: float(values[start:end].max()) if end > start else 0.0  # noqa: E731
        params, shared, taken = self.params[end] - self.params[start], 0.0, GradientWork()
        for (owner, readers, size), g in zip(self.tied, self.tied_gradients):
            owned, read = start <= owner < end, [start <= r < end for r in readers]
            if any(read) and not owned:  # a copy
                params, shared = params + size, shared + size
            elif owned and not all(read):  # the owner's, with a copy elsewhere
                shared, taken = shared + size, taken + g
        experts = self.experts[end] - self.experts[start]
        folded = self.folded[end] - self.folded[start]
        return (
            self.t[end] - self.t[start],
            self.bwd[end] - self.bwd[start],
            params,
            self.act[end] - self.act[start],
            (
                self.wire[end] - self.wire[start] - taken.elements
                if self.powersgd
                else params - experts - folded
            ),
            self.hook_s[end] - self.hook_s[start] - taken.work_s,
            self.hook_ops[end] - self.hook_ops[start] - taken.ops,
            shared,
            self.tensors[end] - self.tensors[start],
            self.expert_state[end] - self.expert_state[start],
            experts,
            folded,
            peak(self.work),
            peak(self.largest),
        )

    def ranges(self) -> tuple[np.ndarray, ...]:
        """The same fourteen quantities for every [start, end) as (n+1) x (n+1) arrays."""

        def diff(prefix):
            return prefix[None, :] - prefix[:, None]

        def running_max(values):
            table = np.zeros((self.n + 1, self.n + 1))
            for start in range(self.n):
                table[start, start + 1 :] = np.maximum.accumulate(values[start:])
            return table

        index = np.arange(self.n + 1)

        # how many of ``members`` each range holds
        def count(members: tuple[int, ...]) -> np.ndarray:
            before = np.zeros(self.n + 1)
            # members before each position
            before[1:] = np.cumsum(np.isin(np.arange(self.n), members))
            return before[None, :] - before[:, None]

        params, shared = diff(self.params), np.zeros((self.n + 1, self.n + 1))
        wire, hook_s, hook_ops = diff(self.wire), diff(self.hook_s), diff(self.hook_ops)
        for (owner, readers, size), g in zip(self.tied, self.tied_gradients):
            read = count(readers)
            owned = (index[:, None] <= owner) & (owner < index[None, :])
            copy = (read > 0) & ~owned
            elsewhere = owned & (read < len(readers))
            params, shared = params + size * copy, shared + size * (copy | elsewhere)
            wire, hook_s, hook_ops = (
                wire - g.elements * elsewhere,
                hook_s - g.work_s * elsewhere,
                hook_ops - g.ops * elsewhere,
            )
        return (
            diff(self.t),
            diff(self.bwd),
            params,
            diff(self.act),
            wire if self.powersgd else params - diff(self.experts) - diff(self.folded),
            hook_s,
            hook_ops,
            shared,
            diff(self.tensors),
            diff(self.expert_state),
            diff(self.experts),
            diff(self.folded),
            running_max(self.work),
            running_max(self.largest),
        )


def _interleaved_chunks(n: int, profile: ModelProfile, chunks: int) -> list[tuple[int, int]]:
    """Megatron-LM's interleaved layout: equal blocks per virtual stage; what precedes and follows
    the blocks goes with the first and the last virtual stage."""
    block_segments = [i for i, s in enumerate(profile.segments) if s.is_block]
    first, last = block_segments[0], block_segments[-1]
    per_chunk = len(block_segments) // chunks
    bounds = [first + k * per_chunk for k in range(chunks)] + [last + 1]
    bounds[0], bounds[-1] = 0, n
    return list(zip(bounds[:-1], bounds[1:]))


def _memory_frugal_partition(tables: _Tables, p: int, state_bytes: float) -> list[tuple[int, int]]:
    """Contiguous stages minimising the largest stage's parameters + activations (for error
    messages)."""
    n = tables.n
    if p >= n:
        return [(i, i + 1) for i in range(n)] if p == n else [(0, n)]
    quantities = tables.ranges()
    params, act = quantities[2], quantities[3]
    size = np.where(tables.valid, params * state_bytes + act, np.inf)
    return _minmax_partition(lambda stage: size, n, p)


def _minmax_partition(stage_cost, n: int, p: int) -> list[tuple[int, int]] | None:
    """Split segments [0, n) into p contiguous stages minimising the largest stage cost.

    ``stage_cost(k)`` gives stage k's cost of covering [start, end) as an (n+1) x (n+1) array (inf
    where not allowed). best_k(i) = min_j max(best_{k-1}(j), cost_k(j, i)): exact, O(p n^2),
    vectorised.
    """
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((p, n + 1), dtype=np.int64)
    for stage in range(p):
        candidates = np.maximum(best[:, None], stage_cost(stage))  # [start, end]
        choice[stage] = np.argmin(candidates, axis=0)
        best = candidates[choice[stage], np.arange(n + 1)]
    if not np.isfinite(best[n]):
        return None
    bounds, end = [], n
    for stage in reversed(range(p)):
        start = int(choice[stage][end])
        bounds.append((start, end))
        end = start
    return bounds[::-1]
