"""How checkpoint bytes reach the disk: DCP storage with checksums and retries.

:class:`ChecksummedWriter` is DCP's filesystem writer plus three things the transaction in
:mod:`runtime.checkpoint` needs: each file's size and CRC-32, computed while it is written and
sent to rank 0 inside DCP's own gather of write results (no extra collective); the rank-local
file (RNG states) written next to the shards; and retries of transient filesystem errors.
:class:`RetryingReader` retries reads. (The async-save staging copy is
:mod:`runtime.checkpoint.staging`.)

Loading never runs code from the checkpoint directory. Three things in a checkpoint are
pickles: DCP's ``.metadata`` (torch 2.13 reads it with a plain ``pickle.load``), the non-tensor
values inside the shards (DCP's default planner reads them with ``torch.load(weights_only=False)``)
and each rank-local file. :class:`RetryingReader` unpickles ``.metadata`` with an allow-list of
DCP's own metadata types, :class:`SafeLoadPlanner` and :func:`load_pickled` use
``torch.load(weights_only=True)`` with only the numpy types of an RNG state added, and
:func:`unpickling_problem` tries all three on rank 0 before anything is loaded, so a refused
file quarantines its checkpoint like a corrupt one. See docs/security.md.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import signal
import time
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from runtime.checkpoint.manifest import Crc32Stream, FileEntry, Manifest, retry_transient

log = logging.getLogger("hpc.checkpoint")

#: Test hook: ``point`` or ``point@rank``; the process SIGKILLs itself there (see tests).
KILL_AT_ENV = "HPC_CKPT_TEST_KILL_AT"
#: Test hook: seconds each rank's shard writes are delayed (a slow file system).
WRITE_DELAY_ENV = "HPC_CKPT_TEST_WRITE_DELAY_S"
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


_LOCAL_RE = re.compile(r"^rank-\d+\.local\.pt$")


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
        assert mode == "wb", mode
        # O_NOFOLLOW: a symlink planted in the step directory can not redirect a shard elsewhere
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as raw:
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
        if (delay := os.environ.get(WRITE_DELAY_ENV)):   # test hook: a slow file system
            time.sleep(float(delay))
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


class UnsafeCheckpointError(ValueError):
    """A checkpoint file needs a type to unpickle that checkpoints never hold (tampered or foreign)."""


#: What every checkpoint pickle may hold besides tensors and plain data: DCP's metadata types.
_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


def runtime_safe_globals() -> list[Any]:
    """The non-tensor types the runtime's own rank-local state holds: numpy's RNG state (an array)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 moved it
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _refusal(exc: BaseException) -> str:
    """The one useful line of torch's weights-only refusal ("Unsupported global: GLOBAL posix.system")."""
    if m := re.search(r"Unsupported global: GLOBAL (\S+)", str(exc)):
        return f"global {m.group(1)}"
    m = re.search(r"WeightsUnpickler error: (.+?)(?:\. Please|\n|$)", str(exc))
    return m.group(1).strip() if m else str(exc).strip().splitlines()[-1]


def _refused_message(what: str, detail: str) -> str:
    return (f"{what}: refused to unpickle ({detail}); checkpoints written by hpc-elastic hold only "
            "tensors and plain data, so this file was tampered with or written by something else")


def load_pickled(source: str | os.PathLike | io.BytesIO, *, what: str,
                 extra_globals: Iterable[Any] = ()) -> Any:
    """``torch.load(weights_only=True)`` with the runtime's own types (and ``extra_globals``) allowed.

    Args:
        source: A file path or an in-memory stream.
        what: Names the file (or value) in the error.
        extra_globals: Types the user's own state holds (``Checkpointer(safe_globals=...)``).

    Raises:
        UnsafeCheckpointError: When unpickling would need any other global (nothing is run).
    """
    with torch.serialization.safe_globals([*runtime_safe_globals(), *extra_globals]):
        try:
            return torch.load(source, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(_refused_message(what, _refusal(e))) from None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` with an allow-list: its own dataclasses, torch dtypes, paths."""

    def __init__(self, file: Any, what: str) -> None:
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(_refused_message(self.what, f"global {module}.{name}"))


def read_metadata_file(stream: Any, what: str) -> Metadata:
    """DCP's metadata from ``stream``, unpickled with the allow-list (no code runs)."""
    metadata = _MetadataUnpickler(stream, what).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{what}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class RetryingReader(FileSystemReader):
    """DCP reader whose per-rank reads retry transient errors and whose metadata runs no code."""

    @retry_transient
    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # same signature: DCP inspects it
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata_file(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are loaded with ``weights_only=True``.

    Args:
        extra_globals: Types the user's own state holds (``Checkpointer(safe_globals=...)``).
    """

    def __init__(self, extra_globals: Iterable[Any] = ()) -> None:
        super().__init__()
        self.extra_globals = tuple(extra_globals)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_pickled(value, what=f"value {fqn!r} in the shards", extra_globals=self.extra_globals)
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does with the object
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def unpickling_problem(step_dir: Path, manifest: Manifest, extra_globals: Iterable[Any] = ()) -> str | None:
    """Rank 0, before a resume: whether any pickle of the checkpoint would be refused at load.

    Tries the same restricted loads the ranks will do (nothing from the files is run):
    ``.metadata``, every non-tensor value in the shards, every rank-local file. Costs reading
    ``.metadata``, the small non-tensor records and the rank-local files.

    Returns:
        None when all load, else one line naming the file and what was refused.
    """
    extra = tuple(extra_globals)
    try:
        with open(step_dir / ".metadata", "rb") as f:
            metadata = read_metadata_file(f, ".metadata")
        by_file: dict[str, list[tuple[str, Any]]] = {}
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                by_file.setdefault(str(info.relative_path), []).append((index.fqn, info))
        for name, items in sorted(by_file.items()):
            if Path(name).name != name:
                return f".metadata: shard file name {name!r} is not a plain file name"
            with open(step_dir / name, "rb") as f:
                for fqn, info in items:
                    if info.transform_descriptors:
                        return f"{name}: value {fqn!r} uses storage transforms {info.transform_descriptors}"
                    f.seek(info.offset)
                    load_pickled(io.BytesIO(f.read(info.length)), what=f"{name} (value {fqn!r})",
                                 extra_globals=extra)
        for entry in manifest.files:
            if _LOCAL_RE.match(entry.name):
                load_pickled(step_dir / entry.name, what=entry.name, extra_globals=extra)
    except UnsafeCheckpointError as e:
        return str(e)
    except Exception as e:  # a damaged pickle: the same verdict as a bad checksum
        return f"unreadable: {e!r}".splitlines()[0]
    return None
