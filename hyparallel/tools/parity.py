"""``hp.check``: does a layout give the single-device numbers for this architecture? Answered on the
CPU.

Note [a parity check]
    ``check(model, tp=2, pp=2, dp=1)`` builds a small copy of the model (``hf:`` architectures:
    their own config class shrunk by hyparallel.models.tiny, the user's overrides on top; zoo names
    and factories: the spec as given, so pass small sizes), trains it ``steps`` SGD steps on one
    process, then plans the layout (its degrees fixed, the rest the planner's pick, as ``hyparallel
    plan`` would), runs ``parallelize`` in ``dp * tp * pp`` local gloo processes on the same weights
    (the same seed) and batches, and compares: every parameter's first-step gradient, each rank's
    slice against the same slice of the single device's, and the loss of every step. Tolerance:
    fp32, rtol 1e-5 / atol 1e-6 elementwise (the layouts sum partial products, micro-batches and
    ranks in another order: rounding only; as the suite's parity tests), widened for a gradient only
    by the single device's own rounding error against a float64 run (``_close``).

    A model whose training forward draws random numbers of its own (Phi-MoE's Gumbel-sampled
    routing, a dropout the config cannot switch off) gives other numbers on every run, on one
    process too: no layout can match it. Found from the ATen ops one forward of the small copy runs
    (those torch tags as seeded draws, a dropout of p = 0 aside); such a model is compared in eval
    mode (traced, planned, trained and checked with ``model.eval()``), and the report says so
    (``mode``).

    A verdict per parameter group (the names with layer indices folded:
    ``model.layers.*.mlp.up_proj.weight``): equal, differs (with the worst relative error and
    where), or not compared (no rank held it: itself a failure). The layout as a whole is ``equal``,
    ``differs``, ``refused`` (hyparallel said no before the first collective, with its one line) or
    ``failed`` (anything else: a crash inside torch is a bug to report).

    The processes are forked from a launcher that has imported torch and hyparallel once, and one
    launcher serves every check of the calling process (Note [one launcher for every check]); each
    rank joins a gloo group through a file store in a temporary folder, so whatever torchrun
    variables the caller's environment holds, nothing is read from them. The first
    rank to fail ends the launch (the others are terminated, none waits in a collective); a launch
    past ``timeout`` seconds is killed and reported as failed. With HYPARALLEL_CHECK_DIR set, each
    check's folder (every rank's log, result and error) is kept there.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from hyparallel.graph.kinds import logits_of
from hyparallel.graph.tracer import call_with
from hyparallel.spec.errors import ConfigError, HyparallelError

__all__ = ["CheckReport", "GroupVerdict", "check", "expected_slice", "small_spec"]

RTOL, ATOL = 1e-5, 1e-6
LR = 0.1
Verdict = Literal["equal", "differs", "refused", "failed"]


@dataclass
class GroupVerdict:
    """One parameter group: its names, how many were compared, the worst relative error and
    where."""

    group: str
    names: list[str]
    compared: int
    worst_rel: float
    worst_name: str | None
    equal: bool
    unused: int = 0  # names the single-device forward never reads (no gradient) that no rank held

    @property
    def verdict(self) -> str:
        """equal, differs, not compared (a parameter no rank held), or unused (no forward reads
        it)."""
        if self.compared + self.unused < len(self.names):
            return "not compared"
        if self.compared == 0:
            return "unused"
        return "equal" if self.equal else "differs"


@dataclass
class CheckReport:
    """What ``check`` found for one layout of one model."""

    model: str
    layout: dict[str, int]
    verdict: Verdict
    reason: str | None = None
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    groups: list[GroupVerdict] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    mode: str = "train"  # "eval" when the model samples in training (Note [a parity check])
    mode_reason: str | None = None

    @property
    def layout_name(self) -> str:
        return " x ".join(f"{k} {v}" for k, v in self.layout.items() if v > 1) or "one process"

    def summary(self) -> str:
        """One line: the layout and its verdict (with the reason or the worst difference)."""
        if self.verdict in ("refused", "failed"):
            return f"{self.layout_name}: {self.verdict}: {self.reason}"
        if self.verdict == "differs":
            worst = max(
                self.groups, key=lambda g: (g.verdict != "equal", g.worst_rel), default=None
            )
            where = (
                f"; worst {worst.group} ({worst.verdict}, {worst.worst_rel:.1e})" if worst else ""
            )
            return f"{self.layout_name}: differs: {self.reason or ''}{where}".replace(": ;", ":")
        worst = max((g.worst_rel for g in self.groups), default=0.0)
        steps, groups = len(self.losses), len(self.groups)
        return (
            f"{self.layout_name}: equal (losses of {steps} steps, {groups} parameter groups; worst"
            f" {worst:.1e})"
        )

    def table(self) -> str:
        """The verdict per parameter group, then the losses, as ``hyparallel check`` prints them."""
        lines = [f"{self.model}: {self.summary()}"]
        if self.plan:
            lines.append("  plan: " + ", ".join(f"{k}={v}" for k, v in self.plan.items()))
        if self.mode != "train":
            lines.append(f"  compared in {self.mode} mode: {self.mode_reason}")
        width = max((len(g.group) for g in self.groups), default=0)
        for g in self.groups:
            lines.append(f"  {g.group:<{width}}  {g.verdict:<12}  worst rel {g.worst_rel:.1e}")
        if self.losses:
            pairs = ", ".join(f"{a:.6f}/{b:.6f}" for a, b in zip(self.losses, self.ref_losses))
            lines.append(f"  losses (layout/single device): {pairs}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "model": self.model,
            "layout": self.layout,
            "verdict": self.verdict,
            "reason": self.reason,
            "losses": self.losses,
            "ref_losses": self.ref_losses,
            "groups": [g.__dict__ for g in self.groups],
            "plan": self.plan,
            "seconds": round(self.seconds, 2),
            "mode": self.mode,
            "mode_reason": self.mode_reason,
        }


def small_spec(spec: str) -> str:
    """``spec`` with a small config for ``hf:`` architectures (the user's overrides on top); others
    as given."""
    head, *words = spec.split()
    if not head.startswith("hf:"):
        return spec
    import transformers

    from hyparallel.models.tiny import tiny_overrides

    arch = head[3:]
    model_cls = getattr(transformers, arch, None)
    if isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel):
        config_cls = model_cls.config_class
    elif arch in transformers.CONFIG_MAPPING:
        config_cls = transformers.CONFIG_MAPPING[arch]
    else:
        return spec  # build_hf names what is wrong
    given = {w.split("=", 1)[0] for w in words if "=" in w}
    shrunk = {k: v for k, v in tiny_overrides(config_cls).items() if k not in given}
    return " ".join([head, *(f"{k}={_word(v)}" for k, v in shrunk.items()), *words])


def _word(value: Any) -> str:
    """An override value as models.load parses it back (JSON for lists and dicts, no spaces)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    # JSON, quoted for the spec's shell-like split (models.load)
    if isinstance(value, (list, dict)):
        return shlex.quote(json.dumps(value, separators=(",", ":")))
    return str(value)


def check(
    model: str,
    *,
    tp: int = 2,
    pp: int = 2,
    dp: int = 1,
    steps: int = 3,
    seq_len: int = 16,
    micro_batch: int = 2,
    seed: int = 0,
    shrink: bool = True,
    timeout: float = 600.0,
    loss: str | None = None,
    **constraints: Any,
) -> CheckReport:
    """Train a small copy of ``model`` under dp x tp x pp in local gloo processes and compare its
    losses and every gradient with one process's (Note [a parity check]).

    Args:
        model: a MODEL spec: a zoo name, ``hf:Class key=value ...`` or ``package.module:fn``.
        tp, pp, dp: the layout (dp x tp x pp processes are launched on this machine).
        steps, seq_len, micro_batch, seed: the training compared (3 SGD steps of 2 x 16 tokens by
        default).
        shrink: build a small copy of the model's config (layers, widths, vocabulary), its structure
            kept.
        timeout: seconds the launch may take.
        loss: the loss you train with, a ``package.module:fn`` spec of ``fn(output, targets) ->
            scalar`` (Note [the loss a check trains]); token cross-entropy by default.
        constraints: more of the plan (schedule, zero, sequence_parallel, recompute...).

    Returns:
        A CheckReport: ``verdict`` (equal, differs, refused, crashed), ``table()`` the comparison
        group by group, ``summary()`` one line. Nothing is raised for a verdict.

    Raises:
        ConfigError: a bad spec or layout, in one line, before anything is launched.

    Example::

        report = hp.check("hf:LlamaForCausalLM", tp=2, pp=2)
        assert report.verdict == "equal", report.table()
    """
    layout = {"dp": dp, "tp": tp, "pp": pp, **constraints}
    return check_layouts(
        model,
        [layout],
        steps=steps,
        seq_len=seq_len,
        micro_batch=micro_batch,
        seed=seed,
        shrink=shrink,
        timeout=timeout,
        loss=loss,
    )[0]


def check_layouts(
    model: str,
    layouts: list[dict[str, Any]],
    *,
    steps: int = 3,
    seq_len: int = 16,
    micro_batch: int = 2,
    seed: int = 0,
    shrink: bool = True,
    timeout: float = 600.0,
    loss: str | None = None,
) -> list[CheckReport]:
    """``check`` for several layouts of one model (each a dict of dp, tp, pp and other plan
    constraints, or
    ``{"world": N}``: the planner's own pick for N processes): one single-device reference per batch
    size, one launcher process (torch imported once), a launch of processes per layout."""
    started = time.perf_counter()
    spec = small_spec(model) if shrink else model
    reports = [
        CheckReport(
            model=model,
            layout={k: layout.get(k, 1) for k in ("dp", "tp", "pp")}
            | ({"ep": layout["ep"]} if layout.get("ep", 1) > 1 else {})
            | ({"cp": layout["cp"]} if layout.get("cp", 1) > 1 else {}),
            verdict="failed",
        )
        for layout in layouts
    ]
    # the ranks' logs and results stay there, for a bug report
    keep = os.environ.get("HYPARALLEL_CHECK_DIR")
    with tempfile.TemporaryDirectory(prefix="hyparallel-check-", dir=keep) as tmp:
        folder = Path(tempfile.mkdtemp(prefix="check-", dir=keep) if keep else tmp)
        try:
            (names, unused), jobs = _prepare(
                spec, layouts, reports, folder, steps, seq_len, micro_batch, seed, loss
            )
        except HyparallelError as exc:  # the model itself: every layout refused with the same line
            for report in reports:
                report.verdict, report.reason = "refused", _one_line(exc)
            return reports
        if jobs:
            _run_launcher(folder, jobs, timeout)
        for index, report in jobs.items():
            _judge(report, names, unused, folder / f"job{index}")
    spent = time.perf_counter() - started
    for report in reports:
        report.seconds = spent / len(reports)
    return reports


# Note [the loss a check trains]
#     A check trains with token cross-entropy on the output's logits unless given the user's loss
#     (``--loss package.module:fn``, ``hp.check(..., loss=...)``): ``fn(output, targets)`` returning
#     a scalar mean, imported by name in every process. Its targets are class ids over the last dim
#     of the output's logits when it has them, else normal floats shaped like the output's first
#     tensor (a denoiser's ``sample``). Under a loss of the user's the plans gather the logits
#     (vocab_parallel_loss: false), as train_step needs for any loss_fn. An output the default loss
#     cannot read (no tensor, no logits: diffusers' UNet2DOutput) without a loss given is refused in
#     one line before anything launches. train_step weighs each micro-batch's mean alike, and a loss
#     of the user's need not be a mean over rows (a mixture of experts' load-balancing loss is a
#     product of two means: Note [the router's auxiliary loss over dp],
#     hyparallel/runtime/router_loss.py), so its single-process reference runs the layout's
#     micro-batches, not the batch at once: micro-batch k of every dp rank's rows together, their
#     losses averaged, as one device accumulating gradients over them. The default loss (the token
#     mean over the whole batch) keeps the batch at once.


def _prepare(spec, layouts, reports, folder, steps, seq_len, micro_batch, seed, loss=None):
    """The reference and one job folder per plannable layout; layouts the planner refuses are
    reported so."""
    import hyparallel as hp

    loss_fn = hp.models.load_callable(loss, "loss function") if loss else None
    model = hp.models.load(spec).module
    worlds = [
        layout.get("world")
        or r.layout["dp"] * r.layout["tp"] * r.layout["pp"] * r.layout.get("cp", 1)
        for layout, r in zip(layouts, reports)
    ]
    # two micro-batches or more for a pipeline; the planner's pick: room for any dp
    global_batches = [
        (
            world * micro_batch * 2
            if "world" in layout
            else r.layout["dp"] * micro_batch * max(2, r.layout["pp"])
        )
        for world, layout, r in zip(worlds, layouts, reports)
    ]
    rows = max(global_batches)
    batches = _batches(model, rows, seq_len, steps, seed, own_loss=loss_fn is not None)
    # by global batch rows, and (dp, micro-batch) under a loss of the user's
    references: dict[tuple, dict[str, Any]] = {}
    jobs: dict[int, CheckReport] = {}
    example = _micro_batch(batches[0][0], micro_batch)
    # real inputs: a CPU model runs them
    sampling = _samples(spec, _rows(batches[0][0], micro_batch), seed)
    if sampling is not None:  # Note [a parity check]: compared in eval mode
        model.eval()
        for report in reports:
            report.mode, report.mode_reason = "eval", sampling
    tokens = [v for v in torch.utils._pytree.tree_leaves(example) if isinstance(v, torch.Tensor)]
    # token models: traced once at one micro-batch, planned for every layout (as parallelize traces)
    graph = None
    if tokens and not tokens[0].is_floating_point() and tokens[0].dim() == 2:
        graph = hp.trace(model, example)
    # the planner's picks last: they
    order = sorted(range(len(layouts)), key=lambda i: "world" in layouts[i])
    # may replicate what fails only at a larger tp, on the shared graph
    for index in order:
        layout, report = layouts[index], reports[index]
        constraints = {
            k: v for k, v in layout.items() if k not in ("dp", "tp", "pp", "ep", "cp", "world")
        }
        if loss_fn is not None:  # Note [the loss a check trains]: the logits gathered for it
            constraints.setdefault("vocab_parallel_loss", False)
        # {"world": N}: the planner picks the degrees
        degrees = {} if "world" in layout else report.layout
        cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=worlds[index])
        take = global_batches[index]
        mine = [(_rows(inputs, take), targets[:take]) for inputs, targets in batches]
        tokens = [
            v for v in torch.utils._pytree.tree_leaves(mine[0][0]) if isinstance(v, torch.Tensor)
        ]
        # images have no sequence
        length = seq_len if tokens and not tokens[0].is_floating_point() else None
        try:
            if graph is not None:
                plan = hp.search(
                    graph,
                    cluster,
                    take,
                    length,
                    "fp32",
                    traced_rows=micro_batch,
                    module=model,
                    module_inputs=example,
                    micro_batch=micro_batch,
                    **degrees,
                    **constraints,
                ).plan()
            else:
                plan = hp.plan(
                    model,
                    cluster,
                    take,
                    length,
                    "fp32",
                    example_inputs=example,
                    micro_batch=micro_batch,
                    **degrees,
                    **constraints,
                )
        except HyparallelError as exc:
            report.verdict, report.reason = "refused", _one_line(exc)
            continue
        report.plan = _plan_summary(plan)
        if "world" in layout:
            par = plan.parallel
            report.layout = {"dp": par.dp, "tp": par.tp, "pp": par.pp}
            report.layout |= {"cp": par.cp} if par.cp > 1 else {}
            report.plan = {
                "picked": f"dp {par.dp}"
                + (f" x cp {par.cp}" if par.cp > 1 else "")
                + f" x tp {par.tp} x pp {par.pp}",
                **report.plan,
            }
        # Note [the loss a check trains]: a loss of the user's, over the layout's micro-batches
        groups = (plan.parallel.dp, plan.training.micro_batch) if loss_fn is not None else None
        key = (take, groups)
        if key not in references:
            references[key] = _reference(spec, mine, seed, sampling is not None, loss_fn, groups)
        report.ref_losses = references[key]["losses"]
        job = folder / f"job{index}"
        job.mkdir()
        saved = {
            "grads": references[key]["grads"],
            "truth": references[key]["truth"],
            "batches": mine,
        }
        torch.save(saved, job / "reference.pt")
        job.joinpath("job.json").write_text(
            json.dumps(
                {
                    "spec": spec,
                    "plan": plan.to_dict(),
                    "world": worlds[index],
                    "seed": seed,
                    "eval": bool(sampling),
                    "loss": loss,
                }
            )
        )
        jobs[index] = report
    first = next(iter(references.values()), {"names": [], "unused": set()})
    return (first["names"], first["unused"]), jobs


def _rows(inputs: Any, rows: int) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v[:rows] if isinstance(v, torch.Tensor) and v.dim() else v, inputs
    )


def _write(path: Path, data: dict[str, Any]) -> None:
    """Written whole or not at all: a peer may kill this rank at any moment once one has failed."""
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def _read(path: Path) -> dict[str, Any] | None:
    """A rank's JSON report, or None when the rank was killed while writing it (the first failure is
    reported)."""
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def _plan_summary(plan) -> dict[str, Any]:
    par = plan.parallel
    summary = {
        "schedule": par.schedule if par.pp > 1 else None,
        "micro_batch": plan.training.micro_batch,
        "zero": par.zero,
        "sequence_parallel": par.sequence_parallel if par.tp > 1 else None,
        "recompute": par.recompute,
        "split": (
            sum(style != "replicate" for style in (plan.tensor_parallel or {}).values())
            if par.tp > 1
            else None
        ),
    }
    return {k: v for k, v in summary.items() if v is not None}


def _judge(report: CheckReport, names: list[list[str]], unused: set[str], job: Path) -> None:
    """Read a job's results into ``report``: its failure, or the verdict per parameter group and on
    the losses."""
    errors = [e for e in map(_read, sorted(job.glob("error.rank*.json"))) if e is not None]
    launcher = job / "launcher.json"
    if errors:
        # the rank that failed first; the others may follow from it
        first = min(errors, key=lambda e: e["time"])
        report.verdict = "refused" if first["refused"] else "failed"
        report.reason = (
            first["error"] if first["refused"] else f"rank {first['rank']}: {first['error']}"
        )
        return
    if launcher.exists():
        report.verdict, report.reason = "failed", json.loads(launcher.read_text())["error"]
        return
    results = [r for r in map(_read, sorted(job.glob("result.rank*.json"))) if r is not None]
    if not results:
        report.verdict, report.reason = (
            "failed",
            "no rank reported (the launcher did not run this layout)",
        )
        return
    report.losses = results[0]["losses"]
    compared: dict[str, tuple[float, bool]] = {}
    for result in results:
        for name, (rel, ok) in result["grads"].items():
            old = compared.get(name, (0.0, True))
            compared[name] = (max(old[0], rel), old[1] and ok)
    report.groups = [
        _verdict(group, tied, compared, unused) for group, tied in _groups(names).items()
    ]
    pairs = list(zip(report.losses, report.ref_losses))
    loss_ok = len(report.losses) == len(report.ref_losses) and all(
        abs(a - b) <= RTOL * abs(b) + ATOL for a, b in pairs
    )
    good = all(g.verdict in ("equal", "unused") for g in report.groups)
    report.verdict = "equal" if loss_ok and good else "differs"
    if not loss_ok:
        worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=float("inf"))
        report.reason = f"losses differ by up to {worst:.1e} relative"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400] or type(exc).__name__


def _batches(
    model: nn.Module, rows: int, seq_len: int, steps: int, seed: int, own_loss: bool = False
) -> list[tuple[Any, torch.Tensor]]:
    """``steps`` (inputs, targets) pairs: random token ids (or normal floats) shaped like the
    model's inputs, and targets for the loss (Note [the loss a check trains])."""
    import hyparallel as hp

    vocab = _vocab(model)
    generator = torch.Generator().manual_seed(seed + 1)

    def fill(value):
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point():
            return torch.randn(value.shape, generator=generator, dtype=value.dtype)
        if value.dtype == torch.bool:
            return value  # masks stay as the model's example_inputs make them
        return torch.randint(0, vocab, value.shape, generator=generator, dtype=value.dtype)

    example = hp.models.example_inputs(model, rows, seq_len, device="cpu")
    # a model meta tensors cannot run: a language model's targets
    target_shape, classes = (rows, seq_len), vocab
    # the targets: one class per row of the output's last dimension (token ids for a language model)
    try:
        with torch.no_grad():
            output = call_with(model, _to_meta(example))
    except Exception:  # noqa: BLE001 -- judged when it runs for real
        output = None
    if output is not None:
        logits = logits_of(output) if logits_of(output) is not None else output
        if isinstance(logits, torch.Tensor):
            target_shape, classes = tuple(logits.shape[:-1]), int(logits.shape[-1])
        elif not own_loss:
            raise ConfigError(
                f"{type(model).__name__} returns a {type(output).__name__} without logits, so the"
                " default loss (token cross-entropy) has nothing to read; pass the loss you train"
                " with: --loss package.module:fn (hp.check(..., loss=...)), fn(output, targets)"
                " returning a scalar"
            )
        else:  # Note [the loss a check trains]: floats shaped like the output's first tensor
            first = next(
                t
                for t in torch.utils._pytree.tree_leaves(_fields(output))
                if isinstance(t, torch.Tensor)
            )
            target_shape, classes = tuple(first.shape), None
    out = []
    for _ in range(steps):
        inputs = torch.utils._pytree.tree_map(fill, example)
        if isinstance(inputs, dict) and list(inputs) == ["input_ids"]:
            # as parallelize traces a token model by default: positional token ids
            inputs = inputs["input_ids"]
        targets = (
            torch.randn(target_shape, generator=generator)
            if classes is None
            else torch.randint(0, classes, target_shape, generator=generator)
        )
        out.append((inputs, targets))
    return out


def _fields(output: Any) -> Any:
    """A model output's values as a pytree: a dataclass (diffusers' outputs) as its fields in
    order."""
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [getattr(output, f.name) for f in dataclasses.fields(output)]
    return output


def _to_meta(inputs: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, inputs
    )


def _vocab(model: nn.Module) -> int:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    embeddings = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return min(embeddings) if embeddings else 2


def _micro_batch(inputs: Any, rows: int) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v[:rows].to("meta") if isinstance(v, torch.Tensor) and v.dim() else v, inputs
    )


def _samples(spec: str, inputs: Any, seed: int) -> str | None:
    """Why the model's training forward is random (the ATen ops it draws with), or None when it
    draws nothing.

    Read from one forward of the small copy on the CPU: ops torch tags ``nondeterministic_seeded``
    (a dropout of p = 0 draws nothing: ATen returns its input).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    import hyparallel as hp
    from hyparallel.tensor.init import materialize_

    class Draws(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: dict[str, None] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in func.tags and not _no_dropout(
                func, args, kwargs or {}
            ):
                self.names[func.__name__.split(".")[0]] = None
            return func(*args, **(kwargs or {}))

    model = materialize_(hp.models.load(spec).module, "cpu", seed=seed)
    try:
        with torch.no_grad(), Draws() as draws:
            call_with(model, inputs)
    except Exception:  # noqa: BLE001 -- a forward the dispatch mode cannot follow: compared as it trains; a
        return None  # model that draws then shows as differs, never as equal
    if not draws.names:
        return None
    return (
        f"its training forward draws random numbers ({', '.join(draws.names)}), so it was traced,"
        " trained and compared with model.eval()"
    )


def _no_dropout(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a seeded op draws nothing: its dropout probability (attention's ``dropout_p``) is
    0."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name in ("dropout_p", "p"):
            value = (
                args[index]
                if index < len(args)
                else kwargs.get(argument.name, argument.default_value)
            )
            return value == 0
    return False


def _reference(
    spec: str,
    batches,
    seed: int,
    eval_mode: bool = False,
    loss_fn=None,
    groups: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One process: the first step's gradients by name and the loss of each of ``steps`` SGD
    steps; ``groups``: (dp, micro-batch) whose micro-batches a loss of the user's runs (Note [the
    loss a check trains])."""
    import hyparallel as hp
    from hyparallel.tensor.init import materialize_

    model = materialize_(hp.models.load(spec).module, "cpu", seed=seed)
    if eval_mode:
        model.eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, unused = [], None, set()
    for inputs, targets in batches:
        loss = _reference_loss(model, inputs, targets, loss_fn, groups)
        loss.backward()
        if grads is None:
            unused = {
                n for n, p in model.named_parameters(remove_duplicate=False) if p.grad is None
            }
            # a parameter the loss does not reach has no gradient: zero, as every layout must give
            grads = {
                n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in model.named_parameters(remove_duplicate=False)
            }
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    truth = _exact_gradients(spec, batches[0], seed, eval_mode, loss_fn, groups)
    ties: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(n)
    return {
        "grads": grads,
        "truth": truth,
        "losses": losses,
        "names": list(ties.values()),
        "all": names,
        "unused": unused,
    }


def _reference_loss(
    model: nn.Module, inputs: Any, targets: Any, loss_fn, groups: tuple[int, int] | None
) -> torch.Tensor:
    """The loss one process trains on for a batch: token cross-entropy over it, or ``loss_fn``
    over the layout's micro-batches (``groups``: dp, micro-batch), their means averaged, (total,
    count) pairs summed (Note [the loss a check trains])."""
    from hyparallel.runtime.parallel import token_cross_entropy

    if loss_fn is None:
        return token_cross_entropy(call_with(model, inputs), targets)
    dp, micro = groups or (1, targets.size(0))
    share = targets.size(0) // dp
    values = []
    for k in range(share // micro):  # micro-batch k of every dp rank's rows
        index = torch.cat(
            [torch.arange(r * share + k * micro, r * share + (k + 1) * micro) for r in range(dp)]
        )
        rows = torch.utils._pytree.tree_map(
            lambda v, index=index: v[index] if isinstance(v, torch.Tensor) and v.dim() else v,
            inputs,
        )
        values.append(loss_fn(call_with(model, rows), targets[index]))
    if isinstance(values[0], (tuple, list)):
        return sum(v[0] for v in values) / sum(torch.as_tensor(v[1]) for v in values)
    return sum(values) / len(values)


def _exact_gradients(
    spec: str,
    batch: tuple[Any, torch.Tensor],
    seed: int,
    eval_mode: bool,
    loss_fn=None,
    groups: tuple[int, int] | None = None,
) -> dict | None:
    """The first step's gradients computed in float64 (the same weights), to tell rounding from
    error (``_close``); None where the model does not run in float64."""
    import hyparallel as hp
    from hyparallel.tensor.init import materialize_

    try:
        model = materialize_(hp.models.load(spec).module, "cpu", seed=seed).double()
        if eval_mode:
            model.eval()
        inputs = torch.utils._pytree.tree_map(
            lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            batch[0],
        )
        targets = batch[1].double() if batch[1].is_floating_point() else batch[1]
        _reference_loss(model, inputs, targets, loss_fn, groups).backward()
    except Exception:  # noqa: BLE001 -- float64 is a sharper ruler where it runs; the fp32 tolerance stands alone
        return None
    return {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters(remove_duplicate=False)
    }


def _groups(tied: list[list[str]]) -> dict[str, list[list[str]]]:
    """Parameter groups: names with their layer indices folded (``layers.*.mlp``), each a list of
    tied names."""
    groups: dict[str, list[list[str]]] = {}
    for names in tied:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", names[0]), []).append(names)
    return groups


def _verdict(
    group: str, tied: list[list[str]], compared: dict[str, tuple[float, bool]], unused: set[str]
) -> GroupVerdict:
    worst, where, ok, seen, idle = 0.0, None, True, 0, 0
    for names in tied:
        found = [compared[n] for n in names if n in compared]
        if not found:
            idle += names[0] in unused
            continue
        seen += 1
        rel = max(r for r, _ in found)
        ok = ok and all(good for _, good in found)
        if rel >= worst:
            worst, where = rel, names[0]
    return GroupVerdict(group, [names[0] for names in tied], seen, worst, where, ok, idle)


# Note [one launcher for every check]
#     A check's ranks are forked from a launcher process that has imported torch and hyparallel
#     (about 2.5 s of CPU a process), never from the caller, so nothing depends on how the caller's
#     ``__main__`` imports or which threads it runs. One launcher serves every check of the calling
#     process (a sweep's hundreds, a test suite's dozens): started by the first, it reads one batch
#     of job folders per line on its stdin, runs them in turn and answers one line. Each rank takes
#     the environment, working folder and import path its check was called with (a test's own graph
#     cache, a sweep's PYTHONPATH), not those of the check that started the launcher. A batch past
#     its time ends the launcher and its ranks (its session is killed); a launcher that died or was
#     ended is replaced at the next check. It exits when the caller does (its stdin closes).
_launcher_process: subprocess.Popen | None = None
_launcher_lock = threading.Lock()


def _run_launcher(folder: Path, jobs: dict[int, CheckReport], timeout: float) -> None:
    """Run the jobs on the launcher of this process (Note [one launcher for every check]); a job it
    did not finish has no result and is reported as failed."""
    global _launcher_process
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "MASTER_", "GROUP_"))
    }
    environ["OMP_NUM_THREADS"] = "1"
    request = {
        "jobs": [str(folder / f"job{index}") for index in jobs],
        "timeout": timeout,
        "log": str(folder / "launcher.log"),
        "env": environ,
        "cwd": os.getcwd(),
        "path": [os.getcwd(), *sys.path],
    }
    with _launcher_lock:
        launcher = _launcher_process
        if launcher is None or launcher.poll() is not None:
            # its start (an import that fails) is logged with the first check
            with open(request["log"], "w") as log:
                launcher = _launcher_process = subprocess.Popen(
                    [sys.executable, "-m", "hyparallel.tools.parity", "--serve"],
                    env={**environ, "PYTHONPATH": os.pathsep.join(request["path"])},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    start_new_session=True,
                )
        answered = False
        try:
            launcher.stdin.write(json.dumps(request) + "\n")
            launcher.stdin.flush()
            ready, _, _ = select.select([launcher.stdout], [], [], timeout * len(jobs) + 60)
            answered = bool(ready) and launcher.stdout.readline() == "done\n"
        except OSError:  # the launcher died: its pipe is closed
            pass
        finally:  # unanswered (or interrupted): its next answer would be read as another batch's
            if not answered:
                _stop_launcher()


def _stop_launcher() -> None:
    """End the launcher and every rank it forked (its session)."""
    global _launcher_process
    launcher, _launcher_process = _launcher_process, None
    if launcher is not None and launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()


atexit.register(_stop_launcher)


def _serve() -> None:
    """The launcher's loop: one batch of jobs per line on stdin, "done" on stdout when they ran."""
    # imported once, before the forks: torch.export's machinery (torch._dynamo) is what a rank's
    # first trace would import, about 1.1 s of CPU a rank, and a trace is then 0.04 s for gpt-tiny
    import torch._dynamo  # noqa: F401
    import torch.export  # noqa: F401

    import hyparallel.runtime.parallel  # noqa: F401

    answer = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        for job in request["jobs"]:
            _run_job(Path(job), request)
        answer.write("done\n")
        answer.flush()


def _run_job(job: Path, request: dict) -> None:
    """Fork the job's ranks, in its caller's environment; the first rank to fail ends the job (the
    others are killed)."""
    spec = json.loads((job / "job.json").read_text())
    pids: dict[int, int] = {}
    for rank in range(spec["world"]):
        pid = os.fork()
        if pid == 0:  # the rank: its output to a log of its own, its exit code the verdict
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            sys.path[:] = request["path"]
            fd = os.open(job / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 1  # never back into the launcher's loop, whatever the rank raised
            try:
                _worker(
                    rank,
                    spec["spec"],
                    spec["plan"],
                    str(job),
                    spec["world"],
                    spec["seed"],
                    spec["eval"],
                    spec["loss"],
                )
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    _wait(job, pids, request["timeout"])


def _wait(job: Path, pids: dict[int, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    failed = None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                failed = f"the launch ran past {timeout:.0f} s (a rank waiting in a collective?)"
                break
            time.sleep(0.05)
            continue
        rank = pids.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if rank is not None and code != 0:
            if not (job / f"error.rank{rank}.json").exists():
                log = job / f"rank{rank}.log"
                tail = log.read_text()[-300:].strip().splitlines()[-1:] if log.exists() else []
                failed = (
                    f"rank {rank} died"
                    f" ({'signal ' + str(-code) if code < 0 else 'exit code ' + str(code)})"
                )
                failed += f": {tail[0]}" if tail else ""
            break
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    if failed is not None:
        (job / "launcher.json").write_text(json.dumps({"error": failed}))


def _worker(
    rank: int,
    spec: str,
    plan_data: dict,
    folder: str,
    world: int,
    seed: int,
    eval_mode: bool,
    loss: str | None = None,
) -> None:
    """One rank: parallelize the layout, train the batches, compare this rank's gradient slices by
    name."""
    import datetime

    import torch.distributed as dist

    import hyparallel as hp

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    os.environ.update({"LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    out = Path(folder)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
        saved = torch.load(out / "reference.pt", weights_only=False)
        batches, ref_grads, truth = saved["batches"], saved["grads"], saved["truth"]
        plan = hp.Plan.from_dict(plan_data)
        model = hp.models.load(spec).module
        # Note [a parity check]: a model that samples in training, compared in eval mode
        if eval_mode:
            model.eval()
        first = batches[0][0]
        # parallelize traces token ids
        tokens = isinstance(first, torch.Tensor) and not first.is_floating_point()
        # images and the like: these
        example = None if tokens else _micro_batch(first, plan.training.micro_batch)
        pmodel = hp.parallelize(model, plan, example_inputs=example, seed=seed, device="cpu")
        loss_fn = hp.models.load_callable(loss, "loss function") if loss else None
        optimizer = torch.optim.SGD(pmodel.parameters(), lr=LR)
        modules = dict(model.named_modules())
        losses, grads = [], {}
        for step, (inputs, targets) in enumerate(batches):
            value = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets), loss_fn)
            losses.append(value.item())
            if step == 0:
                for name, param in pmodel.named_parameters():
                    owner, _, leaf = name.rpartition(".")
                    want = expected_slice(modules[owner], leaf, ref_grads[name])
                    exact = expected_slice(modules[owner], leaf, truth[name]) if truth else None
                    got = _full(param.grad) if param.grad is not None else torch.zeros_like(want)
                    # relative to the gradient's norm, floored at the absolute tolerance's (a
                    # gradient that is all rounding, such as a key bias's, is judged by atol as the
                    # elementwise check is)
                    floor = ATOL * max(1, want.numel()) ** 0.5
                    rel = ((got - want).norm() / want.norm().clamp_min(floor)).item()
                    ok = got.shape == want.shape and _close(got, want, exact)
                    grads[name] = (rel, ok)
            optimizer.step()
            optimizer.zero_grad()
        _write(out / f"result.rank{rank}.json", {"losses": losses, "grads": grads})
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which ends the launch
        traceback.print_exc()  # into this rank's log (kept with HYPARALLEL_CHECK_DIR)
        refused = isinstance(exc, HyparallelError)
        text = _one_line(exc) if refused else f"{type(exc).__name__}: {_one_line(exc)}"
        if not refused:
            frames = traceback.extract_tb(exc.__traceback__)
            ours = [f for f in frames if "hyparallel" in f.filename] or frames
            text += f" (at {Path(ours[-1].filename).name}:{ours[-1].lineno})" if ours else ""
        report = {"rank": rank, "refused": refused, "error": text, "time": time.time()}
        _write(out / f"error.rank{rank}.json", report)
        os._exit(1)


def _close(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor | None) -> bool:
    """Whether a layout's gradient ``got`` is the single device's ``want`` up to rounding.

    Elementwise within rtol 1e-5 / atol 1e-6 of it; or, where the float64 gradient ``exact`` is
    known, every element within that tolerance of the exact value plus twice the single device's own
    largest rounding error in that tensor. Where the fp32 single device is itself far from exact,
    two fp32 orders of the same sums differ by as much: Gemma 4 at pp 2 had 6 of 8192 elements of
    its tied embedding's gradient 1.35 x past the plain tolerance (1.7e-6 off at 0.046), while the
    single device's own error reached 8.3e-6 (norm 1.2e-5 relative, measured against float64; two
    micro-batches on one process: the same). A wrong split is off by far more than rounding (1e-4 to
    1 relative in every case issue 16 found).
    """
    if torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        return True
    if exact is None:
        return False
    exact = exact.to(torch.float64)
    own = (want.to(torch.float64) - exact).abs().max()
    bound = ATOL + RTOL * exact.abs() + 2 * own
    return bool(((got.to(torch.float64) - exact).abs() <= bound).all())


def expected_slice(module: nn.Module, leaf: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the single-device tensor ``full`` a tensor-parallel module holds (padding rows
    zero)."""
    layout = module.shard_layout(leaf) if callable(getattr(module, "shard_layout", None)) else None
    if layout is None:
        return full
    source = full.t() if layout.transposed else full
    rows = layout.rows or ((0, layout.full_shape[0]),)
    pieces = [
        torch.cat(
            [
                source[a : min(b, source.size(0))],
                source.new_zeros(max(0, b - max(a, source.size(0))), *source.shape[1:]),
            ]
        )
        for a, b in rows
    ]
    out = torch.cat(pieces)
    return out[:, layout.cols[0] : layout.cols[1]] if layout.cols else out


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # FSDP: gathered over dp
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
