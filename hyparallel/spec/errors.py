"""User-facing errors.

Every error a user can cause (a bad file, an unknown model, a model that cannot be traced, a
plan that does not fit) is a :class:`HyparallelError` whose message is one line naming what is
wrong, where, and what to do. The CLI prints that line and exits 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations


class HyparallelError(Exception):
    """Base class of the errors a user can fix; the message is one line."""


class ConfigError(HyparallelError, ValueError):
    """A plan or cluster file (or object) is malformed or inconsistent."""


class ModelSpecError(HyparallelError, ValueError):
    """A model name, `package.module:factory` or `hf:ARCH` spec cannot be resolved."""


class TraceError(HyparallelError, RuntimeError):
    """Neither torch.fx nor torch.export could trace the model."""


class PlanError(HyparallelError, ValueError):
    """No plan satisfies the request (impossible constraints, indivisible dimensions, nothing
    fits)."""
