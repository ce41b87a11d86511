"""Which Linears split by column, which by row, and what a tensor-parallel degree requires of the
model.

Found from the traced graph's dataflow, never from module names, so any architecture is handled the
same way (fused or separate QKV, grouped-query attention, SwiGLU, transformers' Conv1D):

* Inside a repeated block, a Linear whose output reaches the block's output without passing another
  Linear is a *row* Linear (attention output, MLP down projection). A Linear all of whose next
  Linears are row Linears is a *column* Linear (QKV, MLP up/gate). Megatron pairs: one all-reduce
  forward per row Linear, one backward per distinct input of column Linears (Shoeybi et al. 2019,
  Sec. 3).
* The ops between a column and its row Linears work on split tensors; a norm over the split
  dimension there would need the whole tensor, so such a pair is left replicated.
* A fused column's layout is read from how the graph views and cuts its output (Note [fused layouts
  read from the graph]); a layout not recognised leaves the column and its row partner replicated,
  never guessed.
* The token embedding (fed by a graph input) and an output Linear whose width is that vocabulary are
  vocab-parallel; the vocabulary is padded to a multiple of tp, as Megatron-LM does.
* A layer whose class overrides its base's forward (Note [a module replaced by type] in kinds.py) is
  never split, nor its column/row partners: the parallel layers reimplement the base's forward only.
* Everything else is replicated.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from dataclasses import dataclass, field

from hyparallel.graph.kinds import GROUPED_MM, POINTWISE, REDUCTIONS, VIEW_OPS
from hyparallel.graph.model_graph import ModelGraph, Op
from hyparallel.spec.schema import TPStyle


@dataclass(frozen=True)
class TPAnalysis:
    """The tensor-parallel structure of a traced model."""

    styles: dict[str, TPStyle]
    split_ops: frozenset[str]
    head_groups: dict[str, int]
    attention_heads: dict[str, int]
    vocab_size: int | None
    row_ops: tuple[str, ...]
    column_inputs: tuple[tuple[str, ...], ...]
    vocab_head: str | None = None
    vocab_embedding: str | None = None
    # fused column outputs: sizes of [q | k | v] etc.
    parts: dict[str, list[int]] = field(default_factory=dict)
    # op -> why it stays replicated whatever the plan
    unsplittable: dict[str, str] = field(default_factory=dict)
    # question -> (a weak reference to the graph asked about, the answer): answers kept, see
    # whole_sequence
    _answers: dict[str, tuple] = field(default_factory=dict, compare=False, repr=False)

    def nothing_split(self, tp: int, graph: ModelGraph) -> str | None:
        """Why ``tp`` > 1 is no plan for a model none of whose ops tensor parallelism splits (None:
        some split).

        A tp with nothing split is not a plan: its ranks would each do the whole model's work.
        """
        if tp == 1 or any(style != "replicate" for style in self.styles.values()):
            return None
        return (
            f"tp {tp} splits nothing of {graph.name}: it has no column/row Linear pair in repeated"
            f" blocks and no vocab-parallel embedding or head, so each of the {tp} ranks would do"
            " the whole model's work; use tp 1"
        )

    def whole_sequence(self, graph: ModelGraph) -> str | None:
        """Why sequence parallelism cannot run on this model (None: it can).

        Under sequence parallelism each rank holds part of the sequence between the first and the
        last block, and only the split regions gather it whole: every other op of a block on the
        token stream must compute each token from that token alone (Note [what acts on each token on
        its own]). Attention left replicated (its projections not split, Note [fused layouts read
        from the graph]) would attend within its rank's part only. The answer is kept: this analysis
        and its graph do not change (``ModelGraph.replicate`` makes a new one), and the planner asks
        for every plan it writes.
        """
        known = self._answers.get("whole_sequence")
        # a weak reference: the graph holds this analysis
        if known is None or known[0]() is not graph:
            known = self._answers["whole_sequence"] = (
                weakref.ref(graph),
                self._whole_sequence(graph),
            )
        return known[1]

    def uneven_sequence(self, graph: ModelGraph, tp: int) -> str | None:
        """Why sequence parallelism cannot split the blocks' sequence ``tp`` ways (None: it can):
        the length the first block reads along dim 1, as traced (a ViT's patches and its class
        token: 257), must divide by tp."""
        if tp == 1 or not graph.blocks:
            return None
        shapes = graph.op(graph.blocks[0].ops[0]).input_shapes
        if not shapes or len(shapes[0]) != 3 or shapes[0][1] % tp == 0:
            return None
        return (
            f"sequence_parallel: {graph.blocks[0].path} reads a sequence of {shapes[0][1]}"
            f" positions, which tp {tp} does not divide; use sequence_parallel: false or a tp that"
            " divides it"
        )

    def _whole_sequence(self, graph: ModelGraph) -> str | None:
        # the sequence is gathered along dim 1 of (batch, seq, hidden)
        for name, style in self.styles.items():
            shapes = graph.op(name).input_shapes
            if style == "column" and shapes and len(shapes[0]) != 3:
                return (
                    f"sequence_parallel: {graph.op(name).module or name} reads a {len(shapes[0])}-d"
                    f" input {tuple(shapes[0])}, not (batch, seq, hidden) (tokens flattened, as MoE"
                    " layers do), so its sequence cannot be gathered; use sequence_parallel: false"
                )
        for block in graph.blocks:
            for name in block.ops:
                op = graph.op(name)
                # experts: below
                products = op.kind == "matmul" and not op.params and op.target not in GROUPED_MM
                if (op.kind == "attention" or products) and name not in self.split_ops:
                    return (
                        f"sequence_parallel: {op.module or name} mixes the whole sequence but is"
                        " replicated (its projections are not split), so it would see only its"
                        " rank's part of the sequence; use sequence_parallel: false"
                    )
        readers = Counter(p for op in graph.compute_ops() for p in set(op.params))
        # a block run several times in one forward (HRM's recurrence, a no-grad warm-up
        for block in graph.blocks:
            # pass, layers sharing weights) would have its input split along the sequence again at
            # every call
            again = next((p for n in block.ops for p in graph.op(n).params if readers[p] > 1), None)
            if again is not None:
                return (
                    f"sequence_parallel: block {block.path} runs more than once in one forward"
                    f" ({again} is read {readers[again]} times), and sequence parallelism splits a"
                    " block's input once; use sequence_parallel: false"
                )
        stream, tokens = _token_stream(graph)
        if not graph.blocks:
            return None
        if reason := _second_stream(graph, stream, tokens):
            return reason
        indices = [graph.op(n).index for block in graph.blocks for n in block.ops]
        first, last = min(indices), max(indices)
        # the blocks' ops, and any run between the first and the last block
        for op in graph.compute_ops():
            if first <= op.index <= last and op.name not in self.split_ops and op.name in stream:
                if why := _mixes_tokens(op, tokens):
                    return (
                        f"sequence_parallel: {op.module or op.name} ({op.target}) {why}, outside"
                        " the split regions, so under sequence parallelism it would see only its"
                        " rank's part of the sequence; use sequence_parallel: false"
                    )
        return None

    def check(self, tp: int, graph: ModelGraph) -> str | None:
        """Why ``tp`` cannot split this model, or None when it can."""
        if tp == 1:
            return None
        if reason := self.nothing_split(tp, graph):
            return reason
        for name, heads in self.attention_heads.items():
            if heads % tp:
                return (
                    f"tp {tp} does not divide the {heads} attention heads of"
                    f" {graph.op(name).module or name}"
                )
        for name, style in self.styles.items():
            op = graph.op(name)
            fan_in, fan_out = op.input_shapes[0][-1], op.output_shapes[0][-1]
            if style == "column":
                groups = self.head_groups.get(name)
                head_dim = fan_out // groups if groups else None
                # each part of a fused [q | k | v] on its own
                for size in self.parts.get(name, [fan_out]):
                    heads = size // head_dim if head_dim else None
                    if heads is not None and heads % tp and tp % heads:
                        return (
                            f"tp {tp} neither divides nor is a multiple of the {heads} heads in"
                            f" {op.module}"
                        )
                    if heads is None and size % tp:
                        return f"tp {tp} does not divide the {size} output features of {op.module}"
            elif style == "row" and fan_in % tp:
                return f"tp {tp} does not divide the {fan_in} input features of {op.module}"
        return None

    def params_per_rank(self, op: Op, tp: int) -> float:
        """Parameters of ``op`` held by one tensor-parallel rank."""
        if tp == 1 or not op.param_count:
            return op.param_count
        style = self.styles.get(op.name, "replicate")
        if style == "column":
            groups = self.head_groups.get(op.name)
            # kv heads fewer than tp are replicated
            share = max(1 / tp, 1 / groups) if groups else 1 / tp
            return op.param_count * share
        if style == "row":
            weight = op.input_shapes[0][-1] * op.output_shapes[0][-1]
            # the bias is added once, after the reduction
            return weight / tp + (op.param_count - weight)
        if style == "vocab":
            rows = self.vocab_size or 1
            return op.param_count * math.ceil(rows / tp) / rows  # padded to a multiple of tp
        return op.param_count


def analyze(graph: ModelGraph) -> TPAnalysis:
    """Find the column/row pairs, vocab-parallel ops and head counts of ``graph``."""
    g = graph.graph
    styles: dict[str, TPStyle] = {}
    split: set[str] = set()
    head_groups: dict[str, int] = {}
    heads: dict[str, int] = {}
    rows_all: list[str] = []
    column_inputs: list[tuple[str, ...]] = []
    unsplittable = {**_own_forwards(graph), **graph.replicated}
    for block in graph.blocks:
        members = set(block.ops)
        linears = [n for n in block.ops if _is_linear(graph.op(n))]
        exits = {n for n in block.ops if any(s not in members for s in g.successors(n))}
        forward = {n: _first_linears(g, n, members, g.successors) for n in linears}
        backward = {n: _first_linears(g, n, members, g.predecessors) for n in linears}
        fixed = {n for n in linears if n in unsplittable}
        rows = {n for n in linears if _reaches(g, n, members, exits)} - fixed
        columns: set[str] = set()
        while True:  # pairs hold only when every column feeds rows and every row is fed by columns
            new_columns = {
                n for n in linears if n not in rows | fixed and forward[n] and forward[n] <= rows
            }
            new_rows = {n for n in rows if backward[n] and backward[n] <= new_columns}
            if new_columns == columns and new_rows == rows:
                break
            columns, rows = new_columns, new_rows
        regions = {column: _region(g, column, members) for column in columns}
        # what replicated Linears feed
        learned = _downstream(g, set(linears) - columns - rows, members)
        accepted: dict[str, tuple[set[str], dict[str, tuple[int, int]], int]] = {}
        split_values = set(columns).union(*regions.values())
        for column in sorted(columns):
            region = regions[column]
            if side := sorted(
                p
                for n in region
                for p in g.predecessors(n)
                if p not in split_values and p in learned
            ):
                unsplittable[column] = (  # Note [a learned value entering a split region]
                    f"{graph.op(side[0]).module or side[0]} feeds its split region without a column"
                    " Linear, so its gradient would hold one rank's heads' share only"
                )
                continue
            attention = sorted(n for n in region if graph.op(n).kind == "attention")
            if any(_breaks_split(graph.op(n), attention, graph) for n in region):
                continue
            found = _attention_heads(graph, region, attention)
            query_heads = next((count for count, _ in found.values()), None)
            # a convolution or linear-attention mixer seen as one-head attention
            if query_heads == 1:
                unsplittable[column] = (
                    "it feeds a single head, which no tensor-parallel degree divides"
                )
                continue
            if reason := unrecognised_layout(graph, column, query_heads):
                unsplittable[column] = reason
                continue
            width = graph.op(column).output_shapes[0][-1]
            if odd := next((d for _, d in found.values() if width < d or width % d), None):
                # heads the analysis does not see whole: a split would cut inside one
                unsplittable[column] = (
                    f"its {width} output features are not a whole number of the {odd}-wide heads it"
                    " feeds"
                )
                continue
            accepted[column] = (region, found, width)
        # A column splits only with every row it feeds split, a row only with every column feeding
        # it split: a column whose row stays whole (its other column refused above) is dropped,
        # until nothing changes.
        while True:
            good_rows = {r for r in rows if backward[r] <= set(accepted)}
            dropped = sorted(c for c in accepted if not forward[c] <= good_rows)
            if not dropped:
                break
            for column in dropped:
                row = sorted(forward[column] - good_rows)[0]
                partner = sorted(c for c in backward[row] if c not in accepted)
                why = (
                    f": {unsplittable[partner[0]]}"
                    if partner and partner[0] in unsplittable
                    else ""
                )
                unsplittable[column] = f"its row partner {graph.op(row).module} stays whole{why}"
                del accepted[column]
        for column, (region, found, width) in sorted(accepted.items()):
            styles[column] = "column"
            split.update(region | {column})
            for n, (count, head_dim) in found.items():
                heads[n] = count
                head_groups[column] = width // head_dim
        for row in sorted(rows):
            if backward[row] <= {c for c, s in styles.items() if s == "column"}:
                styles[row] = "row"
                rows_all.append(row)
            elif refused := sorted(
                c for c in backward[row] if c in unsplittable and c not in fixed
            ):
                unsplittable[row] = (
                    f"its column partner {graph.op(refused[0]).module}: {unsplittable[refused[0]]}"
                )
        by_input: dict[tuple[str, ...], None] = {}
        for column in (c for c in block.ops if styles.get(c) == "column"):
            by_input[tuple(sorted(g.predecessors(column)))] = None
        column_inputs.extend(by_input)
    vocab_embedding, vocab = _token_embedding(graph)
    # and the head with it: a tied head must stay whole with its embedding
    if vocab_embedding in unsplittable:
        vocab_embedding, vocab = None, None
    if vocab_embedding:
        styles[vocab_embedding] = "vocab"
    head = _vocab_head(graph, vocab)
    if head in unsplittable:
        head = None
    if head:
        styles[head] = "vocab"
    untied = _untie(graph, styles)
    head = None if head in untied else head
    vocab_embedding = None if vocab_embedding in untied else vocab_embedding
    for op in graph.compute_ops():  # every other Linear keeps its whole weight on each rank
        if _is_linear(op):
            styles.setdefault(op.name, "replicate")
    return TPAnalysis(
        styles=styles,
        split_ops=frozenset(split),
        head_groups=head_groups,
        attention_heads=heads,
        vocab_size=vocab,
        row_ops=tuple(rows_all),
        column_inputs=tuple(column_inputs),
        vocab_head=head,
        vocab_embedding=vocab_embedding,
        parts={
            name: fused_parts(graph, name) for name, style in styles.items() if style == "column"
        },
        unsplittable=unsplittable,
    )


# Note [tied parameters split one way]
# A parameter several modules hold (graph.ties: a tied embedding and head, BERT's
# `cls.predictions.bias` that is also `cls.predictions.decoder.bias`, T5's `shared` embedding read
# by encoder and decoder) is one tensor: tensor parallelism can split it only if every module
# holding it is swapped to the same style, or the swapped holder's shard and an unswapped holder's
# whole tensor can no longer be one parameter (the runtime's retie refuses it). So the analysis
# replicates every holder of a tie whose holders would get different styles (a module with no op of
# its own, such as BERT's `cls.predictions`, is replicated), until no tie is split two ways;
# check_styles refuses a hand-written map that splits one. A tied column/row Linear is replicated
# alone, and check_styles then refuses its partner's split.


def holder(name: str) -> str:
    """The module path holding parameter ``name`` ('' for the root)."""
    return name.rpartition(".")[0]


def split_tie(ties, module_styles: dict[str, str]) -> tuple[str, str] | None:
    """Two parameter names of one tie whose holding modules ``module_styles`` splits differently
    (None: none do).

    ``module_styles`` maps module paths to styles; a module missing from it is replicated.
    """
    for names in ties:
        first = names[0]
        for name in names[1:]:
            if module_styles.get(holder(name), "replicate") != module_styles.get(
                holder(first), "replicate"
            ):
                return first, name
    return None


def _untie(graph: ModelGraph, styles: dict[str, TPStyle]) -> set[str]:
    """Drop the styles of every op holding a tie its holders would split differently (Note [tied
    parameters split one way]); returns the ops dropped."""
    dropped: set[str] = set()
    while True:
        by_module = {graph.op(name).module: style for name, style in styles.items()}
        pair = split_tie(graph.ties, by_module)
        if pair is None:
            return dropped
        group = next(names for names in graph.ties if pair[0] in names)
        holders = {holder(name) for name in group}
        for name in [n for n in styles if graph.op(n).module in holders]:
            del styles[name]
            dropped.add(name)


def _own_forwards(graph: ModelGraph) -> dict[str, str]:
    """Linear and embedding ops tensor parallelism cannot swap for its layers, and why (Note [a
    module replaced by type] in hyparallel.graph.kinds): a subclass overriding its base's forward, a
    custom layer, a function."""
    reasons = {}
    for op in graph.compute_ops():
        if op.kind in ("linear", "embedding") and op.params and not op.base_forward:
            reasons[op.name] = (
                f"{op.target} does not run the forward of nn.Linear, nn.Embedding or Conv1D, "
                "which a parallel layer would replace"
            )
    return reasons


def fused_parts(graph: ModelGraph, op_name: str) -> list[int]:
    """Sizes of the pieces a fused projection's output is split into along its last dim (one piece
    if not fused).

    Note [fused parts behind a view]: the split may come after views that keep the last dim whole
    (GPTBigCode's multi-query ``c_attn(x).unsqueeze(1).split((embed_dim, kv_dim, kv_dim), dim=3)``),
    or after a view into (..., heads, head_dim) whose heads dim is cut, by slices or by one split
    (Falcon's multi-query ``view(..., heads + 2, head_dim)`` then ``[..., :-2, :]``, ``[..., [-2],
    :]``, ``[..., [-1], :]`` before transformers 5.25, ``.split([heads, 1, 1], dim=-2)`` since).
    Missing the split would cut a single key/value head in half; each piece is sized on its own
    instead (the pieces in the order they run).
    """
    out = graph.op(op_name).output_shapes[0][-1]
    name, head_dim = op_name, None
    while True:
        successors = sorted(
            (graph.op(n) for n in graph.graph.successors(name)), key=lambda op: op.index
        )
        pieces = _pieces(successors, -1 if head_dim is None else -2)
        if len(pieces) > 1 and sum(pieces) * (head_dim or 1) == out:
            return [piece * (head_dim or 1) for piece in pieces]
        view = successors[0] if len(successors) == 1 and successors[0].kind == "view" else None
        shape = view.output_shapes[0] if view is not None and len(view.output_shapes) == 1 else None
        if head_dim is not None or shape is None:
            return [out]
        if len(shape) >= 2 and shape[-1] != out and shape[-2] * shape[-1] == out:
            head_dim = shape[-1]  # viewed as (..., heads, head_dim): pieces are cut along the heads
        elif shape[-1] != out:
            return [out]
        name = view.name


# Note [fused layouts read from the graph]
# How a fused column's output rows are laid out is read from the ops that reshape and cut it, never
# guessed; the split keeps contiguous ranges of rows per part (_column_rows in
# hyparallel/tensor/apply.py), which is right only for these layouts:
# * [q | k | v] parts cut along the last dim (GPT-2's c_attn(x).split, Phi-3's slices), behind views
#   that keep the last dim whole (GPTBigCode's unsqueeze): fused_parts sizes each part.
# * a view into (..., heads, head_dim) whose heads dim is cut, by slices or one split (Falcon's
#   multi-query slices, its split([heads, 1, 1], dim=-2) since transformers 5.25): parts of whole
#   heads.
# * a view into (..., G, W...) cut inside each group (along a W dim), where G is the number of query
#   heads: a per-head interleave (GPT-NeoX's (..., heads, 3 * head_dim) chunked, Bloom's (...,
#   heads, 3, head_dim) indexed). A contiguous range of groups is a contiguous range of heads, so it
#   splits as one part.
# Reshapes one after another regroup the same row-major features, so the grouping read is the last
# one before the cut (Falcon's view(..., 3 * heads, head_dim).unflatten(-2, (heads, 3)).unbind(-2)
# is Bloom's per-head layout). A view into G groups cut inside each group where G is not the head
# count (CodeGen's mp_num groups, each holding q | v | k for several heads, regrouped into heads
# after the cut) interleaves parts at a granularity the split does not follow: such a column and its
# row partner stay replicated (TPAnalysis.unsplittable), and check_styles refuses a hand-written map
# splitting them with that reason. A per-head interleave is read at full sizes only; a module that
# sizes its groups from its attributes (CodeGen with as many heads as mp_num groups: embed_dim //
# mp_num) regroups at one rank's sizes, so parallelize traces a rank-sized meta copy and refuses a
# split column whose groups there are not a 1/tp share of the full ones (_regrouped in
# hyparallel/tensor/apply.py).


def unrecognised_layout(graph: ModelGraph, op_name: str, query_heads: int | None) -> str | None:
    """Why the fused layout of column ``op_name``'s output is not one Note [fused layouts read from
    the graph] recognises (None: recognised, or not fused); ``query_heads`` are its region's
    attention heads, if any."""
    out = graph.op(op_name).output_shapes[0][-1]
    view, groups, inner = _grouping_view(graph, op_name, out)
    if view is None:
        return None
    cut = _first_cut(graph, view)
    # never cut, or cut along the groups (heads-major)
    if cut is None or cut == groups and groups not in inner:
        return None
    # cut inside each head: a per-head interleave
    if cut in inner and groups == query_heads and cut != groups:
        return None
    return (
        f"fused layout not recognised: its output is viewed as {groups} groups of {tuple(inner)}"
        f" and cut along a dim of {cut} inside each group, which is not per attention head"
        f" ({query_heads or 'no'} heads), so a contiguous split of its rows would mix parts"
    )


def interleave(graph: ModelGraph, op_name: str) -> tuple[int, list[int]] | None:
    """(G, W dims) when ``op_name``'s output is viewed into (..., G, W...) and cut inside each group
    (a per-head interleave when G is the head count, Note [fused layouts read from the graph]); None
    otherwise."""
    view, groups, inner = _grouping_view(graph, op_name, graph.op(op_name).output_shapes[0][-1])
    cut = _first_cut(graph, view) if view is not None else None
    if cut is None or cut == groups and groups not in inner:
        return None
    return groups, inner


def grouping(graph: ModelGraph, op_name: str) -> list[int] | None:
    """The trailing dims (G, W...) ``op_name``'s output is viewed into, heads x head size for a
    projection (``_grouping_view``); None when it is not viewed into groups."""
    view, groups, inner = _grouping_view(graph, op_name, graph.op(op_name).output_shapes[0][-1])
    return [groups, *inner] if view is not None else None


def _grouping_view(graph: ModelGraph, op_name: str, out: int) -> tuple[Op | None, int, list[int]]:
    """The view of ``op_name``'s output (through views that keep its last dim whole) into trailing
    dims (G, W...) whose product is the output width, with G and the W dims; (None, 0, []) if there
    is none. Reshapes following one another regroup the same row-major features, so the last before
    the cut is the grouping it reads (Falcon's ``view(..., 3 * heads, head_dim).unflatten(-2,
    (heads, 3))`` since transformers 5.25: heads groups of (3, head_dim)); a permutation after a
    grouping ends the walk (it reorders what the
    grouping laid out)."""
    name, found = op_name, (None, 0, [])
    while True:
        successors = _uses(graph, name)
        op = successors[0] if len(successors) == 1 else None
        if op is None or op.kind != "view" or op.target in _CUTS or len(op.output_shapes) != 1:
            return found
        if found[0] is not None and op.target not in _RESHAPES:
            return found
        shape = list(op.output_shapes[0])
        if shape and shape[-1] != out:
            start = next(
                (
                    s
                    for s in range(len(shape) - 1)
                    if math.prod(shape[s:]) == out and shape[s] != out
                ),
                None,
            )
            # the features mixed with other dims: the grouping before, if any, is the last read
            if start is None:
                return found
            found = (op, shape[start], shape[start + 1 :])
        # the features flattened back: the cut after reads no grouping of this one
        elif found[0] is not None:
            return found
        name = op.name


def _uses(graph: ModelGraph, name: str) -> list[Op]:
    """The ops reading ``name``'s values, in the order they run (x.size() and x.dim() read only its
    shape)."""
    ops = (graph.op(n) for n in graph.graph.successors(name))
    shapes = ("size", "dim")
    return sorted(
        (
            op
            for op in ops
            if op.target not in shapes and not _shape_only(op.kind, op.output_shapes)
        ),
        key=lambda op: op.index,
    )


_CUTS = (
    "split",
    "chunk",
    "split_with_sizes",
    "unbind",
    "slice",
    "narrow",
    "index",
    "select",
    "getitem",
)
_SPLITS = ("split", "chunk", "split_with_sizes", "unbind")
_RESHAPES = (
    "view",
    "_unsafe_view",
    "reshape",
    "unflatten",
    "flatten",
    "unsqueeze",
    "squeeze",
    "contiguous",
)


def _first_cut(graph: ModelGraph, view: Op) -> int | None:
    """The size of the dim the first cut after ``view`` (through single-use views) is taken along;
    None if none."""
    name = view.name
    while True:
        successors = _uses(graph, name)
        cuts = [
            op for op in successors if op.target in _CUTS and op.input_shapes and op.output_shapes
        ]
        if cuts and len(cuts) == len(successors):
            before, after = cuts[0].input_shapes[0], cuts[0].output_shapes[0]
            return next((a for a, b in zip(before, after) if a != b), before[-1])
        if (
            len(successors) != 1
            or successors[0].kind != "view"
            or len(successors[0].output_shapes) != 1
        ):
            return None
        name = successors[0].name


def _pieces(successors: list[Op], dim: int) -> list[int]:
    """The sizes along ``dim`` of one split (x.split / x.chunk) or of the slices (x[..., a:b],
    x[..., [i], :]) that every successor takes; [] if the successors do something else."""
    for op in successors:
        if op.target in _SPLITS and len(op.output_shapes) > 1 and op.input_shapes:
            return _split_sizes(op, dim)
    slicing = ("slice", "narrow", "index", "select", "getitem") if dim == -2 else ("slice",)
    if successors and all(op.target in slicing and len(op.output_shapes) == 1 for op in successors):
        pieces = []
        for op in successors:  # an index drops the dim it takes one group of (Moshi's gated MLP:
            # view(..., 2, -1)[..., 0, :], a select under torch.export, a getitem under torch.fx)
            before, after = list(op.input_shapes[0]), list(op.output_shapes[0])
            at = dim % len(before) if before else 0
            if len(after) == len(before):
                pieces.append(after[dim])
            elif after == before[:at] + before[at + 1 :]:
                pieces.append(1)
            else:
                return []
        return pieces
    return []


def _split_sizes(op: Op, dim: int) -> list[int]:
    """The sizes along ``dim`` of the pieces one split, chunk or unbind ``op`` cuts its input into;
    [] when it cuts along another dim (the dim is read from the shapes: every other dim of each
    piece is the input's)."""
    before = list(op.input_shapes[0])
    if not before:
        return []
    at = dim % len(before)
    rest = before[:at] + before[at + 1 :]
    sizes = []
    for after in map(list, op.output_shapes):
        if len(after) == len(before) and after[:at] + after[at + 1 :] == rest:
            sizes.append(after[at])
        elif after == rest:  # unbind drops the dim it cuts
            sizes.append(1)
        else:
            return []
    return sizes if sum(sizes) == before[at] else []


def _is_linear(op: Op) -> bool:
    return (
        op.kind == "linear"
        and bool(op.params)
        and len(op.input_shapes) >= 1
        and len(op.output_shapes) >= 1
    )


def linears_outside(graph: ModelGraph) -> list[str]:
    """Linear ops not inside any repeated block."""
    inside = {n for block in graph.blocks for n in block.ops}
    return [op.name for op in graph.compute_ops() if _is_linear(op) and op.name not in inside]


def _walk(g, start: str, members: set[str], step) -> tuple[set[str], set[str]]:
    """Walk from ``start`` (``step`` = successors or predecessors) inside a block, stopping at
    Linears.

    Returns the ops passed (none of them a Linear) and the Linears met.
    """
    passed, linears, stack = set(), set(), list(step(start))
    while stack:
        node = stack.pop()
        if (
            node in passed
            or node in linears
            or node not in members
            or _shape_only(g.nodes[node]["kind"], g.nodes[node]["output_shapes"])
        ):
            # x.shape under torch.fx carries no values: the view sized by it is not fed through it
            continue
        if g.nodes[node]["kind"] == "linear" and g.nodes[node]["params"]:
            linears.add(node)
        else:
            passed.add(node)
            stack.extend(step(node))
    return passed, linears


def _shape_only(kind: str, output_shapes: tuple) -> bool:
    """A view op that gives no tensor (``x.shape``, ``x.size()`` under torch.fx): it reads only a
    shape."""
    return kind == "view" and not output_shapes


def _first_linears(g, start: str, members: set[str], step) -> set[str]:
    """The Linears first met walking from ``start`` (forward or backward) inside the block."""
    return _walk(g, start, members, step)[1]


def _reaches(g, start: str, members: set[str], exits: set[str]) -> bool:
    """Whether ``start``'s output reaches a block exit without passing another Linear."""
    return start in exits or bool(_walk(g, start, members, g.successors)[0] & exits)


# Note [a learned value entering a split region]
#     Between a column Linear and its row partner every rank computes its own heads or features from
#     split tensors. A value that enters that region from outside without a column (DeepSeek's
#     multi-head latent attention: the rotary key part k_pe of kv_a_proj_with_mqa, shared by every
#     head) is read by each rank's heads only, so the gradient flowing back to it is one rank's
#     share, and nothing sums it: the parameters before it train on wrong gradients with no error
#     (6e-3 relative at tp 2, measured). What is checked is a value a replicated Linear of the same
#     block feeds (kv_a_proj_with_mqa); masks, rotary tables and positions (read from the input's
#     shape, no gradient) enter freely. Such a column stays replicated, its row partner with it, and
#     the other columns of that row with them.


def _downstream(g, sources: set[str], members: set[str]) -> set[str]:
    """The block's ops that ``sources`` (its replicated Linears) feed, directly or through other
    ops."""
    seen, stack = set(), list(sources)
    while stack:
        for successor in g.successors(stack.pop()):
            if successor in members and successor not in seen:
                seen.add(successor)
                stack.append(successor)
    return seen


def split_region(graph: ModelGraph, column: str) -> set[str]:
    """The ops between column Linear ``column`` and its row Linears, inside its block (they see
    split tensors)."""
    block = next((b for b in graph.blocks if column in b.ops), None)
    return _region(graph.graph, column, set(block.ops)) if block is not None else set()


def _region(g, column: str, members: set[str]) -> set[str]:
    """Ops downstream of a column Linear up to its row Linears: they see split tensors."""
    return _walk(g, column, members, g.successors)[0]


def _attention_heads(
    graph: ModelGraph, region: set[str], attention: list[str]
) -> dict[str, tuple[int, int]]:
    """(query heads, head_dim) of the attention in a split region.

    Fused attention takes (B, heads, S, head_dim) queries. Attention written out with batched matrix
    products (Bloom's baddbmm, eager attention) takes (B, heads, S, D) or (B * heads, S, D)
    operands.
    """
    if attention:
        return {
            n: (graph.op(n).input_shapes[0][1], graph.op(n).input_shapes[0][-1]) for n in attention
        }
    batch = (
        next(
            (op.output_shapes[0][0] for op in graph.ops if op.kind == "input" and op.output_shapes),
            1,
        )
        or 1
    )
    for name in sorted(region, key=lambda n: graph.op(n).index):
        op = graph.op(name)
        if op.kind != "matmul" or not op.input_shapes:
            continue
        # The first product is queries x keys^T; its query operand follows baddbmm's added input.
        query = (
            op.input_shapes[1]
            if op.target in ("baddbmm", "addbmm") and len(op.input_shapes) > 2
            else op.input_shapes[0]
        )
        if len(query) in (3, 4):
            return {name: (query[1] if len(query) == 4 else query[0] // batch, query[-1])}
    return {}


def _breaks_split(op: Op, attention: list[str], graph: ModelGraph) -> bool:
    """A norm over the split dimension (wider than one head) cannot work on a tensor-parallel
    shard."""
    if op.kind != "norm":
        return op.kind in ("other", "loss", "embedding")
    head_dim = graph.op(attention[0]).input_shapes[0][-1] if attention else 0
    return op.input_shapes[0][-1] > head_dim


_TRANSPOSES = frozenset({"transpose", "permute", "t", "movedim", "swapaxes", "swapdims"})
_BATCH_NORMS = ("batch_norm", "native_batch_norm", "group_norm", "instance_norm")


def _token_stream(graph: ModelGraph) -> tuple[set[str], tuple[int, int]]:
    """The ops computed from the token embeddings' outputs (every op when there is none), and their
    (batch, seq)."""
    g = graph.graph
    embeddings = _input_embeddings(graph)
    roots = embeddings or [op.name for op in graph.ops if op.kind == "input"]
    shape = graph.op(embeddings[0]).output_shapes[0] if embeddings else ()
    if len(shape) < 3 and graph.blocks:
        first = graph.op(graph.blocks[0].ops[0])
        shape = first.input_shapes[0] if first.input_shapes else ()
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        for nxt in g.successors(name):
            node = g.nodes[nxt]
            # sizes carry no tokens
            if nxt not in seen and not _shape_only(node["kind"], node["output_shapes"]):
                seen.add(nxt)
                stack.append(nxt)
    return seen, (tuple(shape[:2]) if len(shape) >= 3 else (0, 0))


def _second_stream(graph: ModelGraph, stream: set[str], tokens: tuple[int, int]) -> str | None:
    """Why the blocks are not one chain, the token stream entering at the first only (None: they
    are).

    Sequence parallelism splits the sequence at the first block's input and gathers it at the last
    block's output; a later block fed a token stream computed afresh from the inputs (an
    encoder-decoder's decoder, after its encoder's blocks) would get it whole, and its split regions
    would gather it again.
    """
    g = graph.graph
    in_blocks = {n for block in graph.blocks for n in block.ops}
    for block in graph.blocks[1:]:
        members = set(block.ops)
        entering = {
            p
            for n in block.ops
            for p in g.predecessors(n)
            if p not in members and p not in in_blocks
        }
        hidden = {
            p
            for p in entering & stream
            if any(_prefix(s, tokens) == 2 for s in graph.op(p).output_shapes)
        }
        # (batch, seq, ...) values: tables read off the input's shape are not tokens
        for value in sorted(hidden):
            seen, stack, from_block = set(), [value], False
            while stack and not from_block:
                node = stack.pop()
                for source in g.predecessors(node):
                    from_block |= source in in_blocks
                    if source not in seen and source not in in_blocks:
                        seen.add(source)
                        stack.append(source)
            if not from_block:
                return (
                    f"sequence_parallel: {block.path} reads {graph.op(value).module or value}, a"
                    " token stream that does not come through the blocks before it (an"
                    " encoder-decoder's second stack), so it would enter the sequence-parallel"
                    " region whole; use sequence_parallel: false"
                )
    return None


def _prefix(shape: tuple[int, ...], tokens: tuple[int, int]) -> int:
    """How many leading dims of ``shape`` index tokens: 2 for (batch, seq, ...), 1 for (batch * seq,
    ...), else 0."""
    if len(shape) >= 2 and tuple(shape[:2]) == tokens:
        return 2
    return 1 if shape and shape[0] == tokens[0] * tokens[1] else 0


def _mixes_tokens(op: Op, tokens: tuple[int, int]) -> str | None:
    """Why ``op`` (on the token stream) may combine several tokens, or None when it provably acts
    per token.

    Note [what acts on each token on its own] (hyparallel.graph.kinds): proved by kind, name and
    shapes.
    """
    if tokens == (0, 0):
        return "is on a stream whose (batch, seq) layout the trace does not show"
    inputs = [s for s in op.input_shapes if _prefix(s, tokens)]
    outputs = op.output_shapes
    # sizes, or a value whose producer was judged (one not kept per token is refused there)
    if not inputs:
        return None
    if outputs and not all(_prefix(s, tokens) for s in outputs):
        return f"turns {tuple(inputs[0])} into {tuple(outputs[0])}, which is not one row per token"
    # a module's own views: allowed, but a transpose among them is not
    names = set(op.inner) or {op.target}
    if names & _TRANSPOSES:
        return f"runs {', '.join(sorted(names & _TRANSPOSES))}, which may move the token dimension"
    names -= VIEW_OPS
    if op.kind in ("linear", "embedding", "activation", "dropout") or op.target == "Identity":
        return None
    if op.kind == "norm":
        if names & set(_BATCH_NORMS) or any(w in op.target for w in ("Batch", "Group", "Instance")):
            return "normalises over several tokens"
        return None
    if op.kind == "view":
        return "moves the token dimension" if op.target in _TRANSPOSES else None
    if names <= POINTWISE:
        return None
    if names <= POINTWISE | REDUCTIONS and outputs and len(inputs[0]) > 2:
        # reduced over trailing dims only: the output keeps one row per token (checked above)
        return None
    return (
        f"computes {', '.join(sorted(names - POINTWISE - REDUCTIONS))[:80]}, not proved to act per"
        " token"
    )


def _token_embedding(graph: ModelGraph) -> tuple[str | None, int | None]:
    """The embedding indexed by a graph input (through views only) and its vocabulary size."""
    for name in _input_embeddings(graph):
        op = graph.op(name)
        if op.param_count:
            return op.name, op.param_count // op.output_shapes[0][-1]
    return None, None


def _input_embeddings(graph: ModelGraph) -> list[str]:
    """Every embedding call indexed by a graph input through views only (an encoder-decoder's shared
    embedding is called once per stack), in the order they run."""
    g, found = graph.graph, []
    for op in graph.compute_ops():
        if op.kind != "embedding" or not op.params:
            continue
        stack, seen = list(g.predecessors(op.name)), set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            kind = g.nodes[node]["kind"]
            if kind == "input":
                found.append(op.name)
                break
            if kind == "view":
                stack.extend(g.predecessors(node))
    return found


def _vocab_head(graph: ModelGraph, vocab: int | None) -> str | None:
    """The Linear outside blocks producing vocab-wide logits that reach the model's output."""
    if vocab is None:
        return None
    for name in reversed(linears_outside(graph)):
        if graph.op(name).output_shapes[0][-1] == vocab:
            return name
    return None
