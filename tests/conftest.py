"""Shared pytest configuration of the core's tests.

The ``gpu``/``slow`` markers and the suite's fixtures come from the installed pytest plugin
(``hostkv_providers.testing.plugin``, entry point ``pytest11``); ``pytester`` runs the
conformance suite against deliberately broken providers in nested sessions.
"""

pytest_plugins = ["pytester"]
