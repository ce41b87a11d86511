"""ModelGraph: a traced model as a networkx DiGraph of ops in execution order, with costs.

Each node carries its module path, op kind, parameters (count and bytes), forward FLOPs, output
bytes and tensor shapes; each edge the bytes that cross it. On top of that the graph exposes the
repeated blocks (transformer layers), the candidate pipeline cut points and the segments between
them, which the planner's stage search works over.

Note [what counts as a FLOP]
    ``flops`` are the forward floating-point operations of matrix products (mm, addmm, bmm,
    convolutions, attention, and the grouped products of mixture-of-experts layers, which the tracer
    counts itself: Note [grouped matmul FLOPs]), counted exactly from shapes by
    ``torch.utils.flop_counter``: 2*M*N*K for an (M, K) x (K, N) product, and
    4*B*heads*Tq*Tk*head_dim for attention (causal masking is not discounted, as Megatron-LM's
    model-FLOPs formula does not). Elementwise ops, norms and softmax are memory-bound and are
    costed by their bytes, so they carry 0 FLOPs. The one exception is an embedding bag's pooling,
    one add per gathered value (Note [embedding bag FLOPs] in kinds.py).

Note [bytes]
    Byte figures are at the dtype the model was traced in (usually fp32 on the meta device); the
    planner rescales them to the plan's dtype. ``param_count`` of an op counts the parameters it
    owns: a parameter read by several ops (tied embeddings) is owned by the first in execution
    order and listed in ``params`` of the others.

Note [a gradient path]
    DDP waits for a gradient of every parameter it holds, so it must be told which ones no backward
    gives one (they stay None, as on one device). A parameter gets a gradient only along ops whose
    outputs require grad: the profiled run (grad mode on, parameters requiring grad) records for
    each op whether its output did (Op.grad, read as the node runs, before a later in-place
    requires_grad_(); a later write into the tensor or a view of it, ``out[:, t] = state``, marks it
    as carrying one, as RecurrentGemma's recurrence returns the zeros it wrote into).
    ``unused_params`` are those no such path leads from to the output: dropped outputs, shapes
    (``zeros_like(q).requires_grad_()``, Mra without its kernels), ``detach``, no-grad regions,
    integer results; ignoring them is right under any loss. A write in place counts as reaching the
    output (its later readers name the written tensor's producer, not the write).
    ``params_outside_logits`` reach the output but not its ``logits``: the default loss gives them
    nothing, a user's loss over the other outputs may (EncoderDecoderModel without cross-attention
    returns its encoder's states); DDP then finds each step's unused parameters itself
    (``find_unused_parameters``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import networkx as nx

from hyparallel.graph.kinds import OpKind, writes_in_place

if TYPE_CHECKING:
    from hyparallel.graph.moe import MoEAnalysis
    from hyparallel.graph.structure import TPAnalysis

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Op:
    """One node of the graph: a leaf module call, a functional op, a graph input or the output."""

    name: str
    index: int
    kind: OpKind
    module: str
    target: str
    params: tuple[str, ...] = ()
    param_count: int = 0
    # The shapes of the parameters this op owns (those param_count counts), in ``params`` order:
    # what a gradient compressor sees of each (PowerSGD views a gradient as (shape[0], -1); Note
    # [PowerSGD's wire] in planner/costs.py).
    param_shapes: tuple[Shape, ...] = ()
    param_bytes: int = 0
    buffer_bytes: int = 0
    flops: int = 0
    input_shapes: tuple[Shape, ...] = ()
    output_shapes: tuple[Shape, ...] = ()
    output_bytes: int = 0
    # The standard layer ("Linear", "Embedding", "Conv1D") whose own forward this leaf module call
    # runs; "" for anything else: a subclass overriding forward (a scaled embedding), a custom
    # layer, a function. Note [a module replaced by type]: only such a call may be swapped for a
    # layer that reimplements its base.
    base_forward: str = ""
    # The short names of the ATen ops a leaf module call ran, where the trace shows them
    # (torch.export); () for a functional op or an fx call_module. Lets a rule judge a custom module
    # by what it computes.
    inner: tuple[str, ...] = ()
    # Whether the op's output requires grad in the traced run (Note [a gradient path]): False for
    # what no loss can differentiate through (a shape, zeros_like, detach, a no-grad region, an
    # integer result).
    grad: bool = True
    # An option of the function that changes its work, where the graph can read it: GELU's
    # approximation ("tanh"); "" otherwise. Costs key a CPU's per-element activation times by it
    # (Note [activations a CPU computes]).
    variant: str = ""

    @property
    def function(self) -> str:
        """The function's name as costs key it: the target lowercased, its variant appended
        ("gelu_tanh")."""
        return self.target.lower() + (f"_{self.variant}" if self.variant else "")


@dataclass(frozen=True)
class Value:
    """A tensor produced by one op and read by later ones."""

    name: str
    producer: str
    consumers: tuple[str, ...]
    shape: Shape
    bytes: int


@dataclass(frozen=True)
class Block:
    """One repeated block (e.g. a transformer layer): a child of a ModuleList/Sequential."""

    path: str
    ops: tuple[str, ...]
    flops: int
    param_count: int
    param_bytes: int
    activation_bytes: int


@dataclass(frozen=True)
class CutPoint:
    """A place between two ops where a pipeline stage may end."""

    position: int
    after: str
    before: str
    tensors: tuple[str, ...]
    bytes: int


@dataclass(frozen=True)
class Segment:
    """The ops between two consecutive cut points: the unit of the stage-boundary search."""

    name: str
    ops: tuple[str, ...]
    modules: tuple[str, ...]
    flops: int
    param_count: int
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    is_block: bool


@dataclass
class ModelGraph:
    """A traced model; build it with ``hyparallel.trace(model, example_inputs)``."""

    name: str
    method: Literal["fx", "export"]
    ops: tuple[Op, ...]
    values: tuple[Value, ...]
    blocks: tuple[Block, ...]
    fingerprint: str
    # the fx GraphModule or the torch.export ExportedProgram
    program: Any = field(default=None, repr=False)
    # every module path of the model (root left out)
    modules: tuple[str, ...] = field(default=(), repr=False)
    # Parameter names sharing one tensor (a tied embedding and head, BERT's head bias), each group
    # in the model's named_parameters order; the ops' ``params`` name each group by its first name
    # only.
    ties: tuple[tuple[str, ...], ...] = field(default=(), repr=False)
    # The tracer's program (hyparallel.graph.tracer.Program): the pipeline splitter cuts a copy of
    # it instead of tracing the model again.
    traced: Any = field(default=None, repr=False, compare=False)
    # Ops kept replicated whatever the plan, op name -> why (``replicate``: what fails at one rank's
    # sizes).
    replicated: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # The ops giving the output's ``logits``, what the default loss reads; () when the output has
    # none (then the default loss reads the whole output).
    loss_inputs: tuple[str, ...] = field(default=(), repr=False)
    # (module path, class) of the custom torch.autograd.Functions the forward applies: a traced
    # pipeline stage cannot keep their backward (Note [a custom backward a traced stage cannot
    # keep], graph/tracer.py).
    custom_backwards: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    graph: nx.DiGraph = field(init=False, repr=False)
    cut_points: tuple[CutPoint, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {op.name: op for op in self.ops}
        self.graph = nx.DiGraph(name=self.name)
        names = [f.name for f in fields(Op)]
        for op in self.ops:
            # An Op's fields are immutable (strings, numbers, tuples of them): the node shares them,
            # where asdict rebuilt every tuple (a quarter of a second for GPT-3 175B's 1,835 ops).
            self.graph.add_node(op.name, **{name: getattr(op, name) for name in names})
        for value in self.values:
            for consumer in value.consumers:
                if self.graph.has_edge(value.producer, consumer):
                    edge = self.graph.edges[value.producer, consumer]
                    edge["bytes"] += value.bytes
                    edge["tensors"] += (value.name,)
                else:
                    self.graph.add_edge(
                        value.producer, consumer, bytes=value.bytes, tensors=(value.name,)
                    )
        self.cut_points = tuple(self._find_cut_points())

    # ---- totals -------------------------------------------------------------------------------

    def op(self, name: str) -> Op:
        """The op called ``name``."""
        return self._by_name[name]

    @cached_property
    def structure(self) -> TPAnalysis:
        """The model's tensor-parallel structure (``hyparallel.graph.structure``), computed once per
        trace.

        Which Linears pair as column/row, fused [q | k | v] parts, head counts: facts of the
        dataflow that the planner costs and the runtime splits by, read from this one object by
        both.
        """
        from hyparallel.graph.structure import analyze  # it reads this module's classes

        return analyze(self)

    @cached_property
    def moe(self) -> MoEAnalysis:
        """The model's mixture-of-experts layers (``hyparallel.graph.moe``): router, experts, top-k,
        shared experts, read from this trace; and the routers or expert weights it could not
        read."""
        from hyparallel.graph.moe import find_moe  # it reads this module's classes

        return find_moe(self)

    def replicate(self, reasons: dict[str, str]) -> None:
        """Keep these ops (op name -> why) replicated whatever the plan; ``structure`` is analysed
        again."""
        self.replicated.update(reasons)
        self.__dict__.pop("structure", None)

    @cached_property
    def unused_params(self) -> tuple[str, ...]:
        """Parameters (by first name) no loss can give a gradient (Note [a gradient path]): the
        forward may compute with them (BigBird's pooler, which its causal-LM head drops; Mra's
        attention without its kernels, which reads its projections for their shapes) but no path
        that carries a gradient leads to the output."""
        return self._without_gradient([op.name for op in self.ops if op.kind == "output"])

    @cached_property
    def params_outside_logits(self) -> tuple[str, ...]:
        """Parameters a gradient path leads from to the output but not to its ``logits``: the
        default loss gives them none, a loss over the other outputs may (an encoder-decoder whose
        decoder never reads the encoder)."""
        if not self.loss_inputs:
            return ()
        unused = set(self.unused_params)
        return tuple(p for p in self._without_gradient(list(self.loss_inputs)) if p not in unused)

    def _without_gradient(self, ends: list[str]) -> tuple[str, ...]:
        # A write in place reaches whoever reads the written tensor later, an edge the graph does
        # not hold (its readers name the tensor's producer): every such write counts as reaching the
        # output.
        ends = list(
            dict.fromkeys(
                [*ends, *(op.name for op in self.compute_ops() if writes_in_place(op.target))]
            )
        )
        carrying = {op.name for op in self.ops if op.grad}
        # nothing required grad when traced: no evidence
        if not any(self.op(name).params for name in carrying):
            carrying = set(self._by_name)
        paths = self.graph.subgraph(carrying | set(ends))
        live = set(ends).union(*(nx.ancestors(paths, name) for name in ends))
        used = {p for op in self.ops if op.name in live for p in op.params}
        return tuple(dict.fromkeys(p for op in self.ops for p in op.params if p not in used))

    def compute_ops(self) -> Iterator[Op]:
        """Ops in execution order, without graph inputs and the output."""
        return (op for op in self.ops if op.kind not in ("input", "output"))

    @property
    def num_params(self) -> int:
        """Distinct parameters (tied ones once), as ``sum(p.numel() for p in
        model.parameters())``."""
        return sum(op.param_count for op in self.ops)

    @property
    def param_bytes(self) -> int:
        """Bytes of the distinct parameters at the traced dtype."""
        return sum(op.param_bytes for op in self.ops)

    @property
    def flops(self) -> int:
        """Forward FLOPs of one call with the example inputs (Note [what counts as a FLOP])."""
        return sum(op.flops for op in self.ops)

    @property
    def num_layers(self) -> int:
        """Repeated blocks, or parameterised ops when the model has no repeated blocks."""
        return len(self.blocks) or sum(1 for op in self.ops if op.param_count)

    def flops_by_kind(self) -> dict[str, int]:
        """Forward FLOPs summed per op kind."""
        totals: dict[str, int] = {}
        for op in self.ops:
            if op.flops:
                totals[op.kind] = totals.get(op.kind, 0) + op.flops
        return totals

    # ---- pipeline structure -------------------------------------------------------------------

    def _units(self) -> list[tuple[str | None, list[Op]]]:
        """Consecutive compute ops grouped into units that a stage boundary may separate.

        A repeated block is one unit. Outside blocks a unit ends after an op that reads parameters:
        ending a stage after a parameter-free op (a reshape, an add) gains nothing that ending it
        after the next parameterised op or block does not.
        """
        block_of = {name: block.path for block in self.blocks for name in block.ops}
        units: list[tuple[str | None, list[Op]]] = []
        open_run = False  # the last unit is a run outside blocks that has not ended yet
        for op in self.compute_ops():
            path = block_of.get(op.name)
            if path is not None:
                if units and units[-1][0] == path:
                    units[-1][1].append(op)
                else:
                    units.append((path, [op]))
                open_run = False
                continue
            if open_run:
                units[-1][1].append(op)
            else:
                units.append((None, [op]))
            open_run = not op.params
        return units

    def _crossing(self) -> dict[int, list[Value]]:
        """For every compute position i: the tensors produced at or before i and read after it."""
        index = {op.name: op.index for op in self.ops}
        last_compute = max((op.index for op in self.compute_ops()), default=-1)
        starts: dict[int, list[Value]] = {}
        for value in self.values:
            readers = [index[c] for c in value.consumers if self._by_name[c].kind != "output"]
            if value.bytes and readers:
                starts.setdefault(index[value.producer], []).append(value)
        active: dict[str, tuple[int, Value]] = {}
        crossing: dict[int, list[Value]] = {}
        for position in range(last_compute + 1):
            for value in starts.get(position, []):
                last = max(index[c] for c in value.consumers if self._by_name[c].kind != "output")
                active[value.name] = (last, value)
            active = {k: v for k, v in active.items() if v[0] > position}
            crossing[position] = [v for _, v in active.values()]
        return crossing

    def _find_cut_points(self) -> list[CutPoint]:
        units = self._units()
        if len(units) < 2:
            return []
        crossing = self._crossing()
        candidates = []
        for (path, ops), (next_path, next_ops) in zip(units, units[1:]):
            position = ops[-1].index
            tensors = crossing.get(position, [])
            candidates.append(
                (
                    path is not None or next_path is not None,
                    CutPoint(
                        position=position,
                        after=ops[-1].name,
                        before=next_ops[0].name,
                        tensors=tuple(v.name for v in tensors),
                        bytes=sum(v.bytes for v in tensors),
                    ),
                )
            )
        at_blocks = [cut.bytes for touches_block, cut in candidates if touches_block]
        # Note: with repeated blocks, a cut is offered only where no more crosses than between two
        # blocks; without them every op boundary is offered and the planner prices it by its bytes.
        limit = max(at_blocks) if at_blocks else None
        return [
            cut
            for touches_block, cut in candidates
            if touches_block or limit is None or cut.bytes <= limit
        ]

    def segments(self) -> tuple[Segment, ...]:
        """The ops between consecutive cut points, with their summed costs, in execution order."""
        return self._segments

    @cached_property
    def _segments(self) -> tuple[Segment, ...]:
        # Computed once: the ops, blocks and cut points are fixed when the graph is built, and the
        # planner asks for every plan it writes (Note [the runtime's checks]).
        cut_after = {cut.position: cut for cut in self.cut_points}
        block_paths = {block.path for block in self.blocks}
        segments, current = [], []
        compute = list(self.compute_ops())
        for op in compute:
            current.append(op)
            if op.index in cut_after or op is compute[-1]:
                cut = cut_after.get(op.index)
                segments.append(self._segment(current, cut.bytes if cut else 0, block_paths))
                current = []
        return tuple(segments)

    def _segment(self, ops: list[Op], output_bytes: int, block_paths: set[str]) -> Segment:
        modules: list[str] = []
        for op in ops:
            path = next((p for p in _prefixes(op.module) if p in block_paths), op.module)
            if path and path not in modules:
                modules.append(path)
        is_block = len(modules) == 1 and modules[0] in block_paths
        return Segment(
            name=(
                modules[0]
                if is_block
                else (ops[0].name if len(ops) == 1 else f"{ops[0].name}..{ops[-1].name}")
            ),
            ops=tuple(op.name for op in ops),
            modules=tuple(modules),
            flops=sum(op.flops for op in ops),
            param_count=sum(op.param_count for op in ops),
            param_bytes=sum(op.param_bytes for op in ops),
            activation_bytes=sum(op.output_bytes for op in ops),
            output_bytes=output_bytes,
            is_block=is_block,
        )

    # ---- presentation -------------------------------------------------------------------------

    def summary(self) -> str:
        """A few lines: totals, blocks and cut points."""
        compute = list(self.compute_ops())
        lines = [
            (
                f"{self.name}: traced with torch.{self.method}, {len(compute)} ops,"
                f" {self.graph.number_of_edges()} edges"
            ),
            (
                f"  parameters      {self.num_params:,} ({self.param_bytes / 2**30:.2f} GiB at the"
                " traced dtype)"
            ),
            (
                f"  forward FLOPs   {self.flops:.4g} "
                f"({', '.join(f'{k} {v:.3g}' for k, v in sorted(self.flops_by_kind().items()))})"
            ),
            f"  repeated blocks {len(self.blocks)}"
            + (f" ({self.blocks[0].path} .. {self.blocks[-1].path})" if self.blocks else ""),
            f"  cut points      {len(self.cut_points)}; segments {len(self.segments())}",
        ]
        if self.moe.layers or self.moe.refused:
            kinds = sorted(
                {(m.num_experts, m.top_k, m.layout, m.dispatch) for m in self.moe.layers}
            )
            lines.append(
                f"  MoE layers      {len(self.moe.layers)}"
                + "".join(f"; {e} experts, top-{k}, {lay}, {d}" for e, k, lay, d in kinds)
                + "".join(f"; not read: {path} ({why})" for path, why in self.moe.refused.items())
            )
        return "\n".join(lines)


def _prefixes(path: str) -> list[str]:
    """'a.b.c' -> ['a', 'a.b', 'a.b.c'] (outermost first)."""
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
