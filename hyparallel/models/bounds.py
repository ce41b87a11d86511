"""Checks of a model's shape settings against hyparallel.spec.limits: a zoo config, a Hugging Face
config.

Every check raises ValueError, a wrong type included: the config dataclasses and ``build_hf`` report
it as one line (a ModelSpecError) naming the model.

A setting out of range (``num_layers=-1``, ``hidden_size=abc``, ``num_layers=1000000000``) is a
ValueError naming the setting, the range and the value, raised before any module is built: a model
with a billion layers would take hours to build even on the meta device, and a zero width divides by
zero later.
"""

from __future__ import annotations

import math
from typing import Any

from hyparallel.spec.limits import MAX_FFN_HIDDEN, MAX_HIDDEN, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_int(name: str, value: Any, low: int, high: int) -> None:
    """``value`` must be an int (not a bool) from ``low`` to ``high``."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low:,} to {high:,}, got {_shown(value)}")


def check_number(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> None:
    """``value`` must be a finite int or float in the interval from ``low`` to ``high`` (ends open
    when asked)."""
    number = (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    )
    if (
        not number
        or value < low
        or value > high
        or (open_low and value == low)
        or (open_high and value == high)
    ):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise ValueError(f"{name} must be a number in {interval}, got {_shown(value)}")


def check_bool(name: str, value: Any) -> None:
    """``value`` must be True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {_shown(value)}")  # noqa: TRY004 -- module docstring


def check_common(
    num_layers: Any, hidden_size: Any, num_heads: Any, vocab_size: Any, max_seq_len: Any
) -> None:
    """The settings every decoder has, in the order later checks need them (heads divide the hidden
    size)."""
    check_int("num_layers", num_layers, 1, MAX_LAYERS)
    check_int("hidden_size", hidden_size, 1, MAX_HIDDEN)
    check_int("num_heads", num_heads, 1, hidden_size)
    check_int("vocab_size", vocab_size, 1, MAX_VOCAB)
    check_int("max_seq_len", max_seq_len, 1, MAX_SEQ_LEN)


# Hugging Face config attributes (the standard names, which each config maps onto its own) and their
# ranges;
# None: the range depends on another attribute, filled in by check_hf_config.
HF_SHAPE_ATTRIBUTES: dict[str, int | None] = {
    "num_hidden_layers": MAX_LAYERS,
    "hidden_size": MAX_HIDDEN,
    "num_attention_heads": None,  # up to hidden_size
    "num_key_value_heads": None,  # up to num_attention_heads
    "intermediate_size": MAX_FFN_HIDDEN,
    "vocab_size": MAX_VOCAB,
    "max_position_embeddings": MAX_SEQ_LEN,
}


def check_hf_config(config: Any) -> None:
    """Check a transformers config's shape attributes that it has (and that are set) before a model
    is built."""
    values: dict[str, Any] = {}
    aliases = getattr(config, "attribute_map", {}) or {}
    for name, high in HF_SHAPE_ATTRIBUTES.items():
        value = getattr(config, name, None)
        if value is None:
            continue
        if high is None:
            high = values.get(
                "hidden_size" if name == "num_attention_heads" else "num_attention_heads",
                MAX_HIDDEN,
            )
        label = f"{name} ({aliases[name]})" if name in aliases else name
        # one per layer (Gemma 3n's widths) or stage (Swin's heads)
        if isinstance(value, (list, tuple)) and value:
            for each in value:
                check_int(label, each, 1, high)
            values[name] = max(value)
            continue
        check_int(label, value, 1, high)
        values[name] = value
