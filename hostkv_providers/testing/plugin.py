"""pytest plugin (entry point ``pytest11``): markers and helpers for provider test suites.

Installed with the package, so a third-party provider distribution that subclasses
:class:`hostkv_providers.testing.ProviderTests` gets the same markers and fixtures:

* ``@pytest.mark.gpu`` — needs a CUDA device; skipped cleanly when none is usable.
* ``@pytest.mark.slow`` — long-running reliability tests; they run by default (CI runs
  everything), deselect them locally with ``-m "not slow"``.
* fixture ``hostkv_page`` — ``page(key, nbytes) -> bytes``, the deterministic page content.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hostkv_providers.testing._pages import page_bytes

_GPU_REASON: list[str | None] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running reliability tests (deselect with -m \"not slow\")")


def cuda_unavailable_reason() -> str | None:
    """``None`` when a CUDA device is usable, else why not (asked once, of the copy engine's
    CUDA module, which is the package's only importer of ``cuda.bindings``)."""
    if not _GPU_REASON:
        try:
            from hostkv_providers.device import _cuda
            reason = _cuda.unavailable_reason()
        except Exception as exc:  # an ImportError or a broken driver must skip, not crash collection
            reason = f"CUDA is not usable: {exc!r}"
        _GPU_REASON.append(reason)
    return _GPU_REASON[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            reason = cuda_unavailable_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def hostkv_page() -> Callable[[bytes, int], bytes]:
    """``page(key, nbytes)``: the bytes the conformance suite stores under ``key``."""
    return page_bytes
