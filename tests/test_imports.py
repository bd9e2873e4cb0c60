"""No import circles among the package's own modules (eagle3_ops/** and triton_kernels/**, which installs as
eagle3_ops.triton_kernels), found statically from the source with ast: every import statement counts,
module-level or inside a function, since a function-level import only hides a circle until the function runs.

An edge A -> B is "A's source imports B": `import a.b`, `from a import b` (b a module: to it, else to the
package a) and `from .b import x` alike, plus the packages whose __init__ such an import runs on the way
(those above B that A does not already sit in: a package's own submodules import it freely)."""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# source folder -> the package it installs as (setup.py's package_dir)
PACKAGES = {"eagle3_ops": "eagle3_ops", "triton_kernels": "eagle3_ops.triton_kernels"}


def package_modules() -> dict[str, str]:
    """Module name -> source file (repository-relative) for every .py file of the package."""
    mods = {}
    for folder, package in PACKAGES.items():
        top = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(top):
            # eagle3_ops/triton_kernels is the in-place build's link to triton_kernels/: read that once, as itself
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__"
                                 and not os.path.islink(os.path.join(dirpath, d)))
            rel = os.path.relpath(dirpath, top)
            parts = [package] + ([] if rel == "." else rel.split(os.sep))
            for f in sorted(filenames):
                if f.endswith(".py"):
                    name = ".".join(parts if f == "__init__.py" else parts + [f[:-3]])
                    mods[name] = os.path.relpath(os.path.join(dirpath, f), ROOT)
    return mods


def _is_package(path: str) -> bool:
    return path.endswith("__init__.py")


def import_edges(mods: dict[str, str]) -> dict[str, dict[str, int]]:
    """Module -> {imported package module: line of the first import statement that imports it}."""
    edges: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        package = name if _is_package(path) else name.rpartition(".")[0]
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read(), path)
        out: dict[str, int] = {}

        def add(target: str, line: int) -> None:
            # the target, or its nearest enclosing module of ours (import a.b.c of an attribute c),
            # plus every package __init__ on the way down that is not one of the importer's own packages
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if not target:
                return
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                hop = ".".join(parts[:i])
                own = name == hop or name.startswith(hop + ".")
                if hop in mods and hop != name and not (own and _is_package(mods[hop])):
                    out.setdefault(hop, line)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    add(sub if sub in mods else module, node.lineno)
        edges[name] = out
    return edges


def import_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle [m0, m1, ..., m0] through each strongly connected component of more than one module
    (Tarjan's algorithm, then a shortest path back to the component's first module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)

    return [_cycle_through(comp[0], set(comp), edges) for comp in components]


def _cycle_through(start: str, inside: set[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """The shortest cycle from start back to it through the modules `inside` (breadth first)."""
    came_from: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            if start in edges[v]:
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            for w in sorted(edges[v]):
                if w in inside and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle inside {sorted(inside)}")


def describe(cycle: list[str], edges: dict[str, dict[str, int]], mods: dict[str, str]) -> str:
    hops = ", ".join(f"{mods[a]}:{edges[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:]))
    return f"{' -> '.join(cycle)} ({hops})"


def test_no_import_cycles():
    mods = package_modules()
    assert "eagle3_ops.triton_kernels.tree_attention" in mods and "eagle3_ops.cli" in mods
    edges = import_edges(mods)
    cycles = [describe(c, edges, mods) for c in import_cycles(edges)]
    assert not cycles, "import cycles among the package's modules:\n" + "\n".join(cycles)


def test_finds_function_level_and_relative_cycles(tmp_path, monkeypatch):
    """The scanner on a made-up package: a function-level relative import closing a circle is found and named;
    a submodule importing its own package's __init__ is not a circle; an attribute import from a package
    points at the package."""
    pkg = tmp_path / "eagle3_ops"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "triton_kernels").mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import thing\nimport eagle3_ops\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import thing\n")
    (pkg / "sub" / "b.py").write_text("thing = 1\n\ndef f():\n    from .. import a\n    return a\n")
    (tmp_path / "triton_kernels" / "k.py").write_text("from .. import errors\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    mods = package_modules()
    assert set(mods) == {"eagle3_ops", "eagle3_ops.a", "eagle3_ops.sub", "eagle3_ops.sub.b",
                         "eagle3_ops.triton_kernels.k"}
    edges = import_edges(mods)
    assert edges["eagle3_ops.a"] == {"eagle3_ops.sub": 1}  # not eagle3_ops: a is its submodule
    assert edges["eagle3_ops.sub.b"] == {"eagle3_ops.a": 4}
    assert edges["eagle3_ops.triton_kernels.k"] == {}  # no errors module here: `from ..` is its own package
    cycles = import_cycles(edges)
    assert cycles == [["eagle3_ops.a", "eagle3_ops.sub", "eagle3_ops.sub.b", "eagle3_ops.a"]]
    text = describe(cycles[0], edges, mods)
    assert "/sub/b.py:4 imports eagle3_ops.a" in text, text  # file:line of each hop
