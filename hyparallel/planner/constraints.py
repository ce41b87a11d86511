"""The decisions a caller fixes for the planner's search, as a frozen pydantic model.

``Constraints`` is what ``plan`` and ``search`` take as ``constraints=`` (or build from the same keyword
arguments): each field has the plan file's type and bounds (hyparallel.schema, hyparallel.limits), so the
planner never accepts what a plan file would refuse, and a field left None is searched. A bad value is a
one-line PlanError naming it. What needs the cluster or the batch (the degrees against the GPUs, dp against
the global batch) is checked by the planner, after this.
"""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hyparallel import limits
from hyparallel.cluster import int_in
from hyparallel.errors import PlanError
from hyparallel.schema import DEFAULT_ORDER, Axis, Degree, Recompute, Schedule, Sequences, ZeroStage


class Constraints(BaseModel):
    """Decisions fixed for the search (None: searched); unknown names and bad values are refused as a PlanError."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: Degree | None = Field(None, description="Tensor-parallel degree.")
    pp: Degree | None = Field(None, description="Pipeline-parallel degree.")
    dp: Degree | None = Field(None, description="Data-parallel degree.")
    micro_batch: Sequences | None = Field(None, description="Sequences per micro-batch on one replica.")
    schedule: Schedule | None = Field(None, description="Pipeline schedule.")
    virtual_stages: int_in(1, limits.MAX_VIRTUAL_STAGES) | None = Field(
        None, description="Model chunks per pipeline rank (interleaved-1f1b)."
    )
    recompute: Recompute | None = Field(None, description="Activation recomputation.")
    zero: ZeroStage | None = Field(None, description="ZeRO stage of the data-parallel axis.")
    sequence_parallel: bool | None = Field(None, description="Sequence parallelism along the tp ranks.")
    order: tuple[Axis, Axis, Axis] | None = Field(None, description="The mesh axes outermost first (placement.order).")

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

    def given(self) -> dict[str, Any]:
        """The constraints set (not None) by name, in field order: what the search fixes."""
        return {name: value for name, value in self if value is not None}


def constraint_error(error: pydantic.ValidationError, values: dict[str, Any]) -> str:
    """One line for a failed ``Constraints(**values)``: its unknown names, else its first bad value."""
    problems = error.errors(include_url=False)
    unknown = sorted(str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden")
    if unknown:
        return f"unknown constraint {', '.join(unknown)}; the planner takes {', '.join(Constraints.model_fields)}"
    first = problems[0]
    key = str(first["loc"][0])
    return _bad_value(key, values[key], first)


def _bad_value(key: str, value: Any, problem: dict) -> str:
    """What a field's value should have been, and what it was."""
    if key == "order":
        return f"order must name pp, dp and tp once each, outermost first (e.g. ['pp', 'dp', 'tp']), got {value!r}"
    if problem["type"] == "literal_error":
        return f"{key} must be one of {problem['ctx']['expected']}, got {repr(value)[:40]}"
    if problem["type"].startswith("bool_"):
        return f"{key} must be True or False, got {repr(value)[:40]}"
    return count_message(key, value, problem["ctx"]["le"] if problem["type"] == "less_than_equal" else None)


def count_message(key: str, value: Any, high: int | None = None) -> str:
    """The error for a count that is not a positive integer or, with ``high``, is one above ``high``."""
    if high is None:
        return f"{key} must be a positive integer, got {repr(value)[:40]}"
    shown = f"{value:,}" if value.bit_length() < 200 else "an integer of more than 60 digits"
    return f"{key} must be a positive integer up to {high:,}, got {shown}"
