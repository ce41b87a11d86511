"""Reading the files a user names and writing the files a user asks for, with one-line errors.

Reads are bounded (a YAML file larger than ``MAX_YAML_BYTES`` is refused, so ``/dev/zero`` does not
hang) and must be UTF-8 text. Writes go to a temporary file beside the target that replaces it only
once
complete: a failed write leaves an existing file untouched and no partial file behind.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from hyparallel.spec.errors import ConfigError
from hyparallel.spec.limits import MAX_YAML_BYTES

# The file that marks a checkpoint's step folder complete (hyparallel.runtime.checkpoint), here so
# that what writes one without the rest of checkpointing (a parameter server's actor, a fresh
# process) need not import torch.distributed.checkpoint
CHECKPOINT_MARKER = "hyparallel.json"


def read_text(path: str | Path, limit_bytes: int = MAX_YAML_BYTES) -> str:
    """The UTF-8 text of ``path``; a missing, unreadable, oversized or binary file is a one-line
    ConfigError."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            data = file.read(limit_bytes + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder; give a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > limit_bytes:
        raise ConfigError(
            f"{path}: larger than {limit_bytes // 2**20} MiB; expected a YAML file of a plan or"
            " cluster"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); expected"
            " a YAML file"
        ) from None


def kind_of(path: str | Path) -> Literal["file", "folder", "other", "missing"]:
    """What is at ``path``; a path the system cannot even look up (a name too long, a loop) is a
    ConfigError."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as exc:
        raise ConfigError(f"{str(path)[:200]}: {exc.strerror or exc}") from None
    return "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def check_writable(path: str | Path) -> Path:
    """Fail early, in one line, when ``path`` cannot be written as a file (before minutes of
    work)."""
    path = Path(path)
    folder = path.parent
    if kind_of(folder) != "folder":
        raise ConfigError(f"cannot write {path}: no folder {folder}; create it first")
    kind = kind_of(path)
    if kind == "folder":
        raise ConfigError(f"cannot write {path}: it is a folder; give a file name")
    if not os.access(path if kind != "missing" else folder, os.W_OK):
        raise ConfigError(f"cannot write {path}: permission denied")
    return path


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; it replaces ``path`` when the
    block ends.

    On any error the temporary file is removed and ``path`` is left as it was; an OSError (no such
    folder, a folder in the way, no permission, a full disk) becomes a one-line ConfigError.
    """
    path = check_writable(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        reason = exc.strerror or exc
        raise ConfigError(
            f"cannot write {path}: {reason}; check the folder exists and is writable"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
