"""How checkpoint bytes reach the disk: DCP storage with checksums, retries and reused staging.

:class:`ChecksummedWriter` is DCP's filesystem writer plus three things the transaction in
:mod:`runtime.checkpoint` needs: each file's size and CRC-32, computed while it is written and
sent to rank 0 inside DCP's own gather of write results (no extra collective); the rank-local
file (RNG states) written next to the shards; and retries of transient filesystem errors.
:class:`RetryingReader` retries reads. :class:`ReusedStaging` keeps async-save staging buffers
between saves.
"""

from __future__ import annotations

import io
import logging
import os
import signal
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import WriteResult

from runtime.checkpoint.manifest import Crc32Stream, FileEntry, retry_transient

log = logging.getLogger("hpc.checkpoint")

#: Test hook: ``point`` or ``point@rank``; the process SIGKILLs itself there (see tests).
KILL_AT_ENV = "HPC_CKPT_TEST_KILL_AT"
#: Write-result key prefix under which each rank's file entries travel to rank 0.
FILES_KEY = "__hpc_files__"


def kill_point(name: str, rank: int) -> None:
    """SIGKILL this process at the named point of a save when a test asked for it (KILL_AT_ENV)."""
    spec = os.environ.get(KILL_AT_ENV)
    if spec and spec in (name, f"{name}@{rank}"):
        log.warning("test hook: rank %d killing itself at %s", rank, name)
        os.kill(os.getpid(), signal.SIGKILL)


def local_name(rank: int) -> str:
    """File name of a rank's rank-local state (RNG) inside a step directory."""
    return f"rank-{rank:05d}.local.pt"


class Crc32FileSystem(FileSystem):
    """DCP's local filesystem, recording size and CRC-32 of every file as it is written."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, FileEntry] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as raw:
            stream = Crc32Stream(raw)
            try:
                yield stream  # type: ignore[misc]
            except Exception as e:
                if stream.error is not None and stream.error is not e:
                    raise stream.error from e  # keep the errno (ENOSPC, EIO) visible
                raise
        self.entries[Path(path).name] = FileEntry(Path(path).name, stream.size, stream.crc32)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if (entry := self.entries.pop(Path(path).name, None)) is not None:
            self.entries[Path(new_path).name] = FileEntry(Path(new_path).name, entry.size, entry.crc32)


class ChecksummedWriter(FileSystemWriter):
    """DCP writer that adds the rank-local file, retries transient errors, reports checksums."""

    def __init__(self, path: Path, rank: int, local_files: Mapping[str, bytes], thread_count: int) -> None:
        super().__init__(path, thread_count=thread_count, overwrite=False)
        self.fs = Crc32FileSystem()
        self.rank = rank
        self.local_files = dict(local_files)
        self.files: tuple[FileEntry, ...] = ()

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future[list[WriteResult]]:
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(self._write_all(plan, planner))
        return fut

    @retry_transient
    def _write_all(self, plan: Any, planner: Any) -> list[WriteResult]:
        self.fs.entries.clear()
        for name, data in self.local_files.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
        kill_point("before_shards", self.rank)
        with _without_zip_crc32():
            results = super().write_data(plan, planner).value()
        kill_point("after_shards", self.rank)
        files = list(self.fs.entries.values())
        return [*results, WriteResult(MetadataIndex(f"{FILES_KEY}{self.rank}"), 0, files)]

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        files: list[FileEntry] = []
        shards = []
        for rank_results in results:
            files += [e for r in rank_results if r.index.fqn.startswith(FILES_KEY) for e in r.storage_data]
            shards.append([r for r in rank_results if not r.index.fqn.startswith(FILES_KEY)])
        super().finish(metadata, shards)
        files.append(self.fs.entries[".metadata"])
        self.files = tuple(sorted(files, key=lambda e: e.name))


@contextmanager
def _without_zip_crc32() -> Generator[None, None, None]:
    """Turns off the CRC-32 that ``torch.save`` puts in each zip record, for DCP's shard writes.

    It is redundant here (every file's CRC-32 is computed while it is written and verified on
    load) and it costs as much as copying the bytes into the page cache (measured: 0.21 s
    against 0.11 s for ``torch.save`` of 256 MB). ``torch.load`` reads such records. The
    setting is process-wide: a ``torch.save`` on another thread during a save also skips it.
    """
    from torch.utils.serialization import config

    previous = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = previous


class RetryingReader(FileSystemReader):
    """DCP reader whose per-rank reads retry transient filesystem errors."""

    @retry_transient
    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
        return super().read_data(plan, planner)


class ReusedStaging(BlockingAsyncStager):
    """Async staging into CPU buffers kept between saves (pinned when CUDA is present).

    DCP's default stager allocates a fresh copy of the state for every save; on 0.5 GB per rank
    the page faults of that allocation cost more than the copy. The buffers are rebuilt when the
    state's structure (keys, shapes, dtypes) changes. Costs one copy of the local state in RAM.
    """

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=False)
        self._buffers: dict[str, Any] | None = None
        self._signature: tuple[Any, ...] = ()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = tuple(_tensor_signature(state_dict))
        if self._buffers is None or signature != self._signature:
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._signature = signature
        return _copy_state_dict(state_dict, self._buffers, type_check=self.type_check)


def _tensor_signature(obj: Any, path: str = "") -> Generator[tuple[str, Any, Any], None, None]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensor_signature(v, f"{path}/{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensor_signature(v, f"{path}[{i}]")
    elif isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        yield path, tuple(local.shape), local.dtype
    else:
        yield path, type(obj), None
