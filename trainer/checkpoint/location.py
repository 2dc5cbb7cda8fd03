"""Where checkpoints live: a local folder, or a folder in an object store given as a URL.

A URL (``s3://bucket/run``, ``gs://...``, any fsspec protocol) becomes a ``upath.UPath``, which
lists, reads and writes like a ``pathlib.Path``; the rest of the checkpoint code is the same for
both. What differs is here: removing and moving folders, DCP's reader, and how a save becomes
visible. A file system renames ``step-N.partial`` to ``step-N`` in one step; an object store has
no atomic rename, so a save writes ``step-N`` in place and becomes visible when its marker
(:data:`PUBLISHED_FILE`), written last, exists. Credentials come from the environment or the
protocol's own configuration, never from the URL, which appears in logs and ``config.toml``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, Union

from torch.distributed.checkpoint import FileSystemReader
from typing_extensions import TypeIs

from parallelisms.torch_private.checkpoint_storage import fsspec_storage
from trainer.config import Checkpoint
from trainer.runtime.errors import ConfigError

if TYPE_CHECKING:
    from upath import UPath

Location: TypeAlias = Union[Path, "UPath"]
"""A checkpoint folder, or the folder that holds them: local, or in an object store."""

URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
PUBLISHED_FILE = ".published"
"""Written last into an object store's ``step-N``: only a folder holding it is a checkpoint."""
INSTALL = 'pip install -e ".[objectstore]"'
WRITE_PROBE = ".meshtrain-write-check"


def is_remote(path: Location) -> TypeIs[UPath]:
    """Whether ``path`` lies in an object store, where a save is published by its marker."""
    return not isinstance(path, Path)


def location(path: str | Location, base: str | Path = ".") -> Location:
    """``path`` as a :data:`Location`: a URL as itself, a relative local path below ``base``."""
    if not isinstance(path, str) or not URL.match(path):
        return Path(base) / path if isinstance(path, (str, Path)) else path
    try:
        from upath import UPath
    except ImportError:
        raise ConfigError(f"{display(path)} is a URL, and object stores need universal_pathlib: {INSTALL}") from None
    try:
        return UPath(path)
    except ValueError as error:  # a protocol fsspec does not know
        raise ConfigError(f"{display(path)}: fsspec cannot open it ({error})") from None


def display(path: str | Location) -> str:
    """``path`` for a message: a URL without any user or password it carries."""
    text = str(path)
    if not URL.match(text):
        return text
    scheme, rest = text.split("://", 1)
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"


def check_store(key: str, path: Location) -> None:
    """Refuse, in one line before launch, an object-store folder that fsspec cannot open here (its
    protocol's package missing) or whose store cannot be listed (no such bucket, no credentials,
    the endpoint down), so that no rank starts on a store it cannot reach. Local folders pass."""
    if not is_remote(path):
        return
    where = f"`{key}` = {display(path)}"
    try:
        fs = path.fs
    except (ImportError, ValueError) as error:
        raise ConfigError(f"{where}: fsspec cannot open `{path.protocol}://` here ({error})") from None
    try:
        fs.ls(path.anchor or str(path), detail=False)
    except Exception as error:  # each store's client raises its own kinds (botocore, google-auth, ...)
        raise ConfigError(
            f"{where}: the store cannot be listed ({type(error).__name__}: {error}). Check that the bucket "
            "exists and that the credentials in the environment may read and write it."
        ) from None


def check_stores(config: Checkpoint, dump_folder: str) -> None:
    """Open and list, before launch, each object store the job's checkpoint keys name; write and
    delete an object in the checkpoint folder, so that read-only credentials fail here."""
    if config.enable:
        folder = location(config.folder, base=dump_folder)
        check_store("checkpoint.folder", folder)
        if is_remote(folder):
            probe = folder / WRITE_PROBE
            try:
                probe.write_text("")
                probe.unlink()
            except Exception as error:  # each store's client raises its own kinds
                raise ConfigError(
                    f"`checkpoint.folder` = {display(folder)} cannot be written ({type(error).__name__}: {error}): "
                    "give credentials that may write there, or another folder."
                ) from None
    if config.initial_load_path:
        check_store("checkpoint.initial_load_path", location(config.initial_load_path))


def fresh(path: Location) -> Location:
    """``path`` with its store's cached listings dropped: other ranks write files this process's
    client has not seen, and an object store's listing is what says whether they exist."""
    if is_remote(path):
        path.fs.invalidate_cache()
    return path


def dcp_reader(path: Location) -> FileSystemReader:
    """DCP's reader of the checkpoint at ``path``."""
    if not is_remote(path):
        return FileSystemReader(str(path))
    reader, _ = fsspec_storage()
    return reader(str(path))


def remove_tree(path: Location) -> None:
    """Delete a folder and what it holds, if it exists; an object store's marker goes first,
    so a removal cut short never leaves a folder that reads as published."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fresh(path)
    if (path / PUBLISHED_FILE).exists():
        (path / PUBLISHED_FILE).unlink()
    if path.exists():
        path.fs.rm(path.path, recursive=True)


def move(source: Location, target: Location) -> None:
    """Move a folder: one rename on a file system, a copy then a delete in an object store."""
    if not (is_remote(source) and is_remote(target)):
        os.replace(str(source), str(target))
        return
    fresh(source)
    fs, prefix = source.fs, source.path.rstrip("/")
    files = sorted(fs.find(prefix), key=lambda name: name.endswith("/" + PUBLISHED_FILE))  # the marker last
    for name in files:
        fs.copy(name, target.path.rstrip("/") + name[len(prefix) :])
    remove_tree(source)


def replace_file(path: Location, text: str) -> None:
    """Write ``path`` so that a reader sees the old file or the new one, never part of either."""
    if is_remote(path):
        path.write_text(text)  # an object's upload is atomic
        return
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(text)
    os.replace(staged, path)


def mark_published(folder: Location, step: int) -> None:
    """Publish an object store's ``step-N`` (every file of it written): write its marker."""
    (folder / PUBLISHED_FILE).write_text(json.dumps({"step": step}))


def is_published(folder: Location) -> bool:
    """Whether a ``step-N`` folder is a whole checkpoint: any local one (it was renamed whole),
    an object store's one holding its marker."""
    return not is_remote(folder) or (folder / PUBLISHED_FILE).is_file()
