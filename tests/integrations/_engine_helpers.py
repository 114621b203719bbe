"""Shared by the engine-adapter tests: a restart in a new process, and damage to a stored page."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_engine(script: str, *args: str, timeout: float = 300) -> str:
    """Run ``tests/integrations/<script>`` in a new Python process (a restarted engine)."""
    # The same environment as this process: vLLM derives the root of its block-hash chain from
    # PYTHONHASHSEED when it is set, so a restarted engine must see the same value (or none).
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"{script} {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc.stdout


def corrupt_page(store_dir: str | os.PathLike[str], needle: bytes) -> int:
    """Flip one byte in the middle of every stored copy of the page that starts with ``needle``.

    Works on the bytes on disk (the slot files of mmap/lmdb stores), as a bit rot or a torn
    write would; returns how many copies were damaged.
    """
    damaged = 0
    for path in sorted(Path(store_dir).rglob("*")):
        if not path.is_file() or path.stat().st_size < len(needle):
            continue
        data = path.read_bytes()
        start = 0
        while (at := data.find(needle, start)) >= 0:
            with open(path, "r+b") as f:
                f.seek(at + len(needle) + 17)
                b = f.read(1)
                f.seek(at + len(needle) + 17)
                f.write(bytes([b[0] ^ 0x5A]))
            damaged += 1
            start = at + 1
    return damaged
