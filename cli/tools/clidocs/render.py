"""Regenerate docs/cli.md from a real run: ``python3 cli/tools/clidocs/render.py`` (repo root).

Runs examples.sh in a fresh temporary folder and pastes each command's real output into
template.md's ``{N}`` placeholders (N = the command's position in examples.sh).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOC = HERE.parents[2] / "docs" / "cli.md"


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hostkv-docs-") as work:
        for name in ("flip.py", "hold.py"):
            shutil.copy(HERE / name, work)
        out = subprocess.run(["bash", str(HERE / "examples.sh")], cwd=work, capture_output=True, text=True,
                             check=True).stdout
    out = out.replace(work, "/home/me")  # stable, readable paths in the docs
    blocks = [b.rstrip() for b in re.split(r"\n(?=\$ )", out) if b.strip()]
    text = (HERE / "template.md").read_text()
    for i, block in enumerate(blocks):
        lines = []
        for line in block.splitlines():
            m = re.fullmatch(r"\[exit (\d+)\]", line)
            lines.append(f"$ echo $?\n{m.group(1)}" if m else line.rstrip())
        text = text.replace("{" + str(i) + "}", "\n".join(lines))
    missing = re.findall(r"\{\d+\}", text)
    if missing:
        raise SystemExit(f"examples.sh produced {len(blocks)} blocks; template still has {missing}")
    DOC.write_text(text)
    print(f"wrote {DOC} from {len(blocks)} commands")


if __name__ == "__main__":
    main()
