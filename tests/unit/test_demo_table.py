"""`posttrain demo`'s table: every row prints its own measured range, keyed by task and stage (the arithmetic
and the colour task both have a row "after RL (GRPO, verifiable reward)"), and the Results tables of
README.md and docs/getting-started.md show the same ranges as the code (`demo.MEASURED`, the one place they
are kept)."""
import re
from pathlib import Path

import pytest

from posttrain.cli import demo

ROOT = Path(__file__).resolve().parents[2]
RANGE = re.compile(r"\d+\.\d-\d+\.\d%")
SECTIONS = {"held-out accuracy on arith": "arithmetic", "held-out success on calc": "calculator",
            "held-out accuracy on colour": "colour"}


def printed_ranges(capsys) -> dict[tuple[str, str], str]:
    """{(task, stage): the range printed on that row ("" if none)} of the demo's table of a made-up run."""
    minutes = {s: 1.0 for s in (*demo.STAGES, *demo.AGENT_STAGES, *demo.VISION_STAGES, "reward model")}
    demo.print_table({
        "task": "arith", "held_out_prompts": 200, "rm_preference_accuracy": 0.9,
        "accuracy": {demo.BASE: 0.0, **dict.fromkeys(demo.STAGES, 0.5)}, "minutes": minutes,
        "agent_task": "calc",
        "agent_success": dict.fromkeys(demo.AGENT_STAGES, 0.2), "vision_task": "colour",
        "vision_accuracy": {demo.BASE: 0.25, **dict.fromkeys(demo.VISION_STAGES, 0.7)}, "seconds": 60,
        "output": "runs/demo"})
    rows, task = {}, None
    for line in capsys.readouterr().out.splitlines():
        heading = [t for prefix, t in SECTIONS.items() if line.startswith(prefix)]
        if heading:
            task = heading[0]
            continue
        stage = line[2:44].strip()
        if task and line.startswith("  ") and stage != "stage":
            found = RANGE.findall(line)
            rows[(task, stage)] = found[-1] if found else ""
    return rows


def test_each_row_prints_its_own_range(capsys, monkeypatch):
    """Every key gets a range of its own here, so a row that printed another row's range would show."""
    ranges = {key: demo.MeasuredRange(i, i + 0.5, r.readme, r.guide)
              for i, (key, r) in enumerate(demo.MEASURED.items())}
    monkeypatch.setattr(demo, "MEASURED", ranges)
    printed = printed_ranges(capsys)
    assert ("arithmetic", demo.STAGES[3]) in printed and ("colour", demo.STAGES[3]) in printed
    assert demo.STAGES[3] == demo.VISION_STAGES[1]  # the same stage name in two tasks
    expected = {key: f"{r.low:.1f}-{r.high:.1f}%" for key, r in ranges.items()}
    assert {key: printed[key] for key in ranges} == expected


def test_every_row_of_the_table_has_a_measured_range(capsys):
    """Every row the demo prints has its own measured range, and MEASURED holds no row it does not print."""
    printed = printed_ranges(capsys)
    assert sorted(printed) == sorted(demo.MEASURED)
    assert [key for key, text in printed.items() if not text] == []


def results_rows(path: Path) -> dict[str, str]:
    """{first cell: range cell} of the table of `path` whose third column is the range over the seeds."""
    lines = path.read_text().splitlines()
    start, = [i for i, line in enumerate(lines)
              if line.startswith("| stage") and f"| range ({demo.MEASURED_SEEDS} seeds) | minutes |" in line]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[2]
    return rows


@pytest.mark.parametrize("doc,label", [("README.md", "readme"), ("docs/getting-started.md", "guide")])
def test_docs_show_the_ranges_the_demo_prints(doc, label):
    rows = results_rows(ROOT / doc)
    matched = set()
    for key, r in demo.MEASURED.items():
        labels = [row for row in rows if row.startswith(getattr(r, label))]
        assert len(labels) == 1, (key, getattr(r, label), labels)
        assert rows[labels[0]] == f"{r.low:.1f}-{r.high:.1f}%", (key, labels[0])
        matched.add(labels[0])
    assert [label for label, cell in rows.items() if cell and label not in matched] == []


@pytest.mark.parametrize("key", sorted(demo.MEASURED))
def test_ranges_are_percentages_low_to_high(key):
    r = demo.MEASURED[key]
    assert 0.0 <= r.low <= r.high <= 100.0
