"""A checkpoint written before the issue-9 reshaping loads after it, value for value.

``tests/fixtures/checkpoint_628a82d`` was made by commit 628a82d, the last one before
``trainer/model.py``, ``trainer/checkpoint.py`` and ``trainer/hf_interop.py`` were split into
``trainer/model/``, ``trainer/checkpoint/`` and ``trainer/train_state.py``.
``tests/fixtures/make_checkpoint_fixture.py`` (run in a tree of 628a82d; its docstring says how)
ran, in one gloo process: the ``Transformer`` of ``ARGS`` below, sharded with ``apply_fsdp`` on a
1-rank mesh and initialised with seed 5; ``build_optimizer`` (AdamW, default config) and
``build_lr_scheduler`` (warm-up 1 of 4 steps); ``build_dataloader`` over 8 random-token samples
(global batch 2, seed 3); a ``TrainState``. It took
two optimizer steps, set ``n_skipped_steps`` to 1 (a value a fresh state does not have) and saved
with ``CheckpointManager.save(2)`` into ``checkpoint/step-2``. ``expected.pt`` holds the full values
at that moment: model, optimizer (by parameter name), scheduler, loader and train state.

The model and optimizer here are initialised differently on purpose (another seed, no steps), so
only a load that restores everything makes the values equal. The 2-rank case shows the old
1-rank checkpoint reshards.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import assert_equal, run_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import Dataset

from parallelisms.fsdp import apply_fsdp
from trainer.checkpoint.folders import read_model_args
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.model_entry import read_dcp_model
from trainer.checkpoint.states import Checkpointed
from trainer.config import Checkpoint, LRScheduler, Optimizer
from trainer.data.loader import build_dataloader
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.optimizer import build_lr_scheduler, build_optimizer
from trainer.train_state import TrainState

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_628a82d"
ARGS = ModelArgs(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, rope_scaling=False, max_seq_len=16
)
SEQ_LEN, NUM_SAMPLES, GLOBAL_BATCH, DATA_SEED, TOTAL_STEPS = 16, 8, 2, 3, 4


class RandomTokens(Dataset):
    """Only its length reaches the checkpoint (the loader's ``num_samples``)."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, ARGS.vocab_size, (SEQ_LEN + 1,), generator=torch.Generator().manual_seed(i))
        return tokens[:-1], tokens[1:]


def load_fixture(dump_folder: str) -> dict[str, Any]:
    """Build the fixture's job on the current process group, load the checkpoint, return every value."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, reshard_after_forward="default")
    model.to_empty(device="cpu")
    model.init_weights(seed=6)
    optimizer = build_optimizer(model, Optimizer(), "cpu")
    scheduler = build_lr_scheduler(optimizer, TOTAL_STEPS, LRScheduler(warmup_steps=1))
    loader = build_dataloader(
        RandomTokens(),
        microbatches=1,
        local_batch_size=GLOBAL_BATCH // world,
        dp_rank=rank,
        dp_degree=world,
        seed=DATA_SEED,
    )
    train_state = TrainState()
    manager = CheckpointManager(
        Checkpoint(enable=True, folder="checkpoint"),
        dump_folder,
        Checkpointed(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            dataloader=loader,
            train_state=train_state,
            model_args=ARGS,
            total_steps=TOTAL_STEPS,
        ),
    )
    start = manager.load()
    rng_cpu = torch.get_rng_state()  # before anything below can draw from it
    full = StateDictOptions(full_state_dict=True)
    return {
        "start": start,
        "model": get_model_state_dict(model, options=full),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=full),
        "lr_scheduler": scheduler.state_dict(),
        "dataloader": loader.state_dict(),
        "train_state": {"step": train_state.step, "n_skipped_steps": train_state.n_skipped_steps, "rng_cpu": rng_cpu},
    }


def assert_loaded(got: dict[str, Any]) -> None:
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    assert got["start"] == 2
    for part in ("model", "optimizer", "lr_scheduler", "dataloader", "train_state"):
        assert_equal(got[part], expected[part], part)
    # Two optimizer steps were taken: the fixture's optimizer state is not a fresh one.
    assert expected["optimizer"]["state"]["output.weight"]["step"].item() == 2.0


@pytest.fixture
def dump_folder(tmp_path: Path) -> str:
    """A copy of the fixture, so nothing the load might write lands in the repository."""
    shutil.copytree(FIXTURE / "checkpoint", tmp_path / "checkpoint")
    return str(tmp_path)


def test_checkpoint_from_628a82d_loads_in_one_process(dump_folder: str):
    rng = torch.get_rng_state()
    owns_group = not dist.is_initialized()  # another in-process test may have left a 1-rank group
    if owns_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        got = load_fixture(dump_folder)
    finally:
        if owns_group:
            dist.destroy_process_group()
        torch.set_rng_state(rng)  # the load set this process's RNG to the checkpoint's
    assert_loaded(got)


@pytest.mark.slow
def test_checkpoint_from_628a82d_reshards_over_two_ranks(dump_folder: str):
    for got in run_ranks(load_fixture, 2, dump_folder):
        assert_loaded(got)


def test_checkpoint_from_628a82d_reads_without_a_process_group():
    """The converters' readers: model_args.json as the old trainer wrote it, and the model entry."""
    folder = FIXTURE / "checkpoint" / "step-2"
    assert read_model_args(folder) == ARGS
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    assert_equal(read_dcp_model(folder), expected["model"], "model")
