"""Pictures of plans: ``render_timeline`` draws a simulated training step as pipeline papers do.

One row per pipeline rank, rank 0 on top: forward blocks in blues, backward in greens, a lighter
shade per virtual-stage chunk, the micro-batch number inside each block wide enough for it, idle
time left empty; hatched grey where a rank waits on a point-to-point transfer, a thin dark bar under
a row while its sends are on the wire, and each rank's tail (gradient sync and optimizer step) in
purple. Below, each rank's memory over the step against the device's memory. When the blocks of the
whole step are too narrow to read, the first and the last stretch of the step are drawn again,
magnified.

matplotlib is imported inside the functions that draw (Agg canvas, no pyplot, no global backend), so
``import hyparallel`` never needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hyparallel.planner.timeline import Block, Timeline
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.files import atomic_output, check_writable

FORMATS = (".png", ".svg")
WIDTH_IN, DPI = 15.0, 120
ROW_HEIGHT = 0.8  # of one rank's row; the rest is the gap between rows
LABEL_FONT_PT = 7
LEFT, RIGHT = 0.09, 0.98  # the panels' edges, as fractions of the figure's width
# magnify the ends of the step when the median forward block is narrower than this ...
MIN_BLOCK_PX = 22
ZOOMED_BLOCK_PX = 32  # ... to this: room for a three-digit micro-batch number
TAIL_COLOR, WAIT_COLOR, WIRE_COLOR = "#8e6bbf", "#b0b0b0", "#404040"


@dataclass(frozen=True)
class Rendered:
    """What ``render_timeline`` drew: counts a test can check against the schedule IR."""

    path: Path
    # F and B blocks in the whole-step panel (pp * virtual_stages * num_microbatches * 2), each its
    compute_bars: int
    # own bar or, when under a pixel wide, part of a run drawn as one bar
    labels: int  # micro-batch numbers written inside blocks, all panels together
    magnified: bool  # whether the first and last stretch of the step got panels of their own


def check_picture_path(path: str | Path) -> Path:
    """``path`` if a picture can be written there (a known extension, a writable place), else a
    one-line ConfigError."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ConfigError(
            f"cannot draw '{path}': unknown picture extension '{path.suffix or '(none)'}'; "
            f"use one of {', '.join(FORMATS)}"
        )
    return check_writable(path)


def render_timeline(timeline: Timeline, path: str | Path) -> Rendered:
    """Draw ``timeline`` (a Gantt chart of the step over its memory per rank) to ``path``, PNG or
    SVG by extension."""
    path = check_picture_path(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scale, unit = _time_unit(timeline)
    gantt_in, memory_in = 0.9 + 0.42 * timeline.pp, 2.6
    forward_s = _median_forward_s(timeline)
    magnify = forward_s / timeline.total_s * WIDTH_IN * DPI * (RIGHT - LEFT) < MIN_BLOCK_PX
    heights = [gantt_in, gantt_in, memory_in] if magnify else [gantt_in, memory_in]
    fig = Figure(figsize=(WIDTH_IN, sum(heights) + 0.85 * (len(heights) - 1) + 1.75), dpi=DPI)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(
        len(heights),
        2,
        height_ratios=heights,
        left=LEFT,
        right=RIGHT,
        wspace=0.04,
        bottom=0.5 / fig.get_figheight(),
        top=1 - 1.25 / fig.get_figheight(),
        hspace=0.85 / (sum(heights) / len(heights)),
    )  # 0.85 in between panels
    whole = fig.add_subplot(grid[0, :])
    bars, labels = _draw_gantt(whole, timeline, scale, (0.0, timeline.total_s))
    whole.set_title(
        "the whole step"
        + (" (blocks too narrow to number: its two ends magnified below)" if magnify else "")
        + (
            "; runs of blocks under a pixel wide drawn as one bar, coloured by their forward /"
            " backward mix"
            if forward_s / timeline.total_s * whole.bbox.width < 1
            else ""
        ),
        fontsize=9,
        loc="left",
    )
    if magnify:
        for column, name in enumerate(("start", "end")):
            ax = fig.add_subplot(grid[1, column])
            window = min(forward_s * ax.bbox.width / ZOOMED_BLOCK_PX, timeline.total_s / 2)
            # The end: the pipeline's cool-down, then the start of the tails (which may be longer
            # than the window).
            lo = (
                0.0
                if name == "start"
                else max(b.end_s for b in timeline.compute_blocks()) - 0.85 * window
            )
            labels += _draw_gantt(
                ax, timeline, scale, (lo, lo + window), rank_labels=name == "start"
            )[1]
            ax.set_title(
                f"the {name} of the step, magnified {timeline.total_s / window:.0f}x",
                fontsize=9,
                loc="left",
            )
    _draw_memory(fig.add_subplot(grid[-1, :]), timeline, scale)
    for ax in fig.axes:
        ax.set_xlabel(unit, fontsize=8)
    fig.suptitle(
        _title(timeline), fontsize=10, x=LEFT, ha="left", y=1 - 0.15 / fig.get_figheight(), va="top"
    )
    _legend(fig, timeline)
    with atomic_output(path) as tmp:  # a failed write leaves no partial picture
        fig.savefig(tmp, format=path.suffix.lower()[1:])
    return Rendered(path, bars, labels, magnify)


def _time_unit(timeline: Timeline) -> tuple[float, str]:
    """Factor from the timeline's seconds to the axis unit, and the axis label."""
    if timeline.units == "relative":
        return 1.0, "time (relative units: a forward = 1, a backward = 2)"
    return (1e3, "time (ms)") if timeline.total_s < 1 else (1.0, "time (s)")


def _median_forward_s(timeline: Timeline) -> float:
    """The median forward block's duration."""
    durations = sorted(b.duration_s for b in timeline.blocks if b.kind == "F")
    return durations[len(durations) // 2]


def _colors(kind: str, virtual_stages: int) -> list[tuple[float, float, float, float]]:
    """One shade per chunk, darkest for chunk 0: blues for forward, greens for backward."""
    from matplotlib import colormaps

    cmap = colormaps["Blues" if kind == "F" else "Greens"]
    if virtual_stages == 1:
        return [cmap(0.7)]
    return [cmap(0.85 - 0.55 * k / (virtual_stages - 1)) for k in range(virtual_stages)]


def _draw_gantt(
    ax, timeline: Timeline, scale: float, window: tuple[float, float], rank_labels: bool = True
) -> tuple[int, int]:
    """The blocks overlapping ``window`` (seconds), one row per rank; returns (F and B blocks drawn,
    labels written)."""
    lo, hi = window
    shown = [
        b
        for b in timeline.blocks
        if b.end_s >= lo and b.start_s <= hi and (b.duration_s > 0 or b.kind in ("F", "B"))
    ]
    computes = [b for b in shown if b.kind in ("F", "B")]
    shades = {kind: _colors(kind, timeline.virtual_stages) for kind in ("F", "B")}
    px_per_s = ax.bbox.width / (hi - lo)
    if _median_forward_s(timeline) * px_per_s < 1:
        _draw_runs(ax, computes, scale, 1 / px_per_s, shades)
    else:
        _draw_blocks(
            ax,
            computes,
            scale,
            timeline.pp,
            shades,
            edge=0.4 if _median_forward_s(timeline) * px_per_s >= 4 else 0.0,
        )
    _draw_marks(ax, [b for b in shown if b.kind not in ("F", "B")], scale)
    row_px = ax.bbox.height / (timeline.pp + 0.2) * ROW_HEIGHT
    labels = 0
    if row_px >= LABEL_FONT_PT * DPI / 72:
        labels = sum(
            _label(
                ax,
                b,
                scale,
                px_per_s,
                TAIL_COLOR if b.kind == "tail" else shades[b.kind][b.stage // timeline.pp],
            )
            for b in shown
            if b.kind in ("F", "B", "tail")
        )
    ax.set_xlim(lo * scale, hi * scale)
    ax.set_ylim(timeline.pp - 0.4, -0.6)  # rank 0 on top
    ax.set_yticks(range(timeline.pp))
    ax.set_yticklabels(
        (
            [f"rank {r}  bubble {timeline.bubble_fraction[r]:.1%}" for r in range(timeline.pp)]
            if rank_labels
            else []
        ),
        fontsize=8,
    )
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#e8e8e8", linewidth=0.6)
    ax.set_axisbelow(True)
    return len(computes), labels


def _draw_blocks(ax, computes: list[Block], scale: float, pp: int, shades, edge: float) -> None:
    """One bar per F and B block, shaded by chunk; white edges (``edge`` points) keep neighbours
    apart."""
    groups: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for b in computes:
        groups.setdefault((b.rank, b.kind, b.stage // pp), []).append(
            (b.start_s * scale, b.duration_s * scale)
        )  # type: ignore[operator]
    for (rank, kind, chunk), spans in groups.items():
        ax.broken_barh(
            spans,
            (rank - ROW_HEIGHT / 2, ROW_HEIGHT),
            facecolors=shades[kind][chunk],
            edgecolor="white",
            linewidth=edge,
        )


def _draw_runs(ax, computes: list[Block], scale: float, pixel_s: float, shades) -> None:
    """Blocks narrower than a pixel, merged into runs (gaps under a pixel closed), each coloured by
    its F/B mix.

    Drawn one by one they alias into stripes that are not in the schedule; a run's blend is what the
    eye would see at a resolution where they could be told apart.
    """
    # rank -> [start, end, forward seconds, backward seconds]
    runs: dict[int, list[list[float]]] = {}
    for b in sorted(computes, key=lambda b: (b.rank, b.start_s)):
        rank_runs = runs.setdefault(b.rank, [])
        if not rank_runs or b.start_s - rank_runs[-1][1] > pixel_s:
            rank_runs.append([b.start_s, b.end_s, 0.0, 0.0])
        run = rank_runs[-1]
        run[1] = b.end_s
        run[2 if b.kind == "F" else 3] += b.duration_s
    for rank, rank_runs in runs.items():
        colors = [
            _blend(shades["F"][0], shades["B"][0], forward / (forward + backward))
            for _, _, forward, backward in rank_runs
        ]
        ax.broken_barh(
            [(start * scale, (end - start) * scale) for start, end, _, _ in rank_runs],
            (rank - ROW_HEIGHT / 2, ROW_HEIGHT),
            facecolors=colors,
            linewidth=0.0,
        )


def _blend(first, second, weight: float) -> tuple[float, ...]:
    """``weight`` of colour ``first`` and the rest of ``second``."""
    return tuple(weight * a + (1 - weight) * b for a, b in zip(first, second))


def _draw_marks(ax, blocks: list[Block], scale: float) -> None:
    """Waits on transfers (hatched), sends on the wire (a thin bar under the row), tails
    (purple)."""
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for b in blocks:
        groups.setdefault((b.rank, _style_key(b)), []).append(
            (b.start_s * scale, b.duration_s * scale)
        )
    for (rank, style), spans in groups.items():
        if style == "wait":
            ax.broken_barh(
                spans,
                (rank - ROW_HEIGHT / 2, ROW_HEIGHT),
                facecolors="white",
                edgecolor=WAIT_COLOR,
                hatch="////",
                linewidth=0.0,
            )
        elif style == "wire":
            ax.broken_barh(
                spans, (rank + ROW_HEIGHT / 2, 0.1), facecolors=WIRE_COLOR, linewidth=0.0
            )
        else:
            ax.broken_barh(
                spans,
                (rank - ROW_HEIGHT / 2, ROW_HEIGHT),
                facecolors=TAIL_COLOR,
                edgecolor="white",
                linewidth=0.4,
            )


def _style_key(block: Block) -> str:
    """F, B, wait (a receive's exposed transfer), wire (a send in flight) or tail."""
    if block.kind.startswith("RECV"):
        return "wait"
    if block.kind.startswith("SEND"):
        return "wire"
    return block.kind


def _label(ax, block: Block, scale: float, px_per_s: float, face) -> int:
    """Write the micro-batch number (or "sync+opt" on a tail) inside ``block`` if it fits; 1 if
    written."""
    text = "sync+opt" if block.kind == "tail" else str(block.microbatch)
    needed_px = (len(text) * 0.62 * LABEL_FONT_PT + 3) * DPI / 72
    if block.duration_s * px_per_s < needed_px:
        return 0
    from matplotlib.colors import to_rgb

    red, green, blue = to_rgb(face)
    dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.55  # perceived luminance (ITU-R BT.601)
    ax.text(
        (block.start_s + block.end_s) / 2 * scale,
        block.rank,
        text,
        ha="center",
        va="center",
        fontsize=LABEL_FONT_PT,
        color="white" if dark else "black",
        clip_on=True,
    )
    return 1


def _draw_memory(ax, timeline: Timeline, scale: float) -> None:
    """Each rank's memory over the step as a step line, and the device's memory as a dashed line."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if timeline.pp <= 10 else "viridis"]
    peak = max(level for series in timeline.memory.values() for _, level in series)
    low = min(level for series in timeline.memory.values() for _, level in series)
    for rank, series in timeline.memory.items():
        color = cmap(rank if timeline.pp <= 10 else rank / max(timeline.pp - 1, 1))
        ax.step(
            [t * scale for t, _ in series],
            [level for _, level in series],
            where="post",
            color=color,
            linewidth=1.0,
            label=f"rank {rank}",
        )
    limit = timeline.memory_limit
    near = limit is not None and peak >= limit / 5
    if near:
        ax.axhline(
            limit,
            color="black",
            linestyle="--",
            linewidth=1.0,
            label=f"device memory {limit:.0f} GiB",
        )
        ax.set_ylim(0, limit * 1.08)
    else:  # far below the device's memory: zoom on the curves, name the limit in the title
        margin = max(peak - low, peak * 0.01) * 0.15
        ax.set_ylim(max(low - margin, 0.0), peak + margin)
    if timeline.memory_units == "micro-batches":
        title = "micro-batches in flight per rank (a chunk's activations count 1 / v)"
    else:
        title = (
            "memory (GiB) per rank: static state plus the activations of micro-batches in flight"
        )
        title += (
            f"; device memory {limit:.1f} GiB, off scale" if limit is not None and not near else ""
        )
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_ylabel(timeline.memory_units, fontsize=8)
    ax.set_xlim(0, timeline.total_s * scale)
    ax.tick_params(labelsize=8)
    ax.grid(color="#e8e8e8", linewidth=0.6)
    ax.legend(fontsize=7, ncol=min(timeline.pp + 1, 10), loc="best", frameon=False)


def _title(timeline: Timeline) -> str:
    """Two lines: what was simulated, then how long it took and how much of it was bubble."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in timeline.mesh.items())
    schedule = timeline.schedule + (
        f" (v = {timeline.virtual_stages})" if timeline.virtual_stages > 1 else ""
    )
    m = timeline.num_microbatches
    first = (
        f"{timeline.model or 'hand-written plan'}: {mesh}, {schedule}, {m}"
        f" micro-batch{'es' if m > 1 else ''} per step"
    )
    bubble = sum(timeline.bubble_fraction.values()) / timeline.pp
    if timeline.units == "relative":
        return f"{first}\n{timeline.notes[0]}; bubble {bubble:.1%} of the step (mean over ranks)"
    step = f"simulated step {_seconds(timeline.total_s)}"
    if timeline.predicted_step_s is not None:
        step += f" (planner: {_seconds(timeline.predicted_step_s)})"
    planner_bubble = (
        ""
        if timeline.predicted_bubble_fraction is None
        else f"; planner's (p - 1) / (v m) = {timeline.predicted_bubble_fraction:.1%} of compute"
    )
    return f"{first}\n{step}; bubble {bubble:.1%} of the step (mean over ranks){planner_bubble}"


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def _legend(fig, timeline: Timeline) -> None:
    """The key of colours and marks, top right, under the title."""
    from matplotlib.patches import Patch

    v = timeline.virtual_stages
    handles = []
    for kind, name in (("F", "forward"), ("B", "backward")):
        shades = _colors(kind, v)
        handles += [
            Patch(
                facecolor=shade,
                label=f"{name}, chunk {k}" if v > 1 else f"{name} (number: micro-batch)",
            )
            for k, shade in enumerate(shades)
        ]
    present = {_style_key(b) for b in timeline.blocks if b.duration_s > 0}
    marks = [
        (
            "wait",
            Patch(
                facecolor="white",
                edgecolor=WAIT_COLOR,
                hatch="////",
                label="waiting on a p2p transfer",
            ),
        ),
        ("wire", Patch(facecolor=WIRE_COLOR, label="p2p send in flight")),
        ("tail", Patch(facecolor=TAIL_COLOR, label="grad sync + optimizer")),
    ]
    handles += [patch for style, patch in marks if style in present]
    handles.append(Patch(facecolor="white", edgecolor="#c0c0c0", label="idle (bubble)"))
    fig.legend(
        handles=handles,
        loc="upper right",
        ncol=min(len(handles), 6 if v == 1 else v + 1),
        fontsize=7,
        frameon=False,
        bbox_to_anchor=(0.98, 1 - 0.55 / fig.get_figheight()),
    )
