"""YAML and schema I/O shared by plans and cluster specs.

Safe loading only, floats written so that YAML 1.1 readers load them back as floats, and
pydantic validation errors turned into one line: ``file: field.path: expected ..., got ...``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from hyparallel.errors import ConfigError

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes floats in a form YAML 1.1 loaders read back as floats."""


def _represent_float(dumper: yaml.SafeDumper, value: float) -> yaml.Node:
    if math.isnan(value) or math.isinf(value):
        return dumper.represent_float(value)
    text = repr(value)
    # Prefer the shortest exact scientific form for large/small figures (3.12e+14, not 312000000000000.0).
    for digits in range(17):
        candidate = f"{value:.{digits}e}"
        if float(candidate) == value:
            break
    if len(candidate) < len(text):
        text = candidate
    mantissa, _, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"  # PyYAML reads '3e+14' as a string; '3.0e+14' as a float
    if exponent and exponent[0] not in "+-":
        exponent = "+" + exponent
    return dumper.represent_scalar("tag:yaml.org,2002:float", f"{mantissa}e{exponent}" if exponent else mantissa)


def _represent_list(dumper: yaml.SafeDumper, value: list) -> yaml.Node:
    # Lists of scalars (mesh orders, per-stage figures) read best on one line.
    flow = all(isinstance(v, (str, int, float, bool)) or v is None for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


_Dumper.add_representer(float, _represent_float)
_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(tuple, _represent_list)


def dump_yaml(data: Any) -> str:
    """Serialise plain data (dicts, lists, scalars) to block-style YAML, keys in insertion order."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def read_yaml(path: str | Path) -> Any:
    """Load a YAML file with the safe loader; a missing file or bad syntax is a one-line ConfigError."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None


def validate(model_cls: type[ModelT], data: Any, source: str) -> ModelT:
    """Validate ``data`` as ``model_cls``; errors become one line prefixed by ``source``."""
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"{type(data).__name__} {data!r}"[:80]
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {got}")
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{source}: {format_validation_error(exc, model_cls)}") from None


def format_validation_error(exc: pydantic.ValidationError, model_cls: type[pydantic.BaseModel]) -> str:
    """One line for the first error: ``field.path: expected <what the schema says>, got <input>``."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    schema = model_cls.model_json_schema()
    message = _describe_error(first, loc, schema)
    path = ".".join(str(part) for part in loc)
    if first["type"] == "value_error" and loc and message.startswith(str(loc[0])):
        path = ""  # the check's own message already names its fields (e.g. "parallel.virtual_stages is 2 ...")
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{path}: {message}{more}" if path else f"{message}{more}"


def _describe_error(error: dict, loc: tuple, schema: dict) -> str:
    kind = error["type"]
    got = error.get("input")
    if kind == "missing":
        return "missing required key"
    if kind == "extra_forbidden":
        parent = _schema_at(schema, loc[:-1], schema)
        allowed = ", ".join(parent.get("properties", {})) if parent else ""
        return f"unknown key '{loc[-1]}'" + (f"; expected one of: {allowed}" if allowed else "")
    if kind == "value_error":
        return str(error.get("ctx", {}).get("error", error["msg"]))
    expected = _expectation(_schema_at(schema, loc, schema))
    if expected is None:
        return f"{error['msg'][0].lower()}{error['msg'][1:]}, got {_show(got)}"
    return f"expected {expected}, got {_show(got)}"


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
    text = text.removesuffix("\n...").removesuffix(" ...")
    return text if len(text) <= 60 else text[:57] + "..."


def _resolve(node: dict, root: dict) -> dict:
    while "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def _schema_at(node: dict | None, loc: tuple, root: dict) -> dict | None:
    """The JSON-schema node that describes the value at ``loc`` (None when not found)."""
    for part in loc:
        if node is None:
            return None
        node = _resolve(node, root)
        for option in node.get("anyOf", []):  # Optional[X]: follow the non-null branch
            option = _resolve(option, root)
            if option.get("type") != "null":
                node = option
                break
        if isinstance(part, int) and "items" in node:
            node = node["items"]
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            node = None  # a union tag or a key the schema does not name
    return _resolve(node, root) if node is not None else None


def _expectation(node: dict | None) -> str | None:
    if not node:
        return None
    if "anyOf" in node:
        parts = [p for p in (_expectation(o) for o in node["anyOf"]) if p]
        return " or ".join(parts) if parts else None
    if "const" in node:
        return repr(node["const"])
    if "enum" in node:
        values = [repr(v) for v in node["enum"]]
        return "one of " + ", ".join(values)
    kind = node.get("type")
    if kind == "integer":
        if node.get("exclusiveMinimum") == 0 or node.get("minimum") == 1:
            return "a positive integer"
        if node.get("minimum") == 0:
            return "a non-negative integer"
        return "an integer"
    if kind == "number":
        if node.get("exclusiveMinimum") == 0:
            return "a positive number"
        if node.get("minimum") == 0:
            return "a non-negative number"
        return "a number"
    if kind == "boolean":
        return "true or false"
    if kind == "string":
        return "a string"
    if kind == "object":
        return "a mapping"
    if kind == "array":
        return "a list"
    return None
