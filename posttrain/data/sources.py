"""Resolve one dataset source (file, folder, ``save_to_disk`` folder or hub name) to rows of a split.

Split rules:
  * a plain file has exactly one split, ``train`` (the whole file);
  * a folder of data files: a file belongs to split ``s`` when a folder on its relative path is
    named ``s`` or its name starts with ``s`` followed by ``.``, ``-`` or ``_`` (``train.jsonl``,
    ``test-00000-of-00001.parquet``, ``validation/part1.csv``); ``val``/``valid``/``dev``/``eval``
    mean ``validation``. Files matching no split name belong to ``train``;
  * a ``datasets.save_to_disk`` folder: a ``Dataset`` is split ``train``; a ``DatasetDict``
    offers its own split names;
  * anything else is tried as a Hugging Face hub name with ``datasets.load_dataset(name, split=split)``.
"""

from __future__ import annotations

import os
import re

from .errors import DataError
from .readers import READERS, Row, read_columns, read_file

SPLIT_ALIASES = {"val": "validation", "valid": "validation", "dev": "validation", "eval": "validation"}
KNOWN_SPLITS = ("train", "test", "validation", "val", "valid", "dev", "eval")
_SPLIT_RE = re.compile(rf"^({'|'.join(KNOWN_SPLITS)})([-_.].*)?$", re.IGNORECASE)


def _canonical_split(name: str) -> str:
    name = name.lower()
    return SPLIT_ALIASES.get(name, name)


def file_split(rel_path: str) -> str | None:
    """Split named by a relative path (folder component or file-name prefix), or None."""
    parts = rel_path.replace(os.sep, "/").split("/")
    parts[-1] = os.path.splitext(parts[-1])[0]
    for part in reversed(parts):
        m = _SPLIT_RE.match(part)
        if m:
            return _canonical_split(m.group(1))
    return None


def _is_saved_dataset(folder: str) -> bool:
    has = lambda name: os.path.isfile(os.path.join(folder, name))
    return has("dataset_dict.json") or (has("dataset_info.json") and has("state.json"))


def _arrow_rows(dataset, source: str) -> list[Row]:
    rows = dataset.to_list()
    for i, row in enumerate(rows, start=1):
        row["__source__"] = source
        row["__row__"] = i
    return rows


def _saved_split(folder: str, split: str):
    """The ``datasets.Dataset`` of ``split`` in a ``save_to_disk`` folder."""
    import datasets

    try:
        loaded = datasets.load_from_disk(folder)
    except Exception as e:
        raise DataError(
            f"{folder}: cannot load datasets.save_to_disk folder ({type(e).__name__}: {e})."
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded.keys())
        match = [n for n in names if _canonical_split(n) == _canonical_split(split)]
        if not match:
            raise DataError(
                f"{folder}: split '{split}' not found; this DatasetDict has splits {names}. "
                f"Pass one of them as --data.dataset_split / --data.prompt_split / --eval.split."
            )
        return loaded[match[0]]
    if _canonical_split(split) != "train":
        raise DataError(
            f"{folder}: is a single saved Dataset (only split 'train'), but split '{split}' was "
            f"requested. Use split 'train' or save a DatasetDict with a '{split}' split."
        )
    return loaded


def _data_files(folder: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in READERS:
                found.append(os.path.join(root, name))
    return found


def _split_files(folder: str, split: str) -> list[str]:
    """The data files of ``split`` in a folder (see the module docstring)."""
    files = _data_files(folder)
    if not files:
        raise DataError(
            f"{folder}: folder holds no data files ({', '.join(READERS)}) and is not a "
            f"datasets.save_to_disk folder (no dataset_info.json/state.json or dataset_dict.json)."
        )
    by_split: dict[str, list[str]] = {}
    for path in files:
        by_split.setdefault(file_split(os.path.relpath(path, folder)) or "train", []).append(path)
    wanted = _canonical_split(split)
    if wanted not in by_split:
        raise DataError(
            f"{folder}: no files for split '{split}'; found splits {sorted(by_split)} "
            f"(a file belongs to split s when its name starts with s or it sits in a folder named s)."
        )
    return by_split[wanted]


def _looks_local(source: str) -> bool:
    return (
        os.path.isabs(source)
        or source.startswith(("./", "../", "~", "."))
        or os.path.splitext(source)[1].lower() in READERS
    )


def _load_hub(name: str, split: str) -> list[Row]:
    try:
        import datasets

        loaded = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(
            f"dataset '{name}': the path does not exist locally ({os.path.abspath(name)}) and loading "
            f"it from the Hugging Face hub failed ({type(e).__name__}: {str(e)[:300]}). Check the path, "
            f"or the hub name, split '{split}' and network access."
        ) from e
    return _arrow_rows(loaded, name)


def missing_source(source: str) -> str | None:
    """Why ``source`` names a local file or folder that does not exist (the error `load_source` would
    raise), or None: it exists, or it is a hub name."""
    path = os.path.expanduser(source)
    if os.path.exists(path) or not _looks_local(source):
        return None
    return f"dataset '{source}': no such file or folder ({os.path.abspath(path)})."


def _file_split(source: str, split: str) -> None:
    """A single file is split ``train``; DataError for any other split."""
    if _canonical_split(split) != "train":
        raise DataError(
            f"{source}: a single file has only the split 'train' (the whole file), but split "
            f"'{split}' was requested. Pass a folder holding e.g. {split}.jsonl, or use split 'train'."
        )


def source_columns(source: str, split: str = "train") -> list[tuple[str, list[str]]] | None:
    """``(file, keys of its first row)`` for every file ``load_source(source, split)`` reads that has rows
    (a ``save_to_disk`` folder: the folder and its columns), read without loading the rows; None for a
    hub name or a missing path. Raises the DataError ``load_source`` raises for a split the source lacks
    or a file whose first row cannot be read."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        _file_split(source, split)
        files = [path]
    elif os.path.isdir(path):
        if _is_saved_dataset(path):
            return [(source, list(_saved_split(path, split).column_names))]
        files = _split_files(path, split)
    else:
        return None
    found = [(file, read_columns(file)) for file in files]
    return [(file, columns) for file, columns in found if columns is not None]


def load_source(source: str, split: str = "train") -> list[Row]:
    """All rows of ``split`` from one source (see the module docstring for the rules)."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        _file_split(source, split)
        return read_file(path)
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return _arrow_rows(_saved_split(path, split), path)
        return [row for file in _split_files(path, split) for row in read_file(file)]
    if missing_source(source):
        raise DataError(missing_source(source))
    return _load_hub(source, split)
