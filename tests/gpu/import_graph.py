"""The import graph of gpu/, read from the source with `ast` (nothing is imported).

Owns one fact: which file of gpu/ imports which. `tests/gpu/test_import_graph.py` asserts on it;
`python -m tests.gpu.import_graph` prints its cycles and the backend -> model imports.

Invariants of the reading:
- A node is a file, `gpu/a/b.py` or `gpu/a/__init__.py`; `conveyor.gpu.a.b` and relative
  imports both map onto it. `from conveyor.gpu.a import b` is an edge to `gpu/a/b.py` when that
  file exists, else to the module `gpu/a` that defines the name `b`.
- No edge is drawn to the parent packages an import runs first: a package's `__init__` that
  re-exports its submodules would otherwise close a loop with each of them.
- Each edge has a kind: "module" (runs at import), "lazy" (inside a function, runs at call), or
  "typing" (under `if TYPE_CHECKING:`, never runs). Only the first two are runtime dependencies.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "gpu"
PACKAGE = "conveyor.gpu"
RUNTIME = frozenset({"module", "lazy"})


@dataclass(frozen=True)
class Edge:
    source: str  # "gpu/backends/cpu/ops.py"
    target: str  # "gpu/models/llama.py"
    kind: str  # "module" | "lazy" | "typing"
    line: int


def _file_of(module: str) -> str | None:
    """`conveyor.gpu.a.b` -> "gpu/a/b.py" (or its package's `__init__.py`); None outside gpu/."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    parts = module.split(".")[2:]
    base = GPU.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):  # no gpu.py beside gpu/: the package's own
        if path.is_file():
            return path.relative_to(ROOT).as_posix()
    return None


def _module_of(path: Path) -> str:
    """gpu/a/b.py -> conveyor.gpu.a.b; gpu/a/__init__.py -> conveyor.gpu.a."""
    parts = path.relative_to(GPU).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with its kind, walking into functions and TYPE_CHECKING blocks."""

    def walk(nodes: list[ast.stmt], kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, kind
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, "typing")
                yield from walk(node.orelse, kind)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(node.body, "typing" if kind == "typing" else "lazy")
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    children = getattr(node, field, None)
                    if isinstance(children, list):
                        stmts = [c for c in children if isinstance(c, ast.stmt)]
                        # except handlers and match cases hold their statements one level down
                        for c in children:
                            if isinstance(c, (ast.ExceptHandler, ast.match_case)):
                                stmts.extend(c.body)
                        yield from walk(stmts, kind)

    return walk(tree.body, "module")


def edges_of(path: Path) -> list[Edge]:
    source = path.relative_to(ROOT).as_posix()
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Edge] = []
    for node, kind in _imports(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:  # relative: strip level - 1 trailing parts of this file's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            # a submodule named in the from-list is the target; a plain name lives in `base`
            targets = [f"{base}.{a.name}" if _file_of(f"{base}.{a.name}") else base for a in node.names]
        for target in dict.fromkeys(targets):
            file = _file_of(target)
            if file is None and (target == PACKAGE or target.startswith(PACKAGE + ".")):
                raise ValueError(f"{source}:{node.lineno}: {target} is no file of gpu/")  # never a silent miss
            if file is not None and file != source:
                found.append(Edge(source, file, kind, node.lineno))
    return found


def graph() -> list[Edge]:
    return [e for path in sorted(GPU.rglob("*.py")) for e in edges_of(path)]


def cycles(edges: list[Edge], kinds: frozenset[str] = RUNTIME) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        if e.kind in kinds:
            succ.setdefault(e.source, set()).add(e.target)
            succ.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(found)


def backend_model_imports(edges: list[Edge]) -> list[Edge]:
    """Every import, of any kind, from gpu/backends/ of a file in gpu/models/."""
    return [e for e in edges if e.source.startswith("gpu/backends/") and e.target.startswith("gpu/models/")]


def main() -> int:
    edges = graph()
    sys.setrecursionlimit(10_000)
    for label, kinds in (("runtime", RUNTIME), ("runtime + TYPE_CHECKING", RUNTIME | {"typing"})):
        found = cycles(edges, kinds)
        print(f"{len(found)} cycle(s) inside gpu/ over {label} imports")
        for component in found:
            members = set(component)
            print("  " + " ".join(component))
            for e in edges:
                if e.source in members and e.target in members and e.kind in kinds:
                    print(f"    {e.source}:{e.line} -> {e.target} ({e.kind})")
    wrong = backend_model_imports(edges)
    print(f"{len(wrong)} import(s) of gpu/models/ from gpu/backends/")
    for e in wrong:
        print(f"  {e.source}:{e.line} -> {e.target} ({e.kind})")
    return 1 if wrong or cycles(edges) else 0


if __name__ == "__main__":
    sys.exit(main())
