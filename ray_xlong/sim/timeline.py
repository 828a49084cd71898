"""Per-cell Gantt chart of an event log (simulated or from the Ray driver: same format).

Each cell is a row; each role interval is a bar coloured by role, from the ``role`` event that
entered it to the next one; the first part of a training / syncing bar up to the ``ready``
event (the switch or sync delay) is hatched. Steps ending are thin vertical lines. matplotlib
is imported inside :func:`plot_timelines` (Agg backend), so importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ray_xlong.scheduling.events import Event

COLORS = {"rollout": "#4c9be8", "draining": "#f0b840", "training": "#d9534f", "syncing": "#7f7f7f"}


@dataclass(frozen=True, slots=True)
class Span:
    """One bar of the chart."""

    cell: int
    """Row."""
    role: str
    """Role during the span."""
    start: float
    """Hours."""
    end: float
    """Hours."""
    ready: float
    """When the switch / sync delay ended (== start when none)."""


def spans(events: Sequence[Event]) -> list[Span]:
    """Role intervals per cell; every cell starts in rollout at time 0."""
    end = max((e.time for e in events), default=0.0)
    cells = sorted({e.cell for e in events if e.cell >= 0})
    open_: dict[int, list] = {c: ["rollout", 0.0, 0.0] for c in cells}
    out: list[Span] = []
    for e in events:
        if e.kind == "role":
            role, start, ready = open_[e.cell]
            out.append(Span(e.cell, role, start, e.time, max(ready, start)))
            open_[e.cell] = [e.role, e.time, e.time]
        elif e.kind == "ready":
            open_[e.cell][2] = e.time
    out += [Span(c, r, s, end, max(rd, s)) for c, (r, s, rd) in open_.items()]
    return [s for s in out if s.end > s.start]


def plot_timelines(logs: Mapping[str, Sequence[Event]], path: str, *, title: str = "",
                   time_unit: str = "hours") -> None:
    """Draw one Gantt panel per mode into ``path`` (PNG).

    Args:
        logs: mode name -> event log.
        path: output file.
        title: figure title.
        time_unit: label of the time axis (the simulator logs hours; the Ray driver seconds).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(logs), 1, figsize=(14, 1.2 + 0.35 * 8 * len(logs)), squeeze=False)
    for ax, (mode, events) in zip(axes[:, 0], logs.items()):
        for s in spans(events):
            ax.barh(s.cell, s.end - s.start, left=s.start, color=COLORS[s.role], height=0.8)
            if s.ready > s.start:
                ax.barh(s.cell, s.ready - s.start, left=s.start, color="white", height=0.8,
                        hatch="///", alpha=0.6)
        for e in events:
            if e.kind == "step_ended":
                ax.axvline(e.time, color="black", lw=0.3, alpha=0.4)
        ax.set_ylabel(f"{mode}\ncell")
        ax.yaxis.get_major_locator().set_params(integer=True)   # cells are whole numbers
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel(time_unit)
    handles = [Patch(color=c, label=r) for r, c in COLORS.items()]
    axes[0, 0].legend(handles=handles, ncol=4, loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
