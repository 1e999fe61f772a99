"""No import cycle in the package, counting every import: module level, inside functions, under TYPE_CHECKING.

A cycle hidden in a function-level import still ties two modules into one; the fix is to move what both need to
where it belongs, not to hide the import.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asyncrl"


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` (a package is its ``__init__``)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name ``module`` imports anywhere in its file, relative imports resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            source = ".".join(filter(None, [base, node.module])) if node.level else node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. ``from pkg.mod import name`` counts as importing pkg.mod and the
    packages enclosing it (their ``__init__`` runs first); an import of the module's own enclosing packages does
    not count (Python runs them first whatever the order)."""
    modules = module_files(package)

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    def with_packages(name: str) -> set[str]:
        """``name`` and the packages enclosing it: importing pkg.sub.mod runs pkg/sub/__init__ first."""
        parts = name.split(".")
        return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}

    graph = {}
    for module, path in modules.items():
        targets = {t for name in imported_names(module, path) for t in with_packages(owner(name)) if t in modules}
        graph[module] = {t for t in targets if t != module and not module.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the modules along it (the first repeated at the end), or None."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        return list(reversed(error.args[1]))
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (package / "c.py").write_text("import pkg\nfrom . import a\n")  # the package itself and a one-way import
    cycle = find_cycle(import_graph(package))
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.sub.b"} and cycle[0] == cycle[-1]


def test_config_error_is_imported_from_its_own_module():
    """``ConfigError`` lives in config/errors.py so that any layer can raise it; no module takes it from a
    re-export (the ``asyncrl.config`` package re-exports it for users only)."""
    elsewhere = [
        f"{module}: from {node.module} import ConfigError"
        for module, path in module_files(PACKAGE).items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module != "asyncrl.config.errors"
        and any(alias.name == "ConfigError" for alias in node.names)
    ]  # fmt: skip
    assert not elsewhere, elsewhere


def test_the_config_package_imports_nothing_above_it():
    """config/ is schema and composition: besides itself it imports only modules that import nothing of asyncrl
    (the checks that need the components, the servers or the trainer run in asyncrl/plan/)."""
    graph = import_graph(PACKAGE)
    config = {m for m in graph if m == "asyncrl.config" or m.startswith("asyncrl.config.")}
    above = sorted(f"{m} -> {t}" for m in config for t in graph[m] if t not in config and graph[t])
    assert not above, above
