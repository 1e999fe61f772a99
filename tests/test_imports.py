"""No import cycle in the package, and no two of its packages importing each other, counting every import: module
level, inside functions, under TYPE_CHECKING.

A cycle hidden in a function-level import still ties two modules into one; the fix is to move what both need to
where it belongs, not to hide the import. Packages are layered (issue 54): config < base modules < components <
rollout / engine / serving / weights / trainer < plan < launch < cli. A module imports only from its layer and those
below (LAYER, with the modules placed apart from their package named in LAYER_EXCEPTIONS), and no two packages import
each other, within a layer too.
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


def top_package(module: str) -> str:
    """asyncrl.trainer.loop -> trainer; a top-level module (asyncrl/launch.py) is a package of its own: launch."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def mutual_imports(graph: dict[str, set[str]]) -> dict[frozenset[str], list[str]]:
    """Each pair of top-level packages that import each other -> the module imports that tie them, both ways."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            pair = top_package(module), top_package(target)
            if pair[0] != pair[1]:
                edges.setdefault(pair, []).append(f"{module} -> {target}")
    return {frozenset(pair): sorted(ties + edges[pair[::-1]]) for pair, ties in edges.items() if pair[::-1] in edges}


LAYERS = ("below config", "config", "base", "components", "processes", "plan", "launch", "cli")
"""Issue 54's order, lowest first: a module imports only from its own layer and those below it."""

LAYER = {
    "asyncrl": "below config",  # the package's __init__: a version string
    "sampling": "below config",  # config/schema.py's sampling keys extend its Decoding
    "assets": "below config",  # config/compose.py finds the shipped model (asset_path)
    "config": "config",
    **dict.fromkeys(("app_thread", "client", "data", "dtypes", "flow", "hub", "interrupts", "logs", "lora"), "base"),
    **dict.fromkeys(("metrics", "model_kind", "parent", "prompts", "recipes", "registry", "safetensors_files"), "base"),
    **dict.fromkeys(("advantages", "components", "environments", "losses", "packing", "rewards"), "components"),
    "footprint": "components",  # sizes the reward models beside the policy, for the trainer and the vLLM command
    "hub_sources": "components",  # lists the reward models' Hub ids
    "run_plan": "components",  # the plan's type names the chosen components; every process reads it
    "plan_file": "components",  # the plan's file, read by the trainer's ranks
    **dict.fromkeys(("engine", "rollout", "server", "serving", "trainer", "weights"), "processes"),
    "control_group": "processes",  # the trainer's group of weight receivers, built on weights/
    "evaluate": "processes",  # the trainer's evaluation pass, through the rollout's scoring
    "trackers": "processes",  # the trainer's experiment trackers, fed the rollout's completions table
    "plan": "plan",
    "export": "plan",  # reads the trainer's checkpoints; launch and cli call it
    "hub_push": "plan",  # the same
    "report": "plan",  # reads the trainer's console and timeline for a run's summary
    "restart": "plan",  # restarts the trainer's and servers' processes; launch calls it
    "launch": "launch",
    "cli": "cli",
    "__main__": "cli",
}
"""Each top-level package or module of asyncrl -> its layer, the reason beside the placements the name does not
give."""

LAYER_EXCEPTIONS = {
    "asyncrl.rollout.types": ("base", "the types that cross processes (STYLE.md: one home, rollout/types.py); packing "
                              "and losses carry its samples"),
    "asyncrl.rollout.trainer_state": ("base", "the state rollout.scoring hands a reward; it reads the config only"),
    "asyncrl.rollout.scoring": ("components", "runs the rewards; components.py and rewards/ name its RewardSource"),
    "asyncrl.assets.counter": ("cli", "a script (python -m) that builds the tiny-counter asset from the counter "
                               "environment and the tool calls it teaches; nothing imports it"),
}  # fmt: skip
"""Modules whose layer is not their package's, each with why; one whose package's layer would do must leave."""


def layer_of(module: str, exceptions: dict[str, tuple[str, str]]) -> int:
    """The module's place in LAYERS: its own, when named in ``exceptions``, else its top-level package's."""
    name = exceptions[module][0] if module in exceptions else LAYER[top_package(module)]
    return LAYERS.index(name)


def imports_upward(graph: dict[str, set[str]], exceptions: dict[str, tuple[str, str]]) -> list[str]:
    """Every import from a module to one of a higher layer."""
    return sorted(
        f"{module} ({LAYERS[layer_of(module, exceptions)]}) -> {target} ({LAYERS[layer_of(target, exceptions)]})"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target, exceptions) > layer_of(module, exceptions)
    )


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


def test_no_two_packages_import_each_other():
    mutual = mutual_imports(import_graph(PACKAGE))
    assert not mutual, {" <-> ".join(sorted(pair)): ties for pair, ties in mutual.items()}


def test_the_layers_import_only_downward():
    graph = import_graph(PACKAGE)
    assert set(LAYER) == {top_package(module) for module in graph}, "place each package or module in LAYER"
    assert set(LAYER.values()) <= set(LAYERS) and set(LAYER_EXCEPTIONS) <= set(graph)
    upward = imports_upward(graph, LAYER_EXCEPTIONS)
    assert not upward, upward
    for module in LAYER_EXCEPTIONS:  # each is needed: without it, an import goes up
        others = {name: placed for name, placed in LAYER_EXCEPTIONS.items() if name != module}
        assert imports_upward(graph, others), f"its package's layer holds {module}: remove it from LAYER_EXCEPTIONS"


def test_two_packages_importing_each_other_are_found_through_any_import(tmp_path):
    package = tmp_path / "pkg"
    for sub in ("a", "b", "c"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a" / "x.py").write_text("def f():\n    from pkg.b import y\n")
    (package / "b" / "y.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import z\n")
    (package / "a" / "z.py").write_text("")
    (package / "c" / "w.py").write_text("from pkg.a import z\nfrom pkg import top\n")  # one-way imports only
    (package / "top.py").write_text("from pkg.a import x\n")
    graph = import_graph(package)
    assert find_cycle(graph) is None  # no module cycle: a.x -> b.y -> a.z
    ties = ["pkg.a.x -> pkg.b", "pkg.a.x -> pkg.b.y", "pkg.b.y -> pkg.a", "pkg.b.y -> pkg.a.z"]  # with __init__s
    assert mutual_imports(graph) == {frozenset({"a", "b"}): ties}


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
