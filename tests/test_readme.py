"""The README's code must run as written, and open with the two commands CI relies on."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippets_run() -> None:
    text = README.read_text()
    snippets = re.findall(r"```python\n(.*?)```", text, re.S)
    assert snippets, "README has no python snippet"
    for code in snippets:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})


def test_readme_opens_with_demo_and_test_commands() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert blocks[0].strip() == "bash scripts/demo.sh"
    demo = (README.parent / "scripts" / "demo.sh").read_text()
    assert "bash scripts/install.sh" in demo and " demo " in demo
    assert blocks[1].strip() == "bash scripts/test.sh"
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci
