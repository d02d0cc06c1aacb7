"""The base class of every error a user can cause (bad flags, data, reward code, checkpoints,
run folders). The command line turns any `UserError` into one `prog: error: <message>` line and
exit status 2; anything else is a bug of ours and keeps its traceback."""
from __future__ import annotations


class UserError(Exception):
    """A mistake or environment problem the user can fix; the message names the flag, file, row
    or URL, the cause, and the fix."""


class WorkerFailed(UserError):
    """A process of a distributed run died, could not start or could not be placed (the message
    names the role and rank)."""


class ConfigError(UserError, ValueError):
    """Bad flags, YAML or values. The message names the flag(s) and what is valid; `problems` lists
    every individual problem when several were found at once."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems else [message]

    @classmethod
    def collect(cls, problems: list[str], header: str = "invalid configuration") -> ConfigError:
        if len(problems) == 1:
            return cls(problems[0], problems)
        return cls(
            f"{header} ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems), problems
        )
