"""``scripts/show_batch.py``: a step's samples as the model sees them, learned text plain and
context marked, and the same samples the loader gives training at that step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hf_tokenizer import build

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("show_batch", ROOT / "scripts" / "show_batch.py")
show_batch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(show_batch)


def test_chat_sample_marks_exactly_the_context(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = build(tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hail!"}]})
    )
    argv = [
        "--model.tokenizer_path",
        str(tokenizer),
        "--training.dataset",
        "chat",
        "--training.dataset_path",
        str(data),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "1",
    ]
    assert show_batch.main(["--step", "3", *argv]) == 0
    out = capsys.readouterr().out
    assert "step 3: 1 samples" in out and "1 of 1 conversations kept" in out
    assert (
        "⟦<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\n⟧Hail!<|eot_id|>⟨pad × "
    ) in out
    from trainer.data.tokenizer import load_tokenizer

    learned = len(load_tokenizer(str(tokenizer)).encode("Hail!", bos=False, eos=False)) + 1  # and <|eot_id|>
    assert f", {learned} label tokens ---" in out
    assert show_batch.main(["--step", "0", *argv]) == 2
    assert "--step must be >= 1" in capsys.readouterr().err


def test_packed_step_is_the_loader_batch(capsys: pytest.CaptureFixture) -> None:
    from trainer.config import load_config
    from trainer.data.datasets import load_dataset
    from trainer.data.loader import build_dataloader
    from trainer.planning.job_plan import resolve_job

    argv = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.global_batch_size", "4"]
    assert show_batch.main(["--step", "2", "--samples", "4", *argv]) == 0
    out = capsys.readouterr().out
    job = resolve_job(load_config(argv), 1)
    dataset = load_dataset(job.config, job.tokenizer, job.global_batch_size)
    loader = build_dataloader(
        dataset, microbatches=2, local_batch_size=2, dp_rank=0, dp_degree=1, seed=job.config.debug.seed
    )
    loader.next_step()
    inputs = [row.tolist() for micro, _ in loader.next_step() for row in micro]
    for row in inputs:  # every sample of training's step 2, in order
        assert show_batch.decode_visibly(job.tokenizer, row[1:8]) in out
    assert out.count("--- sample") == 4 and "micro-batch 2, data-parallel rank 0" in out
