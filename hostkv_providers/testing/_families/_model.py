"""Conformance family: the hypothesis state machine against a dict oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._base import SuiteBase


class StatefulTests(SuiteBase):
    """Conformance tests: the hypothesis state machine against a dict oracle."""

    # ==========================================================================================
    # The stateful model
    # ==========================================================================================
    def test_stateful(self, tmp_path: Path) -> None:
        pytest.importorskip("hypothesis", reason="the stateful model needs hypothesis (pip install hypothesis)")
        from hostkv_providers.testing._stateful import run_provider_state_machine

        run_provider_state_machine(self, tmp_path, **self.stateful_settings)
