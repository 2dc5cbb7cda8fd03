"""What makes a checkpoint trustworthy: a checksum for every file, and a finite state.

**Checksums.** :class:`ChecksummingWriter` is DCP's file-system writer plus one step: right
after a rank has written its data files it reads them back and computes their CRC-32 (in the
background thread with async saves, so off the training's critical path). The checksums travel
to the coordinator with DCP's own write results, and after DCP has written ``.metadata`` the
coordinator writes them, with every file's size and the metadata's own checksum, into
``checksums.json``; the files written beside it before the rename that publishes the folder
(``model_args.json``, ``data.json``, ``schedule.json``) are added to it. The writer also marks DCP's ``.metadata``
as checksummed, so a folder whose ``checksums.json`` went missing is refused rather than taken
for one written before checksums existed. At load,
:func:`checksum_problem` recomputes them (each rank a share of the files), so a checkpoint with
a flipped byte is skipped instead of silently loading garbage. CRC-32 detects accidental
corruption (bad disk, torn copy), which is the threat here, at about twice SHA-256's speed.

**Finite state.** :func:`first_non_finite` finds a NaN or an infinity among tensors: the
checkpoint manager refuses to publish such a state (weights, optimizer state, and the buffers a
checkpoint holds: :func:`published_buffers`), so a diverged run never replaces good checkpoints
with garbage.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from parallelisms.torch_private.checkpoint_storage import fsspec_storage
from trainer.checkpoint.location import Location, dcp_reader, fresh, is_remote, location

MANIFEST_FILE = "checksums.json"
METADATA_FILE = ".metadata"
CHECKSUMMED = "meshtrain.checksums"
"""Recorded in ``.metadata``'s ``storage_meta.modules`` (which DCP does not interpret): this
checkpoint was written with a ``checksums.json``."""
LAYOUT_INVARIANT = "meshtrain.layout_invariant"
"""Recorded there too by a run with ``debug.layout_invariant``: only then does the state hold the
same bits as on any other layout, which a layout-invariant run resuming it needs to know."""
LAYOUT_DEPENDENT = (
    "%s was written with `debug.layout_invariant` off: its weights and optimizer state hold the sums of "
    "the layout that trained them, so this run's bits will match runs resumed from the same checkpoint, "
    "not an uninterrupted `debug.layout_invariant` run"
)
_CHUNK = 8 << 20


def file_crc32(path: Location) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits."""
    crc = 0
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


@dataclass(frozen=True)
class _Checksummed:
    """A write result's storage info, carrying the checksum of the file it points into."""

    storage_data: Any
    crc32: str
    size: int


class _Checksumming(FileSystemWriter):
    """DCP's writer (on a file system or an object store) that records every file's CRC-32 in
    ``checksums.json`` (see above), and whether the state was trained with ``debug.layout_invariant``."""

    def __init__(self, path: str, *, layout_invariant: bool = False) -> None:
        super().__init__(path)
        self.layout_invariant = layout_invariant
        self.folder = location(path)

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta() or StorageMeta()
        meta.modules = [*meta.modules, CHECKSUMMED, *([LAYOUT_INVARIANT] if self.layout_invariant else [])]
        return meta

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        written.wait()
        results = written.value()
        sums: dict[str, tuple[str, int]] = {}
        for result in results:
            name = result.storage_data.relative_path
            if name not in sums:
                file = fresh(self.folder) / name
                sums[name] = (file_crc32(file), file.stat().st_size)
        future: Future[list[WriteResult]] = Future()
        future.set_result(
            [
                WriteResult(r.index, r.size_in_bytes, _Checksummed(r.storage_data, *sums[r.storage_data.relative_path]))
                for r in results
            ]
        )
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, dict[str, Any]] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                checked: _Checksummed = r.storage_data
                files[checked.storage_data.relative_path] = {"size": checked.size, "crc32": checked.crc32}
                plain[-1].append(WriteResult(r.index, r.size_in_bytes, checked.storage_data))
        super().finish(metadata, plain)
        folder = fresh(self.folder)
        meta = folder / METADATA_FILE
        files[METADATA_FILE] = {"size": meta.stat().st_size, "crc32": file_crc32(meta)}
        write_manifest(folder, files)


class ChecksummingWriter(_Checksumming):
    """The checksumming writer of a local folder."""


class _FsspecChecksummingWriter(_Checksumming, fsspec_storage()[1]):  # type: ignore[misc]
    """The checksumming writer of an object store's folder."""


def checksumming_writer(folder: Location, *, layout_invariant: bool = False) -> FileSystemWriter:
    """DCP's writer into ``folder`` that records checksums, for a local folder or an object store's."""
    kind = _FsspecChecksummingWriter if is_remote(folder) else ChecksummingWriter
    return kind(str(folder), layout_invariant=layout_invariant)


def written_layout_invariant(folder: Location) -> bool:
    """Whether a checkpoint (whose metadata reads) was written by a ``debug.layout_invariant`` run."""
    storage_meta = dcp_reader(folder).read_metadata().storage_meta
    return storage_meta is not None and LAYOUT_INVARIANT in storage_meta.modules


def write_manifest(folder: Location, files: dict[str, dict[str, Any]]) -> None:
    manifest = {"format": 1, "algorithm": "crc32", "files": dict(sorted(files.items()))}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))


def add_to_manifest(folder: Location, names: Iterable[str]) -> None:
    """Record files written beside the checkpoint after DCP's (a folder without checksums gets none)."""
    files = read_manifest(folder)
    if files is None:
        return
    for name in names:
        file = folder / name
        files[name] = {"size": file.stat().st_size, "crc32": file_crc32(file)}
    write_manifest(folder, files)


def read_manifest(folder: Location) -> dict[str, dict[str, Any]] | None:
    """``{file: {"size", "crc32"}}``, or None for a checkpoint written without checksums."""
    try:
        return json.loads((folder / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {MANIFEST_FILE: {"unreadable": f"{type(e).__name__}: {e}"}}


def checksum_problem(folder: Location, share: int = 0, shares: int = 1) -> str | None:
    """Why ``folder``'s files do not match its manifest, checking the ``share``-th of
    ``shares`` slices of the files (so the ranks of a job divide the reading); None if they
    match or the checkpoint has no manifest (written before checksums existed)."""
    manifest = read_manifest(fresh(folder))
    if manifest is None:
        return None
    if "unreadable" in manifest.get(MANIFEST_FILE, {}):
        return f"its checksum manifest is damaged ({manifest[MANIFEST_FILE]['unreadable']})"
    for name in sorted(manifest)[share::shares]:
        expected, file = manifest[name], folder / name
        if not file.is_file():
            return f"its file {name} is missing"
        size = file.stat().st_size
        if size != expected["size"]:
            return f"its file {name} has {size} bytes, {expected['size']} when written"
        if file_crc32(file) != expected["crc32"]:
            return f"its file {name} does not match its checksum (corrupted after it was written)"
    return None


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None.

    Each tensor's minimum and maximum (NaN propagates through both) in one pass without a
    temporary, then one transfer to the host per device: on CPU ``aminmax`` reads about 20 GB/s,
    ten times an infinity norm and thirty times ``isfinite().all()``.
    """
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        if tensor.is_floating_point() and tensor.numel():
            by_device.setdefault(tensor.device, []).append((name, tensor))
    for members in by_device.values():
        extremes = torch.stack([torch.stack(torch.aminmax(t)).float() for _, t in members])
        finite = torch.isfinite(extremes).all(dim=1).cpu()
        if not bool(finite.all()):
            return members[int((~finite).nonzero()[0])][0]
    return None


def published_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds beside the weights (the persistent ones, such as an MoE
    layer's routing bias ``expert_bias``): a NaN there poisons a resumed run as surely as in a weight."""
    return [
        (f"{module_name}.{name}" if module_name else name, buffer)
        for module_name, module in model.named_modules()
        for name, buffer in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set
    ]
