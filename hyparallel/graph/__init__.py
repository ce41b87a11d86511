"""Tracing a model into a ModelGraph (torch.fx, falling back to torch.export)."""

from hyparallel.graph.kinds import OpKind
from hyparallel.graph.model_graph import Block, CutPoint, ModelGraph, Op, Segment, Value
from hyparallel.graph.tracer import trace

__all__ = ["Block", "CutPoint", "ModelGraph", "Op", "OpKind", "Segment", "Value", "trace"]
