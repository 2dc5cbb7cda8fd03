"""Tests for trainer.metrics: FLOPs/MFU accounting, device memory, log cadence, the console line
and validation logging. What TensorBoard gets and its dashboard layout: test_dashboard.py."""

from __future__ import annotations

import errno
import io
import logging
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from metrics_helpers import (
    CPU_ALIASES,
    CPU_TAGS,
    GPU_ONLY_ALIASES,
    GPU_ONLY_TAGS,
    LOCAL_TOKENS,
    _make_logger,
    _read_events,
    _run,
    _scalars,
    _stats,
    fake_cuda,
    tb_dir,
)

from trainer import metrics
from trainer.metrics import (
    CONSOLE_TTY_ENV,
    DASHBOARD_ALIASES,
    MetricsLogger,
    flops_per_token,
    peak_flops,
    use_color,
)
from trainer.metrics.tensorboard_sink import TensorBoardSink
from trainer.runtime.errors import JobError
from trainer.step.train_step import StepStats
from trainer.validation import ValidationResult

__all__ = ["fake_cuda"]  # the fixture, used by name


def test_flops_per_token_matches_hand_count() -> None:
    n_params, n_layers, dim, seq_len = 1000, 2, 8, 16
    # Weights: 2 FLOPs/param forward (multiply + add), 4 backward.
    weight_flops = (2 + 4) * n_params
    # Attention per layer and token: Q·K^T and A·V are each 2·S·d forward,
    # and backward costs twice the forward.
    attention_flops = n_layers * 3 * (2 * seq_len * dim + 2 * seq_len * dim)
    result = flops_per_token(n_params, n_layers, dim, seq_len)
    assert result == weight_flops + attention_flops == 9072
    assert isinstance(result, int)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA B200", 2.25e15),
    ],
)
def test_peak_flops_by_device_name(monkeypatch: pytest.MonkeyPatch, name: str, expected: float) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == expected


def test_peak_flops_unknown_gpu_warns_and_override_wins(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    unknown = "NVIDIA GeForce RTX 4090"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: unknown)
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        assert peak_flops(torch.device("cuda", 0)) is None
    assert "RTX 4090" in caplog.text
    assert peak_flops(torch.device("cuda", 0), override=165e12) == 165e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda", 0), override=500e12) == 500e12


def test_peak_flops_is_none_on_cpu() -> None:
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), override=1e12) is None


def test_peak_flops_rejects_non_positive_override() -> None:
    with pytest.raises(ValueError, match="positive"):
        peak_flops(torch.device("cpu"), override=0.0)


def test_device_memory_cpu_reports_rss_only() -> None:
    memory = metrics.device_memory(torch.device("cpu"))
    assert 0 < memory.active_gib < 1024
    # No device total, allocator or counters on CPU: nothing is made up.
    assert memory == metrics.MemoryStats(active_gib=memory.active_gib)


def test_device_memory_cuda_reports_torchtitan_memory_stats(fake_cuda: list[object]) -> None:
    memory = metrics.device_memory(torch.device("cuda", 0))
    assert memory == metrics.MemoryStats(
        active_gib=2.0,
        reserved_gib=4.0,
        active_pct=2.5,
        reserved_pct=5.0,
        num_alloc_retries=3,
        num_ooms=1,
    )
    assert fake_cuda == [torch.device("cuda", 0)]


def test_validation_is_logged_to_console_and_tensorboard(tmp_path: os.PathLike[str], caplog) -> None:
    logger = _make_logger(tmp_path, validation=True)
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        logger.log_validation(10, ValidationResult(loss=math.log(50.0), n_valid_tokens=1234, batches=3, seconds=1.25))
    assert "validation: step 10  loss: 3.9120  perplexity: 50.00  (1,234 tokens, 3 batches, 1.2s)" in caplog.text
    logger.close()
    scalars = _read_events(tb_dir(logger))
    assert scalars.Scalars("validation/perplexity")[0].value == pytest.approx(50.0)
    assert [e.step for e in scalars.Scalars("validation/loss")] == [10]


def test_devices_per_replica_scales_throughput(tmp_path: os.PathLike[str]) -> None:
    logger = _make_logger(tmp_path, console=False, devices_per_replica=2)
    assert tb_dir(logger) is not None
    _run(logger, [_stats(1)])
    tps = _scalars(_read_events(tb_dir(logger)), "throughput(tps)")
    assert tps[1] == pytest.approx(LOCAL_TOKENS / (0.5 * 2))


def _console_lines(caplog: pytest.LogCaptureFixture, logger: MetricsLogger, steps: Iterable[StepStats]) -> list[str]:
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        _run(logger, steps)
    return [r.getMessage() for r in caplog.records if r.name == "meshtrain"]


def test_console_plain_line(tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture) -> None:
    logger = _make_logger(tmp_path, enable_tensorboard=False, total_steps=10, log_freq=4)
    lines = _console_lines(caplog, logger, [_stats(s) for s in range(1, 5)])
    assert len(lines) == 2  # steps 1 and 4
    first, fourth = lines
    assert "\033[" not in first
    assert first.startswith("step: 1/10")
    for field in ("loss: 10.0000", "max loss: 12.0000", "grad norm: 1.5000", "memory: ", "GiB"):
        assert field in first
    assert "tps/device: 256" in first
    assert "tflops: " in first
    assert "mfu" not in first
    assert "skipped" not in first
    # 6 steps left at 0.5 s each.
    assert "eta: 0:00:03" in fourth


def test_console_colored_line_with_skips_and_non_finite_values(
    tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture
) -> None:
    logger = _make_logger(tmp_path, enable_tensorboard=True, color=True, total_steps=3, log_freq=10)
    steps = [
        _stats(1),
        _stats(2, n_skipped_steps=1, loss_avg=math.nan, grad_norm=math.inf),
        _stats(3, n_skipped_steps=1, loss_avg=math.nan, loss_max=math.nan, grad_norm=math.nan),
    ]
    lines = _console_lines(caplog, logger, steps)
    assert len(lines) == 2  # steps 1 and 3 (the last one)
    last = lines[-1]
    assert "\033[" in last
    assert last.endswith("\033[0m")
    assert "loss: nan" in last
    assert "grad norm: nan" in last
    assert "skipped steps: 1" in last
    assert tb_dir(logger) is not None
    assert math.isnan(_scalars(_read_events(tb_dir(logger)), "grad_norm")[3])


def test_console_disabled_emits_nothing(tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture) -> None:
    logger = _make_logger(tmp_path, console=False, enable_tensorboard=False)
    assert _console_lines(caplog, logger, [_stats(1), _stats(2)]) == []


def test_gpu_path_reports_mfu_and_torchtitan_memory_tags(
    fake_cuda: list[object],
    tmp_path: os.PathLike[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    peak = 1e9
    logger = _make_logger(tmp_path, device=torch.device("cuda", 0), peak_flops=peak, total_steps=2)
    assert tb_dir(logger) is not None
    lines = _console_lines(caplog, logger, [_stats(1), _stats(2)])

    assert len(fake_cuda) == 2
    assert "memory: 4.00GiB (5.0%)" in lines[0]
    assert "mfu: " in lines[0]
    acc = _read_events(tb_dir(logger))
    assert set(acc.Tags()["scalars"]) == CPU_TAGS | CPU_ALIASES | GPU_ONLY_TAGS | GPU_ONLY_ALIASES
    tflops = _scalars(acc, "tflops")[1]
    expected = {
        "mfu(%)": 100 * tflops * 1e12 / peak,
        "memory/max_active(GiB)": 2.0,
        "memory/max_reserved(GiB)": 4.0,
        "memory/max_active(%)": 2.5,
        "memory/max_reserved(%)": 5.0,
        "memory/num_alloc_retries": 3,
        "memory/num_ooms": 1,
    }
    for tag, value in expected.items():
        assert _scalars(acc, tag) == {1: pytest.approx(value), 2: pytest.approx(value)}, tag
        if tag in DASHBOARD_ALIASES:
            assert _scalars(acc, DASHBOARD_ALIASES[tag]) == _scalars(acc, tag), tag


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize(
    ("disabled", "tty", "environ", "expected"),
    [
        (False, True, {}, True),
        (False, False, {}, False),  # a file or a pipe: plain text
        (True, True, {}, False),  # the flag forces plain text on a terminal too
        (False, False, {CONSOLE_TTY_ENV: "1"}, True),  # run_train.sh's tee file, launcher on a terminal
        (False, True, {CONSOLE_TTY_ENV: "0"}, False),  # launcher piped to a file
        (True, False, {CONSOLE_TTY_ENV: "1"}, False),
    ],
)
def test_color_only_on_a_terminal(disabled: bool, tty: bool, environ: dict[str, str], expected: bool) -> None:
    assert use_color(disabled, _Stream(tty), environ) is expected


@pytest.mark.parametrize("failing", ["add_scalar", "flush"])
@pytest.mark.parametrize("call", ["step", "validation"])
def test_a_log_folder_that_cannot_be_written_ends_the_job_naming_it(tmp_path, monkeypatch, failing, call) -> None:
    """A dump folder made read-only (or full) mid-run: one JobError naming the folder and the key,
    whichever write fails and whatever is being logged."""
    logger = _make_logger(tmp_path, log_freq=1)
    (sink,) = logger.sinks
    assert isinstance(sink, TensorBoardSink) and sink._writer is not None

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(sink._writer, failing, refuse)
    with pytest.raises(JobError, match="cannot write the TensorBoard logs in .*Permission denied.*job.dump_folder"):
        if call == "step":
            logger.log(_stats(1))
        else:
            logger.log_validation(1, ValidationResult(loss=1.0, n_valid_tokens=10, batches=1, seconds=0.1))


def test_a_refused_write_in_tensorboards_thread_is_the_one_error_not_a_thread_traceback(tmp_path, monkeypatch) -> None:
    """TensorBoard writes events from a thread of its own: a disk that refuses them kills that
    thread, whose traceback must not print; the next flush raises the JobError instead."""
    from tensorboard.compat.tensorflow_stub.io.gfile import LocalFileSystem

    reported: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", reported.append)
    logger = _make_logger(tmp_path, log_freq=1, console=False)

    def refuse(*args: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(LocalFileSystem, "append", refuse)
    with pytest.raises(JobError, match=r"TensorBoard logs in .* at step 1 \(Read-only file system\)"):
        logger.log(_stats(1))
    logger.close()
    assert reported == []

    def other_thread_fails() -> None:
        raise ValueError("not the events writer")

    thread = threading.Thread(target=other_thread_fails)
    thread.start()
    thread.join()
    assert [type(args.exc_value) for args in reported] == [ValueError]


def test_the_cpu_memory_figure_is_the_process_own_peak_not_its_launchers():
    """``ru_maxrss`` survives ``exec``: a worker started by a large process (the test runner, a
    notebook) would report its launcher's peak as its own. The worker's own figure is what it
    reports started by this process before the ballast (torch's import alone differs by build)."""
    code = "from trainer.metrics.accounting import peak_rss_bytes; print(peak_rss_bytes())"

    def worker_peak() -> int:
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent
        )
        return int(run.stdout)

    own = worker_peak()
    ballast = bytearray(768 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # resident, not only reserved
    assert worker_peak() < own + 256 * 2**20, (own / 2**20, worker_peak() / 2**20)
    del ballast
