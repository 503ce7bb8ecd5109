"""The code's layout holds: imports flow one way and never in a circle.

Walks the AST of every module (function-level imports included), so a new import that crosses a
line docs/development.md's Layout section draws fails here, naming the module and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvbatch", "jobs", "storage", "runner")

# importer prefix -> prefixes it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "jobs": ("storage", "runner", "kvbatch"),
    "storage": ("runner", "kvbatch"),
    "runner": ("kvbatch",),  # kvbatch is the Python API: the top layer, over submit and export
    "kvbatch": ("runner.engine", "runner.observe", "runner.coordinator", "runner.pool", "runner.cli"),
    "runner.engine": ("runner.observe", "runner.coordinator", "runner.submit", "runner.cli", "runner.pool",
                      "runner.recorder", "runner.cluster", "runner.dealer", "runner.scratch_cleanup"),
    "runner.observe": ("runner.engine", "runner.coordinator", "runner.submit", "runner.cli", "runner.pool"),
}
ALLOWED: dict[str, tuple[str, ...]] = {"kvbatch": ("runner.engine.kvcache", "runner.observe.status")}
"""What an importer may import under a prefix FORBIDDEN to it: the Python API's caches (`kvbatch.TieredCache`)
and a job's status (`kvbatch.status`, what `kvbatch status --json` prints)."""
NO_RAY = ("jobs", "storage", "runner.coordinator")
"""What a batch is, where bytes live, and the coordinator's queue and retries: none of them talk to Ray."""
NO_TORCH = ("jobs", "storage")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    return {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Every module this one imports, resolved to the known module it names (a package's `__init__`
    when the name is a package, the module itself for `from package import module`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")[: -node.level] if not path.name == "__init__.py" else module.split(".")
                base = ".".join([*package, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            resolved.add(name)
    return resolved


def _graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    modules = _modules(root, packages)
    return {name: _imports(path, name, set(modules)) for name, path in modules.items()}


def _raw_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


GRAPH = _graph(ROOT, PACKAGES)


def test_the_walk_sees_the_layout() -> None:
    """The checks below are only as good as the graph: it must hold every part and real edges."""
    for module in ("kvbatch", "jobs.config", "storage.checkpoint", "runner.coordinator", "runner.engine.worker",
                   "runner.observe.status", "runner.engine.kvcache.tiered"):
        assert module in GRAPH
    assert "runner.engine.kvcache.tiered" in GRAPH["runner.engine.kvcache"]
    assert "jobs.config" in GRAPH["runner.engine.worker"]
    assert "runner.submit" in GRAPH["kvbatch"]


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_imports_flow_one_way(importer: str) -> None:
    crossings = [f"{module} imports {target}"
                 for module, targets in GRAPH.items() if _under(module, importer)
                 for target in sorted(targets) for banned in FORBIDDEN[importer] if _under(target, banned)
                 and not any(_under(target, allowed) for allowed in ALLOWED.get(importer, ()))]
    assert not crossings, "imports against the layout (see docs/development.md, Layout):\n" + "\n".join(crossings)


@pytest.mark.parametrize(("part", "library"), [*((p, "ray") for p in NO_RAY), *((p, "torch") for p in NO_TORCH)])
def test_parts_that_stay_free_of_ray_and_torch(part: str, library: str) -> None:
    users = [m for m in GRAPH if _under(m, part) and library in _raw_imports(_modules(ROOT, PACKAGES)[m])]
    assert not users, f"{library} imported by {users}"


def test_no_import_circle() -> None:
    cycle = _cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_import_circle_in_the_benchmarks() -> None:
    bench = {p.stem: p for p in (ROOT / "bench").glob("*.py")}
    graph = {name: {dep for dep in _raw_imports(path) if dep in bench and dep != name} for name, path in bench.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import circle in bench/: " + " -> ".join(cycle or [])


def test_the_circle_finder_finds_a_circle(tmp_path: Path) -> None:
    """A check that cannot fail proves nothing: two modules that import each other are caught."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import thing\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n")
    assert _cycle(_graph(tmp_path, ("pkg",))) == ["pkg.a", "pkg.b", "pkg.a"]


CACHE_KINDS = {"Cache", "DynamicCache", "StaticCache", "BudgetedDynamicCache", "PooledCache", "TieredCache",
               "CacheLayerMixin", "DynamicLayer", "DummyLayer", "GrowingLayer", "PooledLayer", "TieredLayer",
               "DiskTier", "HostTier"}
"""The caches, their layers and tiers: what the engine asks by their flags (`takes_chunks`, `pooled`,
`streamed`, `grows`, transformers' `is_compileable`, ...), never by their type (issue 49)."""


def test_the_engine_asks_caches_what_they_can_do_not_what_they_are() -> None:
    branches = []
    for module, path in _modules(ROOT, ("runner",)).items():
        if not _under(module, "runner.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                kinds = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])} & CACHE_KINDS
                if kinds:
                    branches.append(f"{module}:{node.lineno} {sorted(kinds)}")
    assert not branches, "type branches on caches: " + ", ".join(branches)


WORK_ITEMS = {"Planning", "Pass", "DocumentRun", "PassSpec", "LevelPlan"}
"""What the coordinator and the dealer run: a work item runs itself (`item.run(dealer, worker)`), a
document says its stage; neither is told apart by its type (issue 49)."""


def test_the_coordinator_is_small_and_never_branches_on_a_work_items_type() -> None:
    runner = ROOT / "runner"
    assert len(list(runner.glob("*.py"))) <= 12, sorted(p.name for p in runner.glob("*.py"))
    assert len((runner / "coordinator.py").read_text().splitlines()) <= 400
    branches = []
    for name in ("coordinator", "dealer"):
        tree = ast.parse((runner / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                kinds = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])} & WORK_ITEMS
                if kinds:
                    branches.append(f"{name}:{node.lineno} {sorted(kinds)}")
    assert not branches, "type branches on work items: " + ", ".join(branches)
