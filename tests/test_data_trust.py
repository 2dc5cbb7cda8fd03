"""Data the run can trust: a failed preparation never destroys the good output before it, what trains
is what was prepared (verified by hash, not by size), and inputs that cannot be what the user meant
are refused (or warned about) in one line naming the file and the fix."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_helpers import SEQ_LEN, TOKENIZER_PATH, load_data, run_prepare, write
from harness import children
from hf_tokenizer import build

from trainer.data import prepare as prepare_module
from trainer.data.prepare import prepare
from trainer.data.prepared import PreparedDataset
from trainer.data.samples import build_dataset, open_dataset
from trainer.data.shards import verify
from trainer.data.sources import read_sources
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.runtime.dump_folder import DumpFolderLock
from trainer.runtime.errors import BusyFolderError, DataError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The token cache and the verified records, out of the home directory."""
    path = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(str(TOKENIZER_PATH))


@functools.cache
def _plays() -> list[str]:
    return [play.text for play in read_sources(None).plays()[:2]]


def corpus(root: Path, variant: str = "") -> Path:
    """A .txt file and a .jsonl file cut into several units."""
    plays = _plays()
    write(root / "a.txt", variant + plays[0][:2500])
    lines = [json.dumps({"text": variant + p}) for p in plays[1].split("\n\n")[:120]]
    write(root / "b.jsonl", "\n".join(lines) + "\n")
    return root


def snapshot(out: Path) -> dict[str, bytes]:
    """The manifest and every file it names, by bytes."""
    manifest = json.loads((out / "manifest.json").read_text())
    names = ["manifest.json"] + [name for s in manifest["shards"] for name in (s["file"], s["index"])]
    return {name: (out / name).read_bytes() for name in names}


def samples(dataset: Any) -> list[list[int]]:
    return [dataset[i][0].tolist() for i in range(len(dataset))]


# ------------------------------------------------------------------------------------------
# 1. A tool never destroys good output before the new output is complete
# ------------------------------------------------------------------------------------------


def _fail_on(name: str, when: Callable[..., bool], error: BaseException) -> Callable[[pytest.MonkeyPatch], None]:
    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        real = getattr(prepare_module, name)

        def failing(*args: Any) -> Any:
            if when(*args):
                raise error
            return real(*args)

        monkeypatch.setattr(prepare_module, name, failing)

    return inject


FAILURES: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "a bad line in a later unit": (lambda mp: None, "bad"),
    "a binary input": (lambda mp: None, "binary"),
    "a missing input": (lambda mp: None, "missing"),
    "a full disk while writing a shard": (
        _fail_on("_write_atomic", lambda file, data: file.suffix == ".idx", DataError("disk full")),
        "",
    ),
    "an interrupt in the third unit": (
        _fail_on("_run_unit", lambda task: task.index == 2, KeyboardInterrupt()),
        "",
    ),
    "a failure hashing the stream": (_fail_on("stream_sha256", lambda *args: True, OSError("EIO")), ""),
    "a full disk while writing the manifest": (
        _fail_on("_write_atomic", lambda file, data: file.name == "manifest.json", DataError("disk full")),
        "",
    ),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_a_failed_preparation_leaves_the_previous_output_intact(
    failure: str, tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    run_prepare([corpus(tmp_path / "good")], out)
    before, good = snapshot(out), samples(PreparedDataset(str(out), SEQ_LEN, tokenizer))
    inject, extra = FAILURES[failure]
    new = corpus(tmp_path / "new", variant="Other words. ")  # every unit changes
    if extra == "bad":
        write(new / "z.jsonl", '{"text": "fine"}\n{"text": 3}\n')
    elif extra == "binary":
        (new / "z.txt").write_bytes(b"\x00\x01\x02 data")
    inputs = [new, tmp_path / "nowhere"] if extra == "missing" else [new]
    inject(monkeypatch)
    with pytest.raises((DataError, KeyboardInterrupt, OSError)):
        run_prepare(inputs, out)
    assert snapshot(out) == before
    assert verify(str(out)) == []
    assert samples(PreparedDataset(str(out), SEQ_LEN, tokenizer)) == good
    monkeypatch.undo()
    # The rerun, once the cause is gone, completes and replaces the old output; nothing unnamed is left.
    manifest = run_prepare([corpus(tmp_path / "fixed", variant="Other words. ")], out)
    named = {name for s in manifest["shards"] for name in (s["file"], s["index"], s["file"][:-4] + ".json")}
    assert {f"shards/{p.name}" for p in (out / "shards").iterdir()} == named


def test_two_runs_on_one_folder_are_refused_at_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    holder = DumpFolderLock(out)
    holder.acquire()  # a live run: this process
    try:
        with pytest.raises(BusyFolderError, match=rf"--out '{out}' is being prepared by another prepare_data run: pid"):
            run_prepare([corpus(tmp_path / "in")], out)
    finally:
        holder.release()
    run_prepare([tmp_path / "in"], out)  # free again


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_workers_die_with_a_killed_run(tmp_path: Path) -> None:
    """kill -9 skips the pool's shutdown; its workers must not wait for work forever."""
    corpus(tmp_path / "in")
    script = (
        "import time, trainer.data.prepare as p\n"
        "real = p._run_unit\n"
        "def slow(task):\n"
        "    time.sleep(120)\n"
        "    return real(task)\n"
        "p._run_unit = slow\n"
        f"p.prepare([{str(tmp_path / 'in')!r}], {str(TOKENIZER_PATH)!r}, {str(tmp_path / 'out')!r}, 2, 3000, None)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        workers: list[int] = []
        for _ in range(300):
            workers = [pid for pid in children(run.pid) if _alive(pid)]
            if len(workers) >= 2:
                break
            time.sleep(0.1)
        assert len(workers) >= 2, "the pool never started"
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        for _ in range(100):
            if not any(_alive(pid) for pid in workers):
                break
            time.sleep(0.1)
        orphans = [pid for pid in workers if _alive(pid)]
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        assert not orphans, f"pool workers {orphans} outlived the killed run"
    finally:
        if run.poll() is None:
            run.kill()


# ------------------------------------------------------------------------------------------
# 2. What trains is what was prepared, verified, not sized
# ------------------------------------------------------------------------------------------


def _rewrite_ids(out: Path, manifest: dict) -> Path:
    file = out / manifest["shards"][1]["file"]
    ids = np.fromfile(file, dtype="<u2")
    ids[: len(ids) * 3 // 10] = (ids[: len(ids) * 3 // 10] + 1) % 100  # in the vocabulary, same size
    ids.tofile(file)
    return file


def _ff_bytes(out: Path, manifest: dict) -> Path:
    file = out / manifest["shards"][1]["file"]
    file.write_bytes(b"\xff" * file.stat().st_size)
    return file


def _edit_manifest(change: Callable[[dict], None]) -> Callable[[Path, dict], Path]:
    def edit(out: Path, manifest: dict) -> Path:
        change(manifest)
        (out / "manifest.json").write_text(json.dumps(manifest))
        return out / "manifest.json"

    return edit


def _drop_done_record(out: Path, manifest: dict) -> Path:
    record = out / (manifest["shards"][2]["file"][:-4] + ".json")
    record.unlink()
    return record


TAMPERING: dict[str, tuple[Callable[[Path, dict], Path], str]] = {
    "30% of a shard's ids rewritten in place": (_rewrite_ids, "its bytes are not the ones prepared"),
    "a shard's bytes set to 0xFF": (_ff_bytes, "holds the token id 65535, beyond the vocabulary of"),
    "a shard dropped from the manifest": (
        _edit_manifest(lambda m: m["shards"].pop(1)),
        "do not match its manifest_sha256",
    ),
    "a shard named twice in the manifest": (
        _edit_manifest(lambda m: m["shards"].append(m["shards"][0])),
        "do not match its manifest_sha256",
    ),
    "the manifest's total edited": (
        _edit_manifest(lambda m: m.update(total_tokens=m["total_tokens"] + 1)),
        "do not match its manifest_sha256",
    ),
    "the manifest's checksum removed": (
        _edit_manifest(lambda m: m.pop("manifest_sha256")),
        "manifest_sha256 is missing.*rerun scripts/prepare_data.py with the same arguments",
    ),
    "a done-record deleted": (_drop_done_record, "missing, so nothing proves that prepare_data finished"),
}


@pytest.mark.parametrize("tampering", TAMPERING)
def test_what_trains_is_what_was_prepared(tampering: str, tmp_path: Path, tokenizer: Tokenizer) -> None:
    out = tmp_path / "out"
    source = corpus(tmp_path / "in")
    first = run_prepare([source], out)
    expected = samples(PreparedDataset(str(out), SEQ_LEN, tokenizer))  # verified and recorded once
    damage, message = TAMPERING[tampering]
    manifest = json.loads((out / "manifest.json").read_text())
    named = damage(out, manifest)
    with pytest.raises(DataError, match=f"{named}.*{message}"):
        open_dataset("shakespeare", str(out), tokenizer, SEQ_LEN)
    # The documented repair redoes what is damaged (reuse is by hash, not by size) and trains as before.
    again = run_prepare([source], out)
    assert again["reused_units"] >= len(first["shards"]) - 1
    assert samples(PreparedDataset(str(out), SEQ_LEN, tokenizer)) == expected
    assert verify(str(out)) == []


def test_shards_are_hashed_once_per_file_version(tmp_path: Path, tokenizer: Tokenizer) -> None:
    out = tmp_path / "out"
    manifest = run_prepare([corpus(tmp_path / "in")], out)
    assert PreparedDataset(str(out), SEQ_LEN, tokenizer).hashed == len(manifest["shards"])
    assert PreparedDataset(str(out), SEQ_LEN, tokenizer).hashed == 0
    os.utime(out / manifest["shards"][3]["file"])  # written to, even with the same bytes
    assert PreparedDataset(str(out), SEQ_LEN, tokenizer).hashed == 1


def test_every_tokenizer_file_is_part_of_the_tokenizer(tmp_path: Path) -> None:
    """tokenizer_config.json picks BOS/EOS: editing it is another tokenizer to the token cache, the data
    identity and the prepared-folder check; a malformed one is an error naming it."""
    tokenizer_json = build(tmp_path / "tok")
    config = tmp_path / "tok" / "tokenizer_config.json"
    base = load_tokenizer(str(tokenizer_json))
    write(tmp_path / "in" / "a.txt", "To be, or not to be. " * 200)
    prepare([str(tmp_path / "in")], str(tokenizer_json), str(tmp_path / "out"), 1, progress=None)
    before = build_dataset("shakespeare", str(tmp_path / "in"), base, 16).identity
    settings = json.loads(config.read_text())
    config.write_text(json.dumps({**settings, "eos_token": "<|eot_id|>"}))
    edited = load_tokenizer(str(tokenizer_json))
    assert edited.sha256 != base.sha256 and edited.eos_id != base.eos_id
    after = build_dataset("shakespeare", str(tmp_path / "in"), edited, 16).identity
    assert after["tokenizer_sha256"] != before["tokenizer_sha256"]
    assert after["samples_sha256"] != before["samples_sha256"]  # the cache was not reused: EOS differs
    with pytest.raises(DataError, match="prepared with the tokenizer 'tokenizer.json'.*another tokenizer"):
        PreparedDataset(str(tmp_path / "out"), 16, edited)
    for broken in ("{not json", "[1, 2]"):
        config.write_text(broken)
        with pytest.raises(DataError, match=f"{config}: .*repair it"):
            load_tokenizer(str(tokenizer_json))


def test_raw_files_and_their_prepared_folder_are_the_sameload_data(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """A run may resume from the prepared form of the files it trained on, and the reverse: the data
    identity is what the samples are, not where they were read from."""
    source = corpus(tmp_path / "in")
    run_prepare([source], tmp_path / "out")
    raw = build_dataset("shakespeare", str(source), tokenizer, SEQ_LEN)
    prepared = PreparedDataset(str(tmp_path / "out"), SEQ_LEN, tokenizer)
    assert raw.identity == prepared.identity
    assert PreparedDataset(str(tmp_path / "out"), SEQ_LEN + 1, tokenizer).identity != prepared.identity
    write(source / "a.txt", "Other text. " * 300)
    assert build_dataset("shakespeare", str(source), tokenizer, SEQ_LEN).identity != prepared.identity


# ------------------------------------------------------------------------------------------
# 8. Inputs that cannot be what the user meant
# ------------------------------------------------------------------------------------------


def _input(name: str, data: bytes) -> Callable[[Path], list[Path]]:
    def make(root: Path) -> list[Path]:
        file = root / name
        file.write_bytes(data)
        return [file]

    return make


NOT_MEANT: dict[str, tuple[Callable[[Path], list[Path]], str]] = {
    "binary data (NUL bytes)": (_input("model.txt", b"PK\x03\x04\x00\x00binary"), "model.txt: holds NUL bytes"),
    "text that is not UTF-8": (_input("latin1.txt", "café".encode("latin-1")), "latin1.txt: not UTF-8 text"),
    "gzip data named .jsonl": (
        _input("web.jsonl", b"\x1f\x8b\x08\x00rest"),
        "web.jsonl: gzip-compressed data in a file not named .gz; rename it web.jsonl.gz",
    ),
    "JSON lines named .txt": (
        _input("web.txt", b'{"text": "a"}\n{"text": "b"}\n'),
        "web.txt: a .txt file whose lines are JSON records.*rename it web.jsonl",
    ),
    "the same file named twice": (lambda root: [write(root / "a.txt", "words " * 100)] * 2, "a.txt' is named twice"),
    "a file and its folder": (
        lambda root: [root / "data", write(root / "data" / "a.txt", "words " * 100)],
        "a.txt' is named twice",
    ),
    "a misspelt assistant role": (
        _input(
            "chat.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assitant", "content": "yo"}]}'
        ),
        'chat.jsonl:1: message 2 has the role "assitant": did you mean "assistant"',
    ),
    "a capitalised assistant role": (
        _input("chat.jsonl", b'{"messages": [{"role": "User", "content": "hi"}]}'),
        'chat.jsonl:1: message 1 has the role "User": did you mean "user"',
    ),
}


@pytest.mark.parametrize("case", NOT_MEANT)
def test_inputs_that_cannot_be_meant_are_refused_naming_the_file(
    case: str, tmp_path: Path, tokenizer: Tokenizer
) -> None:
    make, message = NOT_MEANT[case]
    inputs = make(tmp_path)
    kind = "chat" if "role" in case else "shakespeare"
    if len(inputs) == 1:  # training from the files reads them the same way
        with pytest.raises(DataError, match=message):
            build_dataset(kind, str(inputs[0]), tokenizer, SEQ_LEN)
    if kind == "shakespeare":
        with pytest.raises(DataError, match=message):
            run_prepare(inputs, tmp_path / "out")
        assert not (tmp_path / "out" / "manifest.json").exists()


def test_training_paths_named_twice_or_too_small_are_refused(tmp_path: Path) -> None:
    data = write(tmp_path / "data" / "a.txt", "To be, or not to be. " * 400)
    # The same path spelt twice alike is a config error; these name one file two ways.
    for paths in (f"{data},{tmp_path}/data/../data/a.txt", f"{tmp_path / 'data'},{data}"):
        with pytest.raises(DataError, match=r"`training.dataset_path` names .*a.txt' twice.*dataset_weights"):
            load_data("--training.dataset_path", paths)
    small = write(tmp_path / "small.txt", "Few words here. " * 10)
    with pytest.raises(
        DataError, match=r"small.txt gives \d+ samples .* fewer than one global batch of 64.*global_batch"
    ):
        load_data("--training.dataset_path", str(small), "--training.global_batch_size", "64")
    run_prepare([tmp_path / "data"], tmp_path / "prepared")
    with pytest.raises(
        DataError, match=r"is a prepared folder's manifest; point `training.dataset_path` at the folder"
    ):
        load_data("--training.dataset_path", str(tmp_path / "prepared" / "manifest.json"))
    with pytest.raises(DataError, match=r"shards' is a folder without .* \(the shards of a prepared folder"):
        load_data("--training.dataset_path", str(tmp_path / "prepared" / "shards"))


def test_prepare_data_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--verify of a folder that does not exist says so; a missing input gets the tool's own fix."""
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts" / "prepare_data.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--verify", str(tmp_path / "nowhere")]) == 2
    assert "nowhere' does not exist" in capsys.readouterr().err
    missing = ["--tokenizer", str(TOKENIZER_PATH), "--out", str(tmp_path / "o"), str(tmp_path / "gone.txt")]
    assert script.main(missing) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "prepare_data input" in error and "gone.txt' does not exist" in error
    assert "bundled plays" not in error and "training.dataset_path" not in error
