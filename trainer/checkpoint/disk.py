"""Writes the disk refuses (full, over quota, read-only, no permission), and converter output
that appears whole or not at all.

:func:`disk_refusal` tells a refusal from a bug, for the trainer's saves (``save_failures.py``)
and the converters. :func:`staged_output` makes a converter's output folder gain its files only
once all of them are written: a full disk, a read-only folder, Ctrl-C or a bug midway leaves the
folder as it was, so nothing blocks the rerun and nothing the user had is touched.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from trainer.model.hf_llama3 import InteropError
from trainer.runtime.errors import JobError

FULL, READ_ONLY = "full", "read-only"
_ERRNOS = {errno.ENOSPC: FULL, errno.EDQUOT: FULL, errno.EROFS: READ_ONLY, errno.EACCES: READ_ONLY}
_TEXTS = {
    "No space left on device": FULL,
    "Disk quota exceeded": FULL,
    "unexpected pos": FULL,  # torch's zip writer reports a short write so
    "Read-only file system": READ_ONLY,
    "Permission denied": READ_ONLY,
}
STAGING = ".meshtrain-"
"""How the hidden folder a converter writes into begins (it ends in ``.partial``): only a
SIGKILL leaves one behind, and the converters ignore it when they check that a folder is empty."""


def disk_refusal(error: BaseException) -> str | None:
    """``FULL`` or ``READ_ONLY`` when the disk refused a write, anywhere in the chain of causes.

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


def user_entries(folder: Path) -> list[str]:
    """The names in ``folder``, less the staging folders a killed converter left."""
    return sorted(p.name for p in folder.iterdir() if not (p.name.startswith(STAGING) and p.name.endswith(".partial")))


@contextmanager
def staged_output(out: Path, what: str, needs: int) -> Iterator[Path]:
    """A hidden empty folder on ``out``'s file system to write ``what`` into; when the block ends
    its files are moved into ``out`` (created if need be), none of them replacing a file there.

    The staging folder lies inside ``out`` when it exists (``out`` may be a mount point), else
    beside it. Whatever ends the block early, the staging folder is removed and ``out`` keeps
    only what it had; a disk that refuses the writes becomes one line naming ``out``, the space
    free against the about ``needs`` bytes to write, and the fix.
    """
    if out.exists() and not out.is_dir():
        raise InteropError(f"{out} is a file; pass a new or empty folder to {what} into.")
    moved: list[Path] = []
    staging: Path | None = None
    try:
        if out.is_dir():
            staging = Path(tempfile.mkdtemp(prefix=STAGING, suffix=".partial", dir=out))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f"{STAGING}{out.name}-", suffix=".partial", dir=out.parent))
        yield staging
        names = sorted(p.name for p in staging.iterdir())
        clash = [name for name in names if (out / name).exists()]
        if clash:
            raise InteropError(f"{out} already holds {clash}; {what} into a new or empty folder.")
        out.mkdir(exist_ok=True)
        for name in names:
            os.replace(staging / name, out / name)
            moved.append(out / name)
    except (OSError, CheckpointException) as error:
        for path in moved:
            path.unlink(missing_ok=True)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        refusal = disk_refusal(error)
        if refusal is None:
            raise
        raise JobError(_refusal_message(refusal, out, what, needs, error)) from error
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _refusal_message(refusal: str, out: Path, what: str, needs: int, error: BaseException) -> str:
    where = out if out.exists() else out.parent
    if refusal == FULL:
        free = shutil.disk_usage(where).free if where.exists() else 0
        return (
            f"cannot {what} into {out}: no space left on its device ({free:,} bytes free, about {needs:,} "
            "needed). Nothing was written there; free some space or pass a folder on a larger disk, then rerun."
        )
    reason = error.strerror if isinstance(error, OSError) and error.strerror else "not writable"
    return (
        f"cannot {what} into {out}: {where} is read-only or not writable by this user ({reason}). Nothing "
        "was written there; make it writable or pass a folder on a writable disk, then rerun."
    )
