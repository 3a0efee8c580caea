"""The package's layers point down and its imports have no cycles.

Every module of ``mstar`` belongs to a layer (its first package under ``mstar``); a module
may import its own package or a package of a lower layer, never one beside or above it.
Every import counts: at module level, inside a function, under ``TYPE_CHECKING``. The
package root (``mstar/__init__.py``: the version and a lazy re-export of the SDK) is left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mstar"

# Lower numbers are lower layers: graph <- engine/layers <- model <- runtime <- server/client.
LAYERS = {
    "contract": 0, "graph": 0, "config": 0,  # request contract, walk graph, deployment config
    "distributed": 1, "audio": 1, "media": 1,  # process groups; decoding audio and images
    "layers": 2, "diffusion": 2,  # nn building blocks and kernels; scheduler maths
    "engine": 3,
    "model": 4,
    "runtime": 5,
    "server": 6, "client": 6,
    "cli": 7,
}


def package_sources(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source of every module under ``root`` (``mstar``)."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path.read_text()
    return sources


def imports_of(name: str, source: str, modules: Iterable[str], is_package: bool = False) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports (an imported name resolves to
    the longest module prefix it has: ``from mstar.graph import Node`` is ``mstar.graph``)."""
    known = set(modules)
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from package import submodule`` imports the submodule; any other name, the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(module: str) -> str:
    return module.split(".")[1]


def import_graph(sources: Mapping[str, str], packages: Iterable[str] = ()) -> dict[str, set[str]]:
    modules = [m for m in sources if m != "mstar"]
    return {m: imports_of(m, sources[m], modules, m in packages) - {"mstar"} for m in modules}


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import of a package in the same or a higher layer."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            mine, theirs = layer_of(module), layer_of(target)
            if mine != theirs and LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{module} -> {target} ({mine} is layer {LAYERS[mine]}, {theirs} is {LAYERS[theirs]})")
    return bad


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def _package_graph() -> dict[str, set[str]]:
    sources = package_sources()
    packages = {".".join(p.relative_to(ROOT.parent).parts[:-1]) for p in ROOT.rglob("__init__.py")}
    return import_graph(sources, packages)


def test_every_module_is_in_a_layer() -> None:
    assert {layer_of(m) for m in _package_graph()} <= set(LAYERS), "a new top-level module needs a layer"


def test_layers_point_down() -> None:
    assert upward_imports(_package_graph()) == []


def test_no_import_cycles() -> None:
    assert cycles(_package_graph()) == []


def test_an_upward_import_is_caught() -> None:
    """A synthetic model module importing the server, and two runtime modules importing each
    other, are reported by name."""
    sources = package_sources() | {
        "mstar.model.synthetic": "from mstar.server.app import create_app\n",
        "mstar.runtime.synthetic_a": "def f():\n    from mstar.runtime.synthetic_b import g\n",
        "mstar.runtime.synthetic_b": "from mstar.runtime import synthetic_a\n",
    }
    graph = import_graph(sources)
    assert any(line.startswith("mstar.model.synthetic -> mstar.server.app") for line in upward_imports(graph))
    assert ["mstar.runtime.synthetic_a", "mstar.runtime.synthetic_b"] in cycles(graph)


@pytest.mark.parametrize("layer", ["graph", "engine", "layers", "model", "runtime", "audio", "media",
                                   "diffusion", "distributed", "contract", "config"])
def test_nothing_below_the_server_imports_it(layer: str) -> None:
    graph = _package_graph()
    offenders = [f"{m} -> {t}" for m, ts in graph.items() if layer_of(m) == layer for t in ts
                 if layer_of(t) == "server"]
    assert offenders == []
