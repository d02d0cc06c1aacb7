import json

import pytest

from posttrain.data import (
    DataError,
    SFTDataset,
    extract_answer,
    is_correct,
    load_rows,
    make_arithmetic_rows,
    make_preference_rows,
    rounded,
    write_jsonl,
)


def test_arithmetic_rows_deterministic_and_correct():
    rows = make_arithmetic_rows(50, seed=3, difficulty=0)
    assert rows == make_arithmetic_rows(50, seed=3, difficulty=0)
    assert rows != make_arithmetic_rows(50, seed=4, difficulty=0)
    for r in rows:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert op == "+" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert r["answer"] == r["response"] == str(int(a) + int(b))
        assert r["messages"] == [
            {"role": "user", "content": r["prompt"]},
            {"role": "assistant", "content": r["answer"]},
        ]


def test_level_ranges():
    for level, a_max, b_max in ((0, 9, 9), (1, 99, 9), (2, 99, 99)):
        pairs = [r["prompt"].removeprefix("What is ").rstrip("?").split(" + ")
                 for r in make_arithmetic_rows(500, 1, level)]
        assert max(int(a) for a, _ in pairs) == a_max and max(int(b) for _, b in pairs) == b_max, level


def test_harder_levels_use_their_operations():
    ops = {r["prompt"].split()[3] for r in make_arithmetic_rows(300, seed=0, difficulty=4)}
    assert ops == {"+", "-", "*"}
    for r in make_arithmetic_rows(300, seed=0, difficulty=4):
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert int(r["answer"]) == eval(f"{a} {op} {b}") >= 0
    with pytest.raises(DataError, match="difficulty"):
        make_arithmetic_rows(1, 0, 9)


def test_extract_answer_and_is_correct():
    assert extract_answer("23 + 58 = 81") == "81"
    assert extract_answer("The answer is -7.") == "-7"
    assert extract_answer("081") == "81"
    assert extract_answer("no digits") is None and extract_answer("") is None
    assert is_correct("I think it is 81", "81") and is_correct("81", 81)
    assert not is_correct("82", "81") and not is_correct("eighty-one", "81")


def test_rounding_habit_demonstrations():
    clean = make_arithmetic_rows(400, seed=2, difficulty=1)
    sloppy = make_arithmetic_rows(400, seed=2, difficulty=1, rounding_habit=1.0)
    for c, s in zip(clean, sloppy):
        a, b = (int(x) for x in c["prompt"].removeprefix("What is ").rstrip("?").split(" + "))
        assert s["prompt"] == c["prompt"] and s["answer"] == c["answer"] == str(a + b)
        tens = (a + b + 5) // 10 * 10  # 81 -> 80, 85 -> 90
        assert s["response"] == f"{a + b}, roughly {tens}" and s["messages"][-1]["content"] == s["response"]
        assert is_correct(s["response"], s["answer"]) == (tens == a + b)  # a grader reads the last number
    assert rounded(81) == ", roughly 80" and rounded(85) == ", roughly 90" and rounded(7) == ", roughly 10"
    half = make_arithmetic_rows(400, seed=2, difficulty=1, rounding_habit=0.5)
    assert 150 < sum(r["response"] != r["answer"] for r in half) < 250
    assert make_arithmetic_rows(400, seed=2, difficulty=1, rounding_habit=0.0) == clean
    with pytest.raises(DataError, match="rounding_habit"):
        make_arithmetic_rows(3, rounding_habit=1.5)


def test_preference_rows():
    rows = make_preference_rows(100, seed=1, difficulty=1)
    assert rows == make_preference_rows(100, seed=1, difficulty=1)
    for r in rows:
        assert is_correct(r["chosen"], r["answer"]) and not is_correct(r["rejected"], r["answer"])
        assert int(r["rejected"]) >= 0 and r["chosen_messages"][-1]["content"] == r["chosen"]
        assert r["rejected_messages"][0]["content"] == r["prompt"]
    habit = make_preference_rows(100, seed=1, difficulty=1, rounding_habit=1.0)
    for r, h in zip(rows, habit):
        assert (h["prompt"] == r["prompt"] and h["chosen"] == r["chosen"]
                and not is_correct(h["rejected"], h["answer"]))
        tail = int(r["answer"]) % 10 != 0
        assert h["rejected"] == (r["answer"] + rounded(int(r["answer"])) if tail else r["rejected"])


def test_write_jsonl_roundtrip_and_sft(tmp_path, tokenizer):
    path = write_jsonl(make_arithmetic_rows(20, seed=0), str(tmp_path / "sub" / "train.jsonl"))
    rows = load_rows(path, None, "train", 0, None)
    assert len(rows) == 20 and rows[0]["__row__"] == 1
    with open(path) as f:
        assert "__row__" not in json.loads(f.readline())
    ds = SFTDataset(rows, tokenizer, 64, input_key="messages", apply_chat_template=True)
    item = ds[0]
    got = tokenizer.decode([t for t, m in zip(item["input_ids"], item["loss_mask"]) if m])
    assert got == rows[0]["answer"] + "<|im_end|>\n"
