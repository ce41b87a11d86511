"""Run one rank's pipeline stages: the lowered schedule IR executed with point-to-point send/recv.

    split = split_model(model, stage_map, example_microbatch)
    runtime = PipelineRuntime(split, {s: split.stage_module(s) for s in my_stages}, pp_group,
                              schedule="1f1b", num_microbatches=8)
    # every rank of the pipeline: same batch, same mean loss
    loss = runtime.train_step(inputs, targets, loss_fn)

The runtime walks exactly the list of actions ``lower(schedule(...))`` gives this rank (the list the
simulator runs; ``last_order`` records what ran). Sends are non-blocking and buffered (gloo), which
is what the simulator assumes; receives wait. See Note [transfers] for what travels and how, and
Note [one step's state] for what a step keeps.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.utils._pytree import (
    TreeSpec,
    tree_flatten,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)

from hyparallel.pipeline.schedule import Action, ActionKind, lower, schedule, send_window
from hyparallel.pipeline.split import PipelineSplit, Stage, split_model
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.schema import LossFn, Plan, Schedule

StageCall = Callable[[Stage, Any, Any], Any]  # (stage, micro-batch inputs, received) -> output
BeforeBackward = Callable[[Stage, bool], None]  # (stage, is this its last backward of the step)

# Note [transfers]
# A stage hands the next one a tuple of values (PipelineSplit.io): activations, masks, the odd
# Python int an fx trace computes from a shape. Shapes, dtypes, requires_grad flags and the
# non-tensor values are negotiated once per (stage, micro-batch input shapes): the first send
# carries a small pickled header (its length, then its bytes); both ends cache it under the same
# key, since every rank of a pipeline is handed the same batch and so knows the shapes. After that
# only tensors travel, batched with batch_isend_irecv. Gradients travel back for exactly the tensors
# flagged requires_grad. Every message has a tag naming (sending stage, direction, micro-batch,
# slot), so gloo matches a receive to its send whatever else is in flight between the two ranks; the
# schedules also receive in the order of the sends between every pair of ranks
# (schedule.p2p_order_mismatches, tested), which is how NCCL, ignoring tags, matches them. Before
# each F or B the next receive of the list is posted, so its data lands while the rank computes
# instead of after.


@dataclass(frozen=True)
class _Entry:
    """One value crossing a boundary: a tensor's metadata, or a Python value sent once."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    requires_grad: bool = False
    value: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


# Note [one step's state]
# What a step builds (its micro-batches, what each stage received and produced, gradients on their
# way, the sends and receives in flight) lives in one _Step: _run creates it and hands it to each
# action's handler, so none of it outlives the step. What the runtime keeps across steps is only
# what steps share: the negotiated headers and tree specs (Note [transfers]), last_order and
# peak_inflight. A failing step's traceback still holds its _Step, so _run drops its tensors on the
# way out, even then.


@dataclass
class _Step:
    """One step's state (Note [one step's state]); keys ``(stage, micro-batch)`` unless said
    otherwise."""

    inputs: list[list[Any]]  # per micro-batch, the flat user inputs
    targets: list[Any]  # per micro-batch
    # (input shapes, grad mode): eval_step's forwards carry no requires_grad, their own header
    key: tuple[Any, bool]
    loss_fn: LossFn | None  # None: a forward, the last stage keeps its outputs (``results``)
    m: int  # micro-batches of this step
    # flat leaves of what a stage received
    received: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    # what it produced (the last: its loss)
    outputs: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # of its outputs
    # of what it received
    input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    # detached, in the order the last stage ran
    losses: list[torch.Tensor] = field(default_factory=list)
    # a forward's model outputs, by micro-batch (last stage)
    results: dict[int, Any] = field(default_factory=dict)
    # (stage, F/B, micro-batch)
    sends: dict[tuple[int, str, int], list[Any]] = field(default_factory=dict)
    # sends' keys of gradients, oldest first
    sent_back: deque[tuple[int, str, int]] = field(default_factory=deque)
    # early receives
    posted: dict[Action, tuple[list[torch.Tensor], list[Any]]] = field(default_factory=dict)

    def release(self) -> None:
        """Drop every tensor of the step but its (detached) losses."""
        for part in (
            self.inputs,
            self.targets,
            self.received,
            self.outputs,
            self.grads,
            self.input_grads,
        ):
            part.clear()
        self.sends.clear()  # a failed step's sends and early receives: dropped, not waited for
        self.sent_back.clear()
        self.posted.clear()


class PipelineRuntime:
    """One rank of a pipeline: its stage modules, the schedule, and the p2p between neighbours."""

    def __init__(
        self,
        split: PipelineSplit,
        stages: Mapping[int, Stage],
        group: ProcessGroup | None,
        *,
        schedule_kind: Schedule,
        num_microbatches: int,
        virtual_stages: int = 1,
        stage_call: StageCall | None = None,
        before_backward: BeforeBackward | None = None,
    ):
        self.split, self.group = split, group
        # How a stage's forward runs (autocast, recomputation: hyparallel.parallelize sets it), and
        # what runs before each backward (FSDP: reduce gradients at a stage's last micro-batch
        # only).
        self.stage_call = stage_call or (lambda stage, inputs, received: stage(inputs, received))
        self.before_backward = before_backward
        self.pp = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.num_microbatches, self.virtual_stages = num_microbatches, virtual_stages
        self.num_stages = split.num_stages
        if self.num_stages != self.pp * virtual_stages:
            raise ConfigError(
                f"the split has {self.num_stages} stages but pp ({self.pp}) x virtual_stages"
                f" ({virtual_stages}) = {self.pp * virtual_stages}; split into one stage per"
                " (virtual) stage"
            )
        mine = [s for s in range(self.num_stages) if s % self.pp == self.rank]
        if sorted(stages) != mine:
            raise ConfigError(
                f"pipeline rank {self.rank} runs stages {mine} but was given {sorted(stages)}"
            )
        self.stages = dict(stages)
        # the most gradients sent back this rank held at once (over its steps)
        self.peak_backward_sends = 0
        self.program = lower(
            schedule(schedule_kind, self.pp, num_microbatches, virtual_stages),
            self.pp,
            virtual_stages,
        )[self.rank]
        self._send_window = send_window(self.program)  # Note [gradients sent back]
        self.device = next(
            (p.device for st in self.stages.values() for p in st.parameters()), torch.device("cpu")
        )
        shared = sorted(split.shared_state().items())
        # the same on every rank: tags
        self._tied_index = {name: index for index, (name, _) in enumerate(shared)}
        self._tied = {name: sorted({s % self.pp for s in readers}) for name, readers in shared}
        self._tied = {
            name: ranks
            for name, ranks in self._tied.items()
            if len(ranks) > 1 and self.rank in ranks
        }
        by_tensor: dict[int, list[str]] = {}
        for name, param in split.model.named_parameters(remove_duplicate=False):
            by_tensor.setdefault(id(param), []).append(name)
        # tied head: "output.weight" too
        self._aliases = {names[0]: names for names in by_tensor.values()}
        self.canonical = {alias: names[0] for names in by_tensor.values() for alias in names}
        self._headers: dict[tuple[int, Any], list[_Entry]] = {}
        self._specs: dict[tuple[int, Any], TreeSpec] = {}
        self._last_backward = {a.stage: a for a in self.program if a.kind == "B"}
        # + header length and bytes
        self._slots = max((len(io.inputs) for io in split.io), default=0) + 2
        self.last_order: list[str] = []
        self.peak_inflight = 0.0

    @classmethod
    def from_plan(
        cls,
        model: torch.nn.Module,
        plan: Plan,
        group: ProcessGroup | None,
        *,
        example_inputs: Any = None,
        device: torch.device | str = "cpu",
        seed: int = 0,
        **options: Any,
    ) -> PipelineRuntime:
        """This rank's pipeline for ``plan``: its ``stages`` split out of ``model``, the plan's
        schedule.

        ``options`` go to the constructor (``stage_call``, ``before_backward``).
        A meta-device model is materialised stage by stage: this rank allocates and initialises only
        the parameters its stages read (``materialize_`` with ``seed``). ``example_inputs`` is one
        micro-batch; by default token ids of the plan's ``micro_batch x seq_len``.
        """
        from hyparallel.tensor.init import materialize_

        par = plan.parallel
        if plan.stages is None:
            raise ConfigError(
                "the plan lists no stages; complete it with `hyparallel plan` (or list each stage's"
                " modules under stages:) before running a pipeline"
            )
        size = dist.get_world_size(group) if group is not None else 1
        if size != par.pp:
            raise ConfigError(
                f"the plan has pp = {par.pp} but the pipeline group has {size} ranks; pass a group"
                f" of {par.pp} ranks"
            )
        if example_inputs is None:
            example_inputs = torch.zeros(
                plan.training.micro_batch, plan.training.seq_len, dtype=torch.long, device="meta"
            )
        split = split_model(model, [stage.modules for stage in plan.stages], example_inputs)
        rank = dist.get_rank(group) if group is not None else 0
        mine = [s for s in range(split.num_stages) if s % par.pp == rank]
        names = split.state_names(mine)
        if any(t.is_meta for name, t in _state(model) if name in names):
            materialize_(model, device, seed=seed, only=names)
        return cls.for_plan(
            plan, split, {s: split.stage_module(s, device) for s in mine}, group, **options
        )

    @classmethod
    def for_plan(
        cls,
        plan: Plan,
        split: PipelineSplit,
        stages: Mapping[int, Stage],
        group: ProcessGroup | None,
        **options: Any,
    ) -> PipelineRuntime:
        """A runtime of this rank's ``stages`` (already split and materialised) under ``plan``'s
        schedule."""
        par = plan.parallel
        return cls(
            split,
            stages,
            group,
            schedule_kind=par.schedule,
            num_microbatches=plan.num_microbatches,
            virtual_stages=par.virtual_stages,
            **options,
        )

    # ---- public ----------------------------------------------------------------------------------

    def parameters(self):
        """This rank's parameters (every stage it runs; a weight two local stages share, once)."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for param in stage.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def named_parameters(self):
        """``(name, parameter)`` under the model's own names, each parameter once."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for name, param in stage.body.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def first_holder(self, name: str) -> bool:
        """Whether this rank is the first of the pipeline ranks holding weight ``name`` (under any
        alias).

        A weight several stages read (a tied embedding and head) has a copy on each of their ranks;
        sums over the model, such as a gradient norm, count it on the first one only.
        """
        holders = self._tied.get(self.canonical.get(name, name))
        return not holders or self.rank == min(holders)

    def shared_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's copies of the weights several pipeline ranks hold (a tied embedding and
        head)."""
        return [self._tied_parameter(name) for name in self._tied]

    def train_step(
        self, inputs: Any, targets: Any, loss_fn: LossFn, *, broadcast: bool = True
    ) -> Any:
        """Forward and backward of one batch over the pipeline; gradients accumulate into the
        parameters.

        Every rank of the pipeline passes the same ``inputs`` and ``targets``; they are split along
        dim 0 into micro-batches. ``loss_fn(output, targets)`` returns a micro-batch's mean loss on
        the last stage; gradients are those of the mean over micro-batches (the full batch's mean
        for equal micro-batches), and every rank gets that mean loss back (``broadcast=False``: the
        last stage's micro-batch losses, none on other ranks, for a caller that reduces them
        itself).
        """
        tied_before = self._tied_grads_before()
        losses = self._run(self.program, inputs, targets, loss_fn)
        self._sync_tied_grads(tied_before)
        return self._mean_loss(losses) if broadcast else losses

    @torch.no_grad()
    def eval_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        num_microbatches: int | None = None,
        *,
        broadcast: bool = True,
    ) -> Any:
        """The mean loss of a batch without gradients: forwards only, on every rank (``broadcast``
        as train_step's).

        ``num_microbatches`` (default the schedule's) may differ from training's: an evaluation
        batch of its own size.
        """
        m = num_microbatches or self.num_microbatches
        losses = self._run(self._forwards(m), inputs, targets, loss_fn, m)
        return self._mean_loss(losses) if broadcast else losses

    @torch.no_grad()
    def forward(self, inputs: Any, num_microbatches: int = 1) -> list[Any] | None:
        """The model's outputs for ``inputs``, one per micro-batch, on the last stage's rank (None
        on the others).

        Every rank of the pipeline passes the same ``inputs``; they split along dim 0 into
        ``num_microbatches``.
        """
        step = self._run(
            self._forwards(num_microbatches), inputs, None, None, num_microbatches, keep_step=True
        )
        if not self.stages.get(self.num_stages - 1):
            return None
        return [step.results[mb] for mb in range(num_microbatches)]

    def _forwards(self, m: int) -> list[Action]:
        """This rank's forward-only program for ``m`` micro-batches: each of its stages over every
        micro-batch in turn, stage by stage (every pair of ranks receives in the order sent; sends
        do not wait)."""
        ranks = range(self.pp)
        order = {
            r: [
                Action(c * self.pp + r, "F", mb)
                for c in range(self.virtual_stages)
                for mb in range(m)
            ]
            for r in ranks
        }
        return lower(order, self.pp, self.virtual_stages)[self.rank]

    def _run(
        self,
        program: list[Action],
        inputs: Any,
        targets: Any,
        loss_fn: LossFn | None,
        m: int | None = None,
        keep_step: bool = False,
    ) -> Any:
        """Execute ``program`` over one batch of ``m`` micro-batches (default the schedule's); the
        last stage's micro-batch losses (none on other ranks), or with ``keep_step`` the step itself
        (a forward's results)."""
        step = self._new_step(inputs, targets, loss_fn, m or self.num_microbatches)
        self.last_order, self.peak_inflight, peak = [], 0.0, 0
        upcoming_receive = _next_receives(program)
        try:
            for index, action in enumerate(program):
                # let the next receive land while this computes (Note [transfers])
                if action.is_compute:
                    upcoming = upcoming_receive[index]
                    if (
                        upcoming is not None
                        and upcoming not in step.posted
                        and self._header_known(step, upcoming)
                    ):
                        step.posted[upcoming] = self._post_recv(step, upcoming)
                _HANDLERS[action.kind](self, step, action)
                self.last_order.append(str(action))
                # micro-batches whose activations this rank holds
                peak = max(peak, len(step.outputs))
            for works in step.sends.values():
                for work in works:
                    work.wait()
        finally:  # nothing of this step outlives it, even when it fails (Note [one step's state])
            step.release()
        self.peak_inflight = peak / self.virtual_stages
        return step if keep_step else step.losses

    def _new_step(self, inputs: Any, targets: Any, loss_fn: LossFn | None, m: int) -> _Step:
        """A step's state: ``inputs`` and ``targets`` cut into micro-batches, the first checked
        against the split."""
        flat = self.split.flatten_inputs(inputs)
        chunks = _chunk_each(flat, m, "inputs")
        self.split.check_microbatch(chunks[0])
        targets_per_microbatch = chunk_tree(targets, m)
        shapes = tuple(
            (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in chunks[0]
        )
        return _Step(chunks, targets_per_microbatch, (shapes, torch.is_grad_enabled()), loss_fn, m)

    # ---- compute ---------------------------------------------------------------------------------

    def _forward(self, step: _Step, a: Action) -> None:
        stage = self.stages[a.stage]
        received = ()
        if a.stage > 0:
            received = tree_unflatten(
                self._take_forward(step, a), self._specs[a.stage - 1, step.key]
            )
        output = self.stage_call(stage, step.inputs[a.microbatch], received)
        if stage.is_last and step.loss_fn is None:  # a forward: the model's output is the result
            step.results[a.microbatch] = output
            return
        if stage.is_last:
            loss = loss_fn_checked(step.loss_fn, output, step.targets[a.microbatch])
            step.losses.append(loss.detach())
            step.outputs[a.stage, a.microbatch] = [loss / step.m]
            return
        # a tuple of values, some of them tuples of tensors themselves
        leaves, spec = tree_flatten(output)
        self._specs.setdefault((a.stage, step.key), spec)
        step.outputs[a.stage, a.microbatch] = leaves

    def _backward(self, step: _Step, a: Action) -> None:
        key = (a.stage, a.microbatch)
        outputs = step.outputs.pop(key)
        if self.before_backward is not None:
            self.before_backward(self.stages[a.stage], a == self._last_backward[a.stage])
        for work in step.sends.pop((a.stage, "F", a.microbatch), ()):
            # long done (its gradient came back): drop the reference to the sent activation
            work.wait()
        if a.stage == self.num_stages - 1:
            outputs[0].backward()
        else:
            needs_grad = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            grads = step.grads.pop(key)  # one per output that requires grad, in order
            if needs_grad:
                torch.autograd.backward(needs_grad, grads)
        received = step.received.pop(key, [])
        input_grads = [
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t in received
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        # previous stage on this rank: hand over in memory
        if a.stage > 0 and (a.stage - 1) % self.pp == self.rank:
            step.grads[a.stage - 1, a.microbatch] = input_grads
        elif a.stage > 0:
            step.input_grads[key] = input_grads

    # ---- transfers -------------------------------------------------------------------------------

    def _take_forward(self, step: _Step, a: Action) -> list[Any]:
        key = (a.stage, a.microbatch)
        # previous stage on this rank (pp == 1): its outputs, cut from its graph
        if key not in step.received:
            step.received[key] = [_leaf(v) for v in step.outputs[a.stage - 1, a.microbatch]]
        return step.received[key]

    def _send_activation(self, step: _Step, a: Action) -> None:
        values = step.outputs[a.stage, a.microbatch]
        entries = [
            (
                _Entry(tuple(v.shape), v.dtype, v.requires_grad)
                if isinstance(v, torch.Tensor)
                else _Entry(None, None, value=v)
            )
            for v in values
        ]
        header_key = (a.stage, step.key)
        if header_key not in self._headers:
            self._headers[header_key] = entries
            self._send_header((self._specs[header_key], entries), a)
        elif entries != self._headers[header_key]:
            raise RuntimeError(
                f"stage {a.stage} now hands on {_describe(entries)} but negotiated"
                f" {_describe(self._headers[header_key])} on the first step with these input"
                " shapes: a value between stages changed with the data, or parameters were frozen"
                " or unfrozen after the first step (set requires_grad before it, or build a new"
                " runtime)"
            )
        tensors = [v.detach().contiguous() for v in values if isinstance(v, torch.Tensor)]
        step.sends[a.stage, "F", a.microbatch] = self._isend(tensors, a)

    def _receive_activation(self, step: _Step, a: Action) -> None:
        header_key = (a.stage - 1, step.key)
        if header_key not in self._headers:
            self._specs[header_key], self._headers[header_key] = self._recv_header(a)
        buffers = self._wait_recv(step, a)
        received, it = [], iter(buffers)
        for e in self._headers[header_key]:
            received.append(next(it).requires_grad_(e.requires_grad) if e.is_tensor else e.value)
        step.received[a.stage, a.microbatch] = received

    def _header_known(self, step: _Step, a: Action) -> bool:
        return ((a.stage - 1 if a.kind == "RECV_F" else a.stage), step.key) in self._headers

    def _post_recv(self, step: _Step, a: Action) -> tuple[list[torch.Tensor], list[Any]]:
        """Allocate and post the receives of ``a`` (RECV_F: the values; RECV_B: gradients of those
        needing one)."""
        if a.kind == "RECV_F":
            entries = [e for e in self._headers[a.stage - 1, step.key] if e.is_tensor]
        else:
            entries = [
                e for e in self._headers[a.stage, step.key] if e.is_tensor and e.requires_grad
            ]
        buffers = [torch.empty(e.shape, dtype=e.dtype, device=self.device) for e in entries]
        peer = self._peer(a)
        ops = [
            dist.P2POp(dist.irecv, t, peer, self.group, self._tag(a, 2 + i))
            for i, t in enumerate(buffers)
        ]
        return buffers, dist.batch_isend_irecv(ops) if ops else []

    def _wait_recv(self, step: _Step, a: Action) -> list[torch.Tensor]:
        buffers, works = step.posted.pop(a) if a in step.posted else self._post_recv(step, a)
        for work in works:
            work.wait()
        return buffers

    def _send_gradient(self, step: _Step, a: Action) -> None:
        grads = [g.contiguous() for g in step.input_grads.pop((a.stage, a.microbatch))]
        step.sends[a.stage, "B", a.microbatch] = self._isend(grads, a)
        step.sent_back.append((a.stage, "B", a.microbatch))
        self._hold_fewer_sends(step)

    # Note [gradients sent back]
    #     An isend's work references the tensor it sends until it is waited for. A forward's send is
    #     waited for at that micro-batch's backward; a gradient sent back has no such point, and
    #     waiting for them all at the end of the schedule held m per virtual stage. So each new one
    #     drops those already delivered, and beyond schedule.send_window (one per micro-batch chunk
    #     in flight here) waits for the oldest. That cannot deadlock: the receiving device takes
    #     this device's gradients in the order they were sent (the schedules agree on every pair's
    #     send order, schedule.p2p_order_mismatches), so the oldest one undelivered is the next it
    #     receives, and what it does before receiving it needs nothing from this device that is not
    #     already sent.
    def _hold_fewer_sends(self, step: _Step) -> None:
        held = step.sent_back  # delivered in the order sent: the oldest first
        while held and (
            len(held) > self._send_window
            or all(work.is_completed() for work in step.sends[held[0]])
        ):
            for work in step.sends.pop(held.popleft()):
                # the oldest beyond the window; else done already (raises if the send failed)
                work.wait()
        self.peak_backward_sends = max(self.peak_backward_sends, len(held))

    def _receive_gradient(self, step: _Step, a: Action) -> None:
        step.grads[a.stage, a.microbatch] = self._wait_recv(step, a)

    def _peer(self, a: Action) -> int:
        peer_rank = a.peer % self.pp
        return dist.get_global_rank(self.group, peer_rank) if self.group is not None else peer_rank

    def _tag(self, a: Action, slot: int) -> int:
        sender = a.stage if a.kind.startswith("SEND") else a.peer
        direction = 0 if a.kind.endswith("F") else 1
        return ((a.microbatch * self.num_stages + sender) * 2 + direction) * self._slots + slot

    def _isend(self, tensors: list[torch.Tensor], a: Action, first_slot: int = 2) -> list[Any]:
        peer = self._peer(a)
        ops = [
            dist.P2POp(dist.isend, t, peer, self.group, self._tag(a, first_slot + i))
            for i, t in enumerate(tensors)
        ]
        return dist.batch_isend_irecv(ops) if ops else []

    def _irecv(self, buffers: list[torch.Tensor], a: Action, first_slot: int = 2) -> None:
        peer = self._peer(a)
        ops = [
            dist.P2POp(dist.irecv, t, peer, self.group, self._tag(a, first_slot + i))
            for i, t in enumerate(buffers)
        ]
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()

    def _send_header(self, header: tuple[TreeSpec, list[_Entry]], a: Action) -> None:
        spec, entries = header
        payload = torch.frombuffer(
            bytearray(pickle.dumps((treespec_dumps(spec), entries))), dtype=torch.uint8
        ).to(self.device)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        for work in (
            *self._isend([length], a, first_slot=0),
            *self._isend([payload], a, first_slot=1),
        ):
            work.wait()  # once per shape: keeps the two small buffers alive until sent

    def _recv_header(self, a: Action) -> tuple[TreeSpec, list[_Entry]]:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        self._irecv([length], a, first_slot=0)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._irecv([payload], a, first_slot=1)
        # noqa: S301 -- from a rank of our own job
        spec, entries = pickle.loads(payload.cpu().numpy().tobytes())
        return treespec_loads(spec), entries

    # ---- after the schedule ----------------------------------------------------------------------

    def _tied_grads_before(self) -> dict[str, torch.Tensor | None]:
        """The gradients of shared weights before this step: only the step's own part is
        exchanged."""
        before = {}
        for name in self._tied:
            grad = self._tied_parameter(name).grad
            before[name] = None if grad is None else _local(grad).clone()
        return before

    def _tied_parameter(self, name: str) -> torch.nn.Parameter:
        """The shared weight as this rank's stages hold it now (under any alias; FSDP may have
        replaced it)."""
        for stage in self.stages.values():
            held = dict(stage.body.named_parameters(remove_duplicate=False))
            for alias in self._aliases[name]:
                if alias in held:
                    return held[alias]
        raise KeyError(f"no stage on pipeline rank {self.rank} holds {name}")

    def _sync_tied_grads(self, before: dict[str, torch.Tensor | None]) -> None:
        """A weight read by stages on several ranks (tied embedding and head): sum this step's
        gradient over them.

        Every holder adds the same parts in the same (rank) order to the same earlier total, so the
        copies stay bitwise equal, as Megatron-LM's all-reduce over its embedding group keeps them.
        Tags come from the weight's place among all shared weights, the same on every rank.
        """
        # above every action's tags
        first_free_tag = self.num_microbatches * self.num_stages * 2 * self._slots
        for name, ranks in self._tied.items():
            param = self._tied_parameter(name)
            grad = _local(param.grad) if param.grad is not None else torch.zeros_like(_local(param))
            step_part = grad - before[name] if before[name] is not None else grad.clone()
            base = first_free_tag + self._tied_index[name] * self.pp
            parts: dict[int, torch.Tensor] = {self.rank: step_part}
            ops = []
            for other in ranks:
                if other == self.rank:
                    continue
                peer = dist.get_global_rank(self.group, other)
                parts[other] = torch.empty_like(step_part)
                ops.append(dist.P2POp(dist.isend, step_part, peer, self.group, base + self.rank))
                ops.append(dist.P2POp(dist.irecv, parts[other], peer, self.group, base + other))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            total = (
                before[name].clone() if before[name] is not None else torch.zeros_like(step_part)
            )
            for other in ranks:
                total += parts[other]
            if param.grad is None:
                param.grad = total
            else:
                _local(param.grad).copy_(total)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's micro-batch ``losses``, broadcast from its rank to the whole
        pipeline."""
        last_rank = (self.num_stages - 1) % self.pp
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        if self.group is not None and self.pp > 1:
            loss = loss.to(torch.float32).contiguous()
            dist.broadcast(loss, src=dist.get_global_rank(self.group, last_rank), group=self.group)
        return loss


# Note [action handlers]
# Each kind of action has one handler, (runtime, step, action) -> None, in one table built at
# import, where it is checked to cover ActionKind exactly: a new kind of action fails the import,
# not a step.
_Handler = Callable[[PipelineRuntime, _Step, Action], None]


def _covering(handlers: Mapping[ActionKind, _Handler]) -> dict[ActionKind, _Handler]:
    """``handlers``, checked to have one entry for each kind in ``ActionKind`` and no other."""
    kinds = list(ActionKind)
    missing = [kind for kind in kinds if kind not in handlers]
    unknown = [kind for kind in handlers if kind not in kinds]
    if missing or unknown:
        raise TypeError(
            f"the runtime's action handlers lack {missing} and have unknown kinds {unknown}"
        )
    return dict(handlers)


_HANDLERS = _covering(
    {
        ActionKind.F: PipelineRuntime._forward,
        ActionKind.B: PipelineRuntime._backward,
        ActionKind.SEND_F: PipelineRuntime._send_activation,
        ActionKind.RECV_F: PipelineRuntime._receive_activation,
        ActionKind.SEND_B: PipelineRuntime._send_gradient,
        ActionKind.RECV_B: PipelineRuntime._receive_gradient,
    }
)


def loss_fn_checked(loss_fn: LossFn, output: Any, targets: Any) -> torch.Tensor:
    """``loss_fn(output, targets)``, checked to be a scalar tensor."""
    loss = loss_fn(output, targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            "loss_fn must return a scalar tensor (a micro-batch's mean loss), got"
            f" {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss


def _next_receives(program: list[Action]) -> list[Action | None]:
    """For each position of ``program``, the first receive after it (None if there is none)."""
    upcoming: list[Action | None] = [None] * len(program)
    following = None
    for index in range(len(program) - 1, -1, -1):
        upcoming[index] = following
        if program[index].kind.startswith("RECV"):
            following = program[index]
    return upcoming


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a weight sharded over data parallelism), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _describe(entries: list[_Entry]) -> str:
    return (
        "["
        + ", ".join(
            (
                f"tensor{list(e.shape)}{' (grad)' if e.requires_grad else ''}"
                if e.is_tensor
                else repr(e.value)
            )
            for e in entries
        )
        + "]"
    )


def _leaf(value: Any) -> Any:
    """A value handed to the next stage on the same rank, cut from this stage's autograd graph."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def _chunk_each(flat: list[Any], m: int, what: str) -> list[list[Any]]:
    """Split every tensor along dim 0 into ``m`` equal micro-batches; other values go to each."""
    pieces = []
    for position, value in enumerate(flat):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.size(0) % m:
                raise ConfigError(
                    f"{what}[{position}] has {value.size(0)} rows, which do not split into {m}"
                    f" equal micro-batches; pass a batch that is a multiple of {m}"
                )
            pieces.append(value.chunk(m))
        else:
            pieces.append([value] * m)
    return [[p[i] for p in pieces] for i in range(m)]


def chunk_tree(tree: Any, m: int) -> list[Any]:
    """``tree`` (a tensor, or a tuple, list or dict of them) as ``m`` micro-batches of the same
    structure.

    Every tensor leaf with a dim 0 is split along it into ``m`` equal parts; other leaves (0-d
    tensors, Python values) go to each micro-batch.
    Raises ConfigError when a tensor's rows do not split evenly.
    """
    leaves, spec = tree_flatten(tree)
    return [tree_unflatten(chunk, spec) for chunk in _chunk_each(leaves, m, "targets")]


def _state(model: torch.nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)
