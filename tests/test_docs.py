"""The README's config table is generated from the schema, and CI runs the README's test command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainer.config import FIELDS

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_config_table_is_generated_from_the_schema():
    script = load_script()
    readme = (ROOT / "README.md").read_text()
    assert script.updated(readme) == readme, "run `python scripts/config_table.py`"
    for key, (_, field) in FIELDS.items():
        assert f"| `{key}` |" in readme and field.metadata["doc"] in readme, key


def test_a_changed_doc_makes_the_readme_stale(monkeypatch: pytest.MonkeyPatch, capsys):
    script = load_script()
    _, field = FIELDS["training.steps"]
    monkeypatch.setattr(field, "metadata", {**field.metadata, "doc": "A different text."})
    assert script.main(["--check"]) == 1
    assert "config_table.py" in capsys.readouterr().err


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest tests" in readme
    assert "python -m pytest tests" in (ROOT / ".ci" / "run").read_text()
