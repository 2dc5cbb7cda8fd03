r"""Where and when metrics go: the console line, TensorBoard and wandb.

The trainer hands one :class:`StepStats` per optimizer step to
:class:`MetricsLogger`, which owns every decision about *when* and *where*
metrics go. Keeping that out of the training loop means the loop never pays for
formatting or I/O on steps that are not logged, and every rank can call
``log`` unconditionally while only the configured ranks actually emit.

TensorBoard's tags and its Custom Scalars layout are in :mod:`trainer.metrics.dashboard`; each
destination of the scalars is a sink of its own (``tensorboard_sink``, ``wandb_sink``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import torch

if TYPE_CHECKING:
    from trainer.validation import ValidationResult

from trainer.metrics.accounting import MemoryStats, device_memory, tokens_per_second_per_device
from trainer.metrics.dashboard import Tag, written_tags
from trainer.metrics.tensorboard_sink import TensorBoardSink
from trainer.metrics.wandb_sink import WandbSink
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
    wandb: bool = False


class Sink(Protocol):
    """A destination of the logged scalars (rank 0's): ``where`` says where to look."""

    name: str

    def where(self) -> str: ...
    def write(self, scalars: Mapping[str, float], step: int) -> None: ...
    def close(self) -> None: ...


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

    def __init__(
        self,
        settings: LogSettings,
        throughput: Throughput,
        logged: tuple[Logged, ...] = (),
        sinks: tuple[Sink, ...] = (),
    ):
        self.settings, self.throughput, self.logged, self.sinks = settings, throughput, logged, sinks
        self._colors = _ANSI if settings.color else dict.fromkeys(_ANSI, "")
        self._window_steps = 0
        self._window_tokens = 0
        self._window_data_time = 0.0
        self._window_step_time = 0.0
        self._n_skipped_steps = 0

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
        if every_step:
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
        if self.sinks:
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
        if self.sinks:
            values = {Tag.VAL_LOSS: result.loss, Tag.VAL_PERPLEXITY: result.perplexity, Tag.VAL_TIME: result.seconds}
            self._write(values, step)

    def _write(self, scalars: Mapping[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.write(scalars, step)

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
        """Flush and release every sink; safe to call more than once."""
        for sink in self.sinks:
            sink.close()


def open_sinks(
    settings: LogSettings, throughput: Throughput, logged: tuple[Logged, ...], rank: int, run_config: Mapping[str, Any]
) -> tuple[Sink, ...]:
    """Rank 0's destinations of the scalars, as ``[metrics]`` turns them on."""
    if rank != 0:
        return ()
    sinks: list[Sink] = []
    if settings.tensorboard:
        written = written_tags(
            mfu=throughput.peak_flops is not None, cuda=throughput.device.type == "cuda", validation=settings.validation
        )
        sinks.append(TensorBoardSink(Path(settings.dump_folder), settings.tb_folder, settings.resumed, written, logged))
    if settings.wandb:
        sinks.append(WandbSink(Path(settings.dump_folder), settings.resumed, run_config))
    return tuple(sinks)
