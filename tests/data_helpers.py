"""What the data tests share: the bundled tokenizer, small corpora written to disk, a step's
global batch read back on any data-parallel layout, and a dataset opened through the trainer's
own plan."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from trainer.config import load_config
from trainer.data.datasets import load_dataset, load_validation_dataset
from trainer.data.loader import build_dataloader
from trainer.data.prepare import prepare
from trainer.planning.job_plan import resolve_job

TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "assets" / "tokenizer" / "shakespeare.model"
SEQ_LEN = 32
"""Of the datasets :func:`load_data` opens: short, so that small corpora hold many samples."""
UNIT_BYTES = 3000
"""``prepare_data``'s unit at test size: a few KB of text make several units."""

__all__ = ["cache_dir"]


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the token cache out of the home directory, one per test module (imported there)."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHTRAIN_CACHE_DIR", str(path))
        yield path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def global_batches(
    dataset: Dataset,
    *,
    dp: int,
    lbs: int,
    g: int,
    steps: int,
    seed: int = 0,
    state: dict | None = None,
    workers: int = 0,
) -> list[list[torch.Tensor]]:
    """Each step's micro-batches of all ranks in global order (micro-batch major, then rank)."""
    accumulation = g // (lbs * dp)
    per_rank = []
    for rank in range(dp):
        loader = build_dataloader(
            dataset,
            microbatches=accumulation,
            local_batch_size=lbs,
            dp_rank=rank,
            dp_degree=dp,
            seed=seed,
            num_workers=workers,
        )
        if state is not None:
            loader.load_state_dict(state)
        per_rank.append([loader.next_step() for _ in range(steps)])
    return [[per_rank[r][s][m][0] for m in range(accumulation) for r in range(dp)] for s in range(steps)]


def run_prepare(inputs: list[Path], out: Path, workers: int = 1) -> dict:
    return prepare([str(i) for i in inputs], str(TOKENIZER_PATH), str(out), workers, UNIT_BYTES, progress=None)


def load_data(*args: str, validation: bool = False) -> Any:
    plan = resolve_job(load_config(["--training.seq_len", str(SEQ_LEN), *args]), 1)
    if validation:
        return load_validation_dataset(plan.config, plan.tokenizer)
    return load_dataset(plan.config, plan.tokenizer, plan.global_batch_size)
