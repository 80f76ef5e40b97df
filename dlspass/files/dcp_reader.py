"""Read a ``torch.distributed.checkpoint`` folder without letting it run code.

``dcp.load`` with the default file-system reader unpickles ``.metadata`` with ``pickle.load``
and every non-tensor value with ``torch.load(weights_only=False)``
(``torch/distributed/checkpoint/filesystem.py`` and ``default_planner.py``, torch 2.13), so a
crafted folder runs code on load. ``load_untrusted`` reads the same format with:

* ``.metadata`` through an unpickler that resolves only the metadata classes DCP writes
  (``Metadata``, ``TensorStorageMetadata``, ..., ``torch.Size``, dtypes, layouts, paths), so
  a pickle that names ``builtins.exec`` or any other callable fails to load;
* every storage entry checked before torch reads it: a plain file name inside the folder, a
  regular file, ``offset + length`` inside it, at most ``MAX_ITEM_BYTES``, no stream
  transforms, and a torch.save zip whose members inflate within bounds (no zip bomb);
* non-tensor values loaded with ``torch.load(weights_only=True)`` (tensors already are);
* the bytes checked are the bytes loaded: every entry is read once (``MAX_TOTAL_BYTES`` in
  all), checked, and handed to DCP from memory instead of the file being read again.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from dlspass.errors import DLSInputError, InputValueError
from dlspass.files.bounded_text import excerpt
from dlspass.files.zip_view import UnsafeArchiveError, check_zip_bounds

MAX_METADATA_BYTES = 16 * 2**20
MAX_ITEM_BYTES = 64 * 2**20
MAX_TOTAL_BYTES = 256 * 2**20
"""Most bytes of storage entries one folder may make this reader hold (a scaler state is a
few kilobytes)."""
MAX_TOTAL_INFLATED = 256 * 2**20
"""Most bytes the distinct storage entries of one folder may inflate to, together."""
MAX_ENTRIES = 100_000
"""Most storage entries one ``.metadata`` may list."""
MAX_METADATA_OBJECTS = 2_000_000
"""Most objects the unpickled metadata may reach, a shared object counted each time it is
reached: a pickle can share one tuple twice at every level, so 30 levels in a few hundred bytes
reach 2**30 objects, which ``str`` or any walk of them would expand."""

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


# a checkpoint folder whose metadata or storage would run code or read outside it
UnsafeCheckpointError = InputValueError


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"the checkpoint metadata names {excerpt(f'{module}.{name}', 80)}, "
                                    "which is not DCP metadata (loading it would run code)")


def read_metadata(folder: Path) -> Any:
    """The folder's ``.metadata`` unpickled with only DCP's metadata classes allowed, after
    every storage entry it names was checked."""
    return _read_checked(folder)[0]


Blobs = dict[tuple[str, int, int], bytes]
"""Checked storage entries by (file name, offset, length)."""


def _read_checked(folder: Path) -> tuple[Any, Blobs]:
    path = folder / ".metadata"
    _regular(path, MAX_METADATA_BYTES)
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{path}: {e}") from None
    except Exception as e:  # a damaged pickle raises anything from EOFError to TypeError
        raise UnsafeCheckpointError(f"{path}: unreadable DCP metadata "
                                    f"({type(e).__name__}: {excerpt(str(e), 80)})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        raise UnsafeCheckpointError(f"{path}: not DCP metadata")
    _check_object_count(meta, path)  # before anything formats or walks it
    if len(meta.storage_data) > MAX_ENTRIES:
        raise UnsafeCheckpointError(f"{path}: {len(meta.storage_data):,} storage entries "
                                    f"(more than {MAX_ENTRIES:,})")
    blobs: Blobs = {}
    total = inflated = 0
    for index, info in meta.storage_data.items():
        key = (getattr(info, "relative_path", None), getattr(info, "offset", None),
               getattr(info, "length", None))
        if key in blobs:  # entries sharing one storage: read, checked and counted once
            continue
        blob, size = _check_storage(folder, index, info)
        total += len(blob)
        inflated += size
        if total > MAX_TOTAL_BYTES or inflated > MAX_TOTAL_INFLATED:
            raise UnsafeCheckpointError(f"{folder}: its storage entries hold more than "
                                        f"{MAX_TOTAL_BYTES:,} bytes or inflate to more than "
                                        f"{MAX_TOTAL_INFLATED:,}")
        blobs[key] = blob
    return meta, blobs


def _check_object_count(meta: Any, path: Path) -> None:
    """Refuse metadata that reaches more than ``MAX_METADATA_OBJECTS`` objects (shared ones
    counted each time), walking at most that many."""
    stack, seen = [meta], 0
    while stack:
        obj = stack.pop()
        seen += 1
        if seen > MAX_METADATA_OBJECTS:
            raise UnsafeCheckpointError(f"{path}: the DCP metadata reaches more than "
                                        f"{MAX_METADATA_OBJECTS:,} objects")
        if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype)):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())


def _regular(path: Path, limit: int) -> int:
    try:
        st = path.stat()
    except OSError as e:
        raise UnsafeCheckpointError(f"{path}: {e.strerror or 'cannot be read'}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCheckpointError(f"{path}: not a regular file")
    if st.st_size > limit:
        raise UnsafeCheckpointError(f"{path}: {st.st_size:,} bytes (more than {limit:,})")
    return st.st_size


def _check_storage(folder: Path, index: Any, info: Any) -> tuple[bytes, int]:
    """The bytes of one storage entry, once they are a bounded torch.save zip in the folder,
    and the bytes its members declare they inflate to."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    name = getattr(info, "relative_path", None)
    if not isinstance(info, _StorageInfo) or not isinstance(name, str) or not name \
            or os.sep in name or "/" in name or name in (".", "..") or "\0" in name:
        raise UnsafeCheckpointError(f"{folder}: storage entry {excerpt(str(index), 80)} does not "
                                    "name a file in the checkpoint folder")
    if info.transform_descriptors:
        raise UnsafeCheckpointError(f"{folder}: storage entry {excerpt(str(index), 80)} uses stream "
                                    "transforms, which this reader does not run")
    size = _regular(folder / name, 2**62)
    offset, length = info.offset, info.length
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)) \
            or offset < 0 or length < 0 or length > MAX_ITEM_BYTES or offset + length > size:
        raise UnsafeCheckpointError(f"{folder}: storage entry {excerpt(str(index), 80)} lies "
                                    f"outside {excerpt(name, 60)} or is too large")
    # every item is a torch.save zip, which torch.load inflates to the sizes it declares
    with open(folder / name, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    try:
        blob = check_zip_bounds(blob, f"storage entry {excerpt(str(index), 80)}")
    except UnsafeArchiveError as e:
        raise UnsafeCheckpointError(f"{folder}: {e}") from None
    with zipfile.ZipFile(io.BytesIO(blob)) as z:  # read_view checked this directory
        return blob, sum(i.file_size for i in z.infolist())


def _reader_and_planner(folder: Path, meta: Any, blobs: Blobs) -> tuple[Any, Any]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element

    class Reader(FileSystemReader):
        def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
            # the entry as it was checked, not the file read again
            blob = blobs.get((sinfo.relative_path, sinfo.offset, sinfo.length))
            if blob is None:
                raise UnsafeCheckpointError(f"{folder}: an entry outside the checked metadata")
            return io.BytesIO(blob)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise UnsafeCheckpointError(f"{folder}: per-rank metadata is not supported")
            if getattr(meta, "storage_meta", None) is not None:
                meta.storage_meta.load_id = self.load_id
            return meta

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:
                raise UnsafeCheckpointError(
                    f"{folder}: value {excerpt(read_item.dest_index.fqn, 80)} cannot be loaded "
                    f"without pickle ({type(e).__name__})") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Reader(str(folder)), Planner()


def load_untrusted(state: dict[str, Any], checkpoint_id: str | os.PathLike[str],
                   process_group: Any = None) -> None:
    """``dcp.load(state, checkpoint_id=...)`` for a folder from an untrusted source."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    folder = Path(checkpoint_id)
    if not folder.is_dir():
        raise UnsafeCheckpointError(f"{folder}: no such checkpoint folder")
    meta, blobs = _read_checked(folder)  # checked here: DCP would bury our error in its own
    reader, planner = _reader_and_planner(folder, meta, blobs)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group)
    except DLSInputError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps every rank's error in the latter
        cause = _first_dls_error(e)
        if cause is not None:
            raise type(cause)(str(cause)) from None
        raise UnsafeCheckpointError(f"{folder}: cannot load the checkpoint "
                                    f"({type(e).__name__}: {excerpt(str(e), 120)})") from None


def _first_dls_error(exc: BaseException) -> DLSInputError | None:
    """The DLSInputError a DCP ``CheckpointException`` wraps (it keeps a failure per rank)."""
    failures = getattr(exc, "failures", None) or {}
    for failure in failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, DLSInputError):
            return inner
    return None
