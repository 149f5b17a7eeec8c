"""No import cycles among the project's modules.

The graph is read from the source (an AST scan, nothing is imported): an edge A -> B for every
`import B`, `from B import x` and `from P import B` (B a module of package P), at any depth in
the file, lazy imports included, since a cycle through a function-level import is still a cycle
in the design; so is one under `if TYPE_CHECKING:` (the two files still cannot be understood
apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "engine_core", "workers", "launch", "scripts")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    # scripts/ puts its own folder on sys.path, so its siblings import by bare name
    local_prefix = "scripts." if name.startswith("scripts.") else ""
    out: set[str] = set()

    def add(target: str) -> None:
        # the module itself, else the closest package that exists
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name if alias.name in modules else local_prefix + alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
                if mod not in modules and local_prefix + mod in modules:
                    mod = local_prefix + mod
            for alias in node.names:
                if f"{mod}.{alias.name}" in modules:
                    add(f"{mod}.{alias.name}")
                else:
                    add(mod)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    result.append(sorted(comp))
    return result


def test_the_scan_sees_the_import_graph() -> None:
    graph = _graph()
    assert "engine_core.sched.scheduler" in graph["engine_core.core"]
    assert "protocol.messages" in graph["engine_core.core"]


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_detector_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _top_level_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_layering() -> None:
    """The scheduler side runs without torch, and the workers meet it only in protocol/."""
    offenders = []
    for name, path in _modules().items():
        top = _top_level_imports(path)
        if name.split(".")[0] in ("engine_core", "protocol") and "torch" in top:
            offenders.append(f"{name} imports torch")
        if name.startswith("workers") and "engine_core" in top:
            offenders.append(f"{name} imports engine_core")
    assert offenders == []
