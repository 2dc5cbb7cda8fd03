"""A save the disk refuses (full, over quota, read-only, no permission), said in one line.

The line says what was lost (the new checkpoint only), what was kept (the older checkpoints, by
name) and what to do. Anything else that fails a save is a bug and keeps its traceback; which
errors are the disk's is ``disk.py``'s to say.
"""

from __future__ import annotations

import shutil

from trainer.checkpoint.disk import FULL
from trainer.checkpoint.folders import step_folders
from trainer.checkpoint.location import Location, display, is_remote


def refusal_message(refusal: str, folder: Location, partial: Location, step: int) -> str:
    kept = step_folders(folder)
    names = ", ".join(p.name for _, p in kept) or "none"
    leftover = (
        f"the partial folder {partial} could not be removed" if partial.exists() else "the partial folder was removed"
    )
    if refusal == FULL:
        free = (
            ""
            if is_remote(folder)
            else f"{shutil.disk_usage(folder if folder.exists() else folder.parent).free:,} bytes free"
        )
        newest = f"the newest checkpoint, {kept[-1][1].name}, takes {_bytes(kept[-1][1]):,} bytes" if kept else ""
        sizes = "; ".join(text for text in (free, newest) if text)
        return (
            f"checkpoint step-{step} could not be written: no space left on the device of {display(folder)} "
            f"({sizes or 'no checkpoint kept'}). Only step-{step} is lost: {leftover} and the older checkpoints "
            f"are kept ({names}). Free some space, lower `checkpoint.keep_latest_k`, or point "
            "`job.dump_folder` at a larger disk; then rerun to resume."
        )
    return (
        f"checkpoint step-{step} could not be written: {display(folder)} is read-only or not writable by this user. "
        f"Only step-{step} is lost: {leftover} and the older checkpoints are kept ({names}). Make the folder "
        "writable or point `job.dump_folder` at a writable disk (copying the checkpoint folder there); then "
        "rerun to resume."
    )


def _bytes(folder: Location) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
