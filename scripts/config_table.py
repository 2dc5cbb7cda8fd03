"""Write the config reference (docs/config.md) from the schema, so the two cannot drift.

Usage: ``python scripts/config_table.py`` rewrites the part of docs/config.md between the
``config-table`` markers; ``--check`` only compares and exits 1 when the page is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from anywhere

from trainer.config import FIELDS, StrList, type_name  # noqa: E402

PAGE = REPO_ROOT / "docs" / "config.md"
BEGIN, END = "<!-- config-table:begin -->", "<!-- config-table:end -->"


def render() -> str:
    """One Markdown table per config section: key, type (with choices), default, meaning."""
    lines: list[str] = []
    section = None
    for key, (typ, field) in FIELDS.items():
        name = key.split(".")[0]
        if name != section:
            section = name
            lines += ["", f"**[{name}]**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        choices = field.metadata["choices"]
        kind = type_name(typ) + (" (" + r" \| ".join(choices) + ")" if choices else "")
        default = ",".join(field.default) if isinstance(field.default, StrList) else repr(field.default)
        lines.append(f"| `{key}` | {kind} | `{default}` | {field.metadata['doc']} |")
    return "\n".join(lines[1:])


def updated(page: str) -> str:
    """``page`` with the generated tables between the markers."""
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{PAGE}: the markers {BEGIN} and {END} are missing.")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is stale, change nothing")
    args = parser.parse_args(argv)
    current = PAGE.read_text()
    wanted = updated(current)
    if args.check:
        if wanted != current:
            print("docs/config.md is stale: run `python scripts/config_table.py`.", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
