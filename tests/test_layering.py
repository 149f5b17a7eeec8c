"""Which top-level package may import which.

protocol/ is the bottom: the messages and config every process shares, importing nothing of the
project. The engine core and the workers meet only there, so each imports protocol/ alone; the
launcher (launch/) sits on top and may import anything, as may scripts/ and tests/.

The scan is static (ast, nothing is imported) and sees every import in a file: module level,
inside functions, and under `if TYPE_CHECKING:`, since a lazy or type-only import still ties
the two packages together in the design. test_import_cycles.py checks module cycles; this checks
the direction between packages.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it may import (None: any)
ALLOWED: dict[str, frozenset[str] | None] = {
    "protocol": frozenset(),
    "engine_core": frozenset({"protocol"}),
    "workers": frozenset({"protocol"}),
    "launch": None,
}
PROJECT = frozenset(ALLOWED)

# Known module -> module edges that break the rule and are being moved. Each entry is a debt:
# remove it when the move lands (test_no_stale_exceptions fails once the edge is gone).
# edges allowed against the rule while a move is under way (none today)
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(module: str, path: Path) -> set[str]:
    """Absolute dotted names this file imports (relative imports resolved), at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            # `from pkg import mod` imports pkg.mod; naming the submodule where it is one
            # keeps the reported edge precise (pkg itself is imported either way)
            out.add(target)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file():
                    out.add(sub)
    return out


def module_edges() -> set[tuple[str, str]]:
    """(importer, imported) for every import from one project package into another."""
    edges: set[tuple[str, str]] = set()
    for pkg in PROJECT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = _module_name(path)
            for target in _imported(name, path):
                top = target.split(".")[0]
                if top in PROJECT and top != pkg:
                    edges.add((name, target))
    return edges


def _package_graph(edges: set[tuple[str, str]]) -> str:
    graph: dict[tuple[str, str], list[str]] = defaultdict(list)
    for src, dst in sorted(edges):
        graph[(src.split(".")[0], dst.split(".")[0])].append(f"{src} -> {dst}")
    lines = []
    for (a, b), via in sorted(graph.items()):
        lines.append(f"  {a} -> {b} ({len(via)} imports)")
        lines.extend(f"      {v}" for v in via[:5])
        if len(via) > 5:
            lines.append(f"      ... {len(via) - 5} more")
    return "\n".join(lines)


def _violations(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    bad = []
    for src, dst in sorted(edges):
        allowed = ALLOWED[src.split(".")[0]]
        if allowed is not None and dst.split(".")[0] not in allowed:
            bad.append((src, dst))
    return bad


def test_the_scan_sees_the_layers() -> None:
    edges = module_edges()
    assert ("engine_core.core", "protocol.messages") in edges
    # function-level imports count: a lazy import is still a dependency
    assert any(src.startswith("launch.") and dst.startswith("engine_core") for src, dst in edges)


def test_packages_import_only_the_layers_below() -> None:
    edges = module_edges()
    new = [e for e in _violations(edges) if e not in KNOWN_EXCEPTIONS]
    assert not new, (
        "imports against the layering (protocol imports nothing of the project; engine_core and "
        "workers import only protocol):\n"
        + "\n".join(f"  {src} -> {dst}" for src, dst in new)
        + "\npackage graph:\n" + _package_graph(edges))


def test_no_stale_exceptions() -> None:
    edges = module_edges()
    stale = sorted(KNOWN_EXCEPTIONS - set(_violations(edges)))
    assert not stale, f"edges gone from the tree; drop them from KNOWN_EXCEPTIONS: {stale}"


def test_the_rule_catches_a_violation() -> None:
    assert _violations({("workers.x", "engine_core.y"), ("protocol.a", "workers.b"),
                        ("engine_core.c", "protocol.d"), ("launch.e", "workers.f")}) == [
        ("protocol.a", "workers.b"), ("workers.x", "engine_core.y")]
