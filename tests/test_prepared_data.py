"""Prepared datasets: scripts/prepare_data.py's folders and training from them (memory-mapped)."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import pickle
import re
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from data_helpers import (
    TOKENIZER_PATH,
    cache_dir,  # noqa: F401 (the autouse token-cache fixture)
    global_batches,
    write,
)

from trainer.data import prepare as prepare_module
from trainer.data.loader import GlobalOrder, build_dataloader
from trainer.data.prepare import prepare
from trainer.data.prepared import PreparedDataset, is_prepared
from trainer.data.samples import SampleDataset, build_dataset, open_dataset
from trainer.data.shards import MANIFEST_KEYS, SHARD_KEYS, TOKENIZER_KEYS, manifest_checksum, verify
from trainer.data.sources import read_sources
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.runtime.errors import DataError

SEQ_LEN = 32
ROOT = Path(__file__).resolve().parent.parent
UNIT_BYTES = 4000
"""Small units, so the .jsonl file is cut into several line-aligned ranges and samples span shards."""


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
    bin_file = out / first["shards"][2]["file"]
    bin_file.unlink()
    second = prepared(source, out)
    assert second["reused_units"] == len(first["shards"]) - 1
    assert folder_bytes(out) == before and second["shards"] == first["shards"]
    changed = {p.name for p in (out / "shards").iterdir() if p.stat().st_mtime_ns != mtimes.get(p.name)}
    assert changed == {bin_file.name, bin_file.with_suffix(".idx").name, bin_file.with_suffix(".json").name}
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
    with pytest.raises(DataError, match=rf'{file}:150: key "text" is not a string'):
        prepare([str(file)], str(TOKENIZER_PATH), str(tmp_path / "out"), 1, UNIT_BYTES, progress=None)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="x.jsonl.gz: not a complete gzip file"):
        prepare([str(tmp_path / "bad")], str(TOKENIZER_PATH), str(tmp_path / "out2"), 1, progress=None)


def test_output_folder_and_empty_corpus_errors(tmp_path: Path) -> None:
    write(tmp_path / "other" / "notes.md", "mine")
    write(tmp_path / "in" / "blank.txt", "\n\n")
    with pytest.raises(DataError, match="holds other things.*notes.md.*another --out"):
        prepare([str(tmp_path / "in")], str(TOKENIZER_PATH), str(tmp_path / "other"), 1, progress=None)
    with pytest.raises(DataError, match="no documents"):
        prepare([str(tmp_path / "in")], str(TOKENIZER_PATH), str(tmp_path / "out"), 1, progress=None)
    with pytest.raises(DataError, match="prepare_data input .* does not exist; name a .txt"):
        prepare([str(tmp_path / "nowhere")], str(TOKENIZER_PATH), str(tmp_path / "out"), 1, progress=None)
    with pytest.raises(DataError, match="preparation did not finish.*rerun scripts/prepare_data.py"):
        open_dataset("shakespeare", str(tmp_path / "out"), load_tokenizer(str(TOKENIZER_PATH)), SEQ_LEN)


def test_open_errors(corpus: Path, tokenizer: Tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepared(corpus, out)
    other = load_tokenizer(str(TOKENIZER_PATH))
    other.sha256 = "0" * 64
    with pytest.raises(
        DataError, match="prepared with the tokenizer 'shakespeare.model'.*model.tokenizer_path.*re-prepare"
    ):
        PreparedDataset(str(out), SEQ_LEN, other)
    with pytest.raises(
        DataError, match="training.dataset_path.*prepared folder.*training.dataset` = 'shakespeare_dialogue'"
    ):
        open_dataset("shakespeare_dialogue", str(out), tokenizer, SEQ_LEN)
    with pytest.raises(DataError, match="fewer than one sample.*training.seq_len"):
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
        edited = {**manifest, **change}
        manifest_file.write_text(json.dumps({**edited, "manifest_sha256": manifest_checksum(edited)}))
        with pytest.raises(DataError, match=message):
            PreparedDataset(str(out), SEQ_LEN, tokenizer)
    manifest_file.write_text(json.dumps(manifest))

    bin_file = out / manifest["shards"][1]["file"]
    data = bin_file.read_bytes()
    bin_file.write_bytes(data[:-2])
    with pytest.raises(DataError, match=f"{bin_file}: .* bytes, the manifest says .* truncated"):
        PreparedDataset(str(out), SEQ_LEN, tokenizer)
    bin_file.unlink()
    with pytest.raises(DataError, match=f"{bin_file}: a shard of the prepared folder is missing"):
        PreparedDataset(str(out), SEQ_LEN, tokenizer)
    bin_file.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, other bytes
    with pytest.raises(DataError, match=f"{bin_file}: its bytes are not the ones prepared"):
        PreparedDataset(str(out), SEQ_LEN, tokenizer)
    assert verify(str(out)) == [f"{bin_file}: its bytes differ from the manifest's size or sha256"]


class ByteTokenizer(Tokenizer):
    """A byte-level tokenizer with ids ``base + byte``: ``base`` picks the shards' dtype, and can put
    the ids where a reader that took them for signed numbers would go wrong."""

    def __init__(self, base: int) -> None:
        super().__init__(Path(f"bytes{base}.tok"), f"bytes{base}".encode())
        self.base = base

    library = property(lambda self: "bytes 1.0")
    vocab_size = property(lambda self: self.base + 256)
    bos_id = property(lambda self: 1)
    eos_id = property(lambda self: 2)
    pad_id = property(lambda self: 0)

    def token_id(self, piece: str) -> int | None:
        return None

    def _encode(self, text: str) -> list[int]:
        return [self.base + b for b in text.encode()]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) - self.base for i in ids).decode()


WIDE = 70_000
"""A ``ByteTokenizer`` base whose ids lie above 65535, to exercise uint32 shards."""


def test_uint32_shards(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wide = ByteTokenizer(WIDE)
    monkeypatch.setattr(prepare_module, "load_tokenizer", lambda path: wide)
    manifest = prepared(corpus, tmp_path / "out")
    assert manifest["dtype"] == "uint32" and manifest["max_token_id"] == WIDE + ord("z")
    dataset = PreparedDataset(str(tmp_path / "out"), SEQ_LEN, wide)
    memory = build_dataset("shakespeare", str(corpus), wide, SEQ_LEN)
    assert samples(dataset) == samples(memory)
    assert max(max(x) for x, _ in samples(dataset, range(5))) >= WIDE


LAYOUTS = [("uint16", 0xFF00, "H"), ("uint32", 0x8000_0000, "I")]
"""Each dtype with ids that have the top bit of their width set, and its ``struct`` code."""


def hand_written_folder(folder: Path, dtype: str, base: int, code: str) -> list[int]:
    """A prepared folder written straight from the documented version-1 layout, without
    ``trainer.data.prepare``: two shards of ``base + byte`` ids; returns the token stream."""
    streams = [[1, *range(base, base + 100), 2], [1, *range(base + 100, base + 256), 2]]
    (folder / "shards").mkdir(parents=True)
    shards = []
    for index, stream in enumerate(streams):
        data = struct.pack(f"<{len(stream)}{code}", *stream)
        (folder / "shards" / f"{index:06d}.bin").write_bytes(data)
        (folder / "shards" / f"{index:06d}.idx").write_bytes(struct.pack("<QQ", 0, len(stream)))
        (folder / "shards" / f"{index:06d}.json").write_text(json.dumps({"sha256": hashlib.sha256(data).hexdigest()}))
        shards.append(
            {
                "file": f"shards/{index:06d}.bin",
                "index": f"shards/{index:06d}.idx",
                "tokens": len(stream),
                "documents": 1,
                "sha256": hashlib.sha256(data).hexdigest(),
                "max_token_id": max(stream),
                "source": f"doc{index}.txt",
                "source_range": [0, 1],
                "source_sha256": "0" * 64,
            }
        )
    tokenizer = ByteTokenizer(base)
    manifest = {
        "format": "meshtrain.prepared",
        "format_version": 1,
        "tokenizer": {
            "file": tokenizer.path.name,
            "sha256": tokenizer.sha256,
            "vocab_size": base + 256,
            "bos_id": 1,
            "eos_id": 2,
        },
        "dtype": dtype,
        "byte_order": "little",
        "sources": [{"path": f"doc{index}.txt", "size": 1} for index in range(2)],
        "shards": shards,
        "total_tokens": sum(map(len, streams)),
        "total_documents": 2,
        "max_token_id": base + 255,
        "stream_sha256": hashlib.sha256(b"".join((folder / s["file"]).read_bytes() for s in shards)).hexdigest(),
    }
    manifest["manifest_sha256"] = manifest_checksum(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return [token for stream in streams for token in stream]


@pytest.mark.parametrize(("dtype", "base", "code"), LAYOUTS)
def test_shards_are_the_documented_layout(
    dtype: str, base: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prepared folders written to the documented layout, by hand, read back token for token,
    and prepare writes exactly that layout: little-endian ids and uint64 document offsets."""
    stream = hand_written_folder(tmp_path / "hand", dtype, base, code)
    tokenizer = ByteTokenizer(base)
    dataset = PreparedDataset(str(tmp_path / "hand"), 6, tokenizer)
    assert len(dataset) == len(stream) // 7
    assert samples(dataset) == [(stream[i * 7 : i * 7 + 6], stream[i * 7 + 1 : i * 7 + 7]) for i in range(len(dataset))]
    assert verify(str(tmp_path / "hand")) == []

    monkeypatch.setattr(prepare_module, "load_tokenizer", lambda path: tokenizer)
    write(tmp_path / "in" / "a.txt", "ab")
    write(tmp_path / "in" / "b.jsonl", '{"text": "cde"}\n\n{"text": "f"}\n')
    manifest = prepare([str(tmp_path / "in")], "bytes", str(tmp_path / "out"), 1, progress=None)
    assert manifest["dtype"] == dtype
    written = {
        0: ([1, base + ord("a"), base + ord("b"), 2], [0, 4]),
        1: ([1, base + ord("c"), base + ord("d"), base + ord("e"), 2, 1, base + ord("f"), 2], [0, 5, 8]),
    }
    for index, (tokens, offsets) in written.items():
        bin_file = tmp_path / "out" / manifest["shards"][index]["file"]
        idx_file = tmp_path / "out" / manifest["shards"][index]["index"]
        assert bin_file.read_bytes() == struct.pack(f"<{len(tokens)}{code}", *tokens)
        assert idx_file.read_bytes() == struct.pack(f"<{len(offsets)}Q", *offsets)
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk.keys() == MANIFEST_KEYS.keys() and on_disk["tokenizer"].keys() == TOKENIZER_KEYS.keys()
    assert all(shard.keys() == SHARD_KEYS.keys() for shard in on_disk["shards"])


def test_a_damaged_manifest_names_the_key(tmp_path: Path) -> None:
    """Every key the reader relies on, missing or of another type, is a DataError naming the file and
    the key (never a KeyError or TypeError from deep inside)."""
    hand_written_folder(tmp_path, "uint16", 0xFF00, "H")
    file = tmp_path / "manifest.json"
    good = json.loads(file.read_text())
    tokenizer = ByteTokenizer(0xFF00)
    for section, keys in (("", MANIFEST_KEYS), ("tokenizer.", TOKENIZER_KEYS), ("shards[1].", SHARD_KEYS)):
        for key, kind in keys.items():
            if key in ("format", "format_version"):
                continue  # checked first, with their own messages (test_open_errors)
            for damage in ("delete", "retype"):
                manifest = json.loads(json.dumps(good))
                holder = manifest["tokenizer"] if section == "tokenizer." else manifest
                holder = manifest["shards"][1] if section == "shards[1]." else holder
                if damage == "delete":
                    del holder[key]
                else:
                    holder[key] = "x" if kind is not str else 3
                file.write_text(json.dumps(manifest))
                with pytest.raises(DataError, match=re.escape(f"{file}: {section}{key} is missing or not a")):
                    PreparedDataset(str(tmp_path), 6, tokenizer)
    for manifest, message in (
        ({**good, "dtype": "int8"}, "dtype 'int8'"),
        ({**good, "shards": [7]}, "shards[0] is not a JSON object"),
    ):
        file.write_text(json.dumps(manifest))
        with pytest.raises(DataError, match=re.escape(f"{file}: {message}")):
            verify(str(tmp_path))
    with pytest.raises(DataError, match="nowhere' does not exist"):
        verify(str(tmp_path / "nowhere"))


def test_prepare_data_reports_user_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/prepare_data.py prints a user's mistake as one line with exit code 2, and lets a bug
    (any other exception, ValueError included) keep its traceback."""
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts" / "prepare_data.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    taken = write(tmp_path / "taken", "a file")
    args = ["--tokenizer", str(TOKENIZER_PATH), "--workers", "1", str(taken)]
    assert script.main([*args, "--out", str(taken)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"prepare_data: data error: --out {str(taken)!r} is a file")

    def bug(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(script, "prepare", bug)
    with pytest.raises(ValueError, match="a bug"):
        script.main([*args, "--out", str(tmp_path / "out")])


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
