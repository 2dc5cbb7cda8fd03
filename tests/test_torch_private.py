"""Private torch names: reached only through ``parallelisms/torch_private``, listed there, and behind
one version check that matches ``pyproject.toml``'s torch range."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib
import torch
from harness import ROOT

from parallelisms import torch_private
from trainer.config import ConfigError, load_config
from trainer.planning.job_plan import resolve_job

SCANNED = ("trainer", "parallelisms", "scripts", "benchmarks")
PACKAGE = ROOT / "parallelisms" / "torch_private"
STDLIB_PRIVATE = {"_exit"}
"""Underscored names of the standard library that are public by documentation (``os._exit``)."""


def private_torch_names(file: Path, project_names: set[str]) -> set[str]:
    """The private names ``file`` reaches that are not the project's own: underscored attributes,
    ``getattr``-family strings, and underscored modules or names imported from torch."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Attribute):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id in ("self", "cls")):
                found.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    found.add(name.value)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            found.update(node.module.split("."))
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                part for alias in node.names if alias.name.startswith("torch.") for part in alias.name.split(".")
            )
    private = {n for n in found if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))}
    return private - project_names - STDLIB_PRIVATE


def project_names(files: list[Path]) -> set[str]:
    """Every underscored name the project defines: functions, classes, variables, attributes."""
    names: set[str] = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {n for n in names if n.startswith("_")}


def scanned_files() -> list[Path]:
    return sorted(f for folder in SCANNED for f in (ROOT / folder).rglob("*.py"))


def test_no_private_torch_name_outside_the_concern_modules():
    files = scanned_files()
    names = project_names([f for f in files if PACKAGE not in f.parents])
    listed = {n for concern in torch_private.CONCERNS for n in torch_private.concern(concern).NAMES}
    outside = {
        str(f.relative_to(ROOT)): sorted(found - listed)
        for f in files
        if PACKAGE not in f.parents and (found := private_torch_names(f, names))
    }
    assert not {f: n for f, n in outside.items() if n}, "reach these through parallelisms/torch_private"
    overridden = {"_prepare_output_fn"}  # TP styles override it in parallelisms/tensor_parallel.py
    assert overridden <= listed


def test_each_concern_lists_exactly_the_private_names_it_reaches():
    for name in torch_private.CONCERNS:
        module = torch_private.concern(name)
        used = private_torch_names(PACKAGE / f"{name}.py", set())
        assert used == {n for n in module.NAMES if n.startswith("_")}, name
        assert module.FEATURE and module.CHECKED_ON, name


def test_the_scanner_sees_every_form(tmp_path: Path):
    """The inventory test above would pass vacuously if the scanner missed a form of access."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch._dynamo\nfrom torch._x import y\nfrom torch.a import _b\n"
        "torch._c(1)\nobj._d\ngetattr(obj, '_e')\nself._f\nos._exit(0)\n_g = 1\nobj._g\n"
    )
    assert private_torch_names(sample, project_names([sample])) == {"_dynamo", "_x", "_b", "_c", "_d", "_e"}


def test_pyproject_range_is_the_checked_range():
    spec = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("torch")
    )
    low, high = (torch_private.release(v) for v in re.findall(r"[\d.]+", spec))
    for name in torch_private.CONCERNS:
        first, last = torch_private.supported_range(torch_private.concern(name).CHECKED_ON)
        assert (first, (last[0], last[1] + 1)) == (low, high), (name, spec)


def test_this_torch_is_supported():
    assert torch_private.problem() is None, torch.__version__


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0+cu130", "3.0.0"])
def test_an_unchecked_torch_is_one_line_naming_the_feature_and_range(version):
    message = torch_private.problem(version=version)
    assert message is not None and "\n" not in message
    assert version in message and "2.11 to 2.15" in message and "torch>=2.11,<2.16" in message
    assert torch_private.concern("dtensor").FEATURE in message


def test_the_plan_refuses_an_unchecked_torch_naming_the_jobs_feature(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    with pytest.raises(ConfigError, match="pipeline parallelism") as refused:
        resolve_job(
            load_config(["--parallelism.pipeline_parallel_degree", "2", "--training.global_batch_size", "4"]), 2
        )
    assert "\n" not in str(refused.value)
    monkeypatch.setattr(torch, "__version__", "2.10.1")
    with pytest.raises(ConfigError, match="torch 2.10.1"):
        resolve_job(load_config([]), 1)


def test_the_installer_keeps_the_same_range():
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert 'supported=">=2.11,<2.16"' in script and "(2, 11) <= major_minor < (2, 16)" in script
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("torch>=2.11,<2.16") for d in spec)
