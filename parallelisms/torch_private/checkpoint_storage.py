"""DCP's reader and writer over fsspec, for checkpoints in an object store (``s3://``, ``gs://``)."""

from __future__ import annotations

from typing import Any

FEATURE = "checkpoints in an object store (`checkpoint.folder` or `checkpoint.initial_load_path` as a URL)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.15.0")  # 2.11.0 by its source: the same two classes
NAMES = ("_fsspec_filesystem",)


def fsspec_storage() -> tuple[type[Any], type[Any]]:
    """``(FsspecReader, FsspecWriter)``: DCP's file-system reader and writer on an fsspec file system,
    from the public module where torch has it (2.15, which deprecates the private one)."""
    try:
        from torch.distributed.checkpoint import fsspec_filesystem as storage  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint import _fsspec_filesystem as storage

    return storage.FsspecReader, storage.FsspecWriter
