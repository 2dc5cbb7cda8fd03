"""A loader that stops delivering never hangs a job silently, whoever loads: worker processes
(``tests/test_stop_requests.py`` stops one with SIGSTOP) or the training process itself, whose
read of an unresponsive file system blocks (here: a dataset whose read never returns)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from trainer.data.loader import GlobalOrder, MicroBatchLoader, StoppedWaitingForData
from trainer.runtime.errors import JobError

HUNG = threading.Event()


def batches_then_a_hung_read(step: int) -> Iterator[list[torch.Tensor]]:
    """Two micro-batches, then a read that never returns (until the test releases it)."""
    for _ in range(2):
        yield [torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)]
    HUNG.wait()
    yield [torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)]


def loader(timeout_s: float) -> MicroBatchLoader:
    return MicroBatchLoader(GlobalOrder(100, 2, 0), 2, batches_then_a_hung_read, timeout_s=timeout_s, workers=0)


@pytest.fixture(autouse=True)
def release_the_read():
    HUNG.clear()
    yield
    HUNG.set()


def test_a_hung_read_in_this_process_ends_the_job_naming_the_setting():
    data = loader(timeout_s=1.5)
    assert len(data.next_step()) == 2
    started = time.monotonic()
    with pytest.raises(JobError, match=r"`training.num_workers` = 0\), and its read hangs") as error:
        data.next_step()
    assert 1.5 <= time.monotonic() - started < 10
    assert "`training.data_timeout_seconds` = 1.5 s" in str(error.value) and "\n" not in str(error.value)


def test_a_stop_request_while_this_process_waits_for_its_read_stops_the_step():
    data = loader(timeout_s=60)
    data.next_step()
    asked = time.monotonic()
    with pytest.raises(StoppedWaitingForData):
        data.next_step(stop_requested=lambda: time.monotonic() - asked > 1)
