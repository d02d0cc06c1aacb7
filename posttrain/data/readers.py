"""Readers for single local data files: JSON (a list of objects or JSON lines), JSONL, CSV, parquet.

Each reader returns ``list[dict]`` where every row carries ``"__source__"`` (the file path as
given) and ``"__row__"`` (1-based: the line number for JSON lines, the record index for a JSON
list, the data-row index for CSV — header excluded — and the row index for parquet).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from typing import Any

from .errors import DataError

Row = dict[str, Any]


def _tag(record: Any, path: str, n: int, what: str) -> Row:
    if not isinstance(record, dict):
        raise DataError(
            f'{path}, row {n}: expected a JSON object ({{"key": value, ...}}) per {what}, '
            f"got {type(record).__name__}: {str(record)[:80]!r}. Fix the data."
        )
    row = dict(record)
    row["__source__"] = path
    row["__row__"] = n
    return row


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text ({e}). Convert the file to UTF-8.") from e


def _parse_json_lines(path: str, text: str) -> list[Row]:
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}, line {lineno}: malformed JSON ({e.msg} at column {e.colno}). "
                f"Each line must be one JSON object; fix the data."
            ) from e
        rows.append(_tag(record, path, lineno, "line"))
    return rows


def read_jsonl(path: str) -> list[Row]:
    """JSON lines: one object per non-blank line; ``__row__`` is the line number."""
    return _parse_json_lines(path, _read_text(path))


def read_json(path: str) -> list[Row]:
    """A ``.json`` file holding either a list of objects or JSON lines."""
    text = _read_text(path)
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}, line {e.lineno}: malformed JSON ({e.msg} at column {e.colno}). Fix the data."
            ) from e
        return [_tag(r, path, i, "list item") for i, r in enumerate(records, start=1)]
    try:
        return _parse_json_lines(path, text)
    except DataError:
        try:  # a single pretty-printed object is a common mistake: say so precisely
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict):
            raise DataError(
                f"{path}: holds a single JSON object with keys {sorted(whole)[:10]}; expected a list "
                f"of objects ([{{...}}, {{...}}]) or JSON lines. Fix the data."
            ) from None
        raise


def read_csv(path: str) -> list[Row]:
    """CSV with a header row; every value is a string; ``__row__`` counts data rows from 1."""
    rows = []
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise DataError(f"{path}: empty CSV file (no header row). Fix the data.")
            for n, record in enumerate(reader, start=1):
                if None in record:
                    raise DataError(
                        f"{path}, row {n}: has more fields than the header {reader.fieldnames}. "
                        f"Fix the data (quote values that contain commas)."
                    )
                rows.append(_tag(record, path, n, "row"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text ({e}). Convert the file to UTF-8.") from e
    except csv.Error as e:
        raise DataError(f"{path}: malformed CSV ({e}). Fix the data.") from e
    return rows


def read_parquet(path: str) -> list[Row]:
    """A parquet file; ``__row__`` is the 1-based row index."""
    import pyarrow.parquet as pq

    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet ({type(e).__name__}: {e}).") from e
    return [_tag(r, path, i, "row") for i, r in enumerate(records, start=1)]


def _first_json_line(path: str) -> list[Row]:
    """The first row of a JSON-lines file (read up to its first non-blank line), as `read_jsonl` reads it."""
    head = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                head.append(line)
                if line.strip():
                    break
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text ({e}). Convert the file to UTF-8.") from e
    return _parse_json_lines(path, "".join(head))


def _csv_header(path: str) -> list[Row]:
    """A CSV file's header as one row whose keys are the columns (`read_csv`'s errors for a bad header)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), None)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text ({e}). Convert the file to UTF-8.") from e
    except csv.Error as e:
        raise DataError(f"{path}: malformed CSV ({e}). Fix the data.") from e
    if header is None:
        raise DataError(f"{path}: empty CSV file (no header row). Fix the data.")
    return [dict.fromkeys(header, "")]


def read_columns(path: str) -> list[str] | None:
    """The keys of a data file's first row in file order (a CSV file's header, a parquet file's schema),
    without reading the whole file (a .json file is read whole); None for a file without rows. Raises
    the DataError `read_file` raises for the same first row."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(path).names)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(f"{path}: cannot read parquet ({type(e).__name__}: {e}).") from e
    first = {".jsonl": _first_json_line, ".csv": _csv_header}.get(ext, read_file)(path)
    return [k for k in first[0] if k not in ("__source__", "__row__")] if first else None


READERS: dict[str, Callable[[str], list[Row]]] = {
    ".json": read_json,
    ".jsonl": read_jsonl,
    ".csv": read_csv,
    ".parquet": read_parquet,
}


def read_file(path: str) -> list[Row]:
    """Dispatch on the file extension (one of ``READERS``)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in READERS:
        raise DataError(
            f"{path}: unsupported file type '{ext or '(none)'}'; supported: {', '.join(READERS)}, "
            f"a folder of such files, or a datasets.save_to_disk folder."
        )
    return READERS[ext](path)
