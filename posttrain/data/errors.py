"""The one exception type of the data layer."""
from posttrain.utils.errors import UserError


class DataError(UserError, ValueError):
    """Bad dataset input: the message names the file, the row, the key and the fix
    (either "fix the data" or the flag to pass)."""


def where(row: dict) -> str:
    """Human location of a loaded row: ``"<file>, row <n>"`` (n is the 1-based line for
    JSON-lines files, the 1-based record index for JSON lists / CSV data rows / parquet /
    Arrow datasets)."""
    source = row.get("__source__", "<in-memory rows>")
    n = row.get("__row__")
    return f"{source}, row {n}" if n is not None else str(source)


def check_dropped(what: str, dropped: list[str], total: int, reason: str, max_frac: float) -> str | None:
    """The report of the rows `dropped` out of `total` (count, share, first location), or None when
    none was; raises DataError when their share exceeds `max_frac` (--data.max_dropped_frac)."""
    if not dropped:
        return None
    share = len(dropped) / max(total, 1)
    line = (f"{what}: {len(dropped)} of {total} rows ({share:.0%}) dropped because {reason} (first: "
            f"{dropped[0]})")
    if share > max_frac:
        raise DataError(f"{line}; more than --data.max_dropped_frac {max_frac:g} of the rows. Raise "
                        f"--data.max_len, shorten those rows, or raise --data.max_dropped_frac to train on "
                        f"the rest.")
    return line
