"""hostkv-cli: the ``hostkv`` command for hostkv-providers stores.

Run ``hostkv --help``; docs/cli.md documents every command and the exit codes.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
