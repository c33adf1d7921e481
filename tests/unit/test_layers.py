"""The package's layers (docs/architecture.md, "Layout"): every import of ours points down the documented list, the
module graph has no cycle, and the longest import chain stays within the house's measure (at most 9 modules)."""

from __future__ import annotations

import ast
import re
from functools import lru_cache

from conftest import ROOT

PACKAGE = ROOT / "torchtitan_flux"


def _layers() -> list[list[str]]:
    """The Layout block's entries from the top: one list per line (the root leaves share a line: one layer)."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    layers = []
    for line in text.splitlines():
        names = re.findall(r"^\s{2}((?:[a-z_]+(?:/|\.py)\s+)+)", line + " ")
        if names:
            layers.append([n.removesuffix("/").removesuffix(".py") for n in names[0].split()])
    return layers


def _modules() -> dict[str, set[str]]:
    """Every module of the package -> the modules of ours it imports (any import statement, functions included)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    graph = {}
    for mod, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            found |= {n for n in names if n in paths and n != mod}
        graph[mod] = found
    return graph


def _unit(mod: str) -> str:
    """A module's layer unit: its folder under the package, or the root module's own name."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "torchtitan_flux"


def test_imports_point_down_the_documented_layers():
    layers = _layers()
    rank = {name: i for i, line in enumerate(layers) for name in line}
    graph = {m: deps - {"torchtitan_flux"} for m, deps in _modules().items() if m != "torchtitan_flux"}  # the face
    units = {_unit(m) for m in graph}
    assert units <= set(rank), f"folders or root modules missing from docs/architecture.md's Layout: {units - set(rank)}"
    up = [(m, n) for m, deps in graph.items() for n in deps
          if _unit(m) != _unit(n) and rank[_unit(n)] < rank[_unit(m)]]
    assert up == [], f"imports that go up a layer: {up}"


def test_no_import_cycle_and_the_chain_stays_short():
    graph = _modules()

    @lru_cache(None)
    def chain(m: str, seen: frozenset = frozenset()) -> int:
        assert m not in seen, f"an import cycle through {m}: {sorted(seen)}"
        return 1 + max((chain(n, seen | {m}) for n in graph[m]), default=0)

    longest = max(chain(m) for m in graph)
    assert longest <= 9, longest
    assert len([p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]) <= 10


def test_no_rollout_module_or_class_over_300_lines():
    """The rollout wing stays readable in pieces (it grew back into a 682-line module with a 535-line class once):
    no module of ``rollout/`` and no class in one over 300 lines."""
    big = []
    for path in sorted((PACKAGE / "rollout").glob("*.py")):
        lines = path.read_text().count("\n")
        if lines > 300:
            big.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                big.append(f"{path.name}:{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big
