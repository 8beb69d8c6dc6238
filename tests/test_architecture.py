"""The source tree keeps its shape (docs/architecture.md): no import circles between the modules
of `packages/`, and no source module over 700 lines.

The import graph is read from the code's own `import` statements, those inside functions
included (a function-level import that closes a circle is a circle deferred, not removed).
Importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first, so it counts as importing
those packages too: a package's `__init__` that imports a module which imports a sibling back
through the package is a circle Python hits at run time.

`python tests/test_architecture.py` prints every circle and every long module.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
MAX_LINES = 700


def source_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module under packages/*/src."""
    modules = {}
    for path in sorted(PACKAGES.glob("*/src/**/*.py")):
        parts = path.relative_to(path.parents[len(path.relative_to(PACKAGES).parts) - 3]).parts
        name = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
        modules[name] = path
    return modules


def _known(name: str, modules: dict) -> str | None:
    """`name`, or the nearest enclosing module we have (an imported attribute's module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _with_packages(name: str, modules: dict) -> set[str]:
    """`name` and every package above it that is ours (their __init__ runs first)."""
    out, parts = set(), name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in modules:
            out.add(prefix)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module
                imported = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in imported:
                found = _known(target, modules)
                if found:
                    targets |= _with_packages(found, modules)
        # A package's own __init__ above this module is not an import of it.
        graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def long_modules(modules: dict[str, Path]) -> dict[str, int]:
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    return {name: n for name, n in lengths.items() if n > MAX_LINES}


def test_no_import_circles_in_packages():
    modules = source_modules()
    assert len(modules) > 100  # the glob found the tree
    graph = import_graph(modules)
    assert "megatrain.models" in graph["megatrain.run.setup"] or any(
        t.startswith("megatrain.models") for t in graph["megatrain.run.setup"]
    )
    assert import_circles(graph) == []


def test_the_checker_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_no_source_module_over_700_lines():
    assert long_modules(source_modules()) == {}


if __name__ == "__main__":
    modules = source_modules()
    graph = import_graph(modules)
    for circle in import_circles(graph):
        print("circle:", " <-> ".join(circle))
        for name in circle:
            print("   ", name, "->", sorted(t for t in graph[name] if t in circle))
    for name, n in sorted(long_modules(modules).items(), key=lambda kv: -kv[1]):
        print(f"long: {name} {n} lines")
    sys.exit(bool(import_circles(graph) or long_modules(modules)))
