"""Online calibration: fit the cluster's figures to a run's measured steps, write them, and re-plan.

``pmodel.metrics.calibrate_online(...)`` does it inside a training run (rank 0, once, after the
warm-up), and
``hyparallel calibrate --from-run metrics.json`` does the same from the file a run wrote
(``examples/train_gpt.py --metrics-out``, :func:`run_record`). Neither ever changes the running
plan: the result is a corrected cluster file, and one line saying whether another plan would now be
faster, with the
``hyparallel plan`` command that makes it.

Note [what the fit changes]
    The planner's step time is a function of the cluster file's figures. The fit solves for one
    common compute factor f: the device's matmul, attention and memory efficiencies times f and its
    op_overhead_s divided by f, so every kernel the cost model times (roofline terms and dispatch
    floors alike, and so the shape-dependent curves, which are relative to those efficiencies) runs
    f times faster, the links as they were. f is the root of predicted_step(plan's configuration,
    cluster(f)) = measured step, found on the planner's own prediction (the same configuration, its
    stage boundaries chosen as the planner chooses them): so the corrected file reproduces the
    measured step for this plan by construction, whatever the cost model's formulas are. The
    prediction only falls as f grows (every compute term scales by 1/f), so the root is unique and a
    bracketing search finds it. An efficiency that f would lift above 1 stays at 1 and the excess
    goes into the peak it multiplies (peak_flops for matmul and attention, memory bandwidth), so the
    rates the planner uses are still exactly f times the old ones. Only when the measured step is
    shorter than the plan's communication alone (f -> infinity cannot reach it) are the links'
    bandwidths scaled by f too and their latencies divided by it (``links_scaled``). Why one factor:
    a step is timed as a whole (Note [what a measured step is] in hyparallel.runtime.metrics), and
    what a training loop spends outside the cost model (the optimizer's Python, clipping, data
    loading) is in it; one measured figure identifies one unknown. Splitting compute from
    communication needs phases timed apart, which this does not do; a wrongly slow link would
    otherwise absorb the loop's own time.

Note [memory in the fit]
    Rank 0's measured peak (CUDA: max_memory_allocated; the CPU: a stand-in,
    hyparallel.runtime.metrics. measured_peak_bytes) is compared with its stage's prediction without
    the reserve. When it is higher, the difference is added to device.reserved_bytes: a constant per
    device, so the corrected file predicts at least the measured peak for this plan, and carries the
    same margin into every other plan. It is never lowered: an over-prediction costs a plan that
    would have fitted, an under-prediction an out-of-memory crash.
"""

from __future__ import annotations

import functools
import json
import math
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hyparallel.spec import limits
from hyparallel.spec.cluster import ClusterSpec, NonNegativeFloat
from hyparallel.spec.errors import ConfigError, HyparallelError
from hyparallel.spec.files import kind_of, read_text
from hyparallel.spec.schema import Plan
from hyparallel.spec.yaml_io import validate

# Steps left out before measuring: the first step's allocator growth, gloo/NCCL connection set-up
# and (CUDA) Triton autotuning; measured on this project's CPU runs of gpt-tiny, steps 2 and 3 are
# still 10-30% slower than the ones after them (oneDNN primitive caches).
DEFAULT_WARMUP_STEPS = 3
# Steps measured after the warm-up; their median is the measured step (one slow step does not move
# it).
DEFAULT_MEASURED_STEPS = 3
# |measured / predicted - 1| above which the cluster is corrected: the tolerance is 5%
# against published runs; a run's own noise (another job on the node, a slow data loader) easily
# reaches 5%, so 10%.
DEFAULT_THRESHOLD = 0.10
# Another plan is suggested when it is predicted faster than the running one by more than this,
# under the corrected figures: below it a restart costs more than it gains within the model's own
# error.
DEFAULT_SWITCH_GAIN = 0.05
# The factor's bracket: rates 1000x off are not a mis-calibration but a different machine.
_FACTOR_RANGE = (1e-3, 1e3)
_FIT_TOLERANCE = 1e-4  # relative, on the reproduced step time


class RunRecord(BaseModel):
    """What a run writes for ``hyparallel calibrate --from-run`` (``examples/train_gpt.py
    --metrics-out``).

    The figures of :class:`hyparallel.runtime.metrics.StepFigures` at the top level (``step_time_s``
    the median after the warm-up), with the plan the run ran (its cluster and predictions inside)
    and the model spec.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    step_time_s: float = Field(
        gt=0, allow_inf_nan=False, description="Median measured step after the warm-up."
    )
    steps: int = Field(ge=1, description="Steps the median is over.")
    peak_memory_gib: NonNegativeFloat | None = Field(
        None, description="Rank 0's measured peak (without reserve)."
    )
    plan: Plan = Field(
        description="The plan the run ran, as the run held it (completed: cluster and predictions)."
    )
    model: str | None = Field(
        None, description="The model spec, as `hyparallel plan --model` takes it."
    )
    step_times_s: list[float] = Field(
        [], description="Every step's seconds, in order, warm-up included."
    )
    expert_imbalance: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "The experts' load imbalance the run measured (ParallelModel.expert_imbalance; ep > 1"
            " only): the fit and the re-plan cost the experts with it."
        ),
    )


@dataclass(frozen=True)
class Calibration:
    """The outcome of one fit: the corrected cluster, how it was corrected, and the re-plan under
    it."""

    plan: Plan
    measured_step_s: float
    predicted_step_s: float  # the plan's own prediction (plan.predicted)
    compute_factor: float
    links_scaled: bool
    reserved_added_bytes: int
    cluster: ClusterSpec
    # the plan's configuration re-evaluated under ``cluster``: the measured step
    refit_step_s: float
    measured_memory_gib: float | None
    predicted_memory_gib: float | None
    path: Path | None = None
    # the planner's best plan under ``cluster`` (None: no model to re-plan)
    replanned: Plan | None = None
    current_step_s: float | None = None  # the running configuration in the same re-plan search
    command: str | None = None
    why_no_replan: str | None = None

    @property
    def gain(self) -> float | None:
        """How much faster the re-planned plan is predicted than the running one (0.2: 20% less
        time)."""
        if self.replanned is None or self.replanned.predicted is None or not self.current_step_s:
            return None
        return 1 - self.replanned.predicted.step_time_s / self.current_step_s

    def switch(self, switch_gain: float = DEFAULT_SWITCH_GAIN) -> bool:
        """Whether another plan is predicted faster than the running one by more than
        ``switch_gain``."""
        gain = self.gain
        return (
            gain is not None and gain > switch_gain and not same_layout(self.replanned, self.plan)
        )

    def to_dict(self) -> dict[str, Any]:
        """The fit and the re-plan as plain data (what a run's metrics file records of them)."""
        return {
            "cluster_file": str(self.path) if self.path else None,
            "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s,
            "refit_step_s": self.refit_step_s,
            "compute_factor": self.compute_factor,
            "links_scaled": self.links_scaled,
            "reserved_added_bytes": self.reserved_added_bytes,
            "replanned": self.replanned.to_dict() if self.replanned else None,
            "current_step_s": self.current_step_s,
            "gain": self.gain,
            "command": self.command,
        }

    def line(self, switch_gain: float = DEFAULT_SWITCH_GAIN) -> str:
        """One log line: measured vs predicted, the fit, the file, and the re-plan's verdict with
        its command."""
        ratio = self.measured_step_s / self.predicted_step_s
        memory = ""
        if self.measured_memory_gib is not None and self.predicted_memory_gib is not None:
            memory = (
                f", peak {self.measured_memory_gib:.3g} GiB vs {self.predicted_memory_gib:.3g}"
                " predicted"
            )
        fit = f"compute x{self.compute_factor:.3g}" + (" (links too)" if self.links_scaled else "")
        if self.reserved_added_bytes:
            fit += f", reserve +{self.reserved_added_bytes / 2**20:,.0f} MiB"
        where = f"wrote {self.path}" if self.path else "corrected cluster not written"
        head = (
            f"online calibration: step {self.measured_step_s * 1e3:,.4g} ms measured vs "
            f"{self.predicted_step_s * 1e3:,.4g} predicted (x{ratio:.2f}){memory}; {fit}; {where}"
        )
        if self.replanned is None:
            return f"{head}; no re-plan: {self.why_no_replan}"
        best = f"the planner's pick ({describe(self.replanned)})"
        if self.current_step_s == math.inf:
            return (
                f"{head}; the running plan no longer fits in memory under them; {best}:"
                f" {self.command}"
            )
        if same_layout(self.replanned, self.plan):
            return f"{head}; the running plan stays the planner's pick under them ({self.command})"
        if not self.switch(switch_gain):
            return (
                f"{head}; {best} is {self.gain:.1%} faster under them, within {switch_gain:.0%}: "
                f"not worth a restart ({self.command})"
            )
        return (
            f"{head}; another plan would be {self.gain:.0%} faster, {best}: {self.command}, then"
            " restart with it"
        )


def describe(plan: Plan) -> str:
    """A plan's layout in a few words: ``dp 2 tp 1 pp 1, micro-batch 4 x 2, 1f1b, recompute none,
    ZeRO 0``."""
    par, tr = plan.parallel, plan.training
    return (
        f"dp {par.dp} tp {par.tp} pp {par.pp}"
        + (f" ep {par.ep}" if par.ep > 1 else "")
        + f", micro-batch {tr.micro_batch} x"
        f" {plan.num_microbatches}, {par.schedule}, recompute {par.recompute}, ZeRO {par.zero}"
    )


def same_layout(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same configuration (parallel section, micro-batch and
    placement)."""
    return (a.parallel, a.training.micro_batch, a.placement) == (
        b.parallel,
        b.training.micro_batch,
        b.placement,
    )


# ---- the fit -------------------------------------------------------------------------------------


def scaled(cluster: ClusterSpec, factor: float, links: bool = False) -> ClusterSpec:
    """``cluster`` with every compute rate ``factor`` times faster (Note [what the fit changes])."""
    device = cluster.device
    data = cluster.model_dump()
    flops_up = max(1.0, device.matmul_efficiency * factor, device.attention_efficiency * factor)
    data["device"].update(
        peak_flops={
            k: _six_digits(v * flops_up) for k, v in device.peak_flops.model_dump().items()
        },
        matmul_efficiency=_clamped_efficiency(device.matmul_efficiency * factor / flops_up),
        attention_efficiency=_clamped_efficiency(device.attention_efficiency * factor / flops_up),
        memory_bandwidth_bytes_per_s=_six_digits(
            device.memory_bandwidth_bytes_per_s * max(1.0, device.memory_efficiency * factor)
        ),
        memory_efficiency=_clamped_efficiency(min(1.0, device.memory_efficiency * factor)),
        op_overhead_s=_six_digits(min(device.op_overhead_s / factor, limits.MAX_LATENCY_S)),
        activation_costs={
            name: {
                "forward_s": _six_digits(cost.forward_s / factor),
                "backward_s": _six_digits(cost.backward_s / factor),
            }
            for name, cost in device.activation_costs.items()
        },
    )
    if links:
        for name in ("intra_node", "inter_node"):
            link = data[name]
            bandwidth = min(link["bandwidth_bytes_per_s"] * factor, limits.MAX_BYTES_PER_S)
            link["bandwidth_bytes_per_s"] = _six_digits(bandwidth)
            link["latency_s"] = _six_digits(link["latency_s"] / factor)
            if link.get("collective_latency_s") is not None:
                link["collective_latency_s"] = _six_digits(link["collective_latency_s"] / factor)
    return validate(ClusterSpec, data, f"cluster '{cluster.name}' scaled by {factor:.3g}")


def _clamped_efficiency(value: float) -> float:
    return min(1.0, max(limits.MIN_EFFICIENCY, _six_digits(value)))


def _six_digits(value: float) -> float:
    """6 significant digits: a readable file, and far below the fit's tolerance."""
    return float(f"{value:.6g}")


class Planner:
    """The planner's view of one model for the fit and the re-plan: traced once, as ``hyparallel
    plan`` traces it."""

    def __init__(self, spec: str, plan: Plan):
        from hyparallel import models
        from hyparallel.graph import trace
        from hyparallel.graph.local_shapes import replicate_what_fails
        from hyparallel.planner.api import _tp_degrees

        loaded = models.load(spec)
        self.name, self.plan, self.module = loaded.name, plan, loaded.module
        expected = plan.model.fingerprint if plan.model is not None else ""
        if expected and models.fingerprint(loaded.module) != expected:
            raise ConfigError(
                f"model '{spec}' is not the model the plan was made for (its parameter names or"
                " shapes differ from the plan's fingerprint); pass the spec of the model the run"
                " trained"
            )
        tr = plan.training
        inputs = models.example_inputs(loaded.module, 1, tr.seq_len)
        # Note [example inputs] in planner/api.py
        self.graph = trace(loaded.module, inputs, name=loaded.name)
        # What `hyparallel plan`'s search does with the module before costing anything, done here
        # once.
        replicate_what_fails(loaded.module, self.graph, _tp_degrees(plan.cluster, {}), inputs)

    def evaluate(self, cluster: ClusterSpec) -> float | None:
        """The plan's configuration's step time under ``cluster`` (None: it does not fit there)."""
        from hyparallel.graph.context import attention_interface, takes_positions
        from hyparallel.planner.api import _router_loss_gathered
        from hyparallel.planner.constraints import Constraints
        from hyparallel.planner.profile import ModelProfile
        from hyparallel.planner.search import Search

        tr = self.plan.training
        profile = ModelProfile(
            self.graph,
            cluster,
            tr.dtype,
            tr.seq_len,
            vocab_parallel_loss=self.plan.parallel.vocab_parallel_loss,
            router_loss_gathered=_router_loss_gathered(self.module),
            takes_positions=takes_positions(self.module),
            attention_interface=attention_interface(self.module),
            **{k: v for k, v in asked(self.plan).items() if k == "expert_imbalance"},
        )
        best, _ = Search(profile, cluster, tr.global_batch, tr.dtype).best(
            Constraints(**fixed(self.plan)).given()
        )
        return best[0].step_time_s if best else None

    def replan(self, cluster: ClusterSpec) -> Plan:
        """The planner's best plan under ``cluster``: ``hyparallel plan`` with the plan's batch,
        length and dtype."""
        from hyparallel.planner.api import search

        tr = self.plan.training
        return search(
            self.graph,
            cluster,
            tr.global_batch,
            tr.seq_len,
            tr.dtype,
            module=self.module,
            **asked(self.plan),
        ).plan()


def fixed(plan: Plan) -> dict[str, Any]:
    """Every decision of ``plan`` as the planner's constraints: the search then costs that one
    configuration."""
    from hyparallel.planner.complete import compression_constraints

    par = plan.parallel
    return {
        "tp": par.tp,
        "pp": par.pp,
        "dp": par.dp,
        "ep": par.ep,
        "micro_batch": plan.training.micro_batch,
        "schedule": par.schedule,
        "virtual_stages": par.virtual_stages,
        "recompute": par.recompute,
        "zero": par.zero,
        "sequence_parallel": par.sequence_parallel,
        "vocab_parallel_loss": par.vocab_parallel_loss,
        "order": plan.placement.order,
        **compression_constraints(plan),
    }


def asked(plan: Plan) -> dict[str, Any]:
    """What the re-plan keeps of the plan beyond batch, length and dtype: its gradient compression,
    if any (the planner compresses only when asked, Note [gradient compression is asked for]; a plan
    that compresses was), and the experts' load imbalance its prediction assumed (ep > 1: the
    fit and the re-plan cost the experts as the plan was costed)."""
    from hyparallel.planner.complete import compression_constraints

    kept = compression_constraints(plan) if plan.parallel.grad_compression != "none" else {}
    if plan.predicted is not None and plan.predicted.expert_imbalance is not None:
        kept["expert_imbalance"] = plan.predicted.expert_imbalance
    # its logits gathered: a loss_fn of its own
    if plan.parallel.tp > 1 and not plan.parallel.vocab_parallel_loss:
        kept["vocab_parallel_loss"] = False
    return kept


def fit_factor(
    evaluate: Callable[[ClusterSpec], float | None], cluster: ClusterSpec, measured_s: float
):
    """(f, links_scaled): the common compute factor under which ``evaluate`` gives ``measured_s``.

    Note [what the fit changes]: a bracketing search (Illinois false position on 1/f, where the step
    is close to affine) on the planner's own prediction.
    """

    def error(factor: float, links: bool) -> float:
        step = evaluate(scaled(cluster, factor, links))
        if step is None:
            raise ConfigError(
                "the plan's configuration does not fit in memory under the cluster scaled by"
                f" {factor:.3g}; the fit needs its prediction"
            )
        return step / measured_s - 1

    low, high = _FACTOR_RANGE
    for links in (False, True):
        # slow (too long: > 0) and fast (< 0) ends
        e_low, e_high = error(low, links), error(high, links)
        if e_low >= 0 >= e_high:
            return _root(functools.partial(error, links=links), low, high, e_low, e_high), links
    raise ConfigError(
        f"no common factor in {low:g}..{high:g} on the cluster's figures reproduces the measured"
        f" step of {measured_s * 1e3:,.4g} ms; the run and its plan's cluster describe different"
        " machines"
    )


def _root(
    error: Callable[[float], float], low: float, high: float, e_low: float, e_high: float
) -> float:
    """The root of ``error`` (decreasing in f) between ``low`` and ``high``, by Illinois false
    position on 1/f."""
    u_low, u_high = 1 / low, 1 / high  # error rises with u = 1/f
    side = 0
    for _ in range(100):
        u = u_high - e_high * (u_low - u_high) / (e_low - e_high)
        e = error(1 / u)
        if abs(e) <= _FIT_TOLERANCE:
            return 1 / u
        if e > 0:
            u_low, e_low = u, e
            e_high = e_high / 2 if side == 1 else e_high  # Illinois: halve the stale end's error
            side = 1
        else:
            u_high, e_high = u, e
            e_low = e_low / 2 if side == -1 else e_low
            side = -1
    return 1 / u


def calibrate(
    plan: Plan,
    measured_step_s: float,
    *,
    model: str | None = None,
    measured_memory_bytes: float | None = None,
    out: str | Path | None = None,
    planner: Planner | None = None,
    base: ClusterSpec | None = None,
    expert_imbalance: float | None = None,
) -> Calibration:
    """Fit ``plan``'s cluster to a measured step (and rank 0's peak), write it to ``out``, and
    re-plan.

    ``model`` is the spec ``hyparallel plan --model`` takes (default: the plan's model name, which
    is the spec when `hyparallel plan` made the plan). ``base``: the cluster to correct, of the
    plan's size (default the plan's own). ``expert_imbalance``: the experts' load imbalance the run
    measured (ep > 1), which the fit, the re-plan and its command cost the experts with instead of
    the one the plan was priced with, so that the compute rates absorb only the rest. Note [what
    the fit changes], Note [memory in the fit].
    """
    if plan.cluster is None or plan.predicted is None:
        missing = "cluster" if plan.cluster is None else "predictions"
        raise ConfigError(
            f"the plan has no {missing}: there is nothing the measured step can correct"
        )
    if not measured_step_s > 0 or not math.isfinite(measured_step_s):
        raise ConfigError(
            f"measured step time {measured_step_s!r} is not a positive number of seconds"
        )
    spec = model or (plan.model.name if plan.model else None)
    if not spec:
        raise ConfigError(
            "the plan names no model; pass the model spec (as `hyparallel plan --model` takes it)"
        )
    ran = plan
    if expert_imbalance is not None and plan.parallel.ep > 1:
        # costed as measured (asked() reads it from the prediction)
        predicted = plan.predicted.model_copy(update={"expert_imbalance": expert_imbalance})
        plan = plan.model_copy(update={"predicted": predicted})
    if planner is not None and plan is not ran:
        planner.plan = plan
    planner = planner or Planner(spec, plan)
    cluster = base or plan.cluster
    factor, links = fit_factor(planner.evaluate, cluster, measured_step_s)
    corrected = scaled(cluster, factor, links)
    refit = planner.evaluate(corrected)
    device = cluster.device
    # rank 0's stage, as predicted with the cluster the plan was made for (Note [memory in the fit])
    predicted_memory = plan.predicted.memory_gib[0] * 2**30 - plan.cluster.device.reserved_bytes
    added = 0
    if measured_memory_bytes is not None and measured_memory_bytes > predicted_memory:
        added = int(math.ceil(measured_memory_bytes - predicted_memory))
        added = min(added, device.memory_bytes - 1 - corrected.device.reserved_bytes)
        corrected = corrected.model_copy(
            update={
                "device": corrected.device.model_copy(
                    update={"reserved_bytes": device.reserved_bytes + added}
                )
            }
        )
    corrected = validate(
        ClusterSpec,
        {
            **corrected.model_dump(exclude_none=True),
            "name": (
                cluster.name if cluster.name.endswith("-corrected") else f"{cluster.name}-corrected"
            ),
            "description": _description(cluster, plan, measured_step_s, factor, links, added),
        },
        "the corrected cluster",
    )
    path = None
    if out is not None:
        corrected.save(out)
        path = Path(out)
    result = Calibration(
        plan=ran,
        measured_step_s=measured_step_s,
        predicted_step_s=plan.predicted.step_time_s,
        compute_factor=factor,
        links_scaled=links,
        reserved_added_bytes=added,
        cluster=corrected,
        refit_step_s=refit,
        measured_memory_gib=(
            None if measured_memory_bytes is None else measured_memory_bytes / 2**30
        ),
        predicted_memory_gib=predicted_memory / 2**30,
        path=path,
    )
    return _replanned(result, planner, spec, plan)


def _replanned(result: Calibration, planner: Planner, spec: str, plan: Plan) -> Calibration:
    """``result`` with the planner's best plan under the corrected cluster and the command that
    makes it."""
    from dataclasses import replace

    cluster_arg = str(result.path) if result.path else "CORRECTED.yaml"
    command = plan_command(spec, plan, cluster_arg)
    try:
        best = planner.replan(result.cluster)
    except HyparallelError as error:
        return replace(result, command=command, why_no_replan=str(error))
    # None: the running plan no longer fits (the reserve grew)
    current = planner.evaluate(result.cluster)
    return replace(result, replanned=best, current_step_s=current or math.inf, command=command)


def plan_command(spec: str, plan: Plan, cluster: str) -> str:
    """The ``hyparallel plan`` command that re-plans ``plan``'s model and batch on ``cluster``."""
    tr, size = plan.training, plan.cluster
    words = ["hyparallel", "plan", "--model", *shlex.split(spec), "--gpus", str(plan.world_size)]
    words += ["--gpus-per-node", str(size.gpus_per_node), "--cluster", cluster]
    words += [
        "--global-batch",
        str(tr.global_batch),
        "--seq-len",
        str(tr.seq_len),
        "--dtype",
        tr.dtype,
    ]
    for key, value in asked(plan).items():
        words += [f"--{key.replace('_', '-')}", str(value)]
    return shlex.join([*words, "-o", "plan.yaml"])


def _description(
    cluster: ClusterSpec, plan: Plan, measured_s: float, factor: float, links: bool, added: int
) -> str:
    what = f"compute rates x{factor:.4g}" + (" and links" if links else "")
    if added:
        what += f", reserved_bytes +{added:,}"
    return (
        f"{cluster.name} corrected by online calibration: {what}, fitted to a measured step of"
        f" {measured_s * 1e3:,.5g} ms ({plan.model.name if plan.model else 'a model'},"
        f" {describe(plan)}); was: {cluster.description or cluster.name}"
    )[:2000]


def free_path(path: str | Path) -> Path:
    """``path``, or the first ``stem-2.yaml``, ``stem-3.yaml``... beside it that does not exist
    yet."""
    path = Path(path)
    candidate, number = path, 1
    while kind_of(candidate) != "missing":
        number += 1
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
    return candidate


# ---- runs written to a file ----------------------------------------------------------------------


def run_record(
    figures: Any,
    plan: Plan,
    model: str | None,
    step_times_s: list[float],
    calibration: Calibration | None = None,
    expert_imbalance: float | None = None,
) -> dict[str, Any]:
    """The JSON a run writes for ``hyparallel calibrate --from-run``: ``figures`` (a StepFigures),
    every step's seconds, the model spec and the plan, the experts' load imbalance it measured
    (ep > 1), and the online calibration's outcome when there was one."""
    from dataclasses import asdict

    record = {
        **asdict(figures),
        "step_times_s": step_times_s,
        "model": model,
        "plan": plan.to_dict(),
        **({"expert_imbalance": expert_imbalance} if expert_imbalance else {}),
    }
    return record | ({"calibration": calibration.to_dict()} if calibration else {})


def read_run(path: str | Path) -> RunRecord:
    """Load a run's metrics file; a missing file, bad JSON or a file without what the fit needs is
    one line."""
    if kind_of(path) == "folder":
        raise ConfigError(
            f"{path}: is a folder; give the metrics file a run wrote (`--metrics-out`)"
        )
    text = read_text(path, limits.MAX_YAML_BYTES)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{path}: not JSON ({error.msg} at line {error.lineno}); give the file"
            " `examples/train_gpt.py --metrics-out` writes"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a JSON object of run metrics, got {type(data).__name__}"
        )
    if "plan" not in data:
        raise ConfigError(
            f"{path}: no 'plan' in it, so nothing says what was predicted or for which cluster; it"
            " was written before runs recorded their plan: rerun with `examples/train_gpt.py"
            " --metrics-out`"
        )
    record = validate(RunRecord, data, str(path))
    if record.plan.cluster is None or record.plan.predicted is None:
        missing = "cluster" if record.plan.cluster is None else "predictions"
        raise ConfigError(
            f"{path}: its plan has no {missing}; the fit compares the measured step with them"
        )
    return record


def from_run(
    path: str | Path,
    *,
    out: str | Path | None = None,
    model: str | None = None,
    cluster: str | None = None,
) -> Calibration:
    """``hyparallel calibrate --from-run``: :func:`calibrate` on a run's metrics file.

    ``cluster`` (a preset or file) replaces the plan's own cluster as the one corrected; it must
    describe the same devices and backend as the plan's.
    """
    record = read_run(path)
    plan, base = record.plan, None
    if cluster is not None:
        given = ClusterSpec.resolve(cluster)
        ran = plan.cluster
        if (given.device.name, given.backend) != (ran.device.name, ran.backend):
            raise ConfigError(
                f"cluster '{cluster}' ({given.device.name}, {given.backend}) is not the one the run"
                f" was planned for ('{ran.name}': {ran.device.name}, {ran.backend}); pass that"
                " cluster's file, or leave --cluster out"
            )
        base = given.resized(ran.num_nodes, ran.gpus_per_node)
    memory = None if record.peak_memory_gib is None else record.peak_memory_gib * 2**30
    return calibrate(
        plan,
        run_step_s(record),
        model=model or record.model,
        measured_memory_bytes=memory,
        out=out,
        base=base,
        expert_imbalance=record.expert_imbalance,
    )


def run_step_s(record: RunRecord) -> float:
    """A recorded run's measured step: the median of its steps after DEFAULT_WARMUP_STEPS when it
    recorded each step and has more than that, else its summary's median (after its first step)."""
    times = record.step_times_s
    return (
        statistics.median(times[DEFAULT_WARMUP_STEPS:])
        if len(times) > DEFAULT_WARMUP_STEPS
        else record.step_time_s
    )


def measured_step(step_times_s: list[float], warmup: int, count: int) -> float | None:
    """The median of ``count`` steps after ``warmup`` (None until that many have closed)."""
    if len(step_times_s) < warmup + count:
        return None
    return statistics.median(step_times_s[warmup : warmup + count])
