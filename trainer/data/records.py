"""Files of records, one per ``.jsonl`` line or Parquet row, checked the same way in both.

A kind needs its keys in every record (``text``; ``prompt`` and ``response``; ``messages``), as
strings (messages: a non-empty list of ``{role, content}``). A record that lacks one is an error
naming the file and the line (``file:12``) or row (``file: row 11 (row group 0)``) and what the
kind needs, never a record silently skipped.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.data import parquet
from trainer.data.chat import ASSISTANT, Conversation
from trainer.runtime.errors import DataError

PREPARE_INPUT = "prepare_data input"
"""The ``kind`` (and ``key`` of ``sources.local_files``) of ``scripts/prepare_data.py``'s inputs,
whose fixes differ."""
ROLES = ("system", "user", ASSISTANT, "tool", "ipython")
"""The roles chat formats know; only ``assistant`` messages are learned."""
_MESSAGES_EXAMPLE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}'


def is_jsonl(file: Path) -> bool:
    """A ``.jsonl`` or ``.jsonl.gz`` file: one record per line."""
    return file.name.lower().endswith((".jsonl", ".jsonl.gz"))


def jsonl_records(
    file: Path, text: str, keys: tuple[str, ...], kind: str, first_line: int = 1
) -> Iterator[tuple[str, ...]]:
    """The string fields ``keys`` of each non-blank line, with errors pointing at file:line
    (``text`` starts at line ``first_line`` of ``file``)."""
    where = (
        "of a .jsonl input of prepare_data"
        if kind == PREPARE_INPUT
        else f"of a .jsonl file under `training.dataset_path`, with `training.dataset` = {kind!r},"
    )
    hint = f"every line {where} must be a JSON object with string keys {', '.join(map(json.dumps, keys))}"
    for lineno, record in _json_lines(file, text, hint, first_line):
        if not isinstance(record, dict):
            raise DataError(f"{file}:{lineno}: not a JSON object; {hint}.")
        for key in keys:
            if key not in record:
                raise DataError(f'{file}:{lineno}: missing key "{key}"; {hint}.')
            if not isinstance(record[key], str):
                raise DataError(f'{file}:{lineno}: key "{key}" is not a string; {hint}.')
        yield tuple(record[key] for key in keys)


def _json_lines(file: Path, text: str, hint: str, first_line: int = 1) -> Iterator[tuple[int, Any]]:
    """``(line number, decoded value)`` of each non-blank line; invalid JSON names file:line."""
    # JSONL separates records by "\n" only; str.splitlines would also split inside strings
    # holding U+2028 and friends, which JSON allows unescaped.
    for lineno, line in enumerate(text.split("\n"), start=first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{file}:{lineno}: invalid JSON ({exc.msg}); {hint}.") from None
        yield lineno, record


def parquet_records(
    file: Path, keys: tuple[str, ...], kind: str, start: int = 0, end: int | None = None, expected: str | None = None
) -> Iterator[tuple[str, ...]]:
    """The string columns ``keys`` of each row of a Parquet file (``parquet.rows``: the row
    groups whose bytes begin in ``[start, end)``, checked against their ``expected`` identity)."""
    columns = f"string column{'s' if len(keys) > 1 else ''} {', '.join(map(json.dumps, keys))}"
    if kind == PREPARE_INPUT:
        need = f"a Parquet input of prepare_data needs the {columns}"
    else:
        need = f"with `training.dataset` = {kind!r}, a Parquet file under `training.dataset_path` needs the {columns}"
    for _, values in parquet.rows(file, keys, need, start, end, expected):
        yield values


def _check_role(where: str, number: int, role: str) -> None:
    """A role that is almost a known one (``Assistant``, ``assitant``) is a typo that would
    silently turn answers into context the model never learns."""
    if role in ROLES:
        return
    close = [r for r in ROLES if r == role.lower()] or difflib.get_close_matches(role.lower(), ROLES, 1, 0.75)
    if close:
        raise DataError(
            f'{where}: message {number} has the role "{role}": did you mean "{close[0]}"? Roles are '
            f'lower case: {", ".join(map(json.dumps, ROLES))}; only "{ASSISTANT}" messages are learned.'
        )


def _conversation(where: str, messages: Any, hint: str) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: no "messages" list; {hint}.')
    for number, message in enumerate(messages, start=1):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and message["role"].strip()
            and isinstance(message.get("content"), str)
        ):
            raise DataError(
                f'{where}: message {number} needs a non-empty string "role" and a string "content"; {hint}.'
            )
        _check_role(where, number, message["role"].strip())
    return Conversation(tuple((m["role"].strip(), m["content"]) for m in messages), where)


def jsonl_conversations(file: Path, text: str, kind: str) -> Iterator[Conversation]:
    hint = (
        f"with `training.dataset` = {kind!r}, every line of a .jsonl file under `training.dataset_path` "
        f"must be {_MESSAGES_EXAMPLE}"
    )
    for lineno, record in _json_lines(file, text, hint):
        yield _conversation(f"{file}:{lineno}", record.get("messages") if isinstance(record, dict) else None, hint)


def parquet_conversations(file: Path, kind: str, expected: str | None = None) -> Iterator[Conversation]:
    """A row's ``messages``: a list of structs ``{role, content}``, as a .jsonl line's."""
    hint = (
        f"with `training.dataset` = {kind!r}, a Parquet file under `training.dataset_path` needs a column "
        f'"messages" whose rows are lists of {{role, content}} strings, as a .jsonl line {_MESSAGES_EXAMPLE}'
    )
    for where, (messages,) in parquet.rows(file, ("messages",), hint, expected=expected):
        yield _conversation(where, messages, hint)
