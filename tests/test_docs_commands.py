"""Every command in README.md and docs/*.md runs as written after the README's Quick start.

The Quick start is ``bash scripts/install.sh`` (a virtual environment in ``.venv``) and then ``.venv/bin/...``: a bare
``python``, ``torchrun`` or ``accelerate launch`` finds some other Python, or none. So every command line in a shell
code block (```` ```bash ````, ```` ```sh ```` or one without a language), and every inline code span that starts
like a command, must start with one of the executables the Quick start provides, after optional ``VAR=value``
assignments and a ``taskset -c CPUS`` prefix. The scripts, modules and ds_configs such a command names must exist.
Code blocks marked ``python``, ``json``, ``yaml`` or ``text`` are not commands and are not read.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV_TOOLS = ("python", "torchrun", "accelerate", "deepspeed", "mpirun")  # what scripts/install.sh puts in .venv/bin
PROVIDED = {f".venv/bin/{tool}" for tool in VENV_TOOLS}
INSTALL = ("bash", "scripts/install.sh")
NOT_COMMANDS = {"python", "json", "yaml", "text"}
# An inline span is read as a command when its first word is one of these (a bare tool, or the venv's).
COMMAND_WORDS = {"python", "python3", "torchrun", "accelerate", "deepspeed", "pip", "pip3", "pytest", "mpirun",
                 "bash", *PROVIDED}
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def _shell_lines(block: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments and blank lines dropped."""
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            lines.append(current.strip())
        current = ""
    return lines


def _commands(line: str) -> list[list[str]]:
    """The simple commands of one line (split at ``&&``, ``||``, ``;`` and ``|``), as words, comments removed."""
    words = shlex.split(line, comments=True, posix=True)
    commands, current = [], []
    for word in words:
        if word in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    return [c for c in commands if c]


def _executable(words: list[str]) -> tuple[str, list[str]]:
    """The executable of a simple command and its arguments, after ``VAR=value`` and ``taskset -c CPUS``."""
    i = 0
    while i < len(words) and ASSIGNMENT.match(words[i]):
        i += 1
    if words[i:i + 2] == ["taskset", "-c"]:
        i += 3
    return words[i], words[i + 1:]


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line) for every command of every document."""
    found = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        name = doc.relative_to(REPO).as_posix()
        blocks = list(re.finditer(r"^```([^\n`]*)\n(.*?)^```", text, flags=re.S | re.M))
        for block in blocks:
            if block.group(1).strip() in NOT_COMMANDS:
                continue
            line_no = text[:block.start()].count("\n") + 2
            for line in _shell_lines(block.group(2)):
                found.append((f"{name}:{line_no} (code block)", line))
        prose = text
        for block in reversed(blocks):  # inline spans outside the code blocks
            prose = prose[:block.start()] + "\n" * block.group(0).count("\n") + prose[block.end():]
        for span in re.finditer(r"`([^`\n]+)`", prose):
            first = span.group(1).split()[0] if span.group(1).split() else ""
            words = span.group(1).split()
            while words and ASSIGNMENT.match(words[0]):
                words = words[1:]
            if len(words) > 1 and words[0] in COMMAND_WORDS and first:
                found.append((f"{name}:{prose[:span.start()].count(chr(10)) + 1} (inline)", span.group(1)))
    return found


COMMANDS = documented_commands()


def test_the_documents_have_commands_to_check():
    assert len(COMMANDS) > 50 and any("examples/compare.py" in line for _, line in COMMANDS)


@pytest.mark.parametrize("where,line", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_uses_what_the_quick_start_provides(where, line):
    for words in _commands(line):
        exe, args = _executable(words)
        assert exe in PROVIDED or (exe, *args[:1]) == INSTALL, (
            f"{where}: `{line}` starts with {exe!r}: after the Quick start only {sorted(PROVIDED)} and "
            f"`bash scripts/install.sh` run as written (a bare {exe!r} is some other Python's, or none)")
        venv_bin = Path(sys.executable).parent
        assert (venv_bin / Path(exe).name).exists() or (exe, *args[:1]) == INSTALL, (
            f"{where}: {exe} is not installed next to this Python ({venv_bin}): add it to scripts/install.sh or "
            "use another command")
        _check_what_it_names(where, line, args)


def _check_what_it_names(where: str, line: str, args: list[str]) -> None:
    """The repository's scripts, modules and ds_configs that a command names exist."""
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args) and args[i + 1].startswith("ds_odc"):
            assert importlib.util.find_spec(args[i + 1]) is not None, f"{where}: no module {args[i + 1]} (`{line}`)"
        top = arg.split("/")[0]
        if top in ("examples", "benchmarks", "ds_configs", "scripts") and "/" in arg:
            assert (REPO / arg).exists(), f"{where}: {arg} does not exist (`{line}`)"
