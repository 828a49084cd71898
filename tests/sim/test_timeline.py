"""Event log round-trips through JSONL; role spans and the Gantt plot come from the log alone."""

from __future__ import annotations

from ray_xlong.scheduling.events import Event, from_jsonl, to_jsonl
from ray_xlong.sim.timeline import Span, plot_timelines, spans

LOG = [
    Event(0.0, "start"),
    Event(0.0, "run_started", cell=0, run=0, group=0, version=0),
    Event(2.0, "run_ended", cell=0, run=0, group=0),
    Event(2.0, "role", cell=0, role="training"),
    Event(2.5, "ready", cell=0),
    Event(3.0, "role", cell=0, role="syncing"),
    Event(3.5, "ready", cell=0),
    Event(3.5, "role", cell=0, role="rollout"),
    Event(4.0, "step_ended", step=0, version=1),
]


def test_jsonl_round_trip():
    assert from_jsonl(to_jsonl(LOG)) == LOG


def test_spans_follow_role_events():
    assert spans(LOG) == [
        Span(0, "rollout", 0.0, 2.0, 0.0),
        Span(0, "training", 2.0, 3.0, 2.5),  # first 0.5 h is the switch
        Span(0, "syncing", 3.0, 3.5, 3.5),
        Span(0, "rollout", 3.5, 4.0, 3.5),
    ]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "t.png"
    plot_timelines({"demo": LOG}, str(path), title="demo")
    assert path.read_bytes()[:4] == b"\x89PNG"
