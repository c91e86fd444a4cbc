"""Every import points down: the layers are written once, in docs/design.md ("Layers"), and
this test holds ncclpy/ and bench/ to them.

A module's layer is the row of its longest listed prefix; it may import (at module level or
inside a function, as a reader sees it) only from its own layer or a lower one, and no module
may join an import cycle.  A module in no row, or a row naming no module, fails too, so the
table and the tree cannot drift apart.  The checks are plain functions of (sources, table), so
planted imports prove they catch what they are for.
"""
from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, FrozenSet, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("ncclpy", "bench")

Edges = Dict[str, Dict[str, int]]      # module -> {imported module: first line}


def layer_table(text: str) -> List[Tuple[str, List[str]]]:
    """(layer name, prefixes) bottom first, from the table between the layers markers."""
    body = text.split("<!-- layers:begin -->", 1)[1].split("<!-- layers:end -->", 1)[0]
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        rows.append((cells[0], re.findall(r"`([\w.]+)`", cells[1])))
    return rows


def sources(root: Path = ROOT) -> Dict[str, Tuple[str, str]]:
    """module name -> (path from the root, source) for every .py of the packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = (str(rel), path.read_text())
    return out


def edges(src: Dict[str, Tuple[str, str]]) -> Edges:
    """Each module's imports of the others (the deepest module a name refers to)."""
    names = frozenset(src)
    return {m: dict(_imports(m, path, text, names)) for m, (path, text) in src.items()}


@functools.lru_cache(maxsize=None)
def _imports(m: str, path: str, text: str, known: FrozenSet[str]) -> Tuple[Tuple[str, int], ...]:
    """``m``'s imports of the ``known`` modules, each with its first line (cached: the planted
    trees below reparse only the planted module)."""
    out: Dict[str, int] = {}
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = m.split(".") if is_pkg else m.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != m:
                out.setdefault(n, node.lineno)
    return tuple(out.items())


def layer_of(module: str, table: List[Tuple[str, List[str]]]) -> int:
    """Index of the row of ``module``'s longest listed prefix; -1 if none."""
    best, at = -1, -1
    for i, (_, prefixes) in enumerate(table):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, at = len(p), i
    return at


def upward(src: Dict[str, Tuple[str, str]], g: Edges,
           table: List[Tuple[str, List[str]]]) -> List[str]:
    """One line per import from a higher layer."""
    out = []
    for m, deps in sorted(g.items()):
        a = layer_of(m, table)
        for d, line in sorted(deps.items()):
            b = layer_of(d, table)
            if a >= 0 and b > a:
                out.append(f"{src[m][0]}:{line}: {m} (layer {table[a][0]}) imports {d} "
                           f"(layer {table[b][0]}, higher)")
    return out


def cycles(g: Edges) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []
    for start in g:
        if start in index:
            continue
        work = [(start, iter(g[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(g[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


TABLE = layer_table(DESIGN.read_text())
SRC = sources()


def test_the_table_and_the_tree_agree():
    assert len(TABLE) >= 10, TABLE
    unplaced = [m for m in SRC if layer_of(m, TABLE) < 0]
    assert not unplaced, f"modules in no row of docs/design.md's layers: {unplaced}"
    empty = [p for _, ps in TABLE for p in ps
             if not any(m == p or m.startswith(p + ".") for m in SRC)]
    assert not empty, f"rows of docs/design.md's layers naming no module: {empty}"


def test_every_import_points_down():
    bad = upward(SRC, edges(SRC), TABLE)
    assert not bad, "imports from a higher layer (docs/design.md, Layers):\n" + "\n".join(bad)


def test_no_module_joins_an_import_cycle():
    assert cycles(edges(SRC)) == []


def _planted(module: str, code: str) -> Dict[str, Tuple[str, str]]:
    src = dict(SRC)
    path, text = src[module]
    src[module] = (path, text + "\n\ndef _planted():\n    " + code + "\n")
    return src


def test_a_planted_upward_import_is_caught():
    """A function-level import of the communicator from the dtype tables: one line naming the
    file, the line and both layers."""
    src = _planted("ncclpy.semantics.dtypes", "from ..comm import communicator")
    bad = upward(src, edges(src), TABLE)
    line = len(src["ncclpy.semantics.dtypes"][1].splitlines())
    assert bad == [f"ncclpy/semantics/dtypes.py:{line}: ncclpy.semantics.dtypes (layer "
                   f"foundations) imports ncclpy.comm.communicator (layer comm, higher)"]
    # and the face of a package counts as the package's layer: ``from ncclpy import X``
    # in a low module reaches the top
    src = _planted("ncclpy.errors", "from ncclpy import Buffer")
    assert [b.split(": ", 1)[1] for b in upward(src, edges(src), TABLE)] == [
        "ncclpy.errors (layer base) imports ncclpy (layer face, higher)"]


def test_a_planted_cycle_is_caught_within_a_layer():
    """Two modules of one room importing each other point down in the table's sense; the cycle
    check still catches them."""
    a, b = "ncclpy.buffers.spec", "ncclpy.buffers.host"
    assert a in edges(SRC)[b]            # host imports spec today
    src = _planted(a, "from . import host")
    assert upward(src, edges(src), TABLE) == []
    assert cycles(edges(src)) == [sorted([a, b])]


def test_the_table_is_read_as_written():
    rows = layer_table("x\n<!-- layers:begin -->\n| layer | rooms | what |\n|---|---|---|\n"
                       "| low | `a.b`, `c` | x |\n| high | `a` | y |\n<!-- layers:end -->\n")
    assert rows == [("low", ["a.b", "c"]), ("high", ["a"])]
    assert [layer_of(m, rows) for m in ("a.b.c", "a.bc", "a", "c.d", "d")] == [0, 1, 1, 0, -1]


def test_public_module_names_stay_where_users_import_them():
    """The moved public modules are one module under two names, in a fresh interpreter (the
    import hook is installed by ``import ncclpy`` itself); internal old names are gone."""
    code = """if True:
        import sys, ncclpy
        assert callable(ncclpy.bootstrap) and ncclpy.bootstrap.bootstrap
        import ncclpy.bootstrap, ncclpy.ops, ncclpy.reference, ncclpy.watchdog, ncclpy.checked
        from ncclpy import dtypes, registry
        from ncclpy.watchdog import default_timeout
        from ncclpy.checked import fingerprint
        from ncclpy.ops import parse_op
        from ncclpy.buffers import Buffer, as_buffer
        real = {"bootstrap": "ncclpy.rendezvous.bootstrap", "ops": "ncclpy.semantics.ops",
                "reference": "ncclpy.semantics.reference", "watchdog": "ncclpy.debug.watchdog",
                "checked": "ncclpy.debug.checked", "dtypes": "ncclpy.semantics.dtypes",
                "registry": "ncclpy.semantics.registry"}
        for name, mod in real.items():
            m = sys.modules["ncclpy." + name]
            assert m is sys.modules[mod] is getattr(ncclpy, name), name
            assert m.__name__ == mod and m.__spec__.name == mod, (name, m.__spec__)
        assert Buffer is ncclpy.Buffer and parse_op("sum").name == "sum"
        for name in ncclpy.__all__:
            getattr(ncclpy, name)
        for old in ("hostbuf", "bufkey", "dlpack", "bufspec", "numerics", "torch_store"):
            try:
                __import__("ncclpy." + old)
            except ModuleNotFoundError:
                continue
            raise AssertionError("ncclpy." + old + " still imports")
        print("ok")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=str(ROOT))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    for shim in ("checked.py", "watchdog.py", "bootstrap.py", "buffers.py"):
        assert not os.path.exists(ROOT / "ncclpy" / shim), shim
