"""The loader: the same global batch at every step on any mesh, cut into this rank's share.

:class:`GlobalOrder` decides which samples make up each step's global batch from the step,
dataset size, global batch size and seed only; the rank's sampler then takes its micro-batches
out of that batch. The mesh changes only the cut, never the batch, which is what lets a
checkpoint resume on another mesh with the same sample stream.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from parallelisms.torch_private import dataloader
from trainer.runtime.errors import ConfigError, DataError, JobError

POLL_S = 1.0
"""How often a wait for a worker's micro-batch looks at the stop request and the data timeout."""


class StoppedWaitingForData(Exception):
    """A stop request arrived while the step waited for its data: the step cannot finish."""


class GlobalOrder:
    """The global stream of sample indices and its cut into global batches.

    Epoch e is ``randperm(num_samples)`` seeded with ``seed + e``; step s is stream positions
    ``[s * global_batch_size, (s + 1) * global_batch_size)``. Nothing here knows about ranks,
    which is what makes a step's global batch the same on every mesh, and what a reference
    computation outside the loader (a test, a benchmark) reproduces with :meth:`batch`.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        # Consecutive steps mostly share an epoch; keep its permutation instead of redrawing it.
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = torch.randperm(self.num_samples, generator=generator)
            self._epoch = epoch
        return self._permutation

    def batch(self, step: int) -> list[int]:
        """Dataset indices of step ``step``'s global batch, in global order."""
        return self.stream(step * self.global_batch_size, self.global_batch_size)

    def stream(self, start: int, count: int) -> list[int]:
        """Dataset indices at stream positions ``[start, start + count)``."""
        indices: list[int] = []
        position, end = start, start + count
        while position < end:
            epoch, offset = divmod(position, self.num_samples)
            take = min(self.num_samples - offset, end - position)
            indices.extend(self._epoch_order(epoch)[offset : offset + take].tolist())
            position += take
        return indices


def global_order(dataset: Dataset, global_batch_size: int, seed: int) -> GlobalOrder:
    """The dataset's global order: its own (a mixture's ``order``), or a :class:`GlobalOrder`."""
    own = getattr(dataset, "order", None)
    if own:
        return own(global_batch_size, seed)
    if not isinstance(dataset, Sized):
        raise TypeError(f"{type(dataset).__name__} has no len(): the global order needs the number of samples")
    return GlobalOrder(len(dataset), global_batch_size, seed)


class _RankBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches, step after step, forever, from step ``start_step`` on.

    Micro-batch m of rank r takes the global batch's slice ``(m * dp_degree + r) * local_batch_size``
    onward, so the slices of all (rank, micro-batch) pairs tile the global batch exactly.
    """

    def __init__(
        self,
        order: GlobalOrder,
        microbatches: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        start_step: int,
    ) -> None:
        self._order = order
        self._microbatches = microbatches
        self._local_batch_size = local_batch_size
        self._dp_rank = dp_rank
        self._dp_degree = dp_degree
        self._start_step = start_step

    def __iter__(self) -> Iterator[list[int]]:
        step = self._start_step
        while True:
            batch = self._order.batch(step)
            for micro in range(self._microbatches):
                start = (micro * self._dp_degree + self._dp_rank) * self._local_batch_size
                yield batch[start : start + self._local_batch_size]
            step += 1


class _Fetcher:
    """Takes micro-batches out of a loader's iterator on a thread of its own, so that the training
    loop waits for them with a timeout.

    A batch from a worker process arrives as shared-memory handles that the receiver fetches
    from the worker itself; a stopped (``kill -STOP``) or hung worker blocks that fetch
    forever, past the DataLoader's own ``timeout``. Only a wait on another thread can be
    abandoned. The thread is a daemon: a fetch it never finishes does not keep the process alive.
    """

    def __init__(self) -> None:
        self._requests: queue.Queue[Iterator[list[torch.Tensor]]] = queue.Queue()
        self._results: queue.Queue[tuple[bool, Any]] = queue.Queue()
        threading.Thread(target=self._serve, name="data-fetch", daemon=True).start()

    def _serve(self) -> None:
        while True:
            iterator = self._requests.get()
            try:
                self._results.put((True, next(iterator)))
            except BaseException as error:  # handed to the training loop, which raises it
                self._results.put((False, error))

    def request(self, iterator: Iterator[list[torch.Tensor]]) -> None:
        self._requests.put(iterator)

    def result(self, timeout_s: float) -> tuple[bool, Any]:
        """``(True, micro-batch)``, or ``(False, None)`` when none came within ``timeout_s``;
        raises what the fetch raised."""
        try:
            ok, value = self._results.get(timeout=timeout_s)
        except queue.Empty:
            return False, None
        if not ok:
            raise value
        return True, value


def _end_workers(iterator: Iterator[list[torch.Tensor]]) -> None:
    """End the loader's worker processes: torch's own shutdown first (it waits a few seconds for
    each, then sends SIGTERM), then SIGKILL for any still there. A stopped or hung worker
    ignores the SIGTERM, and Python's exit handlers would wait for it forever."""
    for worker in dataloader.shut_down_workers(iterator):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if worker.is_alive():
                worker.kill()


class MicroBatchLoader:
    """Hands out one optimizer step's micro-batches at a time and checkpoints by step.

    The state is the index of the next step the caller will consume (not how far workers have
    prefetched) plus the inputs that define the global order, so it can be restored on any other
    mesh or accumulation setting and continue with the same global batches. ``open_at(step)``
    returns a fresh stream of this rank's micro-batches from ``step`` on; it is called when
    iteration starts and again after :meth:`load_state_dict`, which restarts the workers.
    """

    def __init__(
        self,
        order: GlobalOrder,
        microbatches: int,
        open_at: Callable[[int], Iterable[list[torch.Tensor]]],
        allow_data_change: bool = False,
        timeout_s: float = 0.0,
        workers: int = 0,
    ) -> None:
        self._order = order
        self._open_at = open_at
        self._allow_data_change = allow_data_change
        self._timeout_s = timeout_s
        self._workers = workers
        self._iterator: Iterator[list[torch.Tensor]] | None = None
        self._fetcher: _Fetcher | None = None
        self._step = 0
        self.microbatches_per_step = microbatches

    def next_step(self, stop_requested: Callable[[], bool] = lambda: False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches. A wait for one is bounded, whoever loads it (worker
        processes, or this process, whose read of a hung file system would block it):
        ``stop_requested`` is asked every :data:`POLL_S` seconds (raising
        :class:`StoppedWaitingForData` when it says yes), and a wait past the data timeout
        raises a :class:`JobError` naming the loader; a stalled worker has no collective to
        time out on, so without this a one-process job would wait silently forever."""
        if self._iterator is None:
            self._iterator = iter(self._open_at(self._step))
        microbatches = []
        for _ in range(self.microbatches_per_step):
            input_ids, labels = self._next(self._iterator, stop_requested)
            microbatches.append((input_ids, labels))
        self._step += 1
        return microbatches

    def _next(self, iterator: Iterator[list[torch.Tensor]], stop_requested: Callable[[], bool]) -> list[torch.Tensor]:
        if self._fetcher is None:
            self._fetcher = _Fetcher()
        started = time.monotonic()
        self._fetcher.request(iterator)
        while True:
            done, value = self._fetcher.result(POLL_S)
            if done:
                return value
            waited = time.monotonic() - started
            if stop_requested():
                _end_workers(iterator)
                raise StoppedWaitingForData(f"after waiting {waited:.0f} s for micro-batches of step {self._step + 1}")
            if waited >= self._timeout_s:
                _end_workers(iterator)
                who = (
                    f"one of its `training.num_workers` = {self._workers} worker processes has stalled, died or hangs"
                    if self._workers
                    else "it reads in this process (`training.num_workers` = 0), and its read hangs"
                )
                raise JobError(
                    f"the data loader delivered nothing for step {self._step + 1} within "
                    f"`training.data_timeout_seconds` = {self._timeout_s:g} s: {who} "
                    "on its input (a stopped process, an unresponsive file system). Checkpoints already "
                    "written are kept; rerun to resume. If loading legitimately takes that long, raise "
                    "`training.data_timeout_seconds`."
                )

    def close(self) -> None:
        """End the worker processes: gracefully, then by SIGKILL for any that cannot stop (a
        stopped or hung one would otherwise keep the finished job from exiting)."""
        if self._iterator is not None:
            _end_workers(self._iterator)
            self._iterator = None

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self._step,
            "global_batch_size": self._order.global_batch_size,
            "seed": self._order.seed,
            "num_samples": self._order.num_samples,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        expected = self.state_dict()
        missing = sorted(expected.keys() - state_dict.keys())
        if missing:
            raise DataError(
                f"The checkpoint's data loader state lacks {', '.join(missing)}: it was not saved by meshtrain's "
                "MicroBatchLoader. Resume from a checkpoint this trainer saved, or start without one."
            )
        # Resuming with a different global order would silently repeat and skip samples.
        for key, config_key in (
            ("global_batch_size", "training.global_batch_size"),
            ("seed", "debug.seed"),
            ("num_samples", "training.dataset / training.dataset_path / training.seq_len"),
        ):
            if key == "num_samples" and self._allow_data_change:
                continue
            if state_dict[key] != expected[key]:
                deliberate = (
                    " (or set `checkpoint.allow_data_change` to resume on new data)" if key == "num_samples" else ""
                )
                raise ConfigError(
                    f"The checkpoint's data order was made with {key} = {state_dict[key]}, this run has "
                    f"{expected[key]}; restore `{config_key}` as it was to resume the same sample stream{deliberate}."
                )
        self._step = int(state_dict["step"])
        self._iterator = None  # the next next_step() restarts the workers from the loaded step


def build_dataloader(
    dataset: Dataset,
    *,
    microbatches: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    allow_data_change: bool = False,
    timeout_s: float = 300.0,
) -> MicroBatchLoader:
    """This rank's loader, handing out ``microbatches`` micro-batches per step.

    The global batch is ``microbatches x local_batch_size x dp_degree`` samples; which samples
    depends on the step, dataset, global batch size and seed only, never on ``dp_degree``,
    ``dp_rank`` or ``local_batch_size``. ``prefetch_factor`` is ignored without workers
    (``num_workers = 0``), where PyTorch rejects it. ``allow_data_change`` lets a checkpoint made
    on a dataset of another size resume (``checkpoint.allow_data_change``); ``timeout_s`` bounds
    the wait for a worker's micro-batch (``training.data_timeout_seconds``).
    """
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"data-parallel rank {dp_rank} is outside the data-parallel degree {dp_degree}.")
    if microbatches < 1:
        raise ValueError(f"microbatches = {microbatches}: a step needs at least one micro-batch.")
    order = global_order(dataset, microbatches * local_batch_size * dp_degree, seed)

    def open_at(start_step: int) -> StatefulDataLoader:
        # Each iterator draws its workers' base seed from ``generator``; from torch's global
        # generator, a resumed run's iterator would advance the RNG its checkpoint just restored,
        # and its next checkpoint would differ from an uninterrupted run's.
        sampler = _RankBatchSampler(order, microbatches, local_batch_size, dp_rank, dp_degree, start_step)
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which newer torch deprecates; nothing to act on.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            return StatefulDataLoader(
                dataset,
                batch_sampler=sampler,
                num_workers=num_workers,
                pin_memory=pin_memory,
                prefetch_factor=prefetch_factor if num_workers > 0 else None,
                generator=torch.Generator().manual_seed(seed),
            )

    return MicroBatchLoader(order, microbatches, open_at, allow_data_change, timeout_s, num_workers)
