"""Why a trace failed, in one line: the cause, the module and user source line, and the fix for that
cause.

``explain(model, failures, given)`` turns what torch.fx and torch.export raised into the message of
a TraceError. Each failure is put into one class by its exception type and message (see
Note [classifying trace failures]); the advice given is the one for that class, never a generic one.
"""

from __future__ import annotations

import inspect
import re
import sysconfig
import traceback
from dataclasses import dataclass
from typing import Literal

from torch import nn

Cause = Literal["missing_input", "shape", "data_dependent", "unsupported_op", "other"]

# Note [classifying trace failures]
# What the tracers raise, by cause (torch 2.x, transformers 4/5):
# - data_dependent: torch.fx raises its own TraceError ("symbolically traced variables cannot be
#   used as inputs to control flow") or a TypeError on a Proxy (``int(x.max())``); torch.export
#   raises GuardOnDataDependentSymNode ("Could not guard on data-dependent expression"), a UserError
#   of type DYNAMIC_CONTROL_FLOW, or a meta tensor's ``.item()`` refusal. Note that fx fails the
#   same way on control flow over *shapes*; export then traces such a model, so a failure reaches
#   the user only when export fails too, and export's cause is then the one shown.
# - shape: ATen's shape checks, raised as RuntimeError (or ValueError from a module's own check)
#   while the graph runs on fake or meta tensors: "shape '[2, 16, 4, 16]' is invalid for input of
#   size 1024", "mat1 and mat2 shapes cannot be multiplied", "a and b must have same reduction dim",
#   "The size of tensor a (8) must match the size of tensor b (4)", ...
# - missing_input: Python's TypeError "missing a required argument: 'mask'" (signature binding, both
#   tracers), or Hugging Face's ValueError "You have to specify either decoder_input_ids or
#   decoder_inputs_embeds" / "You must specify exactly one of input_ids or inputs_embeds" (an
#   encoder-decoder fed only input_ids: its decoder stack names its own arguments, which the model's
#   forward takes as decoder_<name>).
# - unsupported_op: an op without a meta or fake kernel (NotImplementedError "... no fake impl or
#   Meta kernel registered", fake tensor's UnsupportedOperatorException), or a call out of torch
#   (``.numpy()``).
# When the tracers fail for different causes the most specific one wins (_PRIORITY): fx also fails
# on constructs export follows, so its failure is often beside the point.
_PRIORITY: tuple[Cause, ...] = (
    "missing_input",
    "shape",
    "data_dependent",
    "unsupported_op",
    "other",
)

_SHAPE = re.compile(
    r"shape '\[[^\]]*\]' is invalid for input of size"
    r"|shapes cannot be multiplied|must have same reduction dim|must match the size of tensor"
    r"|[Ss]izes? (?:of tensors )?(?:must match|mismatch|do not match|don't match)|size mismatch"
    r"|expected (?:input|size|shape|.* to have)|[Gg]iven normalized_shape|is not broadcastable"
    r"|cannot be broadcast|[Ii]ncompatible (?:shapes|sizes)|Dimension out of range|index out of"
    r" range"
    r"|not divisible by|should be divisible by|invalid (?:shape|size)",
    re.IGNORECASE,
)
_DATA_DEPENDENT = re.compile(
    r"data-dependent|cannot be used as inputs to control flow|'Proxy'|Proxy object"
    r"|item\(\) cannot be called on meta|control flow",
    re.IGNORECASE,
)
_UNSUPPORTED = re.compile(
    r"no fake impl|Meta kernel|Could not run '|not supported for tensor subclasses|to numpy"
    r"|not implemented for|NotImplemented",
    re.IGNORECASE,
)
_MISSING_ARGUMENT = re.compile(
    r"missing (?:a|\d+) required (?:positional |keyword-only )?arguments?: (.*)"
)
_SPECIFY_ONE_OF = re.compile(r"specify (?:either |exactly one of |one of )?(\w+) or (\w+)")

_ADVICE: dict[Cause, str] = {
    "shape": (
        "A tensor's shape does not fit the op at that line (a shape mismatch, not control flow):"
        " check the shapes of the example inputs and the sizes the model's config gives (hidden"
        " size, heads, a tp that divides them), and the view, reshape or layer sizes there"
    ),
    "data_dependent": (
        "Python control flow in forward depends on tensor values (data-dependent): replace it with"
        " torch.where or torch.cond, or decide it from shapes or the config instead of values"
    ),
    "unsupported_op": (
        "An op cannot run on the meta device tracing uses (it has no meta or fake kernel): replace"
        " it with standard torch ops, or register a fake kernel with torch.library.register_fake"
    ),
    "other": (
        "Check that forward runs eagerly on the example inputs (model(*args, **kwargs)); if it"
        " does, the error above names the construct the tracers cannot follow"
    ),
}


@dataclass(frozen=True)
class Failure:
    """One tracer's failure: its name ("fx", "export"), what it raised, the innermost module then
    running."""

    tracer: str
    exc: BaseException
    module: str | None


def explain(model: nn.Module, failures: list[Failure], given: set[str]) -> str:
    """One line: each tracer's failure of the decisive cause (where it happened), then the fix for
    that cause.

    ``given`` names the forward arguments the example inputs bound (to tell which required ones are
    missing).
    """
    causes = [_cause(model, failure, given) for failure in failures]
    cause = min(causes, key=_PRIORITY.index)
    shown = [f for f, c in zip(failures, causes) if c == cause] if cause != "other" else failures
    parts = "; ".join(_describe(failure) for failure in shown)
    if cause == "missing_input":
        advice = _missing_advice(model, shown, given)
    else:
        advice = _ADVICE[cause]
    return f"cannot trace {type(model).__name__}: {parts}. {advice}"


def classify(exc: BaseException) -> Cause:
    """The cause of one tracer failure, from the exception's type (any class in its MRO) and
    message."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = str(exc)
    if _missing_names(exc):
        return "missing_input"
    if names & {"GuardOnDataDependentSymNode", "DataDependentOutputException"}:
        return "data_dependent"
    if "UserError" in names and "DYNAMIC_CONTROL_FLOW" in str(getattr(exc, "error_type", "")):
        return "data_dependent"
    if names & {"UnsupportedOperatorException", "UnsupportedFakeTensorException"}:
        return "unsupported_op"
    if isinstance(exc, (RuntimeError, ValueError, IndexError)) and _SHAPE.search(text):
        return "shape"
    if _DATA_DEPENDENT.search(text):
        return "data_dependent"
    if isinstance(exc, NotImplementedError) or _UNSUPPORTED.search(text):
        return "unsupported_op"
    return "other"


def _cause(model: nn.Module, failure: Failure, given: set[str]) -> Cause:
    """``classify``, except that a TypeError naming arguments the model's forward does not take, or
    that the example inputs give, is a call inside forward gone wrong, not a missing input."""
    cause = classify(failure.exc)
    if cause == "missing_input" and isinstance(failure.exc, TypeError):
        try:
            params = set(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            return cause
        if not set(_missing_names(failure.exc)) <= params - given:
            return "other"
    return cause


def _missing_names(exc: BaseException) -> list[str]:
    """The argument names a missing-input error names (Python's binding TypeError, Hugging Face's
    ValueError)."""
    text = str(exc)
    if isinstance(exc, TypeError) and (match := _MISSING_ARGUMENT.search(text)):
        return re.findall(r"'(\w+)'", match.group(1))
    if isinstance(exc, ValueError) and (match := _SPECIFY_ONE_OF.search(text)):
        return list(match.groups())
    return []


def _missing_advice(model: nn.Module, failures: list[Failure], given: set[str]) -> str:
    """What forward needs that the example inputs leave out, and how to pass it."""
    needed = list(
        dict.fromkeys(
            n for f in failures for n in _forward_names(model, _missing_names(f.exc), f.module)
        )
    )
    have = ", ".join(sorted(given)) or "nothing"
    return (
        f"{type(model).__name__}.forward needs {' or '.join(needed)}, which the example inputs"
        f" (giving {have}) leave out: pass every input forward requires in example_inputs= (a dict"
        " of keyword arguments), or with `--example-inputs package.module:make_inputs` returning"
        " that dict"
    )


def _forward_names(model: nn.Module, names: list[str], module: str | None) -> list[str]:
    """``names`` as the root forward's parameters: a submodule's ``input_ids`` is forward's
    ``decoder_input_ids`` when the failure was in module ``decoder`` (Note [classifying trace
    failures]); unmatched names stay as they are."""
    try:
        params = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return names
    prefixes = [part for part in reversed((module or "").split(".")) if part and not part.isdigit()]
    found = []
    for name in names:
        candidates = [name] + [f"{prefix}_{name}" for prefix in prefixes]
        found.append(
            next((c for c in candidates if c in params and (c != name or not prefixes)), name)
        )
    return found


def _describe(failure: Failure) -> str:
    """``torch.export: RuntimeError: <first line> (in module 'm', file.py:12: code)``."""
    exc = failure.exc
    message = next(
        (line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__
    )
    where = [f"module '{failure.module or '(root)'}'"] if failure.module is not None else []
    where += [frame] if (frame := user_frame(exc)) else []
    if not where:  # Note [where a failure is]
        where = ["module '(root)'"]
    return (
        f"torch.{failure.tracer}: {type(exc).__name__}: {message[:200].rstrip()} (in"
        f" {', '.join(where)})"
    )


# Note [where a failure is]
# A location names a real file and line: the innermost traceback frame in the user's own code.
# Frames that are no one's source are skipped: code generated at run time (``<string>`` from
# torch.export's wrappers, fx's ``<eval_with_key>.N`` graph code, ``<frozen ...>``), torch's and
# hyparallel's files, the standard library (inspect.py binding arguments) and transformers' helpers.
# A Hugging Face model's own file (transformers/models/t5/modeling_t5.py) is the model's source, so
# it is named when no user frame exists. With neither, the module that was running says where;
# failing that, the root module.
_STDLIB = sysconfig.get_paths()["stdlib"].replace("\\", "/")


# attribute of an exception: the stack trace of the graph node that raised it
_SOURCE = "hyparallel_source"


def remember_source(exc: BaseException, stack_trace: str | None) -> None:
    """Record where in the user's forward the graph node that raised ``exc`` was traced (fx's
    ``stack_trace``), for an error raised while running a traced graph, whose own traceback is
    generated code and torch."""
    if stack_trace and getattr(exc, _SOURCE, None) is None:
        setattr(exc, _SOURCE, stack_trace)


def user_frame(exc: BaseException) -> str | None:
    """``file.py:line: code`` of the innermost frame in user code, else in a transformers model
    file; else None.

    Frames come from the traceback, then from the stack trace ``remember_source`` recorded."""
    frames = [(f.filename, f.lineno, f.line) for f in traceback.extract_tb(exc.__traceback__)]
    traced = _STACK_ENTRY.findall(getattr(exc, _SOURCE, None) or "")
    fallback = None
    for filename, lineno, line in [*reversed(frames), *reversed(traced)]:
        path = filename.replace("\\", "/")
        kind = _frame_kind(path)
        if kind == "user":
            return _format_frame(path, lineno, line)
        if kind == "model" and fallback is None:
            fallback = _format_frame(path, lineno, line)
    return fallback


_STACK_ENTRY = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n[ \t]*([^\n]*)')


def _frame_kind(path: str) -> Literal["user", "model", "library"]:
    """Whose source a traceback frame's file is (Note [where a failure is])."""
    if path.startswith("<") or any(
        part in path for part in ("/torch/", "/hyparallel/", "/torchgen/")
    ):
        return "library"
    if "/transformers/" in path:
        return "model" if "/transformers/models/" in path else "library"
    in_stdlib = path.startswith(_STDLIB + "/") and not any(
        p in path for p in ("/site-packages/", "/dist-packages/")
    )
    return "library" if in_stdlib else "user"


def _format_frame(path: str, lineno: int | str | None, line: str | None) -> str:
    return f"{path.rsplit('/', 1)[-1]}:{lineno}: {(line or '').strip()}"
