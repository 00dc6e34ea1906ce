"""The shell commands README.md and docs/ show, as a user would copy them (tests/launch/test_docs_commands.py checks
each; tests/launch/test_restart.py runs the checkpoint ones)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.harness import REPO

#: the files whose ```bash blocks are checked, in reading order
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def bash_commands(files: list[Path] = DOC_FILES) -> list[str]:
    """The command lines of the ```bash blocks of ``files``, in order, each once: continued lines joined, comments
    and a trailing ``&`` dropped, whitespace collapsed. Every line left is a command, whatever program it names."""
    commands: list[str] = []
    for path in files:
        for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(), flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                line = " ".join(line.split("#")[0].split()).removesuffix("&").strip()
                if line and line not in commands:
                    commands.append(line)
    return commands
