"""A Dockerfile read as the classic builder reads it, and the build context as .dockerignore leaves it."""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class Instruction:
    command: str  # upper case: FROM, RUN, COPY, ...
    args: str
    stage: int  # index of the FROM it belongs to (-1: before any)


def instructions(path: Path) -> list[Instruction]:
    joined: list[str] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    out = []
    stage = -1
    for text in joined:
        command, _, args = text.strip().partition(" ")
        command = command.upper()
        if command == "FROM":
            stage += 1
        out.append(Instruction(command, args.strip(), stage))
    return out


@dataclass(frozen=True)
class Copy:
    sources: list[str]
    dest: str


def copy_of(instruction: Instruction) -> Copy | None:
    """A COPY from the build context (not --from another stage)."""
    if instruction.command not in ("COPY", "ADD"):
        return None
    words = shlex.split(instruction.args)
    if any(w.startswith("--from") for w in words):
        return None
    words = [w for w in words if not w.startswith("--")]
    return Copy(words[:-1], words[-1])


class DockerIgnore:
    """Docker's rule: the last pattern that matches a path or one of its parents decides."""

    def __init__(self, text: str):
        self._patterns: list[tuple[re.Pattern[str], bool]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            keep = line.startswith("!")
            pattern = str(PurePosixPath(line.removeprefix("!").strip().strip("/")))
            self._patterns.append((re.compile(self._regex(pattern)), keep))

    @staticmethod
    def _regex(pattern: str) -> str:
        out = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out += "(.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                out += ".*"
                i += 2
            elif pattern[i] == "*":
                out += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                out += "[^/]"
                i += 1
            else:
                out += re.escape(pattern[i])
                i += 1
        return out + "$"

    def excluded(self, path: str) -> bool:
        parts = PurePosixPath(path).parts
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        verdict = False
        for regex, keep in self._patterns:
            if any(regex.match(c) for c in candidates):
                verdict = not keep
        return verdict


def context_files(root: Path, tracked: list[str], source: str) -> list[str]:
    """The tracked files a COPY source brings into the image (empty: nothing, or all excluded)."""
    ignore = DockerIgnore((root / ".dockerignore").read_text())
    prefix = source.strip("/").removeprefix("./")
    under = [f for f in tracked if f == prefix or f.startswith(prefix + "/")]
    return [f for f in under if not ignore.excluded(f)]
