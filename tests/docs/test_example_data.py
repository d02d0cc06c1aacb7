"""examples/data/ is what examples/make_data.py writes, and its SFT demonstrations set up the README's first
RL run: exact sums, most with the sloppy demonstrator's rounded tail, which the exact-match reward removes."""
from __future__ import annotations

import importlib.util
import json
import re

from doc_commands import ROOT

DATA = ROOT / "examples" / "data"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def test_make_data_writes_the_committed_files(tmp_path):
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "examples" / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.main(tmp_path / "data")
    written = sorted(p.relative_to(tmp_path / "data") for p in (tmp_path / "data").rglob("*") if p.is_file())
    assert written == sorted(p.relative_to(DATA) for p in DATA.rglob("*") if p.is_file())
    for rel in written:
        assert (tmp_path / "data" / rel).read_bytes() == (DATA / rel).read_bytes(), rel


def test_sft_demonstrations_carry_the_habit_rl_removes():
    """Every demonstration starts with the exact sum; about 70% add a rounded estimate after it (so the last
    number, which arithmetic_reward.py grades, is mostly wrong), and no held-out prompt is trained on."""
    rows = _rows("sft.jsonl")
    assert len(rows) >= 2000  # enough sums for SFT to learn the arithmetic, not only the answer's form
    for r in rows:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", r["prompt"]).groups())
        assert r["response"] in (f"{a + b}", f"{a + b}, roughly {(a + b + 5) // 10 * 10}"), r
    share = sum("roughly" in r["response"] for r in rows) / len(rows)
    assert 0.6 < share < 0.8
    held = {r["prompt"] for r in _rows("heldout/prompts.jsonl")}
    trained = {r["prompt"] for name in ("sft.jsonl", "prompts.jsonl", "prefs.jsonl") for r in _rows(name)}
    assert held and not held & trained
    assert {r["prompt"] for r in _rows("heldout/sft.jsonl")} == held
