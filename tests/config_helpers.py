"""What the config tests share (``test_config.py``, ``test_config_values.py``): a job's TOML
written where ``--config`` can read it."""

from __future__ import annotations

from pathlib import Path


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)
