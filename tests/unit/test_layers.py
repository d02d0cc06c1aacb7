"""The package's layers as a checked rule (docs/design.md, "Layers"). Every import inside `posttrain/`,
function-level ones included, is read with `ast`; the test fails on

1. an import against the layer order (a layer imports only itself and the layers below it),
2. a cycle between modules, and
3. a cycle between the direct children (modules and sub-packages) of any package: e.g. in
   `trainers/rl/`, `ppo.py` → `placement/` → `updates.py` is one-way.

A package's `__init__.py` naming its own children is not an edge between them."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "posttrain"
# top to bottom; the root package `posttrain/__init__.py` (the version) is below them all
LAYERS = ["cli", "trainers", "agents", "rollout", "rewards", "engines", "models", "data", "algorithms",
          "config", "compat", "utils"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.AST, name: str, package: bool, modules: dict[str, Path]) -> set[str]:
    """The posttrain modules this module imports anywhere (function bodies included):
    `from pkg import name` is `pkg.name` when that is a module, else `pkg`;
    `importlib.import_module("posttrain...")` with a literal counts too."""
    here = name if package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return {n for n in found if n == "posttrain" or n.startswith("posttrain.")}


def import_graph() -> dict[str, set[str]]:
    """module -> the posttrain modules it imports (a package stands for its `__init__.py`)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        tree = ast.parse(path.read_text(), str(path))
        for target in imported_names(tree, name, path.name == "__init__.py", modules):
            while target not in modules:
                target = target.rpartition(".")[0]
            if target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int:
    parts = module.split(".")
    return len(LAYERS) if len(parts) == 1 else LAYERS.index(parts[1])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def sibling_graphs(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """package -> graph between its direct children: child a → child b when a module inside a imports a
    module inside b. The package's own `__init__` is not a child."""
    siblings: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for source, targets in graph.items():
        for target in targets:
            s, t = source.split("."), target.split(".")
            common = 0
            while common < min(len(s), len(t)) and s[common] == t[common]:
                common += 1
            if common == len(s) or common == len(t):
                continue  # one is the other's package (its __init__): not between siblings
            package = ".".join(s[:common])
            siblings[package][s[common]].add(t[common])
    return siblings


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_belongs_to_a_layer(graph):
    unknown = sorted({m.split(".")[1] for m in graph if m.count(".") >= 1} - set(LAYERS))
    assert not unknown, f"top-level packages outside the layer order {LAYERS}: {unknown}"


def test_no_import_against_the_layer_order(graph):
    upward = [f"{source} imports {target}" for source, targets in sorted(graph.items())
              for target in sorted(targets)
              if layer_of(target) < layer_of(source)]
    assert not upward, "imports against the layer order (docs/design.md):\n" + "\n".join(upward)


def test_no_cycle_between_modules(graph):
    assert not cycles(graph)


def test_no_cycle_between_sibling_packages(graph):
    found = {package or "posttrain": c for package, children in sibling_graphs(graph).items()
             for c in cycles({k: set(v) for k, v in children.items()})}
    assert not found, f"cycles between the children of a package: {found}"


def test_design_doc_states_the_order():
    """docs/design.md's "Layers" table lists the layers, top to bottom, one row each."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("\n## Layers"):]
    section = section[: section.index("\n## ", 1)]
    assert re.findall(r"^\| `(\w+)/` \|", section, flags=re.M) == LAYERS


def test_the_checks_catch_what_they_should():
    """The rule itself: an upward edge, a module cycle and a sibling cycle are each found."""
    bad = {"posttrain.utils.x": {"posttrain.cli.main"}, "posttrain.cli.main": set()}
    assert [s for s, ts in bad.items() for t in ts if layer_of(t) < layer_of(s)] == ["posttrain.utils.x"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    pkgs = sibling_graphs({"posttrain.trainers.rl.ppo": {"posttrain.trainers.rl.placement.workers"},
                           "posttrain.trainers.rl.placement.workers": {"posttrain.trainers.rl.ppo"}})
    assert cycles({k: set(v) for k, v in pkgs["posttrain.trainers.rl"].items()}) == [["placement", "ppo"]]
