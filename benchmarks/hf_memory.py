"""Peak host memory of loading a Hugging Face folder into sharded ranks, against the folder's size;
and the 8B preset's logits memory per rank at seq 8192 from the estimate, chunked or not.

Writes the model's folder once (random bf16 weights, streamed tensor by tensor), then loads it
into ``--ranks`` processes (gloo, the trainer's own parallelisation of ``--mesh``, the model in
bf16 so that the shards stay small) and prints, per rank, the rise of its peak RSS (``VmHWM``,
reset first) during the load, counted from before its shard was allocated (the shard itself is
in the rise) and from after it was allocated and written (what the reading costs on top; mapped
file pages count while a read holds them). Each rank then converts every tensor of the folder whole,
one at a time, and checks that its shard equals that tensor's box bit for bit: the whole-model
import. ``--code /work/main`` imports the trainer from another checkout for the comparison; the
8B figures need no processes.

    python benchmarks/hf_memory.py --folder /tmp/hf_1b --ranks 4
    python benchmarks/hf_memory.py --folder /tmp/hf_1b --ranks 2 --code /work/main
    python benchmarks/hf_memory.py --folder /tmp/hf_qwen3 --model moe --flavor qwen3_30b_a3b \
        --n-layers 2 --ranks 4 --mesh dp_shard=4,ep=2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parent.parent


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _plan(opts: argparse.Namespace) -> Any:
    from trainer.config import load_config
    from trainer.planning.job_plan import resolve_job

    argv = ["--model.name", opts.model, "--model.flavor", opts.flavor, "--model.n_layers", str(opts.n_layers)]
    argv += [
        "--mesh",
        opts.mesh or f"dp_shard={opts.ranks}",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        str(opts.ranks),
    ]
    return resolve_job(load_config(argv), opts.ranks)


def write_folder(folder: Path, args: Any) -> None:
    from trainer.checkpoint.hf_folders import export_hf_folder
    from trainer.model.hf_architectures import adapter_for_args

    shapes = {name: shape for name, (_, shape) in adapter_for_args(args).hf_layout(args).items()}
    gen = torch.Generator().manual_seed(0)
    export_hf_folder(folder, lambda name: torch.randn(shapes[name], generator=gen) * 0.02, args, torch.bfloat16)


def _peak_rss() -> int:
    """This process's peak RSS since the last ``_reset_peak`` (``VmHWM``)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def _reset_peak() -> None:
    """Start the peak afresh: ``ru_maxrss`` would carry the parent's peak (writing the folder) into
    a spawned rank, which hides the load's rise under it."""
    Path("/proc/self/clear_refs").write_text("5")


def _rank(rank: int, world: int, port: int, opts: argparse.Namespace, out: str) -> None:
    sys.path.insert(0, opts.code)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from parallelisms.parallelize import parallelize
    from trainer.checkpoint.hf_load import load_hf_weights
    from trainer.model.llama3 import Transformer

    plan = _plan(opts)
    meshes = plan.dims.build_mesh("cpu")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = Transformer(plan.model_args)
    parallelize(model, meshes, plan.dims, plan.parallel, "cpu")
    dist.barrier()
    _reset_peak()
    base = _peak_rss()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            _local(param).zero_()
    held = sum(_local(p).numel() * 2 for p in model.parameters())
    dist.barrier()
    before = _peak_rss()
    load_hf_weights(model, plan.model_args, Path(opts.folder))
    after = _peak_rss()
    differ = _differ_from_whole(model, plan.model_args, Path(opts.folder))
    result = {"base": base, "before": before, "after": after, "held": held, "differ": differ}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _differ_from_whole(model: torch.nn.Module, args: Any, folder: Path) -> list[str]:
    """The parameters whose shard is not the box of the tensor converted whole from the folder."""
    from trainer.checkpoint.hf_folders import HFFolder
    from trainer.model.hf_architectures import adapter_for_args

    try:
        from trainer.model.tiled_init import stacked_box
    except ImportError:  # a `--code` checkout from before expert parallelism's boxes
        return ["not checked: this checkout has no tiled_init.stacked_box"]
    hf, adapter = HFFolder(folder), adapter_for_args(args)
    differ = []
    for name, param in model.named_parameters():
        offset, shape, whole = stacked_box(model.get_submodule(name.rpartition(".")[0]), param)
        full = adapter.read_box(name, args, tuple(slice(0, n) for n in whole), hf.read)
        if not torch.equal(_local(param), full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]):
            differ.append(name)
    return differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True, help="Hugging Face folder, written if missing")
    parser.add_argument("--model", default="llama3", help="`model.name`: llama3 or moe")
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--n-layers", type=int, default=0, help="`model.n_layers` (0: the flavor's)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mesh", default="", help="`--mesh` of the ranks (default: dp_shard = ranks)")
    parser.add_argument("--code", default=str(REPO_ROOT), help="checkout whose trainer loads the folder")
    opts = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    if not (opts.folder / "config.json").is_file():
        write_folder(opts.folder, _plan(opts).model_args)
    size = _folder_bytes(opts.folder)
    out = opts.folder.parent / f"{opts.folder.name}-rss"
    out.mkdir(exist_ok=True)
    mp.spawn(_rank, args=(opts.ranks, 29611, opts, str(out)), nprocs=opts.ranks)
    for rank in range(opts.ranks):
        r = json.loads((out / f"rank{rank}.json").read_text())
        rise, reading = r["after"] - r["base"], r["after"] - r["before"]
        print(
            json.dumps(
                {
                    "code": opts.code,
                    "flavor": opts.flavor,
                    "n_layers": opts.n_layers,
                    "mesh": opts.mesh or f"dp_shard={opts.ranks}",
                    "rank": rank,
                    "folder_GB": round(size / 1e9, 2),
                    "shard_GB": round(r["held"] / 1e9, 2),
                    "peak_rss_rise_GB": round(rise / 1e9, 2),
                    "rise_over_folder": round(rise / size, 2),
                    "reading_rise_GB": round(reading / 1e9, 2),
                    "differs_from_whole_import": r["differ"],
                }
            )
        )
    print(json.dumps(logits_8b()))


def logits_8b() -> dict[str, object]:
    """The 8B preset's logits memory per rank at seq 8192, from the estimate, chunked and not."""
    from dataclasses import replace

    from trainer.config import load_config
    from trainer.planning.job_plan import resolve_job
    from trainer.planning.memory_plan import estimate

    argv = ["--config", str(REPO_ROOT / "train_configs/llama3_8b.toml"), "--training.seq_len", "8192"]
    p = resolve_job(load_config(argv), 8)
    chunked, whole = p.workload, replace(p.workload, loss_chunk_tokens=0)
    return {
        "8B_seq8192_logits_GiB_per_rank_unchunked": round(estimate(whole).logits / 2**30, 2),
        "8B_seq8192_logits_GiB_per_rank_chunked": round(estimate(chunked).logits / 2**30, 2),
        "loss_chunk_tokens": chunked.loss_chunk_tokens,
        "mesh": f"dp_shard={p.dims.dp_shard} tp={p.dims.tp} local_batch={chunked.local_batch_size}",
    }


if __name__ == "__main__":
    main()
