"""The commands the README and docs/*.md tell a user to run, read from their fenced ```bash blocks.

A block's lines are joined at `\\` continuations and cut at `#` comments (shlex). A line that starts
with `posttrain <command>` or `python -m posttrain.cli.<module>` (after any `NAME=value` words) is a
`Command`; a here-document (`cat > FILE <<'END'` ... `END`) is a `WriteFile` (a page may write the
config file its next command reads); every other line (`make setup`, `source ...`) is left to the reader.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
HEREDOC = re.compile(r"^cat > (\S+) <<'?(\w+)'?\n(.*?)^\2$\n?", re.S | re.M)


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: tuple[str, ...]  # command name first: ("sft", "--model...", ...)
    env: tuple[tuple[str, str], ...] = ()  # `NAME=value` words before the command

    def __str__(self):
        return f"{self.page}:{self.line}: posttrain {shlex.join(self.argv)}"


@dataclass(frozen=True)
class WriteFile:
    page: str
    line: int
    path: str
    text: str


def pages() -> list[str]:
    """README.md, then docs/*.md, as paths relative to the repository root."""
    return ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))


def _command(tokens: list[str]) -> list[str] | None:
    from posttrain.cli.main import COMMANDS

    if tokens[:1] == ["posttrain"] and len(tokens) > 1:
        return tokens[1:]
    if tokens[:2] == ["python", "-m"] and len(tokens) > 2 and tokens[2].startswith("posttrain"):
        names = {module: name for name, (module, _) in COMMANDS.items()}
        return [names.get(tokens[2], tokens[2])] + tokens[3:]
    return None


def steps(page: str) -> list[Command | WriteFile]:
    """Every command and here-document of `page`, in page order."""
    text = (ROOT / page).read_text()
    found = []
    for block in FENCE.finditer(text):
        body, start = block.group(1), text[:block.start()].count("\n") + 2
        for doc in HEREDOC.finditer(body):
            at = start + body[:doc.start()].count("\n")
            found.append((at, WriteFile(page, at, doc.group(1), doc.group(3))))
        body = HEREDOC.sub(lambda m: "\n" * m.group(0).count("\n"), body)  # keep the line numbers
        logical, first = "", 0
        for i, line in enumerate(body.split("\n")):
            first = first if logical else start + i
            if line.endswith("\\"):
                logical += line[:-1] + " "
                continue
            tokens = shlex.split(logical + line, comments=True)
            logical = ""
            env = []
            while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
                env.append(tuple(tokens.pop(0).split("=", 1)))
            argv = _command(tokens) if tokens else None
            if argv is not None:
                found.append((first, Command(page, first, tuple(argv), tuple(env))))
    found.sort(key=lambda pair: pair[0])
    return [step for _, step in found]
