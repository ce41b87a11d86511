"""Pipeline parallelism (the Pipeline issue). So far: the schedule IR, its lowering and its simulator."""

from hyparallel.pipeline.schedule import Action, SimulationResult, format_schedule, lower, parse_action, schedule, simulate, validate

__all__ = ["Action", "SimulationResult", "format_schedule", "lower", "parse_action", "schedule", "simulate", "validate"]
