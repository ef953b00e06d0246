"""Reads W&B's offline ``.wandb`` files: the one reader (``hpc sync``'s story and the tests).

wandb has no public reader for them (0.31 no longer ships ``wandb.sdk.internal.datastore``).
The format is small: a 7-byte header (``:W&B``, magic 0xBEE1 little-endian, version 0), then a
LevelDB-log framed stream (32 KiB blocks; each chunk a 4-byte CRC, a 2-byte little-endian length
and a 1-byte type FULL/FIRST/MIDDLE/LAST) of serialized
``wandb.proto.wandb_internal_pb2.Record`` messages. wandb's protobuf module is imported inside
:func:`iter_records`, so importing this module stays light.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_records(path: Path, *, last_blocks: int | None = None) -> Iterator[Any]:
    """Every ``Record`` in one ``.wandb`` file, in write order.

    A torn last chunk (a crash mid-write) ends the stream quietly.

    Args:
        path: the ``.wandb`` file.
        last_blocks: read only the file's last blocks of 32 KiB (from the first record that
            starts in them): the newest records of a long run without parsing all of it.

    Raises:
        ValueError: the file is not a W&B offline file.
    """
    from wandb.proto import wandb_internal_pb2

    with Path(path).open("rb") as f:
        head = f.read(len(HEADER))
        if head != HEADER:
            raise ValueError(f"{path} is not a W&B offline file (header {head!r})")
        blocks = -(-f.seek(0, 2) // BLOCK)
        start = 0 if last_blocks is None else max(0, blocks - last_blocks) * BLOCK
        f.seek(start)
        data = f.read()   # positions below are relative to `start`, a block boundary
    pos, pending, synced = (len(HEADER) if start == 0 else 0), b"", start == 0
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:
            pos += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        payload = data[pos + CHUNK_HEADER: pos + CHUNK_HEADER + length]
        if len(payload) < length or kind not in (FULL, FIRST, MIDDLE, LAST):
            return
        pos += CHUNK_HEADER + length
        synced = synced or kind in (FULL, FIRST)   # a record's tail from an earlier block: skipped
        if not synced:
            continue
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def run_project(path: Path) -> tuple[str, str]:
    """``(project, entity)`` of the first run record in a ``.wandb`` file (empty if none)."""
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.project, record.run.entity
    return "", ""


def offline_folders(wandb_dir: Path, run_id: str) -> list[Path]:
    """The ``offline-run-<YYYYmmdd_HHMMSS>-<id>[-N]`` folders of ``run_id``, oldest first.

    A start within the same second as the previous one gets a ``-1``, ``-2``... suffix.
    """
    pattern = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for folder in Path(wandb_dir).glob("offline-run-*"):
        match = pattern.fullmatch(folder.name)
        if match and (folder / f"run-{run_id}.wandb").is_file():
            found.append(((match[1], int(match[2] or 0)), folder))
    return [folder for _, folder in sorted(found)]
