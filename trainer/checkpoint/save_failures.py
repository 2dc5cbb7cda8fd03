"""A save the disk refuses (full, over quota, read-only, no permission), said in one line.

The line says what was lost (the new checkpoint only), what was kept (the older checkpoints, by
name) and what to do. Anything else that fails a save is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.folders import step_folders

FULL, READ_ONLY = "full", "read-only"
_ERRNOS = {errno.ENOSPC: FULL, errno.EDQUOT: FULL, errno.EROFS: READ_ONLY, errno.EACCES: READ_ONLY}
_TEXTS = {
    "No space left on device": FULL,
    "Disk quota exceeded": FULL,
    "unexpected pos": FULL,  # torch's zip writer reports a short write so
    "Read-only file system": READ_ONLY,
    "Permission denied": READ_ONLY,
}


def disk_refusal(error: BaseException) -> str | None:
    """``FULL`` or ``READ_ONLY`` when the disk refused the save, anywhere in the chain of causes.

    DCP wraps each rank's failure in a ``CheckpointException`` (a ``BaseException``) whose text
    quotes tracebacks, source lines included, so an ``errno`` anywhere in the chain decides first;
    the messages of the other exceptions are searched only then, for writers that lose the ``errno``.
    """
    chain: list[BaseException] = []
    pending: list[BaseException] = [error]
    while pending:
        e = pending.pop(0)
        if any(e is seen for seen in chain):
            continue
        chain.append(e)
        pending.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        if isinstance(e, CheckpointException):
            pending.extend(exc for exc, _ in e.failures.values())
    for e in chain:
        if isinstance(e, OSError) and e.errno in _ERRNOS:
            return _ERRNOS[e.errno]
    for e in chain:
        if not isinstance(e, CheckpointException):
            found = next((kind for text, kind in _TEXTS.items() if text in str(e)), None)
            if found:
                return found
    return None


def refusal_message(refusal: str, folder: Path, partial: Path, step: int) -> str:
    kept = step_folders(folder)
    names = ", ".join(p.name for _, p in kept) or "none"
    leftover = (
        f"the partial folder {partial} could not be removed" if partial.exists() else "the partial folder was removed"
    )
    if refusal == FULL:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
        newest = f"; the newest checkpoint, {kept[-1][1].name}, takes {_bytes(kept[-1][1]):,} bytes" if kept else ""
        return (
            f"checkpoint step-{step} could not be written: no space left on the device of {folder} "
            f"({free:,} bytes free{newest}). Only step-{step} is lost: {leftover} and the older checkpoints "
            f"are kept ({names}). Free some space, lower `checkpoint.keep_latest_k`, or point "
            "`job.dump_folder` at a larger disk; then rerun to resume."
        )
    return (
        f"checkpoint step-{step} could not be written: {folder} is read-only or not writable by this user. "
        f"Only step-{step} is lost: {leftover} and the older checkpoints are kept ({names}). Make the folder "
        "writable or point `job.dump_folder` at a writable disk (copying the checkpoint folder there); then "
        "rerun to resume."
    )


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
