"""One class name, one concept: a class name is defined once across the project's packages, so
a reader (or a grep) that meets it knows which thing it is. Static scan (ast), nothing imported.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "engine_core", "workers", "launch", "scripts")

# Names still defined twice, each waiting for a rename that touches files under restructuring;
# remove an entry once its rename lands (test_no_stale_duplicates then insists).
KNOWN_DUPLICATES: dict[str, set[str]] = {}


def class_definitions() -> dict[str, set[str]]:
    """Class name -> the files (relative to the root) that define it, at any nesting."""
    found: dict[str, set[str]] = defaultdict(set)
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.ClassDef):
                    found[node.name].add(rel)
    return found


def _duplicates() -> dict[str, set[str]]:
    return {name: files for name, files in class_definitions().items() if len(files) > 1}


def test_the_scan_sees_the_classes() -> None:
    assert "protocol/messages.py" in class_definitions()["SchedulerOutput"]


def test_no_new_duplicate_class_names() -> None:
    new = {name: sorted(files) for name, files in _duplicates().items()
           if KNOWN_DUPLICATES.get(name) != files}
    assert not new, f"class names defined in more than one file (name one concept once): {new}"


def test_no_stale_duplicates() -> None:
    dups = _duplicates()
    stale = sorted(name for name in KNOWN_DUPLICATES if name not in dups)
    assert not stale, f"no longer duplicated; drop them from KNOWN_DUPLICATES: {stale}"
