"""The import graph between the project's packages: no cycles, Megatron stays inside `megatron/`, and RL and SFT
stand on `actors/` (SFT never imports the RL trainer).

A package here is a subpackage of `userrl_megatron` (`userrl_megatron.trainer`, ...), a top-level module of it
(`userrl_megatron.types`), or `gyms`. Every import counts, also those inside functions: a deferred import is
still a dependency, only a later one.
"""

import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("userrl_megatron", "gyms")
MEGATRON_ONLY = ("megatron.core", "megatron.training", "transformer_engine")


def _package(module: str) -> str | None:
    """The package `module` belongs to (None: not the project's)."""
    parts = module.split(".")
    if parts[0] == "gyms":
        return "gyms"
    if parts[0] == "userrl_megatron":
        return ".".join(parts[:2])  # the package's own __init__ and __main__ count as `userrl_megatron`
    return None


def _source_files() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py"))


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every absolute module `path` imports (for `from X import y`: X and X.y, as y may be a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def package_graph() -> dict[str, dict[str, list[str]]]:
    """{package: {package it imports: ["file:line", ...]}}."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in _source_files():
        source = _package(_module_of(path))
        assert source is not None
        for module, line in _imports(path):
            target = _package(module)
            if target and target != source:
                where = f"{path.relative_to(REPO)}:{line}"
                if where not in graph[source][target]:
                    graph[source][target].append(where)
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(graph) | {t for targets in graph.values() for t in targets}):
        if node not in index:
            visit(node)
    return found


def test_no_cycle_between_packages() -> None:
    graph = package_graph()
    report = []
    for component in cycles(graph):
        edges = [
            f"  {a} -> {b}: {', '.join(graph[a][b][:3])}" for a in component for b in component if b in graph.get(a, {})
        ]
        report.append(" <-> ".join(component) + "\n" + "\n".join(edges))
    assert not report, "import cycles between packages:\n" + "\n".join(report)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b": ["x:1"]}, "b": {"c": ["y:2"]}, "c": {"a": ["z:3"]}, "d": {"a": ["w:4"]}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b": ["x:1"]}, "b": {}}) == []


def test_only_the_megatron_package_imports_megatron_core_or_transformer_engine() -> None:
    outside = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in _source_files()
        if not path.is_relative_to(REPO / "userrl_megatron" / "megatron")
        for module, line in _imports(path)
        if module.startswith(MEGATRON_ONLY)
    ]
    assert outside == []


def test_the_config_imports_no_gym() -> None:
    # Gyms are plug-ins: they read their settings' types from config/, never the other way round.
    assert "gyms" not in package_graph().get("userrl_megatron.config", {})


# `actors/` (the Megatron ranks as Ray actors, their protocol, the run lock) is what RL and SFT both stand on: it
# imports neither them nor what drives them, and SFT reaches the actor group without the RL trainer.
ABOVE_ACTORS = ("trainer", "sft", "commands", "plan", "eval", "rollout", "fleet", "server")


def test_rl_and_sft_stand_on_the_actors_package() -> None:
    graph = package_graph()
    above = {f"userrl_megatron.{name}" for name in ABOVE_ACTORS}
    assert sorted(above & set(graph.get("userrl_megatron.actors", {}))) == []
    assert "userrl_megatron.actors" in graph["userrl_megatron.trainer"]
    assert "userrl_megatron.actors" in graph["userrl_megatron.sft"]
    assert graph.get("userrl_megatron.sft", {}).get("userrl_megatron.trainer", []) == []


# Ray's start and teardown and the placement group's reservation and removal: one place (`fleet/placement.py`:
# `start_ray`, `ray_session`, `create_placement`, `reserve_placement`), whatever command brings processes up.
BRING_UP_CALLS = {"init", "shutdown", "placement_group", "remove_placement_group"}


def test_ray_and_the_placement_group_are_brought_up_in_one_place() -> None:
    placement = REPO / "userrl_megatron" / "fleet" / "placement.py"
    elsewhere = []
    for path in _source_files():
        if path == placement:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "ray":
                name = func.attr if func.attr in ("init", "shutdown") else ""
            elif isinstance(func, ast.Name | ast.Attribute):
                name = func.id if isinstance(func, ast.Name) else func.attr
                name = name if name in ("placement_group", "remove_placement_group") else ""
            else:
                name = ""
            if name in BRING_UP_CALLS:
                elsewhere.append(f"{path.relative_to(REPO)}:{node.lineno} calls {name}")
    assert elsewhere == []


# `wire/` holds what both sides of an engine call read: the bucket layout, the tensor-handle codec and payload formats,
# the process-group helpers, the bearer-token check, `Generation`. It is low: the standard library, torch, numpy and
# other low packages only. `server/` (the embedded engine), `sync/` (the trainer's sender) and `fleet/` (the engines'
# client and launch) stand beside each other on it: the embedded server imports neither `sync/` nor `fleet/`.
WIRE = "userrl_megatron.wire"
WIRE_MAY_IMPORT = {"userrl_megatron.types", "userrl_megatron.errors"}


def test_the_wire_package_stands_below_server_sync_and_fleet() -> None:
    graph = package_graph()
    assert sorted(set(graph.get(WIRE, {})) - WIRE_MAY_IMPORT) == []
    wire_files = sorted((REPO / "userrl_megatron" / "wire").rglob("*.py"))
    assert wire_files
    outside = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in wire_files
        for module, line in _imports(path)
        if module.split(".")[0] not in sys.stdlib_module_names | {"torch", "numpy", "userrl_megatron"}
    ]
    assert outside == []
    for side in ("server", "sync", "fleet"):
        assert WIRE in graph[f"userrl_megatron.{side}"], side


def test_the_embedded_server_imports_neither_fleet_nor_sync() -> None:
    server = package_graph()["userrl_megatron.server"]
    assert {t: server[t] for t in ("userrl_megatron.fleet", "userrl_megatron.sync") if t in server} == {}
