"""The package's import direction: core -> (wire, store, zk) -> (client, leader, sync) ->
(master, cache) -> master.edge -> (spark, cli) -> ops, checked on the source with ``ast``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Where each part of the package sits; a module belongs to its longest matching prefix. A
#: module may import its own part and any part on a lower rank; parts that share a rank (wire,
#: store and zk, say) do not import each other.
LAYERS: dict[str, int] = {
    "blobha.core": 0,
    "blobha.v1": 0,  # generated protobuf code, for the wire; core never imports it
    "blobha.wire": 1,
    "blobha.store": 1,
    "blobha.zk": 1,
    "blobha.client": 2,
    "blobha.leader": 2,
    "blobha.sync": 2,
    "blobha.master": 3,
    "blobha.cache": 3,
    "blobha.fs": 3,  # blobha:// for fsspec: a client-side adapter, beside the node cache
    "blobha.master.edge": 4,
    # The composition root assembles the master with its edge; the process runs it.
    "blobha.master.assembly": 5,
    "blobha.master.process": 6,
    "blobha.spark": 7,
    "blobha.cli": 8,  # the front of every part, the Spark launcher's included
    "blobha.ops": 9,
    # The package root names public objects, loaded lazily; __main__ is the CLI.
    "blobha": 10,
}

#: Parts on a lower rank that a part may still not import.
FORBIDDEN: list[tuple[str, str, str]] = [
    ("blobha.ops", "blobha.store", "the tools drive masters through their API, never their disk"),
    *(
        (side, server, "the client side never imports the server side")
        for side in ("blobha.client", "blobha.cache", "blobha.fs", "blobha.spark", "blobha.cli")
        for server in ("blobha.store", "blobha.zk", "blobha.leader", "blobha.sync",
                       "blobha.master")
    ),
]

SOURCES = {"blobha": ROOT / "blobha", "blobha.leader": ROOT / "leader",
           "blobha.sync": ROOT / "sync"}


def _modules() -> Iterator[tuple[str, Path]]:
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if prefix == "blobha" and parts[:1] in (["v1"], ["leader"], ["sync"]):
                continue
            yield ".".join([prefix, *parts]), path


def layer_of(module: str) -> tuple[str, int] | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, layer)
    return best


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every blobha module ``module`` imports (at any depth of the code), with its line."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            for alias in node.names:
                # "from blobha.core import errors" imports the module blobha.core.errors
                yield f"{base}.{alias.name}", node.lineno


def violations() -> list[str]:
    found = []
    for module, path in _modules():
        mine = layer_of(module)
        assert mine is not None, f"{module} is in no layer: add it to LAYERS"
        for target, line in imports_of(module, path):
            theirs = layer_of(target)
            if theirs is None or theirs[0] == mine[0]:
                continue
            where = f"{path.relative_to(ROOT)}:{line}: {module} imports {target}"
            if theirs[1] > mine[1]:
                found.append(f"{where} ({theirs[0]} is above {mine[0]})")
            elif theirs[1] == mine[1] and not mine[0].startswith(theirs[0] + "."):
                found.append(f"{where} ({theirs[0]} and {mine[0]} share a rank)")
            for source, banned, why in FORBIDDEN:
                if mine[0].startswith(source) and theirs[0].startswith(banned):
                    found.append(f"{where} ({why})")
    return found


def test_imports_follow_the_layers() -> None:
    found = violations()
    assert not found, "imports against the layers:\n" + "\n".join(found)


def import_cycles() -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (Tarjan)."""
    modules = dict(_modules())
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for target, _ in imports_of(module, path):
            while target and target not in modules:  # a name in a module: the module
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return cycles


def test_no_modules_import_each_other() -> None:
    cycles = import_cycles()
    assert not cycles, f"import circles: {cycles}"


@pytest.mark.parametrize("module", sorted(m for m, _ in _modules()))
def test_every_module_has_a_layer(module: str) -> None:
    assert layer_of(module) is not None


if __name__ == "__main__":
    print("\n".join(violations()))
    print(import_cycles())
