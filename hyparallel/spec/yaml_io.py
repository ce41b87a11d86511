"""YAML and schema I/O shared by plans and cluster specs.

Safe loading only, hardened (see Note [what the loader refuses]), floats written so that YAML 1.1
readers load them back as floats, and pydantic validation errors turned into one line:
``file: field.path: expected ..., got ...``.

Note [what the loader refuses]
    PyYAML's SafeLoader builds no objects, but it still lets the last of two equal keys win silently
    (a plan edited by hand could say two things), recurses once per nesting level (10^5 ``[`` is a
    RecursionError), expands aliases without limit (a "billion laughs" bomb), and converts integers
    of any length (quadratic for sexagesimal ``1:2:3...``, and Python refuses to print ones over
    4,300 digits). ``_Loader`` refuses each with a ``file:line:col`` error: duplicate keys at any
    level (merge keys ``<<`` may still be overridden), nesting deeper than MAX_YAML_DEPTH, more than
    MAX_YAML_NODES values once aliases are expanded (or an alias inside itself), and numbers written
    with more than MAX_NUMBER_CHARS characters.
"""

from __future__ import annotations

import math
import reprlib
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, SequenceNode

from hyparallel.spec.errors import ConfigError
from hyparallel.spec.files import read_text
from hyparallel.spec.limits import MAX_YAML_DEPTH, MAX_YAML_NODES

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)

# digits of a number in a file; every bound in hyparallel.spec.limits has fewer than 25
MAX_NUMBER_CHARS = 1000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """SafeLoader refusing duplicate keys, deep nesting, alias bombs, huge numbers (Note [what the
    loader refuses])."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise ComposerError(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: Node) -> Any:
        _check_expansion(node)
        return super().construct_document(node)

    def construct_mapping(self, node: Node, deep: bool = False) -> dict:
        if isinstance(node, MappingNode):
            _check_duplicates(self, node)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Node) -> int:
        _check_number_length(self, node)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: Node) -> float:
        _check_number_length(self, node)
        return super().construct_yaml_float(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)


def _check_duplicates(loader: _Loader, node: MappingNode) -> None:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG or isinstance(key_node, (MappingNode, SequenceNode)):
            continue  # merged keys may be overridden; unhashable keys are the base loader's error
        key = loader.construct_object(key_node)
        if key in first_line:
            raise ConstructorError(
                None,
                None,
                f"duplicate key {_show(key)} (first on line {first_line[key]}); keep one of them",
                key_node.start_mark,
            )
        first_line[key] = key_node.start_mark.line + 1


def _check_number_length(loader: _Loader, node: Node) -> None:
    text = loader.construct_scalar(node)
    if len(text) > MAX_NUMBER_CHARS:
        raise ConstructorError(
            None,
            None,
            f"a number written with {len(text):,} characters (at most {MAX_NUMBER_CHARS:,})",
            node.start_mark,
        )


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, SequenceNode) else []


def _check_expansion(root: Node) -> None:
    """Refuse a document of more than MAX_YAML_NODES values once aliases are expanded, or deeper
    than MAX_YAML_DEPTH through them, or with an alias inside its own anchor; iterative, so no
    recursion."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key, children = id(node), _children(node)
        if finished:
            open_nodes.discard(key)
            size[key] = 1 + sum(size[id(child)] for child in children)
            depth[key] = 1 + max((depth[id(child)] for child in children), default=0)
            if size[key] > MAX_YAML_NODES or depth[key] > MAX_YAML_DEPTH:
                too_many = size[key] > MAX_YAML_NODES
                what = (
                    f"holds more than {MAX_YAML_NODES:,} values once its aliases are expanded"
                    if too_many
                    else f"is nested more than {MAX_YAML_DEPTH} levels deep through aliases"
                )
                raise ComposerError(None, None, f"this value {what}", node.start_mark)
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise ComposerError(
                None, None, "an alias refers to a value that contains it", node.start_mark
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in size)


def load_yaml_text(text: str) -> Any:
    """Parse YAML text with the hardened safe loader (Note [what the loader refuses]); errors are
    yaml.YAMLError."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes floats in a form YAML 1.1 loaders read back as floats."""


def _represent_float(dumper: yaml.SafeDumper, value: float) -> yaml.Node:
    if math.isnan(value) or math.isinf(value):
        return dumper.represent_float(value)
    text = repr(value)
    # Prefer the shortest exact scientific form for large/small figures (3.12e+14, not
    # 312000000000000.0).
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
    return dumper.represent_scalar(
        "tag:yaml.org,2002:float", f"{mantissa}e{exponent}" if exponent else mantissa
    )


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
    """Load a YAML file with the hardened safe loader; a missing, binary or malformed file is a
    one-line ConfigError."""
    path = Path(path)
    text = read_text(path)
    try:
        return load_yaml_text(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None


def validate(model_cls: type[ModelT], data: Any, source: str) -> ModelT:
    """Validate ``data`` as ``model_cls``; errors become one line prefixed by ``source``."""
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"{type(data).__name__} {_show(data)}"
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {got}")
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{source}: {format_validation_error(exc, model_cls)}") from None


def format_validation_error(
    exc: pydantic.ValidationError, model_cls: type[pydantic.BaseModel]
) -> str:
    """One line for the first error: ``field.path: expected <what the schema says>, got
    <input>``."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    schema = model_cls.model_json_schema()
    message = _describe_error(first, loc, schema)
    path = ".".join(str(part) for part in loc)
    if first["type"] == "value_error" and loc and message.startswith(str(loc[0])):
        # the check's own message already names its fields (e.g. "parallel.virtual_stages is 2 ...")
        path = ""
    more = (
        f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
        if len(errors) > 1
        else ""
    )
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
    if kind == "finite_number":
        return f"expected a finite number, got {_show(got)}"
    expected = _expectation(_schema_at(schema, loc, schema))
    if expected is None:
        return f"{error['msg'][0].lower()}{error['msg'][1:]}, got {_show(got)}"
    return f"expected {expected}{_bound(kind, error.get('ctx', {}), expected)}, got {_show(got)}"


def _bound(kind: str, ctx: dict, expected: str) -> str:
    """The bound a number broke, where ``expected`` ("a positive integer" and the like) does not
    already say it."""

    def number(value: float) -> str:
        return f"{value:,}" if isinstance(value, int) else f"{value:g}"

    if kind == "less_than_equal":
        return f" up to {number(ctx['le'])}"
    if kind == "less_than":
        return f" below {number(ctx['lt'])}"
    said = "positive" in expected or "non-negative" in expected
    if kind == "greater_than_equal" and not (said and ctx["ge"] in (0, 1)):
        return f" of at least {number(ctx['ge'])}"
    if kind == "greater_than" and not (said and ctx["gt"] == 0):
        return f" above {number(ctx['gt'])}"
    return ""


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict, _BRIEF.maxstring, _BRIEF.maxother = 2, 4, 4, 40, 40


def _show(value: Any) -> str:
    """The offending value, in at most 60 characters, in the file's own (YAML flow) notation where
    it is small."""
    # no decimal string: Python refuses past 4,300 digits
    if isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * math.log10(2)):,} digits"
    if not _small(value):
        text = _BRIEF.repr(value)
    else:
        text = (
            repr(value)
            if isinstance(value, str)
            else yaml.safe_dump(value, default_flow_style=True).strip()
        )
        text = text.removesuffix("\n...").removesuffix(" ...")
    return text if len(text) <= 60 else text[:57] + "..."


def _small(value: Any, budget: int = 32) -> bool:
    """Whether ``value`` holds at most ``budget`` scalars (so dumping it whole is cheap)."""
    pending = [value]
    while pending:
        item = pending.pop()
        budget -= 1
        if budget < 0:
            return False
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending.extend(item)
        elif (isinstance(item, str) and len(item) > 1000) or (
            isinstance(item, int) and item.bit_length() > 200
        ):
            return False
    return True


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
