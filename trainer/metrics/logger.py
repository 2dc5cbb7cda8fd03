r"""Where and when metrics go: the console line and TensorBoard.

The trainer hands one :class:`StepStats` per optimizer step to
:class:`MetricsLogger`, which owns every decision about *when* and *where*
metrics go. Keeping that out of the training loop means the loop never pays for
formatting or I/O on steps that are not logged, and every rank can call
``log`` unconditionally while only the configured ranks actually emit.

TensorBoard's tags and its Custom Scalars layout are in :mod:`trainer.metrics.dashboard`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from trainer.validation import ValidationResult

from trainer.metrics.accounting import MemoryStats, device_memory, tokens_per_second_per_device
from trainer.metrics.dashboard import DASHBOARD_ALIASES, Tag, layout_summary, written_tags
from trainer.runtime.errors import JobError
from trainer.step.sums import Logged
from trainer.step.train_step import StepStats

logger = logging.getLogger("meshtrain")

CONSOLE_TTY_ENV = "MESHTRAIN_CONSOLE_TTY"
"""Set by ``./run_train.sh`` for the workers: "1" when its own stderr is a terminal, else "0"."""


def use_color(disabled: bool, stream: TextIO, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the console line gets ANSI colours.

    Escape codes help a terminal only; in a file or a pipe (CI logs, ``| tee``)
    they are noise, so colour needs the stream to be a TTY, and
    ``--metrics.disable_color_printing`` turns it off whatever the stream. Under
    ``./run_train.sh`` a worker's stderr is torchrun's ``--tee`` log file, whose
    lines torchrun copies to the launcher's stderr: the launcher says in
    :data:`CONSOLE_TTY_ENV` whether that one is a terminal, and that answer
    stands for the worker's own stream.
    """
    if disabled:
        return False
    inherited = environ.get(CONSOLE_TTY_ENV)
    if inherited is not None:
        return inherited == "1"
    return stream.isatty()


_ANSI = {
    "reset": "\033[0m",
    "red": "\033[31m",
    "green": "\033[32m",
    "yellow": "\033[33m",
    "blue": "\033[34m",
    "magenta": "\033[35m",
    "cyan": "\033[36m",
    "white": "\033[37m",
}

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
    ``add_scalar`` or ``flush``, which :meth:`MetricsLogger._write` turns into the one line that
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


def format_duration(seconds: float) -> str:
    """h:mm:ss, with hours allowed past 24 so long runs stay readable at a glance."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@dataclass(frozen=True)
class LogSettings:
    """Where and how often this rank's metrics go (``[metrics]``)."""

    console: bool
    dump_folder: str
    tb_folder: str
    tensorboard: bool
    log_freq: int
    color: bool
    total_steps: int
    validation: bool = False
    resumed: bool = False


@dataclass(frozen=True)
class Throughput:
    """What turns a step's time into tokens/s, TFLOP/s and MFU per device: a data-parallel
    replica's tokens are processed by its ``devices_per_replica`` (pp x tp x cp) devices."""

    device: torch.device
    flops_per_token: int
    peak_flops: float | None
    global_tokens_per_step: int
    devices_per_replica: int = 1


class MetricsLogger:
    """Accumulates per-step stats and emits them on log steps.

    Emission happens on step 1 (to show the run is alive and catch setup
    problems early), every ``log_freq`` steps, and on the final step so the
    last values are never lost. Throughput and timing are averaged over all
    steps since the previous emission, so logging less often does not make
    the numbers noisier or hide slow steps. Besides the loss, norm and
    throughput, every value the step declares (``logged``: MoE balancing,
    replica groups, loss terms) goes where its declaration says.
    """

    def __init__(self, settings: LogSettings, throughput: Throughput, logged: tuple[Logged, ...] = (), rank: int = 0):
        self.settings, self.throughput, self.logged = settings, throughput, logged
        self._colors = _ANSI if settings.color else dict.fromkeys(_ANSI, "")
        self._window_steps = 0
        self._window_tokens = 0
        self._window_data_time = 0.0
        self._window_step_time = 0.0
        self._n_skipped_steps = 0

        self.tb_dir: str | None = None
        self._writer: SummaryWriter | None = None
        if rank == 0 and settings.tensorboard:
            # Imported lazily so runs without TensorBoard installed still work
            # when it is disabled.
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = str(tensorboard_run(Path(settings.dump_folder), settings.tb_folder, settings.resumed))
            self._writer = SummaryWriter(log_dir=self.tb_dir)
            _quiet_event_writer_thread()
            device = throughput.device
            written = written_tags(
                mfu=throughput.peak_flops is not None, cuda=device.type == "cuda", validation=settings.validation
            )
            # add_custom_scalars builds margin charts of one series only; this layout goes to the
            # events file the way that method sends its own.
            self._writer._get_file_writer().add_summary(layout_summary(written, logged))

    def log(self, stats: StepStats) -> None:
        """Record one step; emit a console line / TensorBoard point on log steps."""
        settings, throughput = self.settings, self.throughput
        self._window_steps += 1
        self._window_tokens += stats.local_tokens
        self._window_data_time += stats.data_time_s
        self._window_step_time += stats.step_time_s
        self._n_skipped_steps = stats.n_skipped_steps
        values = stats.result.values
        every_step = {d.tag: values[d.tag] for d in self.logged if d.every_step and d.tag in values}
        if every_step and self._writer is not None:
            self._write(every_step, stats.step)

        if not (stats.step == 1 or stats.step % settings.log_freq == 0 or stats.step == settings.total_steps):
            return
        # Summed step times rather than a wall clock between calls: time spent
        # outside steps (checkpointing, evaluation) should not show up as a
        # throughput dip.
        window_time = self._window_step_time
        tps = tokens_per_second_per_device(self._window_tokens, window_time, throughput.devices_per_replica)
        tflops = throughput.flops_per_token * tps / 1e12
        mfu = 100 * tflops * 1e12 / throughput.peak_flops if throughput.peak_flops is not None else None
        mean_step_time = window_time / self._window_steps
        data_pct = 100 * self._window_data_time / window_time if window_time > 0 else 0.0
        memory = device_memory(throughput.device)

        if settings.console:
            eta = mean_step_time * (settings.total_steps - stats.step)
            logger.info(self._console_line(stats, memory, tps, tflops, mfu, eta))
        if self._writer is not None:
            scalars: dict[str, float] = {
                Tag.LOSS_AVG: stats.result.loss_avg,
                Tag.LOSS_MAX: stats.result.loss_max,
                Tag.GRAD_NORM: stats.result.grad_norm,
                Tag.LR: stats.result.lr,
                Tag.VALID_TOKENS: stats.result.n_valid_tokens,
                Tag.TOKENS_SEEN: throughput.global_tokens_per_step * stats.step,
                Tag.TPS: tps,
                Tag.TFLOPS: tflops,
                Tag.MEM_ACTIVE: memory.active_gib,
                Tag.STEP_TIME: mean_step_time,
                Tag.DATA_PCT: data_pct,
                Tag.SKIPPED: self._n_skipped_steps,
            }
            optional: dict[str, float | None] = {
                Tag.MFU: mfu,
                Tag.MEM_RESERVED: memory.reserved_gib,
                Tag.MEM_ACTIVE_PCT: memory.active_pct,
                Tag.MEM_RESERVED_PCT: memory.reserved_pct,
                Tag.ALLOC_RETRIES: memory.num_alloc_retries,
                Tag.OOMS: memory.num_ooms,
            }
            scalars.update({tag: value for tag, value in optional.items() if value is not None})
            scalars.update({d.tag: values[d.tag] for d in self.logged if not d.every_step and d.tag in values})
            self._write(scalars, stats.step)

        self._window_steps = 0
        self._window_tokens = 0
        self._window_data_time = 0.0
        self._window_step_time = 0.0

    def log_validation(self, step: int, result: ValidationResult) -> None:
        """One validation pass: a console line and its TensorBoard points."""
        if self.settings.console:
            c = self._colors
            logger.info(
                f"{c['cyan']}validation: step {step}  {c['green']}loss: {result.loss:.4f}  "
                f"perplexity: {result.perplexity:.2f}  {c['white']}({result.n_valid_tokens:,} tokens, "
                f"{result.batches} batches, {result.seconds:.1f}s){c['reset']}"
            )
        if self._writer is not None:
            values = {Tag.VAL_LOSS: result.loss, Tag.VAL_PERPLEXITY: result.perplexity, Tag.VAL_TIME: result.seconds}
            self._write(values, step)

    def _write(self, scalars: Mapping[str, float], step: int) -> None:
        """Add the scalars (and their dashboard aliases) and flush, so the curves stay up to date
        for a run killed before ``close()``; a log folder that cannot be written any more (read-only,
        full) ends the job with one line naming it. The writer is dropped then: its thread has died,
        and closing it would raise the same error again."""
        assert self._writer is not None
        try:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
                if tag in DASHBOARD_ALIASES:
                    self._writer.add_scalar(DASHBOARD_ALIASES[tag], value, step)
            self._writer.flush()
        except OSError as e:
            self._writer = None
            raise JobError(
                f"cannot write the TensorBoard logs in {self.tb_dir} at step {step} ({e.strerror or e}): the "
                "dump folder (`job.dump_folder`) must stay writable for the whole run; nothing in it was removed. "
                "Free space or make it writable again, then rerun the same command: it resumes from the newest "
                "checkpoint if `checkpoint.enable` is on (or turn TensorBoard off with "
                "`--metrics.enable_tensorboard false`)."
            ) from e

    def _console_line(
        self,
        stats: StepStats,
        memory: MemoryStats,
        tps: float,
        tflops: float,
        mfu: float | None,
        eta_s: float,
    ) -> str:
        """One human-readable line; ``:.4f`` etc. render non-finite values as nan/inf."""
        c = self._colors
        if memory.reserved_gib is not None and memory.reserved_pct is not None:
            # Reserved memory is what runs out first, so that is the headline number.
            shown_memory = f"{memory.reserved_gib:.2f}GiB ({memory.reserved_pct:.1f}%)"
        else:
            shown_memory = f"{memory.active_gib:.2f}GiB"
        fields = [
            f"{c['cyan']}step: {stats.step}/{self.settings.total_steps}",
            f"{c['green']}loss: {stats.result.loss_avg:.4f}",
            f"{c['green']}max loss: {stats.result.loss_max:.4f}",
            f"{c['yellow']}grad norm: {stats.result.grad_norm:.4f}",
            f"{c['blue']}memory: {shown_memory}",
            f"{c['magenta']}tps/device: {tps:,.0f}",
            f"{c['magenta']}tflops: {tflops:.2f}",
        ]
        if mfu is not None:
            fields.append(f"{c['magenta']}mfu: {mfu:.2f}%")
        fields += self._declared_fields(stats.result.values)
        fields.append(f"{c['white']}eta: {format_duration(eta_s)}")
        if self._n_skipped_steps:
            fields.append(f"{c['red']}skipped steps: {self._n_skipped_steps}")
        return "  ".join(fields) + c["reset"]

    def _declared_fields(self, values: Mapping[str, float]) -> list[str]:
        """The declared values with a console label, those of one label in one field."""
        by_label: dict[str, list[str]] = {}
        for d in self.logged:
            if d.label and d.tag in values:
                by_label.setdefault(d.label, []).append(f"{values[d.tag]:.{d.digits}f}")
        return [f"{self._colors['yellow']}{label}: {' '.join(shown)}" for label, shown in by_label.items()]

    def close(self) -> None:
        """Flush and release the TensorBoard writer; safe to call more than once."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
