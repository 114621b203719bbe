"""The engine-adapter tests import their engine drivers (``_vllm_engine`` ...) from this folder;
the drivers also run as scripts in a new process for the restart tests."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
