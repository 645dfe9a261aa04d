"""The package's structure, read from its source: no import circles, and no
module reaching into another's private names.

Every import counts, also those inside functions (a deferred import hides a
circle; it does not remove it). A module's private names are those starting
with one underscore; a private *module* (``jaxcomm._runtime``) is part of the
package's inside and may be imported by the package, but its own private
names stay its own.
"""

from __future__ import annotations

import ast
import pathlib

import jaxcomm

ROOT = pathlib.Path(jaxcomm.__file__).parent
PACKAGE = "jaxcomm"


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    # Compiled modules (_kernels_cpu.cpython-311-x86_64-linux-gnu.so) count as
    # modules too: importing one is not taking a private name.
    for path in sorted([*ROOT.rglob("*.py"), *ROOT.rglob("*.so")]):
        relative = path.relative_to(ROOT)
        parts = (PACKAGE, *relative.parent.parts, relative.name.split(".")[0])
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _source(name: str) -> str:
    return MODULES[name].read_text() if MODULES[name].suffix == ".py" else ""


def _base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module that ``from <...> import`` names, or ''."""
    if node.level == 0:
        return node.module or ""
    here = module.split(".") if _is_package(module) else module.split(".")[:-1]
    if node.level > 1:
        here = here[: -(node.level - 1)]
    return ".".join(here + ([node.module] if node.module else []))


def _compiled(base: str, name: str) -> bool:
    # A kernels module this build did not make (the CUDA or emulated one).
    return base == PACKAGE and name.startswith("_kernels_")


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(tree: ast.AST):
    """ast.walk, leaving out ``if TYPE_CHECKING:`` blocks (never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if not _type_checking_only(c))


def _imports(module: str):
    """(imported module, names taken from it, line) for each of module's imports."""
    tree = ast.parse(_source(module))
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            names = []
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES or _compiled(base, alias.name):
                    yield f"{base}.{alias.name}", [], node.lineno
                else:
                    names.append(alias.name)
            if names:
                yield base, names, node.lineno


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m) if t != m and t in MODULES} for m in MODULES}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_scan_sees_the_package():
    # The checks below pass vacuously on an empty or wrongly parsed tree.
    graph = _graph()
    assert {"jaxcomm.comm", "jaxcomm.ops", "jaxcomm.ops.reduction"} <= set(graph)
    assert "jaxcomm.ops" in graph["jaxcomm.comm"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    circles = _circles(_graph())
    assert not circles, "modules that import each other, directly or around a circle: " + "; ".join(
        " <-> ".join(c) for c in circles
    )


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_private_names_of_another():
    offences = []
    for module in MODULES:
        for target, names, line in _imports(module):
            offences += [f"{module}:{line} imports {target}.{n}" for n in names if _private(n)]
    assert not offences, "\n".join(offences)


def test_no_module_reads_private_names_of_another():
    # `from . import _runtime` then `_runtime._lock`: the same reach, by attribute.
    offences = []
    for module in MODULES:
        tree = ast.parse(_source(module))
        bound = {}
        for node in _walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _base(module, node)
                for alias in node.names:
                    if f"{base}.{alias.name}" in MODULES:
                        bound[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE) and alias.asname:
                        bound[alias.asname] = alias.name
        for node in _walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
                and f"{bound[node.value.id]}.{node.attr}" not in MODULES
                and bound[node.value.id] != module
            ):
                offences.append(f"{module}:{node.lineno} reads {bound[node.value.id]}.{node.attr}")
    assert not offences, "\n".join(offences)
