"""What a config field is: its type (including the two list types), and the metadata the schema
states once and the parser, the checks, ``--help`` and the generated reference all read: the doc,
the allowed choices and the numeric limits."""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from trainer.config.limits import Limits


class StrList(tuple):
    """A list of strings: a TOML array, or comma-separated on the command line."""


class FloatList(tuple):
    """A list of numbers: a TOML array, or comma-separated on the command line."""


def setting(default: Any, doc: str, choices: tuple[str, ...] | None = None, **limits: Any) -> Any:
    """A field of a config section with its doc, choices and limits (``ge``, ``gt``, ``le``,
    ``lt``, ``allowed``: see :class:`~trainer.config.limits.Limits`)."""
    metadata = {"doc": doc, "choices": choices, "limits": Limits(**limits) if limits else None}
    return dataclasses.field(default=default, metadata=metadata)


def fields_by_key(config_class: type) -> dict[str, tuple[type, dataclasses.Field]]:
    """All ``section.key`` names of ``config_class`` with their type and dataclass field."""
    sections = {
        section.name: type(getattr(config_class(), section.name)) for section in dataclasses.fields(config_class)
    }
    return {
        f"{name}.{f.name}": (get_type_hints(cls)[f.name], f)
        for name, cls in sections.items()
        for f in dataclasses.fields(cls)
    }


def type_name(typ: type) -> str:
    if typ is StrList:
        return "comma-separated list"
    return "comma-separated numbers" if typ is FloatList else typ.__name__
