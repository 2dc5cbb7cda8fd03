"""DCP's reader and writer over fsspec, for checkpoints in an object store (``s3://``, ``gs://``)."""

from __future__ import annotations

from typing import Any

FEATURE = "checkpoints in an object store (`checkpoint.folder` or `checkpoint.initial_load_path` as a URL)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.15.0")  # 2.11.0 by its source: the same two classes
NAMES = ("_fsspec_filesystem",)


def fsspec_storage() -> tuple[type[Any], type[Any]]:
    """``(FsspecReader, FsspecWriter)``: DCP's file-system reader and writer on an fsspec file system."""
    from torch.distributed.checkpoint import _fsspec_filesystem

    return _fsspec_filesystem.FsspecReader, _fsspec_filesystem.FsspecWriter
