"""Readers of what the experiment trackers wrote, from their own files: a TensorBoard event file
(tensorboardX's protobuf), an offline W&B run (its record log) and an MLflow file store (its
client). Imported as ``tracker_readers`` (this folder is on ``sys.path`` under pytest)."""

from __future__ import annotations

import json
import pathlib
import struct

import pytest


def tensorboard_scalars(path: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of a TensorBoard event file: TFRecords (u64 length, u32 crc, Event, u32 crc)."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    data, i, out = path.read_bytes(), 0, {}
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def wandb_history(out: pathlib.Path) -> list[dict]:
    """History rows of the (single) offline W&B run under ``out/wandb``: the run file is a
    LevelDB-style log (7-byte file header, 32 KiB blocks, records of crc u32 / len u16 /
    type u8 split FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) of ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = out.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, buf, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:                  # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf = data[pos + 7:pos + 7 + n] if kind in (1, 2) else buf + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record.FromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in rec.history.item})
    return rows


def mlflow_history(out: pathlib.Path, project: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
