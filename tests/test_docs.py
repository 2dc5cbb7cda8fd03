"""The docs stay true to the tree: the config reference (docs/config.md) is generated from the
schema, every relative link in the README and docs/ reaches an existing file (and heading), and CI
runs the README's test command; every install hint names an extra of this checkout."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from trainer.config import FIELDS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives ``page``: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#{1,6} +(.+?) *#* *$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").lower()).replace(" ", "-") for h in headings}


def relative_links(page: Path) -> list[str]:
    """Every Markdown link and image target in ``page`` outside code blocks that is not a URL."""
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_config_reference_is_generated_from_the_schema() -> None:
    script = load_script()
    page = (ROOT / "docs" / "config.md").read_text()
    assert script.updated(page) == page, "run `python scripts/config_table.py`"
    for key, (_, field) in FIELDS.items():
        assert f"| `{key}` |" in page and field.metadata["doc"] in page, key


def test_a_changed_doc_makes_the_config_reference_stale(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = load_script()
    _, field = FIELDS["training.steps"]
    monkeypatch.setattr(field, "metadata", {**field.metadata, "doc": "A different text."})
    assert script.main(["--check"]) == 1
    assert "config_table.py" in capsys.readouterr().err


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest tests" in readme
    assert "python -m pytest -m fast" in readme
    assert "python -m pytest tests" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {', '.join(broken)}"


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## Prepared data: tokenize once, memory-map\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#prepared-data-tokenize-once-memory-map) [gone](c.md) [bad](b.md#nowhere)\n"
        "[web](https://example.org/x.md) ![img](missing.png)\n```\n[in code](nothing.md)\n```\n"
    )
    links = relative_links(page)
    assert links == ["b.md#prepared-data-tokenize-once-memory-map", "c.md", "b.md#nowhere", "missing.png"]
    assert "prepared-data-tokenize-once-memory-map" in anchors(tmp_path / "b.md")
    assert "nowhere" not in anchors(tmp_path / "b.md")


def test_every_install_hint_names_an_extra_of_this_checkout():
    """meshtrain is installed from its checkout: a hint is `pip install -e ".[extra]"` with an
    extra pyproject.toml declares, in the docs and in every message the code prints."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    sources = [*PAGES, *sorted((ROOT / "trainer").rglob("*.py")), *sorted((ROOT / "parallelisms").rglob("*.py"))]
    named: set[str] = set()
    for source in sources:
        text = source.read_text()
        assert "pip install meshtrain" not in text, f"{source}: meshtrain is not on PyPI; use pip install -e"
        for group in re.findall(r'pip install -e \\?"\.\[([^\]]+)\]\\?"', text):
            named.update(group.split(","))
    assert named and named <= extras, named - extras
    assert {"float8", "wandb", "ft", "hf", "parquet"} <= named
