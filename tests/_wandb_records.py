"""Read the records of a W&B offline run file (`run-<id>.wandb`) with wandb's own protobuf
`Record`: the file is wandb's LevelDB-log framing (a 7-byte header ":W&B" + magic + version, then
32 KiB blocks of chunks: crc32 (4 bytes), length (2, little-endian), type (1: full, 2: first,
3: middle, 4: last)). wandb 0.31 ships no Python reader for it."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def wandb_records(path: Path) -> list[Any]:
    """Every `wandb_internal_pb2.Record` in `path`, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(path: Path) -> dict[int, dict[str, Any]]:
    """The logged rows by step: {step: {key: value}} (wandb's own "_step", "_runtime" and
    "_timestamp" left out)."""
    rows: dict[int, dict[str, Any]] = {}
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            step = r.history.step.num if r.history.HasField("step") else items["_step"]
            rows.setdefault(step, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")}
            )
    return rows


def wandb_config(path: Path) -> dict[str, Any]:
    """The run config as recorded (the init config and later updates), values decoded."""
    config: dict[str, Any] = {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        items = (
            r.config.update if kind == "config" else r.run.config.update if kind == "run" else []
        )
        for item in items:
            key = item.key or "/".join(item.nested_key)
            config[key] = json.loads(item.value_json)
    return config
