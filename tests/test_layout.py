"""The house's one structural rule: imports run one way, ``trainer`` -> ``parallelisms``.

The parallelisms take plain settings and the model's module names, so they can be read, tested
and reused without the trainer's configuration; a ``trainer`` import there would start the
two-way layering again.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(file: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def test_parallelisms_never_import_trainer():
    files = sorted((ROOT / "parallelisms").glob("*.py"))
    assert files
    offenders = {
        str(file.relative_to(ROOT)): sorted(m for m in imported_modules(file) if m.split(".")[0] == "trainer")
        for file in files
    }
    assert not {file: mods for file, mods in offenders.items() if mods}


def test_imported_modules_sees_every_form(tmp_path: Path):
    """The check above would pass vacuously if the parser missed an import form."""
    sample = tmp_path / "sample.py"
    sample.write_text("import trainer.model\nfrom trainer.config import x\nfrom . import y\n")
    assert imported_modules(sample) == {"trainer.model", "trainer.config"}
