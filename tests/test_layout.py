"""The house's structure as rules: every file on its floor, imports running one way.

From the top: the roof (``trainer/entry/``: the launcher, ``prepare``, the worker's ``main``,
``--simulate``) may import anything and is imported only by ``scripts/``, ``benchmarks/`` and the
tests; the floors in between (the loop, the builder, the step, planning, data, the model, the
config) import downward only; the ground floor (``trainer/runtime/``) imports nothing of
``trainer`` above it; ``parallelisms`` takes plain settings and the model's module names, never a
``trainer`` import, so it can be read, tested and reused without the trainer's configuration.
No two modules and no two packages import each other. Every import counts, the lazy ones inside
functions and the ``TYPE_CHECKING`` ones too: each still ties the two files together for a reader.
In ``tests/``, no module imports a test module (``test_*``): what tests share lives in
``harness.py``, ``conftest.py`` or a helpers module (``checkpoint_helpers.py``, ...), so a test
module can be read, run and changed on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PACKAGES = ("trainer", "parallelisms")
ROOF = "trainer.entry"
GROUND = "trainer.runtime"
CONFIG = "trainer.config"
BELOW_EVERYTHING = "parallelisms.torch_private"

Graph = dict[str, set[str]]


def imported_modules(file: Path) -> set[str]:
    """The absolute module names ``file`` imports, wherever in it (functions, ``TYPE_CHECKING``)."""
    modules = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def module_name(file: Path, root: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(file: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``file`` (module ``name``) imports: ``from a import b`` counts as
    ``a.b`` where that is a module (else as ``a``), relative imports are resolved, and a name is
    cut back to the nearest module that exists."""
    package = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    modules = set()
    for module in found:
        while module and module not in known:
            module = module.rpartition(".")[0]
        if module and module != name:
            modules.add(module)
    return modules


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> Graph:
    files = {module_name(f, root): f for package in packages for f in sorted((root / package).rglob("*.py"))}
    return {name: project_imports(file, name, set(files)) for name, file in files.items()}


def unit(module: str) -> str:
    """The package a module counts in: ``trainer.config.schema`` -> ``trainer.config``; a
    top-level module (``trainer.step``, ``parallelisms.fsdp``) is a unit of its own."""
    return ".".join(module.split(".")[:2])


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def roof_importers(graph: Graph) -> list[str]:
    """Modules below the roof that import it."""
    return sorted(
        f"{m} -> {i}" for m, imports in graph.items() if not within(m, ROOF) for i in imports if within(i, ROOF)
    )


def ground_floor_upward(graph: Graph) -> list[str]:
    """Imports from the ground floor to anything of the project but itself and the private-torch accessors."""
    return sorted(
        f"{m} -> {i}"
        for m, imports in graph.items()
        if within(m, GROUND)
        for i in imports
        if not (within(i, GROUND) or within(i, BELOW_EVERYTHING))
    )


def config_upward(graph: Graph) -> list[str]:
    """Imports from the config to anything of the project but itself and the ground floor."""
    return sorted(
        f"{m} -> {i}"
        for m, imports in graph.items()
        if within(m, CONFIG)
        for i in imports
        if not (within(i, CONFIG) or within(i, GROUND))
    )


def parallelisms_to_trainer(graph: Graph) -> list[str]:
    return sorted(
        f"{m} -> {i}"
        for m, imports in graph.items()
        if within(m, "parallelisms")
        for i in imports
        if within(i, "trainer")
    )


def cycles(graph: Graph) -> list[list[str]]:
    """Every group of nodes that import each other, directly or round a loop (Tarjan's strongly
    connected components of more than one node)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while (other := stack.pop()) != node:
                group.append(other)
            if group:
                groups.append(sorted([node, *group]))

    for node in list(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def package_graph(graph: Graph) -> Graph:
    units: Graph = {}
    for module, imports in graph.items():
        units.setdefault(unit(module), set()).update(unit(i) for i in imports if unit(i) != unit(module))
    return units


def imports_of_test_modules(folder: Path = TESTS) -> list[str]:
    """Every import of a test module (a module named ``test_*``) by a file under ``folder``."""
    return sorted(
        f"{file.relative_to(folder)} -> {module}"
        for file in sorted(folder.rglob("*.py"))
        for module in imported_modules(file)
        if module.split(".")[0].startswith("test_")
    )


GRAPH = import_graph()


def test_the_roof_is_imported_only_from_scripts_benchmarks_and_tests():
    assert ROOF in GRAPH
    assert not roof_importers(GRAPH)


def test_the_ground_floor_imports_nothing_above_it():
    assert GROUND + ".errors" in GRAPH
    assert not ground_floor_upward(GRAPH)


def test_the_config_imports_only_the_ground_floor_and_no_torch():
    assert not config_upward(GRAPH)
    torch_users = sorted(
        module
        for module, file in ((m, ROOT / (m.replace(".", "/") + ".py")) for m in GRAPH if within(m, CONFIG))
        if file.exists() and any(within(i, "torch") for i in imported_modules(file))
    )
    assert not torch_users


def test_no_two_modules_or_packages_import_each_other():
    assert not cycles(GRAPH)
    assert not cycles(package_graph(GRAPH))


def test_parallelisms_never_import_trainer():
    files = sorted((ROOT / "parallelisms").rglob("*.py"))
    assert files
    offenders = {
        str(file.relative_to(ROOT)): sorted(m for m in imported_modules(file) if m.split(".")[0] == "trainer")
        for file in files
    }
    assert not {file: mods for file, mods in offenders.items() if mods}
    assert not parallelisms_to_trainer(GRAPH)


def test_no_module_of_the_tests_imports_a_test_module():
    assert (TESTS / "harness.py").exists()
    assert not imports_of_test_modules()


def test_imported_modules_sees_every_form(tmp_path: Path):
    """The checks above would pass vacuously if the parser missed an import form."""
    sample = tmp_path / "sample.py"
    sample.write_text("import trainer.model\nfrom trainer.config import x\nfrom . import y\n")
    assert imported_modules(sample) == {"trainer.model", "trainer.config"}


def test_the_graph_counts_lazy_type_checking_and_relative_imports(tmp_path: Path):
    package = tmp_path / "trainer"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py", "sub/leaf.py", "other.py"):
        (package / name).write_text("")
    (package / "top.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from trainer.other import Thing\n"
        "def later():\n    from .sub import leaf\n"
    )
    graph = import_graph(tmp_path, ("trainer",))
    assert graph["trainer.top"] == {"trainer.other", "trainer.sub.leaf"}


def test_each_rule_fails_on_a_violation():
    """A rule that cannot fail checks nothing: each one on a graph with one violation of it."""
    assert roof_importers({"trainer.build": {"trainer.entry.job"}, "trainer.entry.job": set()})
    assert not roof_importers({"trainer.entry.worker": {"trainer.entry.job"}})
    assert ground_floor_upward({"trainer.runtime.errors": {"trainer.config"}})
    assert not ground_floor_upward({"trainer.runtime.distributed": {"trainer.runtime.errors", BELOW_EVERYTHING}})
    assert config_upward({"trainer.config.schema": {"trainer.data.samples"}})
    assert config_upward({"trainer.config.schema": {"parallelisms.pipeline_parallel"}})
    assert not config_upward({"trainer.config.parser": {"trainer.runtime.errors", "trainer.config.schema"}})
    assert parallelisms_to_trainer({"parallelisms.fsdp": {"trainer.loss"}})
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert not cycles({"a": {"b"}, "b": {"c"}, "c": set()})
    two_packages = {"trainer.build": {"trainer.metrics.logger"}, "trainer.metrics.logger": {"trainer.validation"}}
    two_packages["trainer.validation"] = {"trainer.build"}
    assert not cycles({"trainer.metrics.logger": {"trainer.metrics.accounting"}, "trainer.metrics.accounting": set()})
    assert cycles(package_graph(two_packages)) == [["trainer.build", "trainer.metrics", "trainer.validation"]]
    assert cycles(package_graph({"trainer.a.x": {"trainer.b.y"}, "trainer.b.z": {"trainer.a.w"}}))


def test_the_test_module_rule_fails_on_a_violation(tmp_path: Path):
    """Test modules imported at the top, lazily, or as a package's module are each found; helpers are not."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "test_a.py").write_text("from test_b import helper\nfrom checkpoint_helpers import TINY\n")
    (tmp_path / "sub" / "b_helpers.py").write_text("import harness\ndef later():\n    import test_c.inner\n")
    (tmp_path / "test_ok.py").write_text("from harness import ROOT\nimport contest_results\n")
    assert imports_of_test_modules(tmp_path) == ["sub/b_helpers.py -> test_c.inner", "test_a.py -> test_b"]


def test_every_file_stays_under_450_lines():
    """A file past 450 lines holds more than one concept: split it by concept."""
    files = [
        f
        for folder in ("trainer", "parallelisms", "scripts", "benchmarks", "tests")
        for f in (ROOT / folder).rglob("*.py")
    ]
    long = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > 450}
    assert files and not long
