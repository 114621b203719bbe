"""``python -m hostkv_cli`` is the same as the ``hostkv`` command."""

from ._main import main

main()
