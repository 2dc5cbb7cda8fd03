"""Peak host memory of loading a Hugging Face folder into FSDP ranks, against the folder's size;
and the 8B preset's logits memory per rank at seq 8192 from the estimate, chunked or not.

Writes the flavor's folder once (random bf16 weights, streamed tensor by tensor), then loads it
into ``--ranks`` processes (gloo, ``dp_shard`` = ranks, the model in bf16 so that the shards stay
small) and prints, per rank, the rise of its peak RSS during the load. ``--code /work/main``
imports the trainer from another checkout (the loader before shard-by-shard reads) for the
comparison; the 8B figures need no processes.

    python benchmarks/hf_memory.py --folder /tmp/hf_1b --ranks 4
    python benchmarks/hf_memory.py --folder /tmp/hf_1b --ranks 2 --code /work/main
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parent.parent


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def write_folder(folder: Path, flavor: str) -> None:
    from trainer.checkpoint.hf_folders import export_hf_folder
    from trainer.model.hf_llama3 import hf_layout
    from trainer.model.llama3 import FLAVORS

    args = FLAVORS[flavor]
    shapes = {name: shape for name, (_, shape) in hf_layout(args).items()}
    gen = torch.Generator().manual_seed(0)
    export_hf_folder(folder, lambda name: torch.randn(shapes[name], generator=gen) * 0.02, args, torch.bfloat16)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank: int, world: int, port: int, folder: str, flavor: str, code: str, out: str) -> None:
    sys.path.insert(0, code)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.checkpoint.hf_load import load_hf_weights
    from trainer.model.llama3 import FLAVORS, Transformer

    args = FLAVORS[flavor]
    mesh = init_device_mesh("cpu", (world,))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = Transformer(args)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    dist.barrier()
    before = _peak_rss()
    load_hf_weights(model, args, Path(folder))
    after = _peak_rss()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"before": before, "after": after}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True, help="Hugging Face folder, written if missing")
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--code", default=str(REPO_ROOT), help="checkout whose trainer loads the folder")
    opts = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    if not (opts.folder / "config.json").is_file():
        write_folder(opts.folder, opts.flavor)
    size = _folder_bytes(opts.folder)
    out = opts.folder.parent / f"{opts.folder.name}-rss"
    out.mkdir(exist_ok=True)
    mp.spawn(_rank, args=(opts.ranks, 29611, str(opts.folder), opts.flavor, opts.code, str(out)), nprocs=opts.ranks)
    for rank in range(opts.ranks):
        r = json.loads((out / f"rank{rank}.json").read_text())
        rise = r["after"] - r["before"]
        print(
            json.dumps(
                {
                    "code": opts.code,
                    "rank": rank,
                    "ranks": opts.ranks,
                    "folder_GB": round(size / 1e9, 2),
                    "peak_rss_rise_GB": round(rise / 1e9, 2),
                    "rise_over_folder": round(rise / size, 2),
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
