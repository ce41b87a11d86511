"""The decisions a caller fixes for the planner's search, as a frozen pydantic model.

``Constraints`` is what ``plan`` and ``search`` take as ``constraints=`` (or build from the same
keyword arguments): each field has the plan file's type and bounds (hyparallel.spec.schema,
hyparallel.spec.limits), so the planner never accepts what a plan file would refuse, and a field
left None is searched. A bad value is a one-line PlanError naming it. What needs the cluster or the
batch (the degrees against the GPUs, dp against the global batch) is checked by the planner, after
this.

Note [gradient compression is asked for]
    Compression changes the numerics, so, unlike every other decision, ``grad_compression`` is not
    searched when left out: its default is ``none``. A mode fixes it, as a value fixes any
    constraint (where it applies: with dp > 1, and ``powersgd`` only at ZeRO 0, the one stage whose
    reduction takes a communication hook; a layout with dp = 1 reduces nothing and is planned with
    ``none``); ``any`` searches none, bf16, fp16 and powersgd, preferring the earlier on a tie (bf16
    and fp16 cost the same: fp16 is chosen only when asked for).
    ``powersgd_rank`` and ``powersgd_start_step`` shape PowerSGD (the plan's defaults: 4, 1000) and
    are refused unless PowerSGD may be chosen. ``given()`` leaves out these three at their defaults,
    so what a caller did not ask for is not listed in the planner's messages.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hyparallel.spec import limits
from hyparallel.spec.cluster import int_in
from hyparallel.spec.errors import PlanError
from hyparallel.spec.schema import (
    DEFAULT_ORDER,
    Axis,
    Degree,
    GradCompression,
    ParallelConfig,
    Recompute,
    Schedule,
    Sequences,
    ZeroStage,
)

# What a caller may ask of the data-parallel axis: one mode, or ``any`` of them searched.
CompressionChoice = Literal[GradCompression, "any"]
# Note [gradient compression is asked for]: not searched when left out; their defaults are the
# plan's. So is compile: never searched (the costs do not model it), only written into the plan as
# asked.
_PLAN_DEFAULTS = ("grad_compression", "powersgd_rank", "powersgd_start_step", "compile")


class Constraints(BaseModel):
    """Decisions fixed for the search (None: searched); unknown names and bad values are refused as
    a PlanError."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: Degree | None = Field(None, description="Tensor-parallel degree.")
    pp: Degree | None = Field(None, description="Pipeline-parallel degree.")
    dp: Degree | None = Field(None, description="Data-parallel degree.")
    ep: Degree | None = Field(
        None, description="Expert-parallel degree (MoE experts over ep of the dp ranks)."
    )
    cp: Degree | None = Field(
        None,
        description=(
            "Context-parallel degree (each sequence over cp ranks); searched for a model it can"
            " split (hyparallel.graph.context)."
        ),
    )
    cp_attention: Literal["gather", "ring"] | None = Field(
        None, description="How attention crosses the cp ranks (searched: both)."
    )
    expert_imbalance: float | None = Field(
        None,
        ge=1.0,
        le=limits.MAX_EXPERT_IMBALANCE,
        description=(
            "The busiest expert-parallel rank's routed (token, expert) pairs over the mean, which"
            " each MoE layer waits for (pmodel.expert_imbalance() measures a run's); left out: 1.2"
            " (Note [expert parallelism's costs] in costs.py)."
        ),
    )
    micro_batch: Sequences | None = Field(
        None, description="Sequences per micro-batch on one replica."
    )
    schedule: Schedule | None = Field(None, description="Pipeline schedule.")
    virtual_stages: int_in(1, limits.MAX_VIRTUAL_STAGES) | None = Field(
        None, description="Model chunks per pipeline rank (interleaved-1f1b)."
    )
    recompute: Recompute | None = Field(None, description="Activation recomputation.")
    zero: ZeroStage | None = Field(None, description="ZeRO stage of the data-parallel axis.")
    sequence_parallel: bool | None = Field(
        None, description="Sequence parallelism along the tp ranks."
    )
    vocab_parallel_loss: bool | None = Field(
        None,
        description=(
            "The loss on each tp rank's slice of the logits (parallel.vocab_parallel_loss); left"
            " out: on wherever tp > 1 splits the head. false: the logits gathered, for a loss_fn of"
            " your own."
        ),
    )
    order: tuple[Axis, Axis, Axis] | None = Field(
        None, description="The mesh axes outermost first (placement.order)."
    )
    grad_compression: CompressionChoice = Field(
        ParallelConfig.model_fields["grad_compression"].default,
        description=(
            "How gradients cross the data-parallel axis (parallel.grad_compression), or `any`:"
            " searched; not searched when left out (Note [gradient compression is asked for])."
        ),
    )
    powersgd_rank: int_in(1, limits.MAX_POWERSGD_RANK) = Field(
        ParallelConfig.model_fields["powersgd_rank"].default, description="PowerSGD's factor rank."
    )
    powersgd_start_step: int_in(2, limits.MAX_POWERSGD_START_STEP) = Field(
        ParallelConfig.model_fields["powersgd_start_step"].default,
        description="Steps reduced uncompressed before PowerSGD starts.",
    )
    compile: bool = Field(
        ParallelConfig.model_fields["compile"].default,
        description=(
            "torch.compile each block at run time (parallel.compile); written into the plan as"
            " asked, never searched: the costs do not model compilation."
        ),
    )

    def __init__(self, **values: Any) -> None:
        """Validate ``values``; an unknown name or a bad value is a one-line PlanError."""
        try:
            super().__init__(**values)
        except pydantic.ValidationError as error:
            raise PlanError(constraint_error(error, values)) from None

    @field_validator("order")
    @classmethod
    def _permutation(cls, order: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if order is not None and sorted(order) != sorted(DEFAULT_ORDER):
            raise ValueError(f"must name pp, dp and tp once each, got {list(order)}")
        return order

    @model_validator(mode="after")
    def _powersgd_asked(self) -> Constraints:
        shaped = [
            name
            for name in ("powersgd_rank", "powersgd_start_step")
            if name in self.model_fields_set
        ]
        if shaped and self.grad_compression not in ("powersgd", "any"):
            raise ValueError(
                f"{' and '.join(shaped)} shape{'s' if len(shaped) == 1 else ''} PowerSGD, and"
                f" grad_compression is {self.grad_compression}; pass grad_compression='powersgd'"
                f" (or 'any'), or leave {'it' if len(shaped) == 1 else 'them'} out"
            )
        if self.grad_compression == "powersgd" and self.zero:
            raise ValueError(
                f"grad_compression powersgd needs zero 0: ZeRO {self.zero} runs on FSDP2, whose"
                " reduce-scatters take no communication hook to compress; use bf16 or fp16 there,"
                " or zero 0"
            )
        return self

    def given(self) -> dict[str, Any]:
        """The constraints set (not None) by name, in field order: what the search fixes;
        grad_compression and PowerSGD's settings only where they differ from their defaults (Note
        [gradient compression is asked for])."""
        return {
            name: value
            for name, value in self
            if value is not None and not (name in _PLAN_DEFAULTS and value == default(name))
        }


# the search asks for each configuration it enumerates; pydantic's model_fields is slow to reach
@functools.cache
def default(name: str) -> Any:
    """The value the search takes for constraint ``name`` when the caller leaves it out (None: it is
    searched)."""
    return Constraints.model_fields[name].default


def constraint_error(error: pydantic.ValidationError, values: dict[str, Any]) -> str:
    """One line for a failed ``Constraints(**values)``: its unknown names, else its first bad
    value."""
    problems = error.errors(include_url=False)
    unknown = sorted(str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden")
    if unknown:
        return (
            f"unknown constraint {', '.join(unknown)}; the planner takes"
            f" {', '.join(Constraints.model_fields)}"
        )
    first = problems[0]
    if not first["loc"]:  # a rule across fields (model validator): its message is the line
        return str(first["ctx"]["error"])
    key = str(first["loc"][0])
    return _bad_value(key, values[key], first)


def _bad_value(key: str, value: Any, problem: dict) -> str:
    """What a field's value should have been, and what it was."""
    if key == "order":
        return (
            "order must name pp, dp and tp once each, outermost first (e.g. ['pp', 'dp', 'tp']),"
            f" got {value!r}"
        )
    if problem["type"] == "literal_error":
        return f"{key} must be one of {problem['ctx']['expected']}, got {repr(value)[:40]}"
    if problem["type"].startswith("bool_"):
        return f"{key} must be True or False, got {repr(value)[:40]}"
    if key == "expert_imbalance":
        return (
            f"{key} must be a number from 1 to {limits.MAX_EXPERT_IMBALANCE:g} (the busiest"
            " expert-parallel rank's load over"
            f" the mean), got {repr(value)[:40]}"
        )
    if key == "powersgd_start_step" and problem["type"] in (
        "greater_than_equal",
        "less_than_equal",
    ):
        return (
            f"{key} must be an integer from 2 to {limits.MAX_POWERSGD_START_STEP:,}, got"
            f" {_shown(value)}"
        )
    return count_message(
        key, value, problem["ctx"]["le"] if problem["type"] == "less_than_equal" else None
    )


def count_message(key: str, value: Any, high: int | None = None) -> str:
    """The error for a count that is not a positive integer or, with ``high``, is one above
    ``high``."""
    if high is None:
        return f"{key} must be a positive integer, got {repr(value)[:40]}"
    return f"{key} must be a positive integer up to {high:,}, got {_shown(value)}"


def _shown(value: int) -> str:
    return f"{value:,}" if value.bit_length() < 200 else "an integer of more than 60 digits"
