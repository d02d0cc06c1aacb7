import json
from collections import Counter

import pytest

from posttrain.data import DataError, load_rows

ROWS = [{"q": f"question {i}", "a": str(i)} for i in range(5)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _user(rows):
    return [{k: v for k, v in r.items() if not k.startswith("__")} for r in rows]


def test_jsonl_rows_keep_source_and_line_numbers(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"q": "a"}\n\n{"q": "b"}\n')  # blank line 2 is skipped, numbering follows lines
    rows = load_rows(str(p), None, "train", 0, None)
    assert [(r["q"], r["__row__"], r["__source__"]) for r in rows] == [("a", 1, str(p)), ("b", 3, str(p))]


def test_json_list_and_json_lines(tmp_path):
    lst = tmp_path / "list.json"
    lst.write_text(json.dumps(ROWS, indent=2))
    lines = _jsonl(tmp_path / "lines.json", ROWS)
    for path in (str(lst), lines):
        rows = load_rows(path, None, "train", 0, None)
        assert _user(rows) == ROWS and [r["__row__"] for r in rows] == [1, 2, 3, 4, 5]


def test_json_single_object_is_rejected(tmp_path):
    p = tmp_path / "obj.json"
    p.write_text(json.dumps({"q": "x", "a": "y"}, indent=2))
    with pytest.raises(DataError, match=r"obj\.json.*single JSON object"):
        load_rows(str(p), None, "train", 0, None)


def test_csv_and_parquet(tmp_path):
    import csv as csv_module

    import pyarrow as pa
    import pyarrow.parquet as parquet

    csv = tmp_path / "d.csv"
    with csv.open("w", newline="") as f:
        writer = csv_module.DictWriter(f, fieldnames=["q", "a"])
        writer.writeheader()
        writer.writerows(ROWS)
    pq = tmp_path / "d.parquet"
    parquet.write_table(pa.Table.from_pylist(ROWS), pq)
    for path in (csv, pq):
        rows = load_rows(str(path), None, "train", 0, None)
        assert _user(rows) == ROWS
        assert rows[2]["__row__"] == 3 and rows[2]["__source__"] == str(path)


def test_folder_with_split_files(tmp_path):
    _jsonl(tmp_path / "train.jsonl", ROWS[:3])
    (tmp_path / "validation").mkdir()
    _jsonl(tmp_path / "validation" / "part0.jsonl", ROWS[3:4])
    _jsonl(tmp_path / "test-00000-of-00001.jsonl", ROWS[4:])
    assert _user(load_rows(str(tmp_path), None, "train", 0, None)) == ROWS[:3]
    assert _user(load_rows(str(tmp_path), None, "validation", 0, None)) == ROWS[3:4]
    assert _user(load_rows(str(tmp_path), None, "val", 0, None)) == ROWS[3:4]
    assert _user(load_rows(str(tmp_path), None, "test", 0, None)) == ROWS[4:]


def test_folder_without_split_names_is_train(tmp_path):
    _jsonl(tmp_path / "a.jsonl", ROWS[:2])
    _jsonl(tmp_path / "b.jsonl", ROWS[2:])
    assert _user(load_rows(str(tmp_path), None, "train", 0, None)) == ROWS
    with pytest.raises(DataError, match=r"no files for split 'test'.*\['train'\]"):
        load_rows(str(tmp_path), None, "test", 0, None)


def test_plain_file_has_only_train_split(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match=r"d\.jsonl.*only the split 'train'.*'test'"):
        load_rows(p, None, "test", 0, None)


def test_load_from_disk_dataset_and_datasetdict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    rows = load_rows(str(tmp_path / "single"), None, "train", 0, None)
    assert _user(rows) == ROWS and rows[0]["__row__"] == 1
    with pytest.raises(DataError, match="single saved Dataset"):
        load_rows(str(tmp_path / "single"), None, "test", 0, None)

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:4]), "test": datasets.Dataset.from_list(ROWS[4:])}
    )
    dd.save_to_disk(str(tmp_path / "dict"))
    assert _user(load_rows(str(tmp_path / "dict"), None, "test", 0, None)) == ROWS[4:]
    with pytest.raises(DataError, match=r"split 'eval2' not found.*\['train', 'test'\]"):
        load_rows(str(tmp_path / "dict"), None, "eval2", 0, None)


def test_malformed_jsonl_names_file_line_and_error(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"q": "ok"}\n{"q": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: malformed JSON \(Expecting value"):
        load_rows(str(p), None, "train", 0, None)


def test_jsonl_non_object_line(tmp_path):
    p = tmp_path / "arr.jsonl"
    p.write_text('{"q": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"arr\.jsonl, row 2: expected a JSON object"):
        load_rows(str(p), None, "train", 0, None)


def test_missing_local_path_and_unreachable_hub(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="no such file or folder"):
        load_rows(str(tmp_path / "missing.jsonl"), None, "train", 0, None)

    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"some-org/some-set.*does not exist locally.*hub failed.*no network"):
        load_rows("some-org/some-set", None, "train", 0, None)


def test_hub_dataset_rows_are_tagged(monkeypatch):
    import datasets

    calls = []

    def fake(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    rows = load_rows("org/name", None, "test", 0, None)
    assert calls == [("org/name", "test")]
    assert rows[1]["__source__"] == "org/name" and rows[1]["__row__"] == 2 and _user(rows) == ROWS


def test_concatenation_without_probs_and_max_samples(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ROWS[:2])
    b = _jsonl(tmp_path / "b.jsonl", ROWS[2:])
    assert _user(load_rows(f"{a}, {b}", None, "train", 0, None)) == ROWS
    assert _user(load_rows(f"{a},{b}", None, "train", 0, 3)) == ROWS[:3]
    with pytest.raises(DataError, match="max_samples"):
        load_rows(a, None, "train", 0, 0)


def _mix_sources(tmp_path, n=2000):
    a = _jsonl(tmp_path / "a.jsonl", [{"src": "a", "i": i} for i in range(n)])
    b = _jsonl(tmp_path / "b.jsonl", [{"src": "b", "i": i} for i in range(n)])
    return f"{a},{b}"


def test_mixing_follows_probs_and_is_deterministic(tmp_path):
    spec = _mix_sources(tmp_path)
    rows = load_rows(spec, "0.3,0.7", "train", 1, None)
    counts = Counter(r["src"] for r in rows)
    # first-exhausted: stops when source b (p=0.7) runs out at 2000 rows → ~2857 in total
    assert counts["b"] == 2000 and 0.27 < counts["a"] / len(rows) < 0.33
    # each source is consumed in file order, without repeats
    assert [r["i"] for r in rows if r["src"] == "a"] == list(range(counts["a"]))
    again = load_rows(spec, "0.3,0.7", "train", 1, None)
    assert [(r["src"], r["i"]) for r in again] == [(r["src"], r["i"]) for r in rows]
    other = load_rows(spec, "0.3,0.7", "train", 2, None)
    assert [r["src"] for r in other][:200] != [r["src"] for r in rows][:200]


def test_mixing_with_max_samples(tmp_path):
    spec = _mix_sources(tmp_path)
    rows = load_rows(spec, [0.5, 0.5], "train", 0, 1000)
    assert len(rows) == 1000 and 0.45 < Counter(r["src"] for r in rows)["a"] / 1000 < 0.55


@pytest.mark.parametrize("probs, msg", [("0.5", "2 dataset"), ("0.5,0.6", "sum to 1"), ("a,b", "numbers")])
def test_bad_probs(tmp_path, probs, msg):
    with pytest.raises(DataError, match=msg):
        load_rows(_mix_sources(tmp_path, 3), probs, "train", 0, None)


def test_source_columns_reads_the_first_row_of_each_file_of_the_split(tmp_path):
    """`source_columns`: the keys of each file's first row (a CSV header, a parquet schema, a saved dataset's
    columns) for the files `load_rows` would read, without reading their rows; the loader's error for a split
    the source lacks or a first row it cannot parse; None for a hub name or a missing path."""
    import pyarrow as pa
    import pyarrow.parquet as parquet

    from posttrain.data.sources import source_columns

    rows = _jsonl(tmp_path / "rows.jsonl", [{"q": "a", "a": "1"}, {"other": 1}])
    assert source_columns(rows) == [(rows, ["q", "a"])]  # the first row only
    folder = tmp_path / "folder"
    (folder / "test").mkdir(parents=True)
    (folder / "train.csv").write_text("question,answer\nx,y\n")
    parquet.write_table(pa.Table.from_pylist([{"p": "x", "c": "y"}]), folder / "test" / "part.parquet")
    _jsonl(folder / "test" / "empty.jsonl", [])
    assert source_columns(str(folder)) == [(str(folder / "train.csv"), ["question", "answer"])]
    assert source_columns(str(folder), "test") == [(str(folder / "test" / "part.parquet"), ["p", "c"])]
    with pytest.raises(DataError, match="no files for split 'validation'"):
        source_columns(str(folder), "validation")
    with pytest.raises(DataError, match="only the split 'train'"):
        source_columns(rows, "test")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('\n{"q": 1,}\n{"q": 2}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: malformed JSON"):
        source_columns(str(bad))
    assert source_columns(str(tmp_path / "missing.jsonl")) is None
    assert source_columns("some-org/some-hub-dataset") is None
