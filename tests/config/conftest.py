"""Fixtures for the config tests: the OpenRLHF 0.10.2 CLI reference, parsed into current flags, the
migration table (old flag -> new flags) and the removed flags."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

REFERENCE = Path(__file__).parents[2].parent / "shared" / "reference" / "openrlhf-0.10.2-cli-options.rst"

_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_FLAG = re.compile(r"--(?:[\w.]|\{[^}]*\})+")
_PLACEHOLDERS = {
    "..": ["actor", "critic", "ref", "reward"],
    "entity": ["actor", "critic"],
    "prefix": ["actor", "critic"],
}


def expand(token: str) -> list[str]:
    """'--ds.lora.{rank, alpha}' -> ['--ds.lora.rank', '--ds.lora.alpha']; '{..}' -> the four PPO roles."""
    parts = re.split(r"(\{[^}]*\})", token)
    options = []
    for p in parts:
        if p.startswith("{"):
            inner = p[1:-1].strip()
            options.append(_PLACEHOLDERS.get(inner) or [x.strip() for x in inner.split(",")])
        else:
            options.append([p])
    return ["".join(combo).rstrip(".") for combo in itertools.product(*options)]


def flags_in(text: str) -> list[str]:
    out = []
    for lit in _LITERAL.findall(text):
        lit = " ".join(lit.split())
        for m in _FLAG.finditer(lit):
            if lit[m.end() : m.end() + 1] == "*":
                continue  # a section wildcard like --actor.*
            out.extend(expand(m.group()))
    return out


def _strip_code_blocks(text: str) -> str:
    out, skipping = [], False
    for line in text.splitlines():
        if line.strip().startswith(".. code-block::"):
            skipping = True
            continue
        if skipping and line.strip() and not line.startswith((" ", "\t")):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out)


def _table_rows(text: str) -> list[list[str]]:
    rows: list[list[str]] = []
    for line in text.splitlines():
        if re.match(r"^\s*\* - ", line):
            rows.append([line.split("* - ", 1)[1]])
        elif re.match(r"^\s+- ", line) and rows:
            rows[-1].append(line.split("- ", 1)[1])
        elif rows and line.strip():
            rows[-1][-1] += "\n" + line
    return rows


def _section_map_flags(text: str) -> list[str]:
    """Bare names of the 'Section map' table, prefixed by their row's single --prefix.*."""
    body = text.split("Section map", 1)[1].split("DeepSpeed\n---", 1)[0]
    out = []
    for row in _table_rows(body):
        if len(row) < 3:
            continue
        prefixes = re.findall(r"``--([\w.]+)\.\*``", row[0])
        if len(prefixes) != 1:
            continue  # the per-role row and the flat row list names that differ per role
        for lit in _LITERAL.findall(row[2]):
            lit = " ".join(lit.split())
            if not lit.startswith("--") and re.match(r"^[\w.{}, ]+$", lit):
                out.extend(expand(f"--{prefixes[0]}.{lit}"))
    return out


# Named in the reference but not flags of a trainer: a lora_combiner option, and a flag the reference
# says does not exist ("There is no separate --muon.weight_decay flag").
NOT_TRAINER_FLAGS = {"--is_rm", "--muon.weight_decay"}


@pytest.fixture(scope="session")
def reference() -> dict:
    """current: flags of 0.10.2 named anywhere; renames: (old flags, new flags) rows of the migration
    table; old: every pre-0.10.2 flag (table rows, plus 'the old --x' in prose); removed: deleted flags."""
    if not REFERENCE.exists():
        pytest.skip(
            f"CLI reference not found at {REFERENCE} (the shared/ folder sits next to the repository)"
        )
    text = _strip_code_blocks(REFERENCE.read_text(encoding="utf-8"))
    main, migration = text.split(".. _flag_migration:", 1)
    tables, removed_part = migration.split("Removed flags", 1)
    renames, still_current = [], set()
    for row in _table_rows(tables):
        old, new = flags_in(row[0]), flags_in(row[1]) if len(row) > 1 else []
        if not old:
            continue
        if len(row) > 1 and "flat in SFT" in row[1]:
            still_current.update(old)  # e.g. --lr_scheduler: unchanged for SFT / RM / DPO
        renames.append((old, new))
    old_flags = {f for old, _ in renames for f in old} - still_current
    old_flags |= set(re.findall(r"old(?: flat)? ``(--[\w.]+)``", main))
    removed = {
        f
        for line in removed_part.splitlines()
        if line.lstrip().startswith("- ")
        for f in flags_in(re.sub(r"\(.*?\)", "", line))
    }  # (...) names the replacement
    mentioned = set(flags_in(main)) | set(_section_map_flags(main)) | {f for _, new in renames for f in new}
    current = mentioned - old_flags - removed - NOT_TRAINER_FLAGS
    return {"current": sorted(current), "renames": renames, "old": old_flags, "removed": removed}
