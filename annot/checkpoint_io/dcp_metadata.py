"""Reading a torch distributed checkpoint's ``.metadata`` through an allowlist.

torch writes ``.metadata`` with ``pickle`` and its ``FileSystemReader`` reads it with
``pickle.load``: a crafted file runs code (docs/design.md, pitfall 17). annot reads DCP
metadata only for a folder it committed itself or when the user asks for DCP, and even
then through `SafeFileSystemReader`, whose unpickler resolves only the classes DCP's
metadata is made of (checked against torch 2.13's files) and refuses anything else.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from annot.errors import CheckpointError

__all__ = ["SafeFileSystemReader", "read_metadata"]

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "_MEM_FORMAT_ENCODING", "StorageMeta", "MetadataIndex",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # name -> torch layout, a dictionary lookup
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The DCP metadata of folder ``path``, unpickled through the allowlist."""
    return _read(Path(path) / ".metadata")


def _read(file: Path) -> Metadata:
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file.parent}: no {file.name} (not a torch distributed "
                              "checkpoint, or its save did not finish)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{file}: refused ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: holds {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` with `read_metadata` through the allowlist (the
    data files' non-tensor entries torch already loads with ``weights_only=True``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read(Path(self._get_metadata_path(kwargs.get("rank"))))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
