"""Checkpoint save and load time, and how long training stalls, with sync vs async saves.

One process (a 1-rank process group, FSDP over one rank as in training) builds the model,
gives AdamW its state, and saves through the trainer's ``CheckpointManager``:

- sync: the save blocks training for the whole write (stall = save time);
- async: training is blocked only while DCP stages the state to CPU memory; the write goes on
  in the background (stall = the ``save`` call, total = until the checkpoint is published).

Also what trust costs: ``checksum_s`` is the CRC-32 of every written file (done by the writer
after writing: inside the save time, and in the background with async saves), ``verify_s`` the
same check at load (included in ``load_s``), ``finite_check_s`` the NaN/infinity check of the
state before a save (inside both stalls), each with its ratio to the save or load time.

The debug model saves its full state (weights, AdamW moments, schedule, data position). The
~1B-parameter model (Llama-3.2-1B's blocks with the bundled 2048-token vocabulary) saves its
weights only: its full state is 12 GB, and an async save stages a second copy, which would not
fit this 24 GB machine. Prints one JSON line per model.

    python benchmarks/checkpoint.py [--models debugmodel 1B] [--folder /tmp/meshtrain-ckpt-bench]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from parallelisms.fsdp import apply_fsdp
from parallelisms.parallel_dims import ParallelDims
from trainer.checkpoint.integrity import checksum_problem, file_crc32, first_non_finite
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.states import Checkpointed
from trainer.config import Checkpoint, LRScheduler, Optimizer
from trainer.model.llama3 import FLAVORS, Transformer, num_params
from trainer.optimizer import build_lr_scheduler, build_optimizer
from trainer.runtime.distributed import init_distributed
from trainer.train_state import TrainState


class Position:
    """Stands in for the data loader's state: a plain step position."""

    def state_dict(self) -> dict[str, int]:
        return {"step": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        del state


def build(flavor: str, mesh) -> tuple[Transformer, torch.optim.Optimizer]:
    args = replace(FLAVORS[flavor], vocab_size=2048, max_seq_len=128)
    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, reshard_after_forward="default")
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = build_optimizer(model, Optimizer(), "cpu")
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # allocates the AdamW moments that a real checkpoint carries
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def measure(flavor: str, folder: Path, mesh) -> dict:
    model, optimizer = build(flavor, mesh)
    full_state = flavor == "debugmodel"
    scheduler = build_lr_scheduler(optimizer, 10, LRScheduler())
    result: dict = {"model": flavor, "params": num_params(model), "state": "full" if full_state else "weights"}
    for mode in ("disabled", "async"):
        shutil.rmtree(folder, ignore_errors=True)
        config = Checkpoint(enable=True, folder="checkpoint", async_mode=mode, keep_latest_k=0)
        manager = CheckpointManager(
            config,
            str(folder),
            Checkpointed(
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                dataloader=Position(),
                train_state=TrainState(),
                model_args=model.args,
                total_steps=10,
            ),
        )
        start = time.perf_counter()
        manager.save(1, model_only=not full_state)
        stall = time.perf_counter() - start
        manager.close()
        total = time.perf_counter() - start
        name = "sync" if mode == "disabled" else "async"
        result[f"{name}_stall_s"] = round(stall, 3)
        result[f"{name}_save_s"] = round(total, 3)
        if mode == "disabled":
            start = time.perf_counter()
            manager.load()
            result["load_s"] = round(time.perf_counter() - start, 3)
            result.update(trust_costs(folder / "checkpoint" / "step-1", model, optimizer))
    result["checkpoint_gb"] = round(sum(f.stat().st_size for f in (folder / "checkpoint").rglob("*")) / 1e9, 3)
    result["async_stall_over_sync_stall"] = round(result["async_stall_s"] / result["sync_stall_s"], 3)
    result["async_save_over_sync_save"] = round(result["async_save_s"] / result["sync_save_s"], 3)
    result["checksum_over_sync_save"] = round(result["checksum_s"] / result["sync_save_s"], 3)
    result["verify_over_load"] = round(result["verify_s"] / result["load_s"], 3)
    result["finite_check_over_sync_save"] = round(result["finite_check_s"] / result["sync_save_s"], 3)
    shutil.rmtree(folder, ignore_errors=True)
    return result


def trust_costs(path: Path, model: Transformer, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    start = time.perf_counter()
    for file in sorted(path.iterdir()):
        if file.suffix == ".distcp" or file.name == ".metadata":
            file_crc32(file)
    checksum_s = time.perf_counter() - start
    start = time.perf_counter()
    assert checksum_problem(path) is None
    verify_s = time.perf_counter() - start
    # fully_shard made every parameter a DTensor; nn.Parameter's stub cannot say so.
    local = [p.to_local() for p in model.parameters()]  # type: ignore[attr-defined]
    local += [v.to_local() for slots in optimizer.state.values() for v in slots.values() if v.ndim]
    start = time.perf_counter()
    assert first_non_finite((str(i), t) for i, t in enumerate(local)) is None
    finite_s = time.perf_counter() - start
    return {"checksum_s": round(checksum_s, 3), "verify_s": round(verify_s, 3), "finite_check_s": round(finite_s, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["debugmodel", "1B"], choices=["debugmodel", "1B"])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/meshtrain-ckpt-bench"))
    args = parser.parse_args()
    init_distributed("cpu", timeout_s=300)
    mesh = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1).build_mesh("cpu").fsdp
    for flavor in args.models:
        print(json.dumps(measure(flavor, args.folder, mesh)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
