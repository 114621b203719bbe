"""The cache tests import their shared geometry and page helpers (``_cache_common``) from this
folder."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
