"""Parquet input: the same samples, shards and losses as the same records in ``.jsonl``, read one
row group at a time, and every bad file one line naming the file (and row) and the fix."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from data_helpers import cache_dir  # noqa: F401 (the autouse token-cache fixture)
from harness import run_cases, run_train, trainer_for
from step_helpers import fetch_step, forward_backward, optimizer_step

from trainer.build import build_validator
from trainer.data import parquet
from trainer.data.datasets import load_validation_dataset
from trainer.data.prepare import prepare
from trainer.data.prepared import PreparedDataset
from trainer.data.samples import SampleDataset, build_dataset, open_dataset
from trainer.data.shards import verify
from trainer.data.sources import read_sources
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.runtime.errors import DataError

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = str(ROOT / "assets" / "tokenizer" / "shakespeare.model")
SEQ_LEN = 64
PLAYS = 8
ROWS_PER_GROUP = 3
UNIT_BYTES = 200_000
"""About two plays of text: the Parquet file is cut into several units of whole row groups."""


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(TOKENIZER)


def export(folder: Path, name: str, rows: dict[str, list[Any]]) -> tuple[Path, Path]:
    """``rows`` (columns) as ``name.jsonl`` and as ``name.parquet`` in row groups of
    ``ROWS_PER_GROUP`` rows, with page checksums and an extra column that is never read."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = list(rows)
    count = len(rows[keys[0]])
    jsonl = folder / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({k: rows[k][i] for k in keys}) + "\n" for i in range(count)))
    table = pa.table({**rows, "id": list(range(count))})
    pq.write_table(table, folder / f"{name}.parquet", row_group_size=ROWS_PER_GROUP, write_page_checksum=True)
    return jsonl, folder / f"{name}.parquet"


@pytest.fixture(scope="module")
def plays(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The first bundled plays, one document per row, as ``plays.jsonl`` and ``plays.parquet``."""
    texts = [play.text for play in read_sources(None).plays()[:PLAYS]]
    return export(tmp_path_factory.mktemp("plays"), "plays", {"text": texts})


def shards(out: Path, suffix: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((out / "shards").glob(f"*{suffix}"))]


# --------------------------------------------------------------------------------------------
# The same data as .jsonl
# --------------------------------------------------------------------------------------------


def test_raw_parquet_gives_the_jsonl_samples_and_cache(
    plays: tuple[Path, Path],
    tokenizer: Tokenizer,
    cache_dir: Path,  # noqa: F811 (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jsonl, table = plays
    assert pq.ParquetFile(table).metadata.num_row_groups == 3
    cached: list[bytes] = []

    def build(file: Path) -> SampleDataset:
        before = set((cache_dir / "datasets").glob("*.bin"))
        dataset = build_dataset("shakespeare", str(file), tokenizer, SEQ_LEN)
        (new,) = set((cache_dir / "datasets").glob("*.bin")) - before
        cached.append(new.read_bytes())
        return dataset

    from_jsonl, from_parquet = build(jsonl), build(table)
    assert len(from_parquet) == len(from_jsonl) > 1000
    assert torch.equal(from_parquet._tokens, from_jsonl._tokens)
    assert from_parquet.identity == from_jsonl.identity
    # Two cache files, keyed apart (by file), holding the same arrays: all bytes but the key agree.
    a, b = cached
    assert a[8:72] != b[8:72] and a[:8] + a[72:] == b[:8] + b[72:]
    # The next start reads the cache: the Parquet file is hashed, not read.
    monkeypatch.setattr(parquet, "rows", lambda *args, **kwargs: pytest.fail("read although cached"))
    assert torch.equal(build_dataset("shakespeare", str(table), tokenizer, SEQ_LEN)._tokens, from_jsonl._tokens)


def test_a_changed_parquet_file_changes_the_samples(
    plays: tuple[Path, Path], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    table = tmp_path / "plays.parquet"
    shutil.copy(plays[1], table)
    before = build_dataset("shakespeare", str(table), tokenizer, SEQ_LEN)
    texts = pq.read_table(table).column("text").to_pylist()
    changed = [texts[0].replace("Enter", "Exit", 1), *texts[1:]]
    pq.write_table(pa.table({"text": changed}), table, row_group_size=ROWS_PER_GROUP)
    after = build_dataset("shakespeare", str(table), tokenizer, SEQ_LEN)
    assert not torch.equal(before._tokens, after._tokens)
    assert after.identity != before.identity


def test_prepare_parquet_gives_the_jsonl_shards(plays: tuple[Path, Path], tokenizer: Tokenizer, tmp_path: Path) -> None:
    jsonl, table = plays
    # One unit each: the very same shard files.
    whole = [prepare([str(f)], TOKENIZER, str(tmp_path / f.suffix[1:]), 1, 1 << 30, None) for f in (jsonl, table)]
    assert [len(m["shards"]) for m in whole] == [1, 1]
    for suffix in (".bin", ".idx"):
        assert shards(tmp_path / "jsonl", suffix) == shards(tmp_path / "parquet", suffix)
    assert whole[0]["stream_sha256"] == whole[1]["stream_sha256"]
    # Units of whole row groups: cut elsewhere than the .jsonl's line ranges, the same token stream.
    cut = prepare([str(table)], TOKENIZER, str(tmp_path / "cut"), 1, UNIT_BYTES, None)
    assert len(cut["shards"]) == 3
    assert [cut[k] for k in ("stream_sha256", "total_tokens", "total_documents")] == [
        whole[0][k] for k in ("stream_sha256", "total_tokens", "total_documents")
    ]
    assert cut["total_documents"] == PLAYS and verify(str(tmp_path / "cut")) == []
    prepared = open_dataset("shakespeare", str(tmp_path / "cut"), tokenizer, SEQ_LEN)
    memory = build_dataset("shakespeare", str(table), tokenizer, SEQ_LEN)
    assert isinstance(prepared, PreparedDataset)
    assert all(torch.equal(prepared[i][0], memory[i][0]) for i in range(0, len(memory), 97))
    assert prepared.identity == memory.identity


def test_workers_do_not_change_a_parquet_preparation(plays: tuple[Path, Path], tmp_path: Path) -> None:
    """Worker processes forked after the parent opened the file with pyarrow (to plan the units)."""
    one, two = (prepare([str(plays[1])], TOKENIZER, str(tmp_path / f"w{n}"), n, UNIT_BYTES, None) for n in (1, 2))
    assert one == two and len(one["shards"]) == 3
    assert shards(tmp_path / "w1", ".bin") == shards(tmp_path / "w2", ".bin")


def test_prepare_resumes_a_parquet_file(plays: tuple[Path, Path], tmp_path: Path) -> None:
    source = tmp_path / "plays.parquet"
    shutil.copy(plays[1], source)
    out = tmp_path / "out"
    first = prepare([str(source)], TOKENIZER, str(out), 1, UNIT_BYTES, None)
    before = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}
    # An interruption: no manifest, one shard gone. The rerun redoes that unit only.
    (out / "manifest.json").unlink()
    (out / first["shards"][1]["file"]).unlink()
    second = prepare([str(source)], TOKENIZER, str(out), 1, UNIT_BYTES, None)
    assert second["reused_units"] == len(first["shards"]) - 1
    assert {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == before
    # A rewritten file (a new footer) is new data: nothing is reused.
    texts = pq.read_table(source).column("text").to_pylist()
    pq.write_table(pa.table({"text": texts[::-1]}), source, row_group_size=ROWS_PER_GROUP)
    third = prepare([str(source)], TOKENIZER, str(out), 1, UNIT_BYTES, None)
    assert third["reused_units"] == 0 and third["stream_sha256"] != first["stream_sha256"]


def test_chat_and_pairs_from_parquet(tokenizer: Tokenizer, tmp_path: Path) -> None:
    speeches = [s for play in read_sources(None).plays()[:2] for scene in play.scenes for s in scene][:120]
    messages = [
        [{"role": "user", "content": speeches[i]}, {"role": "assistant", "content": speeches[i + 1]}]
        for i in range(0, 120, 2)
    ]
    pairs = {"prompt": speeches[0::2], "response": speeches[1::2]}
    for kind, rows in (("chat", {"messages": messages}), ("shakespeare_dialogue", pairs)):
        jsonl, table = export(tmp_path, kind, rows)
        a, b = (build_dataset(kind, str(f), tokenizer, SEQ_LEN) for f in (jsonl, table))
        assert len(a) == len(b) > 30 and a.identity == b.identity and a.chat_stats == b.chat_stats, kind
    conversations = read_sources(str(tmp_path / "chat.parquet")).conversations("chat")
    assert conversations[4].where.endswith("chat.parquet: row 4 (row group 1)")


def losses_worker(argv: list[str]) -> tuple[list[float], float]:
    p, parts = trainer_for(argv)
    validator = build_validator(p, parts, load_validation_dataset(p.config, p.tokenizer))
    assert validator is not None
    losses = []
    for _ in range(3):
        result = forward_backward(parts, fetch_step(parts))
        optimizer_step(parts, result)
        losses.append(result.loss_avg)
    return losses, validator.run(parts).loss


@pytest.mark.slow
def test_training_on_parquet_gives_the_jsonl_losses(plays: tuple[Path, Path], tmp_path: Path) -> None:
    """Raw .jsonl, raw Parquet and Parquet prepared: the same losses, step for step, and the same
    validation loss (``validation.dataset_path`` a Parquet file)."""
    jsonl, table = plays
    held_out = [play.text for play in read_sources(None, "validation").plays()]
    valid_jsonl, valid_table = export(tmp_path, "valid", {"text": held_out})
    prepare([str(table)], TOKENIZER, str(tmp_path / "prepared"), 1, UNIT_BYTES, None)

    def argv(train: Path, valid: Path) -> list[str]:
        return [
            *("--training.dataset_path", str(train), "--validation.dataset_path", str(valid)),
            *("--validation.enable", "--validation.steps", "2", "--validation.local_batch_size", "4"),
            *("--training.seq_len", str(SEQ_LEN), "--training.global_batch_size", "8"),
            *("--training.local_batch_size", "4", "--debug.seed", "3", "--metrics.enable_tensorboard=false"),
        ]

    results = run_cases(
        1,
        {
            "jsonl": (losses_worker, argv(jsonl, valid_jsonl)),
            "parquet": (losses_worker, argv(table, valid_table)),
            "prepared": (losses_worker, argv(tmp_path / "prepared", valid_table)),
        },
    )
    expected = results["jsonl"][0]
    assert len(set(expected[0])) == 3
    assert results["parquet"][0] == expected and results["prepared"][0] == expected


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


def test_reads_one_row_group_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only ``read_row_group`` of the needed column, one group per call, never the whole file;
    when a group is requested, the Arrow memory of the groups before it has been released (the
    reader keeps a few buffers of about a column chunk: a bound well below the file's column)."""
    groups, rows = 12, 40
    texts = [f"row {i} " + "lorem ipsum dolor sit amet " * (50 + i % 7) for i in range(groups * rows)]
    file = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": texts, "other": texts}), file, row_group_size=rows)
    meta = pq.ParquetFile(file).metadata
    one_group = meta.row_group(0).total_byte_size
    text_column = sum(meta.row_group(g).column(0).total_uncompressed_size for g in range(groups))
    calls: list[tuple[int, list[str], int]] = []
    original = pq.ParquetFile.read_row_group

    def spy(self: pq.ParquetFile, i: int, columns: list[str] | None = None, **kwargs: Any) -> pa.Table:
        calls.append((i, list(columns or []), pa.total_allocated_bytes()))
        return original(self, i, columns=columns, **kwargs)

    def whole(*args: object, **kwargs: object) -> None:
        pytest.fail("the whole file was read")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    for name in ("read", "iter_batches", "read_row_groups"):
        monkeypatch.setattr(pq.ParquetFile, name, whole)
    monkeypatch.setattr(pq, "read_table", whole)
    baseline = pa.total_allocated_bytes()
    documents = read_sources(str(file)).documents("shakespeare")
    assert documents == texts
    assert [(i, columns) for i, columns, _ in calls] == [(i, ["text"]) for i in range(groups)]
    assert max(allocated for *_, allocated in calls) - baseline < text_column / 2
    # prepare_data's units read their own row groups only.
    calls.clear()
    manifest = prepare([str(file)], TOKENIZER, str(tmp_path / "out"), 1, one_group * 5 // 2, None)
    assert len(manifest["shards"]) == 4 and manifest["total_documents"] == groups * rows  # 3 groups a unit
    assert [i for i, *_ in calls] == list(range(groups))


def test_pyarrow_is_imported_only_for_a_parquet_file() -> None:
    code = (
        "import sys, trainer.train, trainer.data.datasets, trainer.data.prepare\n"
        "assert 'pyarrow' not in sys.modules, 'pyarrow imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# --------------------------------------------------------------------------------------------
# Bad input: one line naming the file (and row group, row) and the fix
# --------------------------------------------------------------------------------------------


def _damaged_page(file: Path) -> None:
    """Bytes of row group 1's first page flipped (after its header): its checksum fails."""
    pq.write_table(
        pa.table({"text": [f"row {i} " * 40 for i in range(9)]}), file, row_group_size=3, write_page_checksum=True
    )
    column = pq.ParquetFile(file).metadata.row_group(1).column(0)
    data = bytearray(file.read_bytes())
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data[start + 40 : start + 60] = bytes(255 - b for b in data[start + 40 : start + 60])
    file.write_bytes(bytes(data))


def _truncated(file: Path) -> None:
    pq.write_table(pa.table({"text": ["a document"] * 9}), file, row_group_size=3)
    file.write_bytes(file.read_bytes()[:-20])


BAD_TEXT = {
    "no text column": (
        lambda f: pq.write_table(pa.table({"content": ["a"], "url": ["u"]}), f),
        'no column "text" \\(its columns: "content", "url"\\); .*needs? the string column "text": rename the column',
    ),
    "not strings": (
        lambda f: pq.write_table(pa.table({"text": [1, 2]}), f),
        'the column "text" is of type int64, not string; .*string column "text"',
    ),
    "a null": (
        lambda f: pq.write_table(pa.table({"text": ["a", "b", "c", None]}), f, row_group_size=2),
        'row 3 \\(row group 1\\): "text" is null; .*drop the row or fill it',
    ),
    "not Parquet": (
        lambda f: f.write_bytes(b'{"text": "a .jsonl file named .parquet"}\n'),
        "not a readable Parquet file \\(Parquet magic bytes not found.*\\); write it again",
    ),
    "empty": (lambda f: f.write_bytes(b""), "not a readable Parquet file \\(Parquet file size is 0 bytes\\)"),
    "truncated": (_truncated, "not a readable Parquet file .*a copy cut short loses the footer"),
    "damaged page": (_damaged_page, "row group 1 cannot be read \\(.*\\); the file is damaged: write it again"),
}


def _one_line(error: DataError, file: Path) -> str:
    message = str(error)
    assert "\n" not in message and str(file) in message
    return message


@pytest.mark.parametrize("entry", ["raw", "prepare"])
@pytest.mark.parametrize("case", list(BAD_TEXT))
def test_bad_parquet_text(case: str, entry: str, tokenizer: Tokenizer, tmp_path: Path) -> None:
    make, message = BAD_TEXT[case]
    file = tmp_path / "data.parquet"
    make(file)
    with pytest.raises(DataError, match=f"{file}: {message}") as info:
        if entry == "raw":
            build_dataset("shakespeare", str(file), tokenizer, 4)
        else:
            prepare([str(file)], TOKENIZER, str(tmp_path / "out"), 1, 1 << 20, None)
    _one_line(info.value, file)
    assert ("prepare_data" in str(info.value)) == (
        entry == "prepare" and case in ("no text column", "not strings", "a null")
    )


def _chat(rows: list[Any], file: Path, schema: pa.Schema | None = None) -> None:
    pq.write_table(pa.table({"messages": rows}, schema=schema), file, row_group_size=2)


BAD_CHAT = {
    "strings": (lambda f: _chat(['[{"role": "user"}]'], f), 'the column "messages" is of type string, not a list of'),
    "no content field": (
        lambda f: _chat([[{"role": "user"}]], f),
        'the column "messages" is of type list<element: struct<role: string>>, not a list of structs',
    ),
    "empty list": (
        lambda f: _chat([[{"role": "user", "content": "a"}], [], [{"role": "user", "content": "b"}]], f),
        'row 1 \\(row group 0\\): no "messages" list; .*a column "messages" whose rows are lists',
    ),
    "a role's typo": (
        lambda f: _chat([[{"role": "user", "content": "a"}]] * 2 + [[{"role": "Assistant", "content": "b"}]], f),
        'row 2 \\(row group 1\\): message 1 has the role "Assistant": did you mean "assistant"\\?',
    ),
    "a null role": (
        lambda f: _chat([[{"role": "user", "content": "a"}, {"role": None, "content": "b"}]], f),
        'row 0 \\(row group 0\\): message 2 needs a non-empty string "role"',
    ),
}


@pytest.mark.parametrize("case", list(BAD_CHAT))
def test_bad_parquet_chat(case: str, tokenizer: Tokenizer, tmp_path: Path) -> None:
    make, message = BAD_CHAT[case]
    file = tmp_path / "chat.parquet"
    make(file)
    with pytest.raises(DataError, match=f"{file}: {message}") as info:
        build_dataset("chat", str(file), tokenizer, SEQ_LEN)
    _one_line(info.value, file)


def test_a_parquet_file_without_its_suffix(tokenizer: Tokenizer, tmp_path: Path) -> None:
    file = tmp_path / "data.jsonl"
    pq.write_table(pa.table({"text": ["a"]}), file)
    with pytest.raises(DataError, match=f"{file}: a Parquet file not named .parquet; rename it data.parquet"):
        build_dataset("shakespeare", str(file), tokenizer, 4)


def test_a_file_changed_while_read_is_refused(plays: tuple[Path, Path], tmp_path: Path) -> None:
    file = tmp_path / "plays.parquet"
    shutil.copy(plays[1], file)
    sources = read_sources(str(file))  # hashed now, read later
    pq.write_table(pa.table({"text": ["other text"] * 4}), file)
    with pytest.raises(DataError, match=f"{file}: changed while it was read; rerun once"):
        sources.documents("shakespeare")


def test_without_pyarrow_a_parquet_input_says_what_to_install(
    plays: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts" / "prepare_data.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--tokenizer", TOKENIZER, "--workers", "1", "--out", str(tmp_path / "out")]
    assert script.main([*args, str(plays[1])]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and 'needs the pyarrow package: run pip install -e ".[parquet]"' in error
    assert str(plays[1]) in error
    with pytest.raises(DataError, match=r'pip install -e "\.\[parquet\]"'):
        read_sources(str(plays[1].parent)).documents("shakespeare")


@pytest.mark.launcher
def test_run_train_reports_a_bad_parquet_file_before_launch(tmp_path: Path) -> None:
    file = tmp_path / "web.parquet"
    pq.write_table(pa.table({"content": ["a document"]}), file)
    run = run_train(1, ["--training.dataset_path", str(file), "--dry-run"], MESHTRAIN_CACHE_DIR=str(tmp_path))
    lines = [line for line in run.stderr.splitlines() if str(file) in line]
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr
    assert lines[0].startswith(f'meshtrain: data error: {file}: no column "text" (its columns: "content")')
