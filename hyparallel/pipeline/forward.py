"""A pipelined model's forward for any inputs: outputs gathered on the last stage, and re-traced
stages.

Note [a forward under any plan]
    ``pmodel(...)``, ``eval_step`` and ``generate`` run the pipeline's forwards only
    (``PipelineRuntime.forward``): the batch splits into micro-batches of the plan's ``micro_batch``
    rows when it divides so (else it runs whole), the last stage keeps each micro-batch's output,
    they are concatenated along dim 0 and broadcast to the other pipeline ranks. The stages were
    traced for the training inputs: the same argument names and, under torch.export (which fixes
    every shape), the same micro-batch shapes. Inputs outside that (an attention mask or Hugging
    Face ``labels`` added later, another sequence length while generating) get stages traced again
    for them (``ForwardPipelines``), cached by the inputs' structure and shapes; while generating,
    they are exported with the batch and sequence sizes symbolic and serve every size their input
    constraints admit (Note [one export for every length], hyparallel.graph.tracer), so N new tokens
    cost one trace, not N. They are traced as
    the first ones were: the parameters on the meta device (the model's own tensors are put back
    right after), the buffers as they are, on the run device. Vocab-parallel heads are traced
    gathering their logits, so the outputs, and any loss the model computes inside (``labels=``),
    see the whole vocabulary; sequence parallelism is traced off (Note [whole sequences for a
    forward], hyparallel.tensor.layers), so any length runs. The new stages are graphs over the
    model's own parameters, which under ZeRO 0 are the ones training updates in place. Under ZeRO >=
    1 FSDP2 has replaced them by shards it gathers only around its own stage modules, so a forward
    that needs new stages is refused there, in one line, before any collective.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hyparallel.pipeline.executor import PipelineRuntime, chunk_tree
from hyparallel.pipeline.split import PipelineSplit, split_model
from hyparallel.spec.errors import ConfigError

# re-traced pipelines kept (each one graph per stage of this rank): generation adds one per length
MAX_CACHED = 8


def forward_microbatches(inputs: Any, micro_batch: int) -> int:
    """How many micro-batches a forward of ``inputs`` runs: rows / ``micro_batch`` when it divides,
    else 1."""
    rows = next(
        (v.size(0) for v in tree_flatten(inputs)[0] if isinstance(v, torch.Tensor) and v.dim() > 0),
        0,
    )
    return rows // micro_batch if rows and micro_batch and rows % micro_batch == 0 else 1


def sequence_divides(inputs: Any, multiple: int) -> bool:
    """Whether the inputs' sequence (dim 1 of the first tensor with one) divides by ``multiple``."""
    length = next(
        (v.size(1) for v in tree_flatten(inputs)[0] if isinstance(v, torch.Tensor) and v.dim() > 1),
        0,
    )
    return length % multiple == 0


def fits(split: PipelineSplit, inputs: Any, m: int, sequence_multiple: int = 1) -> bool:
    """Whether ``split``'s stages run ``inputs`` in ``m`` micro-batches: its argument names, a
    sequence that divides by ``sequence_multiple`` (tp under sequence parallelism) and, under
    torch.export, its traced micro-batch shapes."""
    if not sequence_divides(inputs, sequence_multiple):
        return False
    try:
        flat = split.flatten_inputs(inputs)
    except ConfigError:
        return False
    return split.mismatch(flat, m) is None


def concat_outputs(results: list[Any]) -> Any:
    """Per-micro-batch model outputs as one: tensor leaves with a batch dim concatenated, other
    leaves the first's."""
    flats = [tree_flatten(result) for result in results]
    spec = flats[0][1]
    leaves = []
    for position, first in enumerate(flats[0][0]):
        if isinstance(first, torch.Tensor) and first.dim() > 0 and len(flats) > 1:
            leaves.append(torch.cat([flat[position] for flat, _ in flats]))
        else:
            leaves.append(first)
    return tree_unflatten(leaves, spec)


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a broadcast output: its shape and dtype; the tensor itself travels by
    dist.broadcast."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_output(output: Any, source: int, group, device: torch.device) -> Any:
    """``output`` (on the global rank ``source``) on every rank of ``group``: its structure and
    Python values pickled once, with a slot for each tensor, and its tensors broadcast as they
    are."""
    is_source = dist.get_rank() == source
    header = [
        tree_map(
            lambda v: _Slot(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v, output
        )
    ]
    header = header if is_source else [None]
    dist.broadcast_object_list(
        header, src=source, group=group, device=device if device.type == "cuda" else None
    )
    tensors = (
        [v for v in tree_flatten(output)[0] if isinstance(v, torch.Tensor)] if is_source else None
    )

    def fill(slot: Any) -> Any:
        if not isinstance(slot, _Slot):
            return slot
        tensor = (
            tensors.pop(0).contiguous()
            if is_source
            else torch.empty(slot.shape, dtype=slot.dtype, device=device)
        )
        dist.broadcast(tensor, src=source, group=group)
        return tensor

    return tree_map(fill, header[0])


@contextlib.contextmanager
def parameters_on_meta(model: nn.Module) -> Iterator[None]:
    """Every parameter of ``model`` replaced by a meta tensor of its shape while inside (to trace it
    as it was first traced); the model's own parameters are back afterwards, whatever happens."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or param.is_meta:
                    continue
                swapped.append((module, name, param))
                meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
                module._parameters[name] = nn.Parameter(meta, requires_grad=param.requires_grad)
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


class ForwardPipelines:
    """A pipelined model's forwards (Note [a forward under any plan]): on the training stages when
    they run the inputs, else on stages re-traced for them, cached."""

    def __init__(
        self,
        model: nn.Module,
        training: PipelineRuntime,
        stage_modules: list[list[str]],
        device: torch.device,
        *,
        micro_batch: int,
        sequence_multiple: int,
        sliced_head: bool,
        make_runtime: Callable[[PipelineSplit, dict], PipelineRuntime],
        refusal: str | None,
        traced_in: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        """``traced_in()``: a context the model is traced in (the router loss's group: Note [the
        router's auxiliary loss over dp], hyparallel.runtime.router_loss)."""
        self.model, self.training, self.stage_modules, self.device = (
            model,
            training,
            stage_modules,
            device,
        )
        self.group = training.group
        self.micro_batch, self.sequence_multiple, self.sliced_head = (
            micro_batch,
            sequence_multiple,
            sliced_head,
        )
        self.make_runtime, self.refusal, self.traced_in = make_runtime, refusal, traced_in
        self._cache: OrderedDict[Any, PipelineRuntime] = OrderedDict()
        self._lengths_vary = False

    @contextlib.contextmanager
    def lengths_vary(self) -> Iterator[None]:
        """Inside, forwards are expected at many sequence lengths (generation): stages traced for
        them keep their sizes symbolic (Note [one export for every length],
        hyparallel.graph.tracer)."""
        before, self._lengths_vary = self._lengths_vary, True
        try:
            yield
        finally:
            self._lengths_vary = before

    def select(
        self, inputs: Any, whole_logits: Callable[[], Any], gather: bool
    ) -> tuple[PipelineRuntime, int, bool]:
        """(runtime, micro-batches, whether the head gathers the logits) for a forward of
        ``inputs``; ``gather``: whether the caller wants the whole logits (``whole_logits()`` is the
        context that gathers them)."""
        m = forward_microbatches(inputs, self.micro_batch)
        # an exported stage baked the head's slicing in; a torch.fx stage calls the head, which
        # honours the flag
        baked = gather and self.sliced_head and self.training.split.method == "export"
        if fits(self.training.split, inputs, m, self.sequence_multiple) and not baked:
            return self.training, m, gather
        return self._retraced(inputs, m, whole_logits), m, True

    def forward(self, inputs: Any, whole_logits: Callable[[], Any], broadcast: bool) -> Any:
        """The model's output for ``inputs``: on every rank of the pipeline, or with
        ``broadcast=False`` on the last stage's rank only (None elsewhere)."""
        runtime, m, _ = self.select(inputs, whole_logits, gather=True)
        with self.running(runtime):
            results = runtime.forward(inputs, m)
        output = concat_outputs(results) if results is not None else None
        if not broadcast:
            return output
        last = dist.get_global_rank(self.group, (runtime.num_stages - 1) % runtime.pp)
        return broadcast_output(output, last, self.group, self.device)

    def running(self, runtime: PipelineRuntime):
        """The context ``runtime`` runs in: re-traced stages as they were traced (whole
        sequences)."""
        from hyparallel.tensor.layers import whole_sequences

        return contextlib.nullcontext() if runtime is self.training else whole_sequences()

    def _retraced(self, inputs: Any, m: int, whole_logits: Callable[[], Any]) -> PipelineRuntime:
        """The pipeline whose stages run ``inputs`` in ``m`` micro-batches, traced for them on first
        use."""
        example = chunk_tree(inputs, m)[0]
        key = _key(example)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        # stages traced for other sizes that run these too (Note [one export for every length]);
        # traced with whole sequences, so any length divides
        for other, runtime in reversed(self._cache.items()):
            if fits(runtime.split, inputs, m):
                self._cache.move_to_end(other)
                return runtime
        if self.refusal is not None:
            raise ConfigError(self.refusal.format(inputs=_describe(example)))
        from hyparallel.graph.tracer import tracing_device
        from hyparallel.tensor.layers import whole_sequences

        with (
            parameters_on_meta(self.model),
            whole_logits(),
            whole_sequences(),
            tracing_device(self.device),
            self.traced_in(),
        ):
            split = split_model(self.model, self.stage_modules, example, dynamic=self._lengths_vary)
        pp = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        mine = [s for s in range(split.num_stages) if s % pp == rank]
        runtime = self.make_runtime(split, {s: split.stage_module(s, self.device) for s in mine})
        self._cache[key] = runtime
        while len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)
        return runtime


def _key(example: Any) -> Any:
    leaves, spec = tree_flatten(example)
    return str(spec), tuple(
        (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
    )


def _describe(example: Any) -> str:
    leaves, spec = tree_flatten(example)
    shapes = [f"{list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v) for v in leaves]
    names = list(example) if isinstance(example, dict) else None
    return f"{names} shaped {shapes}" if names else f"shaped {shapes}"
