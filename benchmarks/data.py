"""Prepared data: preparation speed, start-up time and memory against corpus size, data stalls.

Prints one JSON line per figure:

- ``prepare``: tokens/s of ``scripts/prepare_data.py``'s library with 1 and 2 workers against the
  tokenizer's own ``encode`` in one process on the same documents (a JSON lines corpus made of
  the bundled plays' paragraphs, repeated to ``--text-mb``). ``vs_raw`` is prepared / raw.
- ``startup``: for a small (``--small-mb``) and a large (``--large-mb``) prepared folder, each
  measured in a fresh process, side by side in this run: the time to open the dataset, build the
  loader and get the first batch, and the process's resident memory after it (``rss_mb``, and
  ``rss_growth_mb`` over the same process before opening, of which ``anon_growth_mb`` is heap;
  the rest is mapped shard pages the kernel can drop). The folders are synthesised as shards
  of random token ids (tokenizing a gigabyte takes too long here); the reader cannot tell.
  ``ratio`` is large / small. ``seq_len`` is given because the loader's global order keeps one
  permutation of the sample indices (8 bytes per sample), the one thing that grows with the corpus.
- ``data_loading``: ``time_metrics/data_loading(%)`` of a debug-model run through
  ``./run_train.sh`` (1 process, ``--training.num_workers 2``) on the bundled plays, prepared,
  read back from its TensorBoard scalars: per log window, and the mean after the first step
  (which includes starting the loader workers).

    python benchmarks/data.py [--text-mb 8] [--small-mb 10] [--large-mb 1024] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKENIZER = ROOT / "assets" / "tokenizer" / "shakespeare.model"
SHARD_TOKENS = 32 << 20  # 64 MB of uint16 per synthetic shard, like prepare_data's units


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def text_corpus(folder: Path, megabytes: float) -> Path:
    from trainer.data.sources import read_sources

    paragraphs = [p for play in read_sources(None).plays() for p in play.text.split("\n\n")]
    file = folder / "corpus.jsonl"
    written = 0
    with open(file, "w", encoding="utf-8") as fh:
        while written < megabytes * 1e6:
            for paragraph in paragraphs:
                written += fh.write(json.dumps({"text": paragraph}) + "\n")
    return file


def bench_prepare(work: Path, megabytes: float) -> None:
    from trainer.data.prepare import prepare
    from trainer.data.sources import decode, file_documents
    from trainer.data.tokenizer import load_tokenizer

    corpus = text_corpus(work, megabytes)
    documents = file_documents(corpus, decode(corpus, corpus.read_bytes()), "shakespeare")
    tokenizer = load_tokenizer(str(TOKENIZER))
    start = time.perf_counter()
    raw_tokens = sum(len(tokenizer.encode(d, bos=True, eos=True)) for d in documents)
    raw = raw_tokens / (time.perf_counter() - start)
    record = {
        "figure": "prepare",
        "cores": cores(),
        "corpus_mb": round(corpus.stat().st_size / 1e6, 1),
        "documents": len(documents),
        "tokens": raw_tokens,
        "raw_encode_tokens_per_s": round(raw),
    }
    for workers in (1, 2):
        start = time.perf_counter()
        manifest = prepare(
            [str(corpus)], str(TOKENIZER), str(work / f"prepared-{workers}"), workers, unit_bytes=1 << 20, progress=None
        )
        seconds = time.perf_counter() - start
        assert manifest["total_tokens"] == raw_tokens
        record[f"workers_{workers}_tokens_per_s"] = round(raw_tokens / seconds)
        record[f"workers_{workers}_vs_raw"] = round(raw_tokens / seconds / raw, 2)
    emit(record)


def synthetic_folder(folder: Path, megabytes: float) -> Path:
    """A prepared folder of random uint16 ids below the tokenizer's vocabulary."""
    import hashlib

    import torch

    from trainer.data.prepare import SHARDS, write_manifest
    from trainer.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(TOKENIZER))
    (folder / SHARDS).mkdir(parents=True)
    total, shards, generator = int(megabytes * 1e6) // 2, [], torch.Generator().manual_seed(0)
    for index, start in enumerate(range(0, total, SHARD_TOKENS)):
        count = min(SHARD_TOKENS, total - start)
        data = (
            torch.randint(0, tokenizer.vocab_size, (count,), generator=generator, dtype=torch.int16).numpy().tobytes()
        )
        name = f"{SHARDS}/{index:06d}"
        (folder / f"{name}.bin").write_bytes(data)
        (folder / f"{name}.idx").write_bytes((0).to_bytes(8, "little") + count.to_bytes(8, "little"))
        shards.append(
            {
                "file": f"{name}.bin",
                "index": f"{name}.idx",
                "tokens": count,
                "documents": 1,
                "sha256": hashlib.sha256(data).hexdigest(),
                "max_token_id": tokenizer.vocab_size - 1,
            }
        )
    write_manifest(folder, tokenizer, "uint16", shards)
    return folder


def rss_mb(field: str = "VmRSS") -> float:
    """Resident memory: all of it (VmRSS), the heap's (RssAnon) or mapped files' pages (RssFile)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def startup_child(folder: str, seq_len: int) -> None:
    """In a fresh process: open, build the loader, take the first batch; print times and RSS."""
    from trainer.data.loader import build_dataloader
    from trainer.data.samples import open_dataset
    from trainer.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(TOKENIZER))
    before, anon_before = rss_mb(), rss_mb("RssAnon")
    start = time.perf_counter()
    dataset = open_dataset("shakespeare", folder, tokenizer, seq_len)
    opened = time.perf_counter()
    loader = build_dataloader(dataset, microbatches=1, local_batch_size=8, dp_rank=0, dp_degree=1, seed=0)
    built = time.perf_counter()
    loader.next_step()
    first = time.perf_counter()
    print(
        json.dumps(
            {
                "samples": len(dataset),
                "open_s": opened - start,
                "loader_s": built - opened,
                "first_batch_s": first - built,
                "startup_s": first - start,
                "rss_mb": rss_mb(),
                "rss_growth_mb": rss_mb() - before,
                "anon_growth_mb": rss_mb("RssAnon") - anon_before,
                "file_backed_mb": rss_mb("RssFile"),
                "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def bench_startup(work: Path, small_mb: float, large_mb: float, repeats: int = 3) -> None:
    folders = {"small": synthetic_folder(work / "small", small_mb), "large": synthetic_folder(work / "large", large_mb)}
    for seq_len in (2048, 128):
        best: dict[str, dict] = {}
        for _ in range(repeats):  # interleaved, so both sizes see the same machine load
            for size, folder in folders.items():
                out = subprocess.run(
                    [sys.executable, __file__, "--startup-child", str(folder), "--seq-len", str(seq_len)],
                    check=True,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                ).stdout
                result = json.loads(out.strip().splitlines()[-1])
                if size not in best or result["startup_s"] < best[size]["startup_s"]:
                    best[size] = result
        record = {"figure": "startup", "synthetic": True, "seq_len": seq_len, "repeats": repeats, "best_of": repeats}
        for size, megabytes in (("small", small_mb), ("large", large_mb)):
            record[size] = {
                "corpus_mb": megabytes,
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in best[size].items()},
            }
        record["ratio"] = {
            key: round(best["large"][key] / best["small"][key], 2)
            for key in ("startup_s", "rss_mb", "rss_growth_mb", "anon_growth_mb")
        }
        emit(record)


def bench_data_loading(work: Path, steps: int) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.data.prepare import prepare
    from trainer.data.sources import read_sources

    plays = work / "plays"
    plays.mkdir()
    for index, play in enumerate(read_sources(None).plays()):
        (plays / f"{index:02d}.txt").write_text(play.text, encoding="utf-8")
    prepare([str(plays)], str(TOKENIZER), str(work / "plays-prepared"), 2, progress=None)
    dump = work / "run"
    command = [
        str(ROOT / "run_train.sh"),
        "--training.dataset_path",
        str(work / "plays-prepared"),
        "--training.num_workers",
        "2",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "10",
        "--job.dump_folder",
        str(dump),
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "NGPU": "1"}, cwd=ROOT)
    seconds = time.perf_counter() - start
    events = EventAccumulator(str(next((dump / "tb").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    points = [(e.step, round(e.value, 3)) for e in events.Scalars("time_metrics/data_loading(%)")]
    after_first = [value for step, value in points if step > 1]
    emit(
        {
            "figure": "data_loading",
            "model": "debugmodel",
            "processes": 1,
            "num_workers": 2,
            "steps": steps,
            "run_s": round(seconds, 1),
            "data_loading_pct_by_log_step": points,
            "mean_after_step_1_pct": round(sum(after_first) / len(after_first), 3) if after_first else None,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-mb", type=float, default=8)
    parser.add_argument("--small-mb", type=float, default=10)
    parser.add_argument("--large-mb", type=float, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", choices=("prepare", "startup", "data_loading"))
    parser.add_argument("--startup-child", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=2048, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.startup_child:
        startup_child(args.startup_child, args.seq_len)
        return
    with tempfile.TemporaryDirectory(prefix="meshtrain-data-bench-") as tmp:
        work = Path(tmp)
        os.environ["MESHTRAIN_CACHE_DIR"] = str(work / "cache")
        if args.only in (None, "prepare"):
            bench_prepare(work, args.text_mb)
        if args.only in (None, "startup"):
            bench_startup(work, args.small_mb, args.large_mb)
        if args.only in (None, "data_loading"):
            bench_data_loading(work, args.steps)


if __name__ == "__main__":
    main()
