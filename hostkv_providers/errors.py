"""Every error the library raises, rooted at :class:`HostKVError`.

Each class also inherits the matching builtin (``KeyError``, ``ValueError``, ``OSError`` ...) and
carries a one-line ``hint`` the CLI prints.
"""

from __future__ import annotations

from hostkv_providers import _errors
from hostkv_providers._errors import *  # noqa: F403  (the public names: _errors.__all__, listed once)

__all__ = _errors.__all__
