"""TensorBoard as a destination of the logged scalars: the run folder, the dashboard layout, and
a folder that stops taking writes ending the job in one line."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from trainer.metrics.dashboard import DASHBOARD_ALIASES, layout_summary
from trainer.runtime.errors import JobError
from trainer.step.sums import Logged

RUN_RECORD = "run-of-this-job.txt"
"""In the TensorBoard folder: the name of the run the job writes, continued when it resumes."""


def tensorboard_run(dump_folder: Path, tb_folder: str, resumed: bool) -> Path:
    """The TensorBoard run directory: named after the job (its dump folder) and its start time,
    so runs of different jobs are told apart in TensorBoard's list; a job that resumes from a
    checkpoint continues the run it wrote before (its name is kept in :data:`RUN_RECORD`)."""
    folder = dump_folder / tb_folder
    record = folder / RUN_RECORD
    if resumed and record.is_file():
        previous = folder / record.read_text().strip()
        if previous.is_dir():
            return previous
    name = f"{dump_folder.resolve().name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    record.write_text(name + "\n")
    return folder / name


_EVENT_WRITER_MODULE = "tensorboard.summary.writer.event_file_writer"


def _quiet_event_writer_thread() -> None:
    """Keep the traceback of TensorBoard's writer thread off the console when the disk refuses a write.

    The events are written by a thread of TensorBoard's own. When the dump folder turns read-only
    or full, that thread dies printing its traceback, and the same error reaches the next
    ``add_scalar`` or ``flush``, which :meth:`TensorBoardSink.write` turns into the one line that
    names the folder; the traceback would print in the middle of it (and hide it from the
    launcher, which looks for that line). Only that thread's ``OSError`` is kept quiet; anything
    else goes to the hook that was there.
    """
    previous = threading.excepthook
    if getattr(previous, "__name__", None) == "event_writer_excepthook":
        return

    def event_writer_excepthook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__ == _EVENT_WRITER_MODULE:
            return
        previous(args)

    threading.excepthook = event_writer_excepthook


class TensorBoardSink:
    """One TensorBoard run of this job (rank 0), its Custom Scalars layout written first."""

    name = "TensorBoard"

    def __init__(self, dump_folder: Path, tb_folder: str, resumed: bool, written: set[str], logged: Sequence[Logged]):
        # Imported here so runs with TensorBoard off work without it installed.
        from torch.utils.tensorboard import SummaryWriter

        self.folder = tensorboard_run(dump_folder, tb_folder, resumed)
        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(self.folder))
        _quiet_event_writer_thread()
        # add_custom_scalars builds margin charts of one series only; this layout goes to the
        # events file the way that method sends its own.
        self._writer._get_file_writer().add_summary(layout_summary(written, logged))

    def where(self) -> str:
        return f"tensorboard --logdir {self.folder}"

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        """Add the scalars (and their dashboard aliases) and flush, so the curves stay up to date
        for a run killed before ``close()``; a log folder that cannot be written any more (read-only,
        full) ends the job with one line naming it. The writer is dropped then: its thread has died,
        and closing it would raise the same error again."""
        if self._writer is None:
            return
        try:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
                if tag in DASHBOARD_ALIASES:
                    self._writer.add_scalar(DASHBOARD_ALIASES[tag], value, step)
            self._writer.flush()
        except OSError as e:
            self._writer = None
            raise JobError(
                f"cannot write the TensorBoard logs in {self.folder} at step {step} ({e.strerror or e}): the "
                "dump folder (`job.dump_folder`) must stay writable for the whole run; nothing in it was removed. "
                "Free space or make it writable again, then rerun the same command: it resumes from the newest "
                "checkpoint if `checkpoint.enable` is on (or turn TensorBoard off with "
                "`--metrics.enable_tensorboard false`)."
            ) from e

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
