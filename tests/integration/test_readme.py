"""The README stays true: its two commands are the ones CI and users run, its Python runs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_readme_starts_with_the_setup_and_test_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [ln for ln in first_block.splitlines() if ln and not ln.startswith("#")]
    assert commands == ["bash scripts/install.sh && agentrl run env=retool", "python -m pytest"]
    assert "python -m pytest" in (REPO / ".ci" / "run").read_text().splitlines()[-1]


def test_readme_python_snippets_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "the README should show how to write an env"
    defined: set[str] = set()
    for code in blocks:
        namespace: dict[str, object] = {"__name__": "readme_snippet"}
        exec(compile(code, "README.md", "exec"), namespace)  # raises if the snippet is broken
        defined |= set(namespace)
    assert "CapitalsEnv" in defined
