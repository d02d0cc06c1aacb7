"""Fixtures for the config tests: the flags of OpenRLHF 0.10.2's CLI reference (current flags, the
migration table old flag -> new flags, pre-0.10.2 flags and removed flags), extracted once from its
docs/source/cli_options.rst into `openrlhf_0_10_2_flags.json` beside this file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REFERENCE = Path(__file__).with_name("openrlhf_0_10_2_flags.json")


@pytest.fixture(scope="session")
def reference() -> dict:
    """current: flags of 0.10.2 named anywhere in the reference; renames: (old flags, new flags) rows of
    the migration table; old: every pre-0.10.2 flag; removed: deleted flags."""
    data = json.loads(REFERENCE.read_text(encoding="utf-8"))
    return {"current": data["current"], "renames": [(old, new) for old, new in data["renames"]],
            "old": set(data["old"]), "removed": set(data["removed"])}
