"""What the checkpoint tests share (``test_checkpoint.py``, ``test_checkpoint_timelines.py``):
the short run that saves every few steps and the rank workers that train it and resume from it,
a byte flipped in a saved file, and a checkpoint manager over a tiny model in this process with
the 1-rank process group it saves under."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_train, tensorboard_scalars, train_as_a_worker, trainer_for
from torch.distributed.checkpoint import FileSystemWriter

from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.states import Checkpointed
from trainer.config import Checkpoint, LRScheduler, Optimizer
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.optimizer import LRSchedule, build_optimizer
from trainer.train_state import TrainState

# A schedule that does not depend on training.steps (warm-up, then constant), so a 4-step run
# and the first 4 steps of an 8-step run take the same learning rates.
COMMON = [
    "--validation.enable=false",  # validation is tested on its own (test_validation, test_run_train)
    "--training.dataset",
    "shakespeare_dialogue",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--lr_scheduler.warmup_steps",
    "2",
    "--lr_scheduler.decay_ratio",
    "0",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--debug.seed",
    "5",
]


def train_worker(argv: list[str], kill_rank: int | None = None, kill_step: int | None = None) -> None:
    """Train through the real entry; optionally SIGKILL one rank while it writes a checkpoint."""
    if kill_rank is not None:
        original = FileSystemWriter.write_data

        def write_then_die(self, plan_, planner):
            result = original(self, plan_, planner)
            if int(os.environ["RANK"]) == kill_rank and f"step-{kill_step}" in str(self.path):
                result.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        FileSystemWriter.write_data = write_then_die
    train_as_a_worker(argv)


def resume_worker(argv: list[str]) -> dict:
    """Which step a new job resumes from, and what it warned about."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("meshtrain").addHandler(handler)
    p, job = trainer_for(argv)
    train_state = TrainState()
    manager = CheckpointManager(
        p.config.checkpoint,
        p.config.job.dump_folder,
        Checkpointed(
            model=job.model,
            optimizer=job.optimizer.optimizer,
            lr_scheduler=job.optimizer.scheduler,
            dataloader=job.step.batches.loader,
            train_state=train_state,
            model_args=p.model_args,
            total_steps=p.config.training.steps,
        ),
    )
    start = manager.load()
    weights = {
        name: (prm.full_tensor() if hasattr(prm, "full_tensor") else prm).detach().clone()
        for name, prm in job.model.named_parameters()
    }
    return {"start": start, "warnings": records, "loader": job.step.batches.loader.state_dict(), "weights": weights}


def small_argv(dump: Path, *extra: str) -> list[str]:
    return COMMON + [
        "--training.local_batch_size",
        "4",
        "--training.steps",
        "6",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--metrics.enable_tensorboard=false",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def overwrite(file: Path, offset: int, size: int) -> None:
    """Replace ``size`` bytes at ``offset`` with other bytes; the file keeps its length."""
    data = bytearray(file.read_bytes())
    data[offset : offset + size] = bytes((b + 1) % 256 for b in data[offset : offset + size])
    file.write_bytes(bytes(data))


TINY = ModelArgs(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, rope_scaling=False, max_seq_len=16
)


class Position:
    """A data loader's place in its stream: all of a loader that reaches the checkpoint."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def tiny_manager(
    dump: Path, args: ModelArgs = TINY, data: str = "a", step: int = 0, optimizer_name: str = "", **checkpoint: Any
) -> CheckpointManager:
    """A manager over a plain ``Transformer(args)`` at ``step``, trained on data fingerprinted ``data``
    (with torch's AdamW, or the trainer's ``optimizer_name``)."""
    model = Transformer(args)
    optimizer = (
        build_optimizer(model, Optimizer(name=optimizer_name), "cpu")
        if optimizer_name
        else torch.optim.AdamW(model.parameters())
    )
    train_state = TrainState()
    train_state.step = step
    return CheckpointManager(
        Checkpoint(**{"enable": True, **checkpoint}),
        str(dump),
        Checkpointed(
            model=model,
            optimizer=optimizer,
            lr_scheduler=LRSchedule(optimizer, 4, LRScheduler(warmup_steps=0, decay_ratio=0.0)),  # a constant rate
            dataloader=Position(),
            train_state=train_state,
            model_args=args,
            total_steps=4,
            data_identity={"data_sha256": data},
        ),
    )


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A 1-rank gloo group in this process (or the one another in-process test left)."""
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rng = torch.get_rng_state()
    yield
    torch.set_rng_state(rng)  # a load sets this process's RNG to the checkpoint's
    if owns_group:
        dist.barrier()
        dist.destroy_process_group()


def assert_resumes_on_another_mesh(tmp_path: Path, job: list[str], first: list[str], second: list[str]) -> Path:
    """``job`` (4 steps, a checkpoint at 2) trains on 2 ranks with ``first``'s mesh arguments, then
    a run with ``second``'s resumes its step-2: its steps 3-4 must log the first run's losses and
    grad norms (1e-5). The step-2 checkpoint."""
    done = run_train(2, [*job, "--job.dump_folder", str(tmp_path / "first"), *first])
    assert done.returncode == 0, done.stderr[-3000:]
    saved = tmp_path / "first" / "checkpoint" / "step-2"
    resumed = run_train(
        2,
        [*job, "--job.dump_folder", str(tmp_path / "second"), *second]
        + ["--checkpoint.initial_load_path", str(saved), "--checkpoint.initial_load_model_only=false"],
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    tags = ("loss_metrics/global_avg_loss", "grad_norm")
    before, after = (tensorboard_scalars(tmp_path / run, tags) for run in ("first", "second"))
    for tag in tags:
        assert list(after[tag]) == [3, 4]
        assert [after[tag][s] for s in (3, 4)] == pytest.approx([before[tag][s] for s in (3, 4)], rel=1e-5), tag
    return saved
