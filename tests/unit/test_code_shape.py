"""Size limits on the code, read with `ast` (issue 49): no function in `posttrain/` is longer than 80
lines, and the RL trainer (`RLTrainer` with its base `RunLoop`) keeps at most 25 instance attributes;
what belongs together is grouped into a named object (`trainers/rl/run_parts.py`,
`run_loop.EvalRecord`)."""
from __future__ import annotations

import ast
from pathlib import Path

import posttrain

PACKAGE = Path(posttrain.__file__).resolve().parent  # the package under test


def self_attributes(path: Path, cls: str) -> set[str]:
    """The names `self.NAME` is assigned to (tuple targets and augmented assignments included) anywhere in
    class `cls` of `path`."""
    tree = ast.parse(path.read_text())
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    found = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
            n, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            found |= {e.attr for e in ast.walk(t) if isinstance(e, ast.Attribute)
                      and isinstance(e.value, ast.Name) and e.value.id == "self"}
    return found


def test_no_function_is_longer_than_80_lines():
    long = [f"{p.relative_to(PACKAGE)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in sorted(PACKAGE.rglob("*.py")) for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert long == []


def test_the_rl_trainer_has_at_most_25_attributes():
    names = (self_attributes(PACKAGE / "trainers/rl/ppo.py", "RLTrainer")
             | self_attributes(PACKAGE / "trainers/run_loop.py", "RunLoop"))
    assert len(names) <= 25, sorted(names)
