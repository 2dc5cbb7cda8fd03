"""The README documents every config field and runs the same test command as CI."""

from pathlib import Path

from trainer.config import FIELDS

ROOT = Path(__file__).resolve().parent.parent


def test_readme_lists_every_config_field():
    readme = (ROOT / "README.md").read_text()
    missing = [key for key in FIELDS if f"`{key}`" not in readme]
    assert not missing, f"README.md does not document {missing}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest tests" in readme
    assert "python -m pytest tests" in (ROOT / ".ci" / "run").read_text()
