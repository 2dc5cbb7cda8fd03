"""Prepared datasets: scripts/prepare_data.py's folders and training from them (memory-mapped)."""

from __future__ import annotations

import gzip
import json
import pickle
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from test_data import TOKENIZER_PATH, global_batches, write

from trainer.data import prepare as prepare_module
from trainer.data.loader import GlobalOrder, build_dataloader
from trainer.data.prepare import prepare, shard_paths, verify
from trainer.data.prepared import PreparedDataset, is_prepared
from trainer.data.samples import SampleDataset, build_dataset, open_dataset
from trainer.data.sources import read_sources
from trainer.data.tokenizer import Tokenizer, load_tokenizer

SEQ_LEN = 32
UNIT_BYTES = 4000
"""Small units, so the .jsonl file is cut into several line-aligned ranges and samples span shards."""


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the in-memory path's token cache out of the home directory."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHTRAIN_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(str(TOKENIZER_PATH))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """.txt files (one blank), a .jsonl file of many lines with a blank line, and a .jsonl.gz, in subfolders."""
    root = tmp_path_factory.mktemp("corpus")
    plays = [play.text for play in read_sources(None).plays()[:4]]
    write(root / "b" / "act.txt", plays[0][:3000])
    write(root / "a.txt", plays[1][:2000] + "\r\nWindows line end.\r\n")
    write(root / "b" / "blank.txt", "  \n")
    paragraphs = plays[2].split("\n\n")[:300]
    lines = (
        [json.dumps({"text": p}) for p in paragraphs[:150]] + [""] + [json.dumps({"text": p}) for p in paragraphs[150:]]
    )
    write(root / "c" / "lines.jsonl", "\n".join(lines) + "\n")
    with gzip.open(root / "c" / "more.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": p}) + "\n" for p in plays[3].split("\n\n")[:40])
    return root


def prepared(corpus: Path, out: Path, workers: int = 1, tokenizer_path: str = str(TOKENIZER_PATH)) -> dict:
    return prepare([str(corpus)], tokenizer_path, str(out), workers, UNIT_BYTES, progress=None)


def samples(
    dataset: torch.utils.data.Dataset, indices: Iterable[int] | None = None
) -> list[tuple[list[int], list[int]]]:
    return [(x.tolist(), y.tolist()) for x, y in (dataset[i] for i in (indices or range(len(dataset))))]


def folder_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "shards").iterdir())}


def test_prepared_samples_equal_the_in_memory_ones(corpus: Path, tokenizer: Tokenizer, tmp_path: Path) -> None:
    manifest = prepared(corpus, tmp_path / "out")
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["sha256"] == tokenizer.sha256
    assert len(manifest["shards"]) > 5  # the .jsonl file was cut into several units
    assert is_prepared(tmp_path / "out") and not is_prepared(corpus)
    memory = build_dataset("shakespeare", str(corpus), tokenizer, SEQ_LEN)
    dataset = open_dataset("shakespeare", str(tmp_path / "out"), tokenizer, SEQ_LEN)
    assert isinstance(dataset, PreparedDataset)
    assert len(dataset) == len(memory) > 100
    assert samples(dataset) == samples(memory)
    assert manifest["total_tokens"] == sum(
        len(tokenizer.encode(d, bos=True, eos=True)) for d in read_sources(str(corpus)).documents("shakespeare")
    )
    x, y = dataset[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (SEQ_LEN,)
    assert dataset.seq_len == SEQ_LEN and dataset.pad_id == tokenizer.pad_id
    assert dataset.identity["tokenizer_sha256"] == tokenizer.sha256
    # Document boundaries: offsets into each shard, one per document plus the end.
    for shard in manifest["shards"]:
        offsets = torch.frombuffer(bytearray((tmp_path / "out" / shard["index"]).read_bytes()), dtype=torch.int64)
        assert offsets[0] == 0 and offsets[-1] == shard["tokens"] and len(offsets) == shard["documents"] + 1
    assert verify(str(tmp_path / "out")) == []


@pytest.mark.slow
def test_workers_do_not_change_the_output(corpus: Path, tmp_path: Path) -> None:
    one, two = prepared(corpus, tmp_path / "one", workers=1), prepared(corpus, tmp_path / "two", workers=2)
    assert one == two
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "two")
    assert (tmp_path / "one" / "manifest.json").read_bytes() == (tmp_path / "two" / "manifest.json").read_bytes()


def test_rerun_redoes_only_unfinished_or_changed_units(corpus: Path, tmp_path: Path, tokenizer: Tokenizer) -> None:
    source = tmp_path / "corpus"
    shutil.copytree(corpus, source)
    out = tmp_path / "out"
    first = prepared(source, out)
    before = folder_bytes(out)
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()}
    # An interruption: the manifest was never written and one shard is gone.
    (out / "manifest.json").unlink()
    bin_file, _, _ = shard_paths(out, 2)
    bin_file.unlink()
    second = prepared(source, out)
    assert second["reused_units"] == len(first["shards"]) - 1
    assert folder_bytes(out) == before and second["shards"] == first["shards"]
    changed = {p.name for p in (out / "shards").iterdir() if p.stat().st_mtime_ns != mtimes.get(p.name)}
    assert changed == {"000002.bin", "000002.idx", "000002.json"}
    # A changed source redoes its unit (and only it), and the samples follow the new text.
    write(source / "a.txt", "Another first file.\n" * 50)
    third = prepared(source, out)
    assert third["reused_units"] == len(first["shards"]) - 1
    assert third["shards"][0]["source_sha256"] != first["shards"][0]["source_sha256"]
    dataset = PreparedDataset(str(out), SEQ_LEN, tokenizer)
    assert samples(dataset) == samples(build_dataset("shakespeare", str(source), tokenizer, SEQ_LEN))


def test_bad_input_names_file_and_line(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"line {i} " * 20}) for i in range(1, 200)]
    lines[149] = '{"text": 3}'
    file = write(tmp_path / "data.jsonl", "\n".join(lines))
    with pytest.raises(ValueError, match=rf'{file}:150: key "text" is not a string'):
        prepare([str(file)], str(TOKENIZER_PATH), str(tmp_path / "out"), 1, UNIT_BYTES, progress=None)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="x.jsonl.gz: not a complete gzip file"):
        prepare([str(tmp_path / "bad")], str(TOKENIZER_PATH), str(tmp_path / "out2"), 1, progress=None)


def test_output_folder_and_empty_corpus_errors(tmp_path: Path) -> None:
    write(tmp_path / "other" / "notes.md", "mine")
    write(tmp_path / "in" / "blank.txt", "\n\n")
    with pytest.raises(ValueError, match="holds other things.*notes.md.*another --out"):
        prepare([str(tmp_path / "in")], str(TOKENIZER_PATH), str(tmp_path / "other"), 1, progress=None)
    with pytest.raises(ValueError, match="no documents"):
        prepare([str(tmp_path / "in")], str(TOKENIZER_PATH), str(tmp_path / "out"), 1, progress=None)
    with pytest.raises(FileNotFoundError, match="input = .* does not exist"):
        prepare([str(tmp_path / "nowhere")], str(TOKENIZER_PATH), str(tmp_path / "out"), 1, progress=None)
    with pytest.raises(FileNotFoundError, match="preparation did not finish.*rerun scripts/prepare_data.py"):
        open_dataset("shakespeare", str(tmp_path / "out"), load_tokenizer(str(TOKENIZER_PATH)), SEQ_LEN)


def test_open_errors(corpus: Path, tokenizer: Tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepared(corpus, out)
    other = load_tokenizer(str(TOKENIZER_PATH))
    other.sha256 = "0" * 64
    with pytest.raises(
        ValueError, match="prepared with the tokenizer 'shakespeare.model'.*model.tokenizer_path.*re-prepare"
    ):
        PreparedDataset(str(out), SEQ_LEN, other)
    with pytest.raises(
        ValueError, match="training.dataset_path.*prepared folder.*training.dataset` = 'shakespeare_dialogue'"
    ):
        open_dataset("shakespeare_dialogue", str(out), tokenizer, SEQ_LEN)
    with pytest.raises(ValueError, match="fewer than one sample.*training.seq_len"):
        PreparedDataset(str(out), 10**7, tokenizer)

    manifest_file = out / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    for change, message in (
        (
            {"max_token_id": tokenizer.vocab_size},
            f"token id {tokenizer.vocab_size}, beyond the vocabulary of {tokenizer.vocab_size}",
        ),
        ({"format_version": 99}, "format version 99; this meshtrain reads version 1. Re-prepare"),
    ):
        manifest_file.write_text(json.dumps({**manifest, **change}))
        with pytest.raises(ValueError, match=message):
            PreparedDataset(str(out), SEQ_LEN, tokenizer)
    manifest_file.write_text(json.dumps(manifest))

    bin_file = out / manifest["shards"][1]["file"]
    data = bin_file.read_bytes()
    bin_file.write_bytes(data[:-2])
    with pytest.raises(ValueError, match=f"{bin_file}: .* bytes, the manifest says .* truncated"):
        PreparedDataset(str(out), SEQ_LEN, tokenizer)
    bin_file.unlink()
    with pytest.raises(FileNotFoundError, match=f"{bin_file}: a shard of the prepared folder is missing"):
        PreparedDataset(str(out), SEQ_LEN, tokenizer)
    bin_file.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, other bytes: only --verify sees it
    PreparedDataset(str(out), SEQ_LEN, tokenizer)
    assert verify(str(out)) == [f"{bin_file}: its bytes differ from the manifest's size or sha256"]


class WideTokenizer(Tokenizer):
    """A byte-level tokenizer whose ids lie above 65535, to exercise uint32 shards."""

    BASE = 70_000

    def __init__(self) -> None:
        super().__init__(Path("wide.tok"), b"wide")

    library = property(lambda self: "wide 1.0")
    vocab_size = property(lambda self: self.BASE + 256)
    bos_id = property(lambda self: 1)
    eos_id = property(lambda self: 2)
    pad_id = property(lambda self: 0)

    def token_id(self, piece: str) -> int | None:
        return None

    def _encode(self, text: str) -> list[int]:
        return [self.BASE + b for b in text.encode()]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) - self.BASE for i in ids).decode()


def test_uint32_shards(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wide = WideTokenizer()
    monkeypatch.setattr(prepare_module, "load_tokenizer", lambda path: wide)
    manifest = prepared(corpus, tmp_path / "out")
    assert manifest["dtype"] == "uint32" and manifest["max_token_id"] == WideTokenizer.BASE + ord("z")
    dataset = PreparedDataset(str(tmp_path / "out"), SEQ_LEN, wide)
    memory = build_dataset("shakespeare", str(corpus), wide, SEQ_LEN)
    assert samples(dataset) == samples(memory)
    assert max(max(x) for x, _ in samples(dataset, range(5))) >= WideTokenizer.BASE


def test_pickles_cheaply_and_loads_in_workers(corpus: Path, tokenizer: Tokenizer, tmp_path: Path) -> None:
    prepared(corpus, tmp_path / "out")
    dataset = PreparedDataset(str(tmp_path / "out"), SEQ_LEN, tokenizer)
    expected = samples(dataset)  # maps every shard in this process
    copy = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset)) < 4096 and copy._views is None
    assert samples(copy) == expected
    by_worker = global_batches(dataset, dp=2, lbs=2, g=8, steps=2, seed=5, workers=1)
    order = GlobalOrder(len(dataset), 8, 5)
    for step in range(2):
        assert torch.cat(by_worker[step]).tolist() == [expected[i][0] for i in order.batch(step)]


@pytest.mark.parametrize(("before", "after"), [((2, 2), (1, 4)), ((1, 8), (4, 1))])
def test_resume_on_another_mesh_continues_the_batches(
    corpus: Path, tokenizer: Tokenizer, tmp_path: Path, before: tuple[int, int], after: tuple[int, int]
) -> None:
    prepared(corpus, tmp_path / "out")
    dataset = PreparedDataset(str(tmp_path / "out"), SEQ_LEN, tokenizer)
    memory = build_dataset("shakespeare", str(corpus), tokenizer, SEQ_LEN)
    g, k = 8, 3
    loader = build_dataloader(
        dataset,
        microbatches=g // (before[0] * before[1]),
        local_batch_size=before[1],
        dp_rank=0,
        dp_degree=before[0],
        seed=7,
    )
    for _ in range(k):
        loader.next_step()
    state = loader.state_dict()
    resumed = global_batches(dataset, dp=after[0], lbs=after[1], g=g, steps=2, seed=7, state=state)
    uninterrupted = global_batches(memory, dp=before[0], lbs=before[1], g=g, steps=k + 2, seed=7)
    assert [torch.cat(step).tolist() for step in resumed] == [torch.cat(step).tolist() for step in uninterrupted[k:]]


def test_in_memory_reads_jsonl_gz(corpus: Path, tokenizer: Tokenizer) -> None:
    """The in-memory path reads .jsonl.gz too (the prepared one is compared against it above)."""
    documents = read_sources(str(corpus / "c" / "more.jsonl.gz")).documents("shakespeare")
    assert len(documents) == 40
    assert isinstance(build_dataset("shakespeare", str(corpus / "c" / "more.jsonl.gz"), tokenizer, 16), SampleDataset)
