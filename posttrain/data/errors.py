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
