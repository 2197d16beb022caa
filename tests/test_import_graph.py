"""The package's import graph has no circle, function-level (lazy) imports included.

Strongly connected components (Tarjan) of the graph whose nodes are the package's modules
and whose edges are every ``import`` statement anywhere in a module, resolved to the
package's modules; importing a parent package is not an edge (Python imports parents
first anyway). Run as a script to print the circles: ``python tests/test_import_graph.py``.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / "sparse_mla"


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _targets(module: str, is_package: bool, node: ast.AST, modules: dict) -> set[str]:
    """The package modules an import statement loads (the longest known prefix of each)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _targets(module, path.name == "__init__.py", node, modules)
        graph[module] = {t for t in edges if t != module and not module.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_a_circle_is_found():
    """The check is not vacuous: a lazy import back makes a circle, and it is reported."""
    graph = import_graph()
    graph["sparse_mla.ops.topk.api"].add("sparse_mla.library")
    found = circles(graph)
    assert len(found) == 1 and {"sparse_mla.library", "sparse_mla.ops.topk.api"} <= set(found[0])
    assert "sparse_mla.library" in graph["sparse_mla.testing.cases"]  # lazy imports are edges


def test_library_does_not_import_the_kit_cases():
    """The library proper (ops, decode's plan, integrations, ...) never reaches the kit's case
    modules; only the kit, verify, the bench and the one-release alias do."""
    graph = import_graph()
    allowed = ("sparse_mla.testing", "sparse_mla.verify", "sparse_mla.bench")
    alias = "sparse_mla.decode.cases"
    assert "sparse_mla.testing.cases" in graph[alias]  # the check sees the alias's import
    for module, edges in graph.items():
        if module == alias or module.startswith(allowed):
            continue
        assert "sparse_mla.testing.cases" not in edges, module
        assert alias not in edges, module


def test_decode_cases_alias():
    """``sparse_mla.decode.cases`` re-exports the kit's cases for one release."""
    from sparse_mla.decode import cases as old
    from sparse_mla.testing import cases

    public = [n for n in vars(cases) if not n.startswith("_") and getattr(cases, n) is not None]
    own = [n for n in public if getattr(getattr(cases, n), "__module__", None) == cases.__name__]
    assert own and all(getattr(old, n) is getattr(cases, n) for n in own)
    assert old.random_step is cases.random_step and old.INDEX_HEADS == cases.INDEX_HEADS


if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    found = circles(import_graph(root))
    print(f"{len(found)} circle(s)", [len(c) for c in found])
    for c in found:
        print(" ", " ".join(c))
